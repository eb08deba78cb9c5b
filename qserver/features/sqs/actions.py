"""The SQS actions, each in the JSON protocol's shape, made as the caller's client through the
client library (a delegated instance: its grants, its routing to each queue's master, its
retries through failovers and handoffs). docs/SQS.md lists what each maps to.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from client.aio import AsyncClient, Message
from qserver.features.sqs import mapping as m
from qserver.features.sqs.errors import (
    BATCH_IDS_NOT_DISTINCT,
    BATCH_TOO_LONG,
    EMPTY_BATCH,
    INVALID_ATTRIBUTE_NAME,
    INVALID_BATCH_ENTRY_ID,
    MISSING_PARAMETER,
    QUEUE_DOES_NOT_EXIST,
    SERVICE_UNAVAILABLE,
    TOO_MANY_ENTRIES,
    SqsError,
    from_queue_error,
)
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError

BATCH_MAX = 10
RECEIVE_MAX = 10
WAIT_MAX_S = 20
LIST_MAX = 1000
REMOTE_CALL_S = 5.0           # a call at another node's client beyond a receive's wait: then 503, retried
ROUTED_QUEUES_MAX = 10_000     # queues whose placement a caller's client read, remembered
_BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,80}")
# Failures of the node named in a receipt handle after which the queue's master is asked instead.
_ELSEWHERE = frozenset({e.E_NOT_MASTER.code, e.E_UNAVAILABLE.code, e.E_QUEUE_UNAVAILABLE.code,
                        e.E_SHUTTING_DOWN.code, e.E_TIMEOUT.code})
_T = TypeVar("_T")
SYSTEM_ATTRIBUTES = ("ApproximateReceiveCount", "SentTimestamp", "SenderId", "MessageDeduplicationId")


@dataclass(frozen=True, slots=True)
class Caller:
    client_id: str
    client: AsyncClient                         # the caller's client library instance homed at this node
    region: str
    client_at: Callable[[str], AsyncClient]     # ... and one homed at the node of that URL


class Actions:
    """What a gateway needs of its node: its URL, the cluster map (queue options, node URLs)."""

    def __init__(self, base_url: str, cluster_map: Callable[[], Any]) -> None:
        self.base_url = base_url
        self._cluster_map = cluster_map
        self.stale_deletes = 0          # deletes of an ended lease, answered with success as SQS does
        # The epoch of each queue's map entry when a caller's client last read where it lives.
        self._routed: weakref.WeakKeyDictionary[AsyncClient, dict[str, int]] = weakref.WeakKeyDictionary()
        self._handlers: dict[str, Callable[[Caller, dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "CreateQueue": self.create_queue, "GetQueueUrl": self.get_queue_url, "ListQueues": self.list_queues,
            "DeleteQueue": self.delete_queue, "GetQueueAttributes": self.get_queue_attributes,
            "SetQueueAttributes": self.set_queue_attributes, "PurgeQueue": self.purge_queue,
            "SendMessage": self.send_message, "SendMessageBatch": self.send_message_batch,
            "ReceiveMessage": self.receive_message, "DeleteMessage": self.delete_message,
            "DeleteMessageBatch": self.delete_message_batch,
            "ChangeMessageVisibility": self.change_message_visibility,
            "ChangeMessageVisibilityBatch": self.change_message_visibility_batch,
        }

    def _queue_client(self, caller: Caller, queue: str) -> AsyncClient:
        """The client to make a queue's message calls with. Under `producer` each member of a
        pair serves its own consumers and a client homed at a member stays with it
        (docs/ARCHITECTURE.md, "Strengths"): an SQS caller is served by the master, as it would
        be under `full`, so a message is leased and deleted in one place whichever node the
        SDK calls."""
        cluster = self._cluster_map()
        entry = cluster.queues.get(queue.removesuffix(DEAD_LETTER_SUFFIX)) if cluster is not None else None
        if entry is None or entry.options.get("strength") == "full":
            return caller.client
        node = cluster.nodes.get(entry.master)
        if node is None or node.url.rstrip("/") == self.base_url.rstrip("/"):
            return caller.client
        return caller.client_at(node.url.rstrip("/"))

    async def _route(self, client: AsyncClient, queue: str) -> None:
        """Have the caller's client read the queue's placement again when this node's map shows
        a pair (epoch) it has not read yet: a client sends a queue it does not know to its home
        node, and under `producer` a replica there serves its own copies (docs/ARCHITECTURE.md,
        "Strengths"), so receives and the nodes their receipt handles name follow the master."""
        cluster = self._cluster_map()
        entry = cluster.queues.get(queue.removesuffix(DEAD_LETTER_SUFFIX)) if cluster is not None else None
        if entry is None:
            return
        seen = self._routed.setdefault(client, {})
        if seen.get(queue) != entry.epoch:
            with contextlib.suppress(QueueError):
                await client.refresh_placement(queue)
            if len(seen) >= ROUTED_QUEUES_MAX:
                seen.clear()
            seen[queue] = entry.epoch

    def handler(self, action: str) -> Callable[[Caller, dict[str, Any]], Awaitable[dict[str, Any]]] | None:
        return self._handlers.get(action)

    # --- queues -----------------------------------------------------------------------------
    def _options(self, queue: str) -> Mapping[str, Any] | None:
        cluster = self._cluster_map()
        entry = cluster.queues.get(queue) if cluster is not None else None
        return entry.options if entry is not None else None

    @staticmethod
    def _name(params: dict[str, Any]) -> str:
        name = params.get("QueueName")
        if not isinstance(name, str) or not name:
            raise SqsError(MISSING_PARAMETER, "The request must contain the parameter QueueName.", "E_BAD_REQUEST")
        if name.endswith(".fifo"):
            raise m.invalid(m.FIFO_REFUSAL)
        if not is_valid_queue_name(name) or len(name) > 196:
            raise m.invalid("Can only include alphanumeric characters, hyphens, or underscores (qcluster also takes "
                            ". and :). 1 to 80 in length (qcluster: 196).", "E_INVALID_NAME")
        return name

    async def create_queue(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        name = self._name(params)
        if name.endswith(DEAD_LETTER_SUFFIX):
            raise m.invalid(f"names ending {DEAD_LETTER_SUFFIX} belong to dead-letter queues (made with their queue)",
                            "E_RESERVED_NAME")
        options = m.attributes_to_options(params.get("Attributes"), name)
        cluster = self._cluster_map()
        if cluster is None or name not in cluster.queues:
            # A queue SQS callers make is `full`: a delete (our ack) is on both members, as an
            # SQS delete is durable. An existing queue keeps its strength (docs/SQS.md).
            options.setdefault("strength", "full")
        await caller.client.create_queue(name, **options)
        return {"QueueUrl": m.queue_url(self.base_url, name)}

    async def get_queue_url(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        name = self._name(params)
        await caller.client.queue_stats(name)     # it exists and the caller may see it
        return {"QueueUrl": m.queue_url(self.base_url, name)}

    async def list_queues(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        prefix = params.get("QueueNamePrefix") or ""
        limit = params.get("MaxResults")
        token = params.get("NextToken") or ""
        if limit is not None:
            limit = _int_param("MaxResults", limit, 1, LIST_MAX)
        names = sorted(q["name"] for q in await caller.client.list_queues()
                       if str(q.get("name", "")).startswith(prefix) and q.get("name", "") > token)
        page = names[:limit or LIST_MAX]
        answer: dict[str, Any] = {"QueueUrls": [m.queue_url(self.base_url, name) for name in page]}
        if limit is not None and len(names) > len(page):
            answer["NextToken"] = page[-1]
        return answer

    async def delete_queue(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        await caller.client.delete_queue(m.queue_from_url(params.get("QueueUrl")))
        return {}

    async def purge_queue(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        await caller.client.purge(m.queue_from_url(params.get("QueueUrl")))
        return {}

    async def get_queue_attributes(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        names = params.get("AttributeNames") or []
        if not isinstance(names, list):
            raise m.invalid("AttributeNames must be a list")
        stats = await caller.client.queue_stats(queue)
        every = m.options_to_attributes(stats.get("options", {}), stats, queue, caller.region)
        if "All" in names:
            return {"Attributes": every}
        unknown = [name for name in names if name not in every and name not in m.SETTABLE + m.READ_ONLY
                   + m.FIFO_ATTRIBUTES]
        if unknown:
            raise SqsError(INVALID_ATTRIBUTE_NAME, f"Unknown Attribute {unknown[0]}.", "E_INVALID_OPTION")
        return {"Attributes": {name: every[name] for name in names if name in every}}

    async def set_queue_attributes(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        options = m.attributes_to_options(params.get("Attributes") or {}, queue)
        if options:
            await caller.client.set_queue_options(queue, **options)
        return {}

    # --- messages ---------------------------------------------------------------------------
    def _send_arguments(self, caller: Caller, queue: str, entry: dict[str, Any]) -> tuple[bytes, dict[str, Any],
                                                                                          dict[str, Any]]:
        body = entry.get("MessageBody")
        if not isinstance(body, str) or not body:
            raise SqsError(MISSING_PARAMETER, "The request must contain the parameter MessageBody.", "E_BAD_REQUEST")
        payload = body.encode()
        if len(payload) > m.MESSAGE_BYTES_MAX:
            raise m.invalid(f"One or more parameters are invalid. Reason: Message must be shorter than "
                            f"{m.MESSAGE_BYTES_MAX} bytes.", "E_PAYLOAD_TOO_LARGE")
        if entry.get("MessageGroupId") is not None:
            raise m.invalid(m.FIFO_REFUSAL)
        headers, attributes_md5 = m.attributes_to_headers(entry.get("MessageAttributes"))
        headers[m.SENT_HEADER] = str(int(time.time() * 1000))
        headers[m.SENDER_HEADER] = caller.client_id
        dedupe_id = entry.get("MessageDeduplicationId")
        if dedupe_id is not None:
            if not isinstance(dedupe_id, str) or not 0 < len(dedupe_id) <= 128 or not dedupe_id.isprintable():
                raise m.invalid("MessageDeduplicationId is 1-128 printable characters")
            headers[m.DEDUPE_HEADER] = dedupe_id
        keywords: dict[str, Any] = {"headers": headers, "dedupe_id": dedupe_id}
        if entry.get("DelaySeconds") is not None:
            keywords["delay_s"] = float(_int_param("DelaySeconds", entry["DelaySeconds"], 0, 900))
        answer = {"MD5OfMessageBody": m.md5_text(body)}
        if attributes_md5 is not None:
            answer["MD5OfMessageAttributes"] = attributes_md5
        return payload, keywords, answer

    async def send_message(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        payload, keywords, answer = self._send_arguments(caller, queue, params)
        client = self._queue_client(caller, queue)
        message_id = await _bounded(caller, client, client.enqueue(queue, payload, **keywords))
        return {"MessageId": str(message_id), **answer}

    async def send_message_batch(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        entries = _entries(params)
        if sum(len(str(entry.get("MessageBody", "")).encode()) for entry in entries) > m.MESSAGE_BYTES_MAX:
            raise SqsError(BATCH_TOO_LONG, f"Batch requests cannot be longer than {m.MESSAGE_BYTES_MAX} bytes.",
                           "E_PAYLOAD_TOO_LARGE")
        client = self._queue_client(caller, queue)

        async def one(entry: dict[str, Any]) -> dict[str, Any]:
            payload, keywords, answer = self._send_arguments(caller, queue, entry)
            message_id = await _bounded(caller, client, client.enqueue(queue, payload, **keywords))
            return {"MessageId": str(message_id), **answer}
        return await _batch(entries, one)

    async def receive_message(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        most = _int_param("MaxNumberOfMessages", params.get("MaxNumberOfMessages", 1), 1, RECEIVE_MAX)
        options = self._options(queue) or {}
        wait = params.get("WaitTimeSeconds")
        # Without WaitTimeSeconds the queue's ReceiveMessageWaitTimeSeconds (our receive_wait_s) applies.
        wait_s = float(_int_param("WaitTimeSeconds", wait, 0, WAIT_MAX_S)) if wait is not None \
            else float(options.get("receive_wait_s", 0) or 0)
        visibility = params.get("VisibilityTimeout")
        visibility_s = float(_int_param("VisibilityTimeout", visibility, 0, 43_200)) if visibility is not None \
            else None
        system = _names(params, "AttributeNames") + _names(params, "MessageSystemAttributeNames")
        attribute_names = _names(params, "MessageAttributeNames")
        client = self._queue_client(caller, queue)
        await self._route(client, queue)
        messages = await _bounded(caller, client, client.receive(queue, most, wait_s, visibility_s), wait_s)
        cluster = self._cluster_map()
        node_of = {entry.url.rstrip("/"): node for node, entry in cluster.nodes.items()} if cluster else {}
        if not messages:
            return {}           # as SQS: no Messages member at all when none came
        return {"Messages": [self._message(client, queue, message, node_of, system, attribute_names)
                             for message in messages]}

    @staticmethod
    def _message(client: AsyncClient, queue: str, message: Message, node_of: Mapping[str, str],
                 system: list[str], attribute_names: list[str]) -> dict[str, Any]:
        body = message.payload.decode("utf-8", errors="replace")
        node = node_of.get(client.leased_at(message).rstrip("/"), "")
        out: dict[str, Any] = {"MessageId": str(message.id),
                               "ReceiptHandle": m.receipt_handle(queue, message.id, message.receipt, node),
                               "MD5OfBody": m.md5_text(body), "Body": body}
        headers = message.headers
        if system:
            every = "All" in system
            attributes = {"ApproximateReceiveCount": str(message.deliveries)}
            for name, header in (("SentTimestamp", m.SENT_HEADER), ("SenderId", m.SENDER_HEADER),
                                 ("MessageDeduplicationId", m.DEDUPE_HEADER)):
                if header in headers:
                    attributes[name] = headers[header]
            out["Attributes"] = {k: v for k, v in attributes.items() if every or k in system}
        shown, digest = m.headers_to_attributes(headers, attribute_names)
        if shown:
            out["MessageAttributes"] = shown
            out["MD5OfMessageAttributes"] = digest
        return out

    def _lease(self, caller: Caller, queue: str, handle: Any) -> tuple[Message, Message]:
        """The leased message a handle names: at the node that leased it, and at the master."""
        message_id, receipt, node = m.parse_receipt_handle(handle, queue)
        cluster = self._cluster_map()
        entry = cluster.nodes.get(node) if cluster is not None and node else None
        master = caller.client.lease(queue, message_id, receipt)
        return (caller.client.lease(queue, message_id, receipt, entry.url) if entry is not None else master), master

    async def _at_lease(self, caller: Caller, queue: str, handle: Any,
                        call: Callable[[Message], Awaitable[None]]) -> None:
        at_node, at_master = self._lease(caller, queue, handle)
        try:
            await call(at_node)
        except QueueError as error:
            if at_node is at_master or error.code not in _ELSEWHERE:
                raise
            await call(at_master)       # that node is gone or no longer serves the queue: its master now

    async def delete_message(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))
        await self._delete(caller, queue, params.get("ReceiptHandle"))
        return {}

    async def _delete(self, caller: Caller, queue: str, handle: Any) -> None:
        try:
            await self._at_lease(caller, queue, handle, lambda message: message.ack())
        except QueueError as error:
            if error.code not in (e.E_UNKNOWN_MESSAGE.code, e.E_LEASE_EXPIRED.code):
                raise
            # Deleted already, or leased again since: SQS answers a delete with an older receipt
            # handle with success and leaves the message (its docs, "DeleteMessage").
            self.stale_deletes += 1

    async def delete_message_batch(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))

        async def one(entry: dict[str, Any]) -> dict[str, Any]:
            await self._delete(caller, queue, entry.get("ReceiptHandle"))
            return {}
        return await _batch(_entries(params), one)

    async def _change(self, caller: Caller, queue: str, entry: dict[str, Any]) -> None:
        timeout_s = _int_param("VisibilityTimeout", entry.get("VisibilityTimeout"), 0, 43_200)

        def change(message: Message) -> Awaitable[None]:
            return message.release() if timeout_s == 0 else message.extend(float(timeout_s))
        await self._at_lease(caller, queue, entry.get("ReceiptHandle"), change)

    async def change_message_visibility(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        await self._change(caller, m.queue_from_url(params.get("QueueUrl")), params)
        return {}

    async def change_message_visibility_batch(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        queue = m.queue_from_url(params.get("QueueUrl"))

        async def one(entry: dict[str, Any]) -> dict[str, Any]:
            await self._change(caller, queue, entry)
            return {}
        return await _batch(_entries(params), one)


async def _bounded(caller: Caller, client: AsyncClient, call: Awaitable[_T], wait_s: float = 0.0) -> _T:
    """A call through a client homed at another node (a `producer` queue's master), bounded: a
    client whose home died stays with it as a member of the pair until its request timeout,
    where the SDK should rather retry (503) and find the master the map names by then."""
    if client is caller.client:
        return await call
    try:
        return await asyncio.wait_for(call, REMOTE_CALL_S + wait_s)
    except TimeoutError:
        raise SqsError(SERVICE_UNAVAILABLE, "the queue's master did not answer in time; retry",
                       e.E_TIMEOUT.code) from None


def _int_param(name: str, value: Any, low: int, high: int) -> int:
    if value is None:
        raise SqsError(MISSING_PARAMETER, f"The request must contain the parameter {name}.", "E_BAD_REQUEST")
    try:
        number = int(value) if not isinstance(value, bool) else -1
    except (TypeError, ValueError):
        number = low - 1
    if not low <= number <= high:
        raise m.invalid(f"Value {str(value)[:40]} for parameter {name} is invalid. Reason: must be between "
                        f"{low} and {high}.")
    return number


def _names(params: dict[str, Any], key: str) -> list[str]:
    names = params.get(key) or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise m.invalid(f"{key} must be a list of names")
    return names


def _entries(params: dict[str, Any]) -> list[dict[str, Any]]:
    entries = params.get("Entries")
    if not entries:
        raise SqsError(EMPTY_BATCH, "There should be at least one SendMessageBatchRequestEntry in the request.",
                       "E_BAD_REQUEST")
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise m.invalid("Entries must be a list of structures", "E_BAD_REQUEST")
    if len(entries) > BATCH_MAX:
        raise SqsError(TOO_MANY_ENTRIES, f"Maximum number of entries per request are {BATCH_MAX}. You have sent "
                                         f"{len(entries)}.", "E_BAD_REQUEST")
    ids = [entry.get("Id") for entry in entries]
    for entry_id in ids:
        if not isinstance(entry_id, str) or not _BATCH_ID.fullmatch(entry_id):
            raise SqsError(INVALID_BATCH_ENTRY_ID, "A batch entry id can only contain alphanumeric characters, "
                                                   "hyphens and underscores. It can be at most 80 letters long.",
                           "E_BAD_REQUEST")
    if len(set(ids)) != len(ids):
        raise SqsError(BATCH_IDS_NOT_DISTINCT, "Two or more batch entries in the request have the same Id.",
                       "E_BAD_REQUEST")
    return entries


async def _batch(entries: list[dict[str, Any]],
                 one: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Every entry at once; Successful and Failed as SQS reports them, in the entries' order."""
    async def guarded(entry: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"Id": entry["Id"], **await one(entry)}
        except QueueError as error:
            failure = from_queue_error(error)
        except SqsError as error:
            failure = error
        if failure.kind is QUEUE_DOES_NOT_EXIST or failure.kind.status >= 500:
            raise failure      # the whole request fails (SDKs retry a 5xx): not a per-entry outcome
        return {"#failed": True, "Id": entry["Id"], "SenderFault": failure.kind.status < 500,
                "Code": failure.kind.code, "Message": failure.message}
    outcomes = await asyncio.gather(*(guarded(entry) for entry in entries))
    return {"Successful": [o for o in outcomes if "#failed" not in o],
            "Failed": [{k: v for k, v in o.items() if k != "#failed"} for o in outcomes if "#failed" in o]}
