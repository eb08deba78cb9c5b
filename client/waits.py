"""Producers that wait for the consumer (seed 004 One_Way_Acknowledged, Two_Way and
CheckMsgCompletion; docs/PROTOCOL.md, "Producers that wait").

`AsyncClient.enqueue(queue, payload, wait="ack" | "reply", timeout_s=...)` stores the message,
then waits for its completion: the node answers WebSocket op 21 (CompletionWaitOp) the moment
the consumer's ack or reply is committed (no polling). One wait is held at the node for at
most `WAIT_CHUNK_S_MAX` (and less than the client's request timeout, which bounds every call):
a longer wait asks again for what is left, and so does a wait whose connection dropped or whose
queue's master moved (E_NOT_MASTER at a handoff, a lost connection at a failover): the new ask
goes to the queue's master as the router knows it, and looks at the status first, so a
completion that happened in between is found at once. A wait that runs out raises
E_WAIT_TIMEOUT: the message stays in the queue (it is not withdrawn).

Against a node of release 0.2.0 (which refuses op 21 as an unknown tag) or a cluster still at
feature level 2 (E_FEATURE_DISABLED), the wait falls back to the REST status call with `wait_s`
and `until` (a long poll the node answers on the change), which 0.2.0 serves.

`on_complete=callback` (fire and continue): the enqueue returns the id at once and the wait
runs in a task of the client; the callback is called once, on the client's event loop, with a
`Completion` (its `error` set when the wait failed or ran out). At most
COMPLETION_TASKS_MAX callbacks wait per client (E_OVERLOADED past it, before anything is
stored).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client.connection import RETRIED_CODES, NodeConnection, jittered
from client.http import HttpClient, query_number, queue_path
from wire.errors import (
    E_BAD_FRAME,
    E_FEATURE_DISABLED,
    E_INTERNAL,
    E_MACRO_QUEUE,
    E_OVERLOADED,
    E_TIMEOUT,
    E_UNKNOWN_MESSAGE,
    E_WAIT_TIMEOUT,
    E_WAIT_UNSUPPORTED,
    QueueError,
)
from wire.protocol import CompletionWaitOp

if TYPE_CHECKING:
    from client.aio import AsyncClient

log = logging.getLogger("client.waits")

WAIT_KINDS = ("ack", "reply")
TERMINAL_STATES = frozenset({"acked", "replied", "dead_lettered", "purged", "expired"})
WAIT_CHUNK_S_MAX = 60.0          # the node holds one wait at most this long (qserver/api/completion_waits.py)
REST_WAIT_S_MAX = 20.0           # a 0.2.0 node's status wait bound (receive_wait_max_s)
TIMEOUT_S_DEFAULT = 30.0
TIMEOUT_S_MAX = 86_400.0
COMPLETION_TASKS_MAX = 10_000    # on_complete waits per client
RETRY_DELAY_INITIAL_S, RETRY_DELAY_MAX_S = 0.05, 1.0
# The codes after which a wait asks again (the message is stored; only the wait was cut):
# the cluster's passing states, and a call that got no answer in time.
ASKED_AGAIN_CODES = RETRIED_CODES | {E_TIMEOUT.code}


@dataclass(frozen=True, slots=True)
class Completion:
    """What became of a message its producer waited for. `outcome`: "acked", "replied",
    "dead_lettered", "purged" or "expired"; with `on_complete`, "timed_out" or "failed" and
    `error` set. `reply`: the consumer's reply on a two_way queue (None otherwise).
    `deliveries`: as the status call reports it (the leases so far while in flight; a
    completion's status row keeps no count, so 0 once completed)."""
    queue: str
    message_id: int
    outcome: str
    deliveries: int = 0
    reply: bytes | None = None
    error: QueueError | None = None

    @property
    def completed(self) -> bool:
        return self.outcome in TERMINAL_STATES


OnComplete = Callable[[Completion], Any]
_tasks: weakref.WeakKeyDictionary[Any, set[asyncio.Task[None]]] = weakref.WeakKeyDictionary()
_checked: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
CHECKED_QUEUES_MAX = 10_000
PROBE_ID = 2**63 - 1          # never issued: the probe of check_queue_type


def check_wait(wait: str | None, timeout_s: float | None) -> tuple[str, float]:
    """The wait's kind and timeout, checked before anything is stored."""
    if wait is not None and wait not in WAIT_KINDS:
        raise ValueError('wait is "ack" (the consumer acked) or "reply" (it replied, on a two_way queue)')
    timeout = TIMEOUT_S_DEFAULT if timeout_s is None else float(timeout_s)
    if not 0 < timeout <= TIMEOUT_S_MAX:
        raise ValueError(f"timeout_s must be in (0, {TIMEOUT_S_MAX:g}]")
    return wait or "ack", timeout


def reserve_callbacks(client: AsyncClient, count: int) -> None:
    held = len(_tasks.get(client, ()))
    if held + count > COMPLETION_TASKS_MAX:
        raise QueueError(E_OVERLOADED, f"this client already waits for {held} completions with on_complete, "
                                       f"the most is {COMPLETION_TASKS_MAX}")


def completion_from(queue: str, message_id: int, result: Any) -> Completion:
    try:
        reply = result.get("reply")
        return Completion(queue, message_id, str(result["state"]), int(result.get("deliveries", 0)),
                          None if reply is None else bytes(reply))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise QueueError(E_INTERNAL, f"a malformed completion answer: {result!r}") from None


async def wait_for(client: AsyncClient, queue: str, message_id: int, kind: str, timeout_s: float) -> Completion:
    """Wait until `message_id` of `queue` completed; E_WAIT_TIMEOUT after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunk_max = max(0.2, min(WAIT_CHUNK_S_MAX, client._request_timeout_s / 2))
    delay_s = RETRY_DELAY_INITIAL_S
    state = "unknown"
    rest = False           # the node knows no op 21: the REST status wait (release 0.2.0)
    while True:
        wait_s = max(0.0, min(deadline - loop.time(), chunk_max))
        try:
            if rest:
                result = await client.message_status(queue, message_id, min(wait_s, REST_WAIT_S_MAX),
                                                     ",".join(sorted(TERMINAL_STATES)))
                if isinstance(result, dict) and "reply_b64" in result:
                    result["reply"] = base64.b64decode(result.pop("reply_b64"))
            else:
                result = await _ask(client, queue, message_id, int(wait_s * 1000), kind)
            completion = completion_from(queue, message_id, result)
            if completion.completed:
                return completion
            state = completion.outcome
            delay_s = RETRY_DELAY_INITIAL_S
        except QueueError as error:
            if not rest and _too_old(error):
                rest = True
                continue
            if error.code not in ASKED_AGAIN_CODES or not client.usable:
                raise
            state = f"unknown ({error.code})"
            pause = jittered(delay_s)
            if loop.time() + pause < deadline:
                await asyncio.sleep(pause)
                delay_s = min(delay_s * 2, RETRY_DELAY_MAX_S)
        if loop.time() >= deadline:
            what = "acked" if kind == "ack" else "replied to"
            raise QueueError(E_WAIT_TIMEOUT, f"message {message_id} of {queue} was not {what} within {timeout_s:g} s "
                                             f"(it is {state}); it stays in the queue")


async def check_queue_type(client: AsyncClient, queue: str, kind: str) -> None:
    """Before the first waiting enqueue on `queue`: whether its type keeps the completion asked
    for, so a wait it cannot have is refused (E_WAIT_UNSUPPORTED) before anything is stored.
    Asked as a wait of no time for an id never issued: the node checks the type first, then
    answers E_UNKNOWN_MESSAGE. Remembered per client (a queue's type never changes)."""
    checked = _checked.setdefault(client, set())
    if (queue, kind) in checked:
        return
    try:
        await _ask(client, queue, PROBE_ID, 0, kind)
    except QueueError as error:
        if error.code == E_WAIT_UNSUPPORTED.code or error.code == E_MACRO_QUEUE.code:
            raise
        if error.code != E_UNKNOWN_MESSAGE.code:
            return           # a node too old, or a passing state: the wait itself checks again
    if len(checked) >= CHECKED_QUEUES_MAX:
        checked.clear()
    checked.add((queue, kind))


def _too_old(error: QueueError) -> bool:
    """A node before 0.3.0 (unknown op tag) or a cluster not yet at feature level 3."""
    return ((error.code == E_BAD_FRAME.code and "unknown operation tag" in error.message)
            or error.code == E_FEATURE_DISABLED.code)


async def _ask(client: AsyncClient, queue: str, message_id: int, wait_ms: int, kind: str) -> Any:
    router = client._router
    target = router.route(queue)

    async def at(node: NodeConnection) -> Any:
        try:
            return await node.call(CompletionWaitOp(node.next_id(), queue, message_id, wait_ms, kind))
        except QueueError as error:
            master = await router.rerouted(queue, error, failed=node)
            if master is None:
                raise
            return await master.call(CompletionWaitOp(master.next_id(), queue, message_id, wait_ms, kind))
    if target is not client._home:
        return await router.via(queue, target, at)
    return await at(target)


def start_callback(client: AsyncClient, queue: str, message_id: int, kind: str, timeout_s: float,
                   on_complete: OnComplete) -> None:
    """Wait in a task of the client and call `on_complete` once with the Completion."""
    tasks = _tasks.setdefault(client, set())
    task = asyncio.get_running_loop().create_task(_callback(client, queue, message_id, kind, timeout_s, on_complete))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _callback(client: AsyncClient, queue: str, message_id: int, kind: str, timeout_s: float,
                    on_complete: OnComplete) -> None:
    try:
        completion = await wait_for(client, queue, message_id, kind, timeout_s)
    except QueueError as error:
        outcome = "timed_out" if error.code == E_WAIT_TIMEOUT.code else "failed"
        completion = Completion(queue, message_id, outcome, error=error)
    except asyncio.CancelledError:
        completion = Completion(queue, message_id, "failed", error=QueueError(E_TIMEOUT, "the client closed"))
        _call(on_complete, completion)
        raise
    _call(on_complete, completion)


def _call(on_complete: OnComplete, completion: Completion) -> None:
    try:
        result = on_complete(completion)
        if asyncio.iscoroutine(result):        # an async callback: run it as a task of its own
            asyncio.get_running_loop().create_task(result)
    except Exception:          # noqa: BLE001 - a callback's error must not end the client's loop
        log.exception("on_complete callback for message %s of %s failed", completion.message_id, completion.queue)


async def cancel_callbacks(client: AsyncClient) -> None:
    """At close: pending on_complete waits end; each callback is called with outcome "failed"."""
    tasks = list(_tasks.pop(client, ()))
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def enqueue_waiting(client: AsyncClient, queue: str, count: int, stored: Any, wait: str | None,
                          timeout_s: float | None, on_complete: OnComplete | None) -> Any:
    """The hook of AsyncClient.enqueue/enqueue_many: `stored()` stores the message(s) (an int id
    or a list of ids); then wait for each (a Completion, or a list of them) or start the
    callbacks and return the id(s)."""
    kind, timeout = check_wait(wait, timeout_s)
    if on_complete is not None and wait is None:
        reserve_callbacks(client, count)
    await check_queue_type(client, queue, kind)
    ids = await stored()
    many = isinstance(ids, list)
    id_list: list[int] = ids if many else [ids]
    if wait is None:
        assert on_complete is not None
        for message_id in id_list:
            start_callback(client, queue, message_id, kind, timeout, on_complete)
        return ids
    completions = list(await asyncio.gather(*(wait_for(client, queue, message_id, kind, timeout)
                                              for message_id in id_list)))
    if on_complete is not None:
        for completion in completions:
            _call(on_complete, completion)
    return completions if many else completions[0]


REST_ENQUEUE_WAIT_S_MAX = 60.0       # the node's bound on an enqueue's wait_s


async def enqueue_rest_waiting(http: HttpClient, queue: str, payload: bytes, wait: str, timeout_s: float, *,
                               priority: int = 4, dedupe_id: str | None = None, ttl_s: float | None = None,
                               delay_s: float | None = None, headers: Mapping[str, str] | None = None
                               ) -> dict[str, Any]:
    """Enqueue over REST and wait for the completion (`qctl put --wait`): `POST
    /v1/queues/{q}/messages?wait=&wait_s=` holds the answer up to 60 s; a longer (or cut) wait
    goes on with the status call. The answer: {"id", "epoch", "state", "deliveries",
    "completed", "reply" (bytes, or absent)}; E_WAIT_TIMEOUT when the message did not complete."""
    kind, timeout = check_wait(wait, timeout_s)
    started = time.monotonic()
    fields = {"X-Priority": str(priority), "X-Dedupe-Id": dedupe_id or uuid.uuid4().hex,
              "Content-Type": "application/octet-stream"}
    if headers:
        fields["X-Headers"] = json.dumps(dict(headers), ensure_ascii=True)
    first_wait = min(timeout, REST_ENQUEUE_WAIT_S_MAX)
    query = [("wait", kind), ("wait_s", query_number(first_wait))]
    query += [(name, query_number(value)) for name, value in (("ttl_s", ttl_s), ("delay_s", delay_s))
              if value is not None]
    answer = dict((await http.request("POST", queue_path(queue, "messages"), body=payload, query=query,
                                      headers=fields, idempotent=False, wait_s=first_wait)).json())
    message_id = int(answer["id"])
    while not answer.get("completed"):
        left = timeout - (time.monotonic() - started)
        if left <= 0:
            what = "acked" if kind == "ack" else "replied to"
            raise QueueError(E_WAIT_TIMEOUT, f"message {message_id} of {queue} was not {what} within {timeout:g} s "
                                             f"(it is {answer.get('state', 'unknown')}); it stays in the queue")
        try:
            status = await http.message_status(queue, message_id, min(left, REST_WAIT_S_MAX),
                                               ",".join(sorted(TERMINAL_STATES)))
        except QueueError as error:
            if error.code not in ASKED_AGAIN_CODES:
                raise
            await asyncio.sleep(RETRY_DELAY_MAX_S)
            continue
        answer.update(status)
        answer["completed"] = status.get("state") in TERMINAL_STATES
    answer.pop("wait_error", None)
    if "reply_b64" in answer:
        answer["reply"] = base64.b64decode(answer.pop("reply_b64"))
    return answer
