"""The client side of a chaos run: producers, consumers, the observer, settling and draining.

Every worker has its own `AsyncClient` bound to one node's client proxy (workers are spread
over the nodes) and records each operation in the history (chaos.history) with the outcome
the client library gave it:

* producers enqueue one message per call at a steady rate, each with a unique dedupe id that
  the payload also carries (the *tag*);
* polling consumers receive up to a few messages, then ack most of them, release a few and
  abandon a few (their leases expire and they come back with a higher delivery count);
* push consumers (`consume`) take what the server pushes and ack it (after holding it
  `push_hold_s`, for a consumer slower than its queue's producers). Each keeps one consumer for
  its whole life: the client library subscribes again by itself after a failure, and an error
  the consumer raises is recorded and iteration goes on. Replacing a consumer that was idle or
  failed would hide a consumer that hangs (issue 40); the liveness check (chaos/liveness.py)
  needs to see it.

Every producer and consumer records a `worker` start and stop in the history: the liveness
check judges each from one to the other (a consumer that hangs records nothing else).

The observer reads every node's cluster map directly (not through the proxies) a few times a
second: what each node believes about each queue's (epoch, master) feeds the one-master-per-
epoch check, and the newest map tells the nemesis whom to target.

After the faults are healed: `settle` waits until every node agrees on every queue's pair,
the replica is in sync and caught up; `drain` then takes every message left, from the master
(and under `producer` from both members, which consume on their own), dead-letter queues too.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.cluster import ChaosCluster
from chaos.history import History, Operation, crc32, payload_for, tag_of
from client import AsyncClient, Message, QueueError
from client.credentials import load_credentials
from client.http import HttpClient
from client.macro import MacroEnqueueError, member_dedupe_id
from replication.options import dead_letter_name

log = logging.getLogger("chaos.workload")

OBSERVE_INTERVAL_S = 0.25
OBSERVE_TIMEOUT_S = 1.0
RECEIVE_WAIT_S = 0.5
EXTEND_VISIBILITY_S = 10.0       # what an extension asks for before the message is acked
PUSH_PREFETCH = 10
STOP_CHECK_S = 1.0               # a push consumer waiting for a message looks at the stop this often
CONSUMER_CLOSE_TIMEOUT_S = 3.0
ERROR_PAUSE_S = 0.2
CHANNEL_KNOWN_ATTEMPTS = 30      # a channel just created, asked for at its master every 0.1 s (_open_durable)
PUSH_ERROR_PAUSE_MAX_S = 2.0     # the longest pause between errors a push consumer raises in a row
DRAIN_BATCH = 200
REDRIVE_LIMIT = 1000             # dead letters one redrive of the workload moves at most
SETTLE_POLL_S = 0.5
WORKER_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class QueueSpec:
    name: str
    strength: str = "full"
    type: str = "queued_ack"         # replication.options.QueueType; one_way answers before durable
    placement: tuple[str, str] | None = None
    producers: int = 2
    consumers: int = 2               # polling consumers
    push_consumers: int = 0
    push_hold_s: float = 0.0         # a push consumer holds each message this long before its ack: slower than
                                     # messages come, its prefetch window stays full (the server's credit used up)
    rate: float = 20.0               # enqueues per second per producer
    priorities: tuple[int, ...] = (4,)
    payload_bytes: int = 64
    receive_max: int = 5
    visibility_timeout_s: float = 5.0
    max_deliveries: int = 20
    release_fraction: float = 0.02
    abandon_fraction: float = 0.01
    extend_fraction: float = 0.02    # extend the lease (a replicated step under full), then ack
    purge_every_s: float = 0.0       # an operator purges the queue about this often (0: never; `full` only)
    redrive_every_s: float = 0.0     # an operator redrives its dead letters about this often (`full`, dead_letter)
    ttl_fraction: float = 0.0        # enqueues with a time to live of ttl_s (expired ones are dead-lettered
    ttl_s: float = 2.0               # when the queue has a dead-letter queue, else dropped)
    delay_fraction: float = 0.0      # enqueues delivered no sooner than delay_s after them
    delay_s: float = 1.0
    dead_letter: bool = True
    max_depth: int = 0               # 0: the server's default
    forward_rate: float = 0.0        # as a forward's root (seed 003): the messages/s its forwarders share
    forward_interval_s: float = 2.0

    def options(self) -> dict[str, Any]:
        options = {"strength": self.strength, "type": self.type, "visibility_timeout_s": self.visibility_timeout_s,
                   "max_deliveries": self.max_deliveries, "dead_letter": self.dead_letter}
        if self.max_depth:
            options["max_depth"] = self.max_depth
        if self.forward_rate:
            options.update(forward_rate=self.forward_rate, forward_interval_s=self.forward_interval_s)
        return options


@dataclass(frozen=True)
class MacroSpec:
    """A macro queue over queues of the scenario: its producers enqueue through it (each call a
    copy into every member under `all`); the members' own consumers take the copies, and the
    checker judges each member as the queue it is (its copies recorded as its enqueues)."""
    name: str
    members: tuple[str, ...]
    producer: str = "all"
    producers: int = 1
    rate: float = 10.0
    priorities: tuple[int, ...] = (4,)
    payload_bytes: int = 64


@dataclass(frozen=True)
class ChannelSpec:
    """A channel: publishers at a steady rate, subscribers that read as fast as values come.
    `latest`: the checker holds each subscriber to "never older than a value already seen",
    every value one that was published, and the last acknowledged value reached after the
    heal. `durable`: each subscriber reads its own durable subscription (opened before anything
    is published) and acknowledges what it takes; the checker holds every subscription to the
    total-queue terms (every acknowledged publish delivered to it, nothing unexpected, nothing
    delivered again once its ack was answered)."""
    name: str
    publishers: int = 1
    subscribers: int = 2
    rate: float = 10.0
    payload_bytes: int = 64
    delivery_class: str = "latest"

    def subscription(self, worker: int) -> str | None:
        """The durable subscription subscriber `worker` reads (None: a live `latest` one)."""
        return f"{self.name}-reader{worker}" if self.delivery_class == "durable" else None


CHANNEL_CATCH_UP_S = 15.0        # after the stop, a subscriber waits this long at most for the last value
DURABLE_QUIET_S = 5.0            # after the stop, a durable subscriber drains until this long without a message


def _error_text(error: BaseException) -> str:
    if isinstance(error, QueueError):
        return f"{error.code}: {error.message}"[:300]
    return repr(error)[:300]


class Observer:
    """Samples every node's /v1/cluster; keeps (queue, epoch, master) as each node saw it."""

    def __init__(self, cluster: ChaosCluster, history: History) -> None:
        self.cluster = cluster
        self.history = history
        credentials = load_credentials(cluster.credentials_path)
        self.http = {node: HttpClient(cluster.urls[node], credentials.signer(), request_timeout_s=OBSERVE_TIMEOUT_S,
                                      ca_file=credentials.ca_file) for node in cluster.ids}
        self.observations: set[tuple[str, int, str]] = set()
        self.seen_by: dict[tuple[str, int, str], set[str]] = {}
        # (queue, epoch) -> (first seen, master, replica): who the pair was, and since when
        self.pairs: dict[tuple[str, int], tuple[float, str, str | None]] = {}
        self.samples = 0
        self.latest: dict[str, Any] = {}

    def newest_map(self) -> dict[str, Any]:
        return self.latest

    def pair_history(self) -> list[tuple[str, int, float, str, str | None]]:
        return sorted((queue, epoch, seen, master, replica)
                      for (queue, epoch), (seen, master, replica) in self.pairs.items())

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._watch(node, stop) for node in self.cluster.ids))

    async def _watch(self, node: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if node in self.cluster.processes and node not in self.cluster.paused:
                await self.sample(node)
            await asyncio.sleep(OBSERVE_INTERVAL_S)

    async def sample(self, node: str) -> dict[str, Any] | None:
        try:
            current = await self.http[node].cluster()
        except (QueueError, ValueError):
            return None
        self.samples += 1
        for queue, entry in current.get("queues", {}).items():
            if entry.get("master"):
                key = (queue, int(entry["epoch"]), str(entry["master"]))
                self.observations.add(key)
                self.seen_by.setdefault(key, set()).add(node)
                self.pairs.setdefault((queue, key[1]), (self.history.now(), key[2], entry.get("replica")))
        if current.get("version", 0) >= self.latest.get("version", -1):
            self.latest = current
        return current

    async def close(self) -> None:
        for http in self.http.values():
            await http.close()


@dataclass
class Workload:
    cluster: ChaosCluster
    history: History
    queues: list[QueueSpec]
    seed: int
    op_timeout_s: float = 8.0
    macros: list[MacroSpec] = field(default_factory=list)
    channels: list[ChannelSpec] = field(default_factory=list)
    clients: list[AsyncClient] = field(default_factory=list)
    last_published: dict[str, int] = field(default_factory=dict)    # channel -> highest acknowledged id
    node_of_url: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    forwarded: frozenset[str] = frozenset()      # queues a forward empties (their own consumer): not drained here

    def __post_init__(self) -> None:
        self.node_of_url = {url.rstrip("/"): node for node, url in self.cluster.client_urls.items()}

    def client(self, node: str) -> AsyncClient:
        client = AsyncClient(self.cluster.client_urls[node], self.cluster.credentials_path,
                             request_timeout_s=self.op_timeout_s, connect_timeout_s=2.0)
        self.clients.append(client)
        return client

    def served_by(self, message: Message) -> str:
        """The node whose client proxy answered: the client library routes each queue to its
        master (or keeps a member's own consumers there, under `producer`)."""
        client = getattr(message, "_client", None)
        return self.node_of_url.get(str(getattr(client, "url", "")).rstrip("/"), "?")

    async def create_queues(self) -> None:
        async with AsyncClient(self.cluster.client_urls[self.cluster.ids[0]], self.cluster.credentials_path) as admin:
            for spec in self.queues:
                await admin.create_queue(spec.name, **spec.options())
            for channel in self.channels:
                await admin.create_channel(channel.name, channel.delivery_class)
                for worker in range(channel.subscribers):   # durable: opened before anything is published
                    name = channel.subscription(worker)
                    if name is not None:
                        await self._open_durable(admin, channel.name, name)
            for macro in self.macros:
                await admin.create_macro(macro.name, macro.producer, "prioritized")
                for member in macro.members:
                    await admin.add_macro_member(macro.name, member)

    @staticmethod
    async def _open_durable(admin: AsyncClient, channel: str, name: str) -> None:
        """Open durable subscription `name` of a channel just created. The channel's master may
        not have applied the map command that made it yet (a node of an older release answers
        E_UNKNOWN_CHANNEL then, seen in tests/test_upgrade.py): asked again, for a bounded while."""
        for attempt in range(CHANNEL_KNOWN_ATTEMPTS):
            try:
                await admin.subscribe(channel, durable=name)
                break
            except QueueError as error:
                if error.code != "E_UNKNOWN_CHANNEL" or attempt == CHANNEL_KNOWN_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.1)
        await admin.unsubscribe(channel)

    # --- workers -------------------------------------------------------------------------------
    def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks = []
        ids = self.cluster.ids
        slot = 0
        for spec in self.queues:
            for worker in range(spec.producers):
                tasks.append(asyncio.create_task(self._produce(spec, worker, ids[slot % len(ids)], stop)))
                slot += 1
            for worker in range(spec.consumers):
                tasks.append(asyncio.create_task(self._consume_polling(spec, worker, ids[slot % len(ids)], stop)))
                slot += 1
            for worker in range(spec.push_consumers):
                tasks.append(asyncio.create_task(self._consume_pushed(spec, worker, ids[slot % len(ids)], stop)))
                slot += 1
            if spec.purge_every_s > 0:
                tasks.append(asyncio.create_task(self._purge_now_and_then(spec, ids[slot % len(ids)], stop)))
                slot += 1
            if spec.redrive_every_s > 0:
                tasks.append(asyncio.create_task(self._redrive_now_and_then(spec, ids[slot % len(ids)], stop)))
                slot += 1
        for macro in self.macros:
            for worker in range(macro.producers):
                tasks.append(asyncio.create_task(self._produce_through_macro(macro, worker, ids[slot % len(ids)], stop)))
                slot += 1
        for channel in self.channels:
            for worker in range(channel.publishers):
                tasks.append(asyncio.create_task(self._publish(channel, worker, ids[slot % len(ids)], stop)))
                slot += 1
            for worker in range(channel.subscribers):
                tasks.append(asyncio.create_task(self._listen(channel, worker, ids[slot % len(ids)], stop)))
                slot += 1
        return tasks

    @contextlib.contextmanager
    def _working(self, process: str, role: str, queue: str) -> Iterator[None]:
        """A worker's life between two `worker` records (stop also when it is cancelled)."""
        self.history.info(process, "worker", queue=queue, role=role, event="start")
        try:
            yield
        finally:
            self.history.info(process, "worker", queue=queue, role=role, event="stop")

    def _rng(self, *parts: object) -> random.Random:
        return random.Random(f"{self.seed}-" + "-".join(map(str, parts)))

    async def _produce(self, spec: QueueSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        rng = self._rng("produce", spec.name, worker)
        client = self.client(node)
        process = f"p-{spec.name}-{worker}@{node}"
        sequence = 0
        with self._working(process, "producer", spec.name):
            while not stop.is_set():
                sequence += 1
                tag = f"{spec.name}.{worker}.{sequence}"
                payload = payload_for(tag, spec.payload_bytes)
                priority = rng.choice(spec.priorities)
                ttl_s = spec.ttl_s if rng.random() < spec.ttl_fraction else None
                delay_s = spec.delay_s if rng.random() < spec.delay_fraction else None
                timing = {name: value for name, value in (("ttl_s", ttl_s), ("delay_s", delay_s)) if value is not None}
                operation = self.history.invoke(process, "enqueue", spec.name, dedupe_id=tag, payload_crc32=crc32(payload),
                                                priority=priority, node=node, **timing)
                ok, _ = await self._outcome(operation, client.enqueue(spec.name, payload, priority, dedupe_id=tag,
                                                                      ttl_s=ttl_s, delay_s=delay_s),
                                            lambda message_id: {"id": message_id})
                await asyncio.sleep(rng.expovariate(spec.rate) if ok else ERROR_PAUSE_S * (1 + rng.random()))

    async def _produce_through_macro(self, spec: MacroSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        """Enqueues through a macro queue: one call, recorded as one enqueue per member (the
        copy's dedupe id, which the journals hold, and the payload's tag, which consumers see),
        each completed with that member's outcome."""
        rng = self._rng("produce", spec.name, worker)
        client = self.client(node)
        process = f"p-{spec.name}-{worker}@{node}"
        sequence = 0
        with self._working(process, "producer", spec.name):
            while not stop.is_set():
                sequence += 1
                tag = f"{spec.name}.{worker}.{sequence}"
                payload = payload_for(tag, spec.payload_bytes)
                priority = rng.choice(spec.priorities)
                operations = {member: self.history.invoke(process, "enqueue", member, dedupe_id=member_dedupe_id(tag, member),
                                                          tag=tag, macro=spec.name, payload_crc32=crc32(payload),
                                                          priority=priority, node=node)
                              for member in spec.members}
                ok = await self._copies_outcome(operations, client.enqueue(spec.name, payload, priority, dedupe_id=tag))
                await asyncio.sleep(rng.expovariate(spec.rate) if ok else ERROR_PAUSE_S * (1 + rng.random()))

    async def _publish(self, spec: ChannelSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        rng = self._rng("publish", spec.name, worker)
        client = self.client(node)
        process = f"pub-{spec.name}-{worker}@{node}"
        sequence = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(client.advertise(spec.name), self.op_timeout_s)
                break
            except (QueueError, TimeoutError) as error:
                self.history.info(process, "advertise", channel=spec.name, error=_error_text(error))
                await asyncio.sleep(ERROR_PAUSE_S)
        while not stop.is_set():
            sequence += 1
            tag = f"{spec.name}.{worker}.{sequence}"
            payload = payload_for(tag, spec.payload_bytes)
            operation = self.history.invoke(process, "publish", None, channel=spec.name, tag=tag, node=node)
            ok, message_id = await self._outcome(operation, client.publish(spec.name, payload, dedupe_id=tag),
                                                 lambda answer: {"id": answer})
            if ok:
                self.last_published[spec.name] = max(self.last_published.get(spec.name, 0), message_id)
            await asyncio.sleep(rng.expovariate(spec.rate) if ok else ERROR_PAUSE_S * (1 + rng.random()))

    async def _listen(self, spec: ChannelSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        """Subscribe (again until it works), then record every value handed out, in order; after
        the stop, wait (bounded) for the last acknowledged value, and record where it ended."""
        client = self.client(node)
        process = f"sub-{spec.name}-{worker}@{node}"
        durable = spec.subscription(worker)
        if durable is not None:
            await self._read_durable(spec, durable, client, process, stop)
            return
        while not stop.is_set():
            try:
                await asyncio.wait_for(client.subscribe(spec.name), self.op_timeout_s)
                break
            except (QueueError, TimeoutError) as error:
                self.history.info(process, "subscribe", channel=spec.name, error=_error_text(error))
                await asyncio.sleep(ERROR_PAUSE_S)
        seen = 0
        stopped_at: float | None = None
        while True:
            if stop.is_set():
                stopped_at = stopped_at or self.history.now()
                if seen >= self.last_published.get(spec.name, 0) or \
                        self.history.now() - stopped_at > CHANNEL_CATCH_UP_S:
                    break
            try:
                message = await asyncio.wait_for(client.next_channel_message(), 1.0)
            except TimeoutError:
                continue
            seen = max(seen, message.id)
            self.history.info(process, "channel_value", channel=spec.name, id=message.id,
                              tag=tag_of(message.payload), resent=message.resent)
        self.history.info(process, "channel_end", channel=spec.name, last_id=seen,
                          last_published=self.last_published.get(spec.name, 0))

    async def _read_durable(self, spec: ChannelSpec, name: str, client: AsyncClient, process: str,
                            stop: asyncio.Event) -> None:
        """Read durable subscription `name`: record each message taken, acknowledge it and
        record the answer; after the stop, drain (bounded) until the backlog stays empty."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(client.subscribe(spec.name, durable=name), self.op_timeout_s)
                break
            except (QueueError, TimeoutError) as error:
                self.history.info(process, "subscribe", channel=spec.name, error=_error_text(error))
                await asyncio.sleep(ERROR_PAUSE_S)
        last_message = self.history.now()
        stopped_at: float | None = None
        while True:
            now = self.history.now()
            if stop.is_set():
                stopped_at = stopped_at or now
                if now - last_message > DURABLE_QUIET_S or now - stopped_at > 4 * CHANNEL_CATCH_UP_S:
                    break
            try:
                message = await asyncio.wait_for(client.next_channel_message(), 1.0)
            except TimeoutError:
                continue
            last_message = self.history.now()
            self.history.info(process, "channel_value", channel=spec.name, id=message.id,
                              tag=tag_of(message.payload), resent=message.resent, subscription=name)
            operation = self.history.invoke(process, "durable_ack", None, channel=spec.name, subscription=name,
                                            id=message.id)
            await self._outcome(operation, message.ack(), lambda _: {})
        self.history.info(process, "channel_end", channel=spec.name, subscription=name,
                          last_published=self.last_published.get(spec.name, 0))

    async def _copies_outcome(self, operations: dict[str, Operation], call: Awaitable[Any]) -> bool:
        try:
            answer = await asyncio.wait_for(call, self.op_timeout_s)
        except MacroEnqueueError as error:          # some members acknowledged their copy, some not
            for member, outcome in error.outcomes.items():
                if isinstance(outcome, QueueError):
                    self.history.complete(operations[member], "unknown" if outcome.outcome_unknown else "fail",
                                          error=_error_text(outcome))
                else:
                    self.history.complete(operations[member], "ok", id=int(outcome))
            return False
        except Exception as error:       # TimeoutError, a QueueError for every member, or a client bug
            unknown = not isinstance(error, QueueError) or error.outcome_unknown
            if not isinstance(error, QueueError | TimeoutError):
                self.errors.append(_error_text(error))
                log.exception("unexpected client error")
            for operation in operations.values():
                self.history.complete(operation, "unknown" if unknown else "fail", error=_error_text(error))
            return False
        for member, operation in operations.items():
            self.history.complete(operation, "ok", id=int(answer.copies[member]))
        return True

    async def _purge_now_and_then(self, spec: QueueSpec, node: str, stop: asyncio.Event) -> None:
        """An operator purging the queue at random moments; the answer's `upto` tells the
        checker which ids it took (under `full` they are the pair's, whichever member answers)."""
        rng = self._rng("purge", spec.name)
        client = self.client(node)
        process = f"o-{spec.name}@{node}"
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), spec.purge_every_s * rng.uniform(0.5, 1.5))
            if stop.is_set():
                return
            operation = self.history.invoke(process, "purge", spec.name, node=node)
            await self._outcome(operation, client.purge(spec.name),
                                lambda answer: {"upto": answer["upto"], "purged": answer["purged"]})

    async def _redrive_now_and_then(self, spec: QueueSpec, node: str, stop: asyncio.Event) -> None:
        """An operator sending dead letters back at random moments; the answer's `ids` are the
        new messages the checker then expects to be delivered (chaos/checker.py `_fold_redrives`)."""
        rng = self._rng("redrive", spec.name)
        client = self.client(node)
        process = f"o-redrive-{spec.name}@{node}"
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), spec.redrive_every_s * rng.uniform(0.5, 1.5))
            if stop.is_set():
                return
            operation = self.history.invoke(process, "redrive", spec.name, node=node)
            await self._outcome(operation, client.redrive(spec.name, REDRIVE_LIMIT),
                                lambda answer: {"redriven": answer["redriven"], "ids": answer["ids"],
                                                "ids_truncated": bool(answer.get("ids_truncated"))})

    async def _outcome(self, operation: Operation, call: Awaitable[Any], fields: Any,
                       timeout_s: float | None = None) -> tuple[bool, Any]:
        """Await `call` and complete the operation: ok, fail (a definite error) or unknown
        (a timeout, or an error whose outcome is unknown). (ok?, the call's result)."""
        try:
            result = await asyncio.wait_for(call, timeout_s or self.op_timeout_s)
        except QueueError as error:
            self.history.complete(operation, "unknown" if error.outcome_unknown else "fail", error=_error_text(error))
            return False, None
        except TimeoutError:
            self.history.complete(operation, "unknown", error="timed out")
            return False, None
        except Exception as error:       # a client bug must not end the run; it is reported
            self.errors.append(_error_text(error))
            log.exception("unexpected client error")
            self.history.complete(operation, "unknown", error=_error_text(error))
            return False, None
        self.history.complete(operation, "ok", **fields(result))
        return True, result

    def _received(self, messages: list[Message]) -> dict[str, Any]:
        return {"messages": [self._message_view(m, "poll") for m in messages]}

    def _message_view(self, message: Message, via: str) -> dict[str, Any]:
        return {"id": message.id, "tag": tag_of(message.payload), "deliveries": message.deliveries,
                "priority": message.priority, "node": self.served_by(message), "via": via,
                "payload_crc32": crc32(message.payload)}

    async def _consume_polling(self, spec: QueueSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        rng = self._rng("consume", spec.name, worker)
        client = self.client(node)
        process = f"c-{spec.name}-{worker}@{node}"
        with self._working(process, "consumer", spec.name):
            while not stop.is_set():
                operation = self.history.invoke(process, "receive", spec.name, node=node)
                ok, received = await self._outcome(
                    operation, client.receive(spec.name, rng.randint(1, spec.receive_max), wait_s=RECEIVE_WAIT_S),
                    self._received, self.op_timeout_s + RECEIVE_WAIT_S)
                if not ok:
                    await asyncio.sleep(ERROR_PAUSE_S)
                    continue
                await self._settle_messages(spec, process, received, rng)

    async def _settle_messages(self, spec: QueueSpec, process: str, messages: list[Message],
                               rng: random.Random) -> None:
        """Ack most, release a few, abandon a few (their leases expire), extend a few first."""
        calls: list[Awaitable[Any]] = []
        for message in messages:
            draw = rng.random()
            if draw < spec.abandon_fraction:
                continue
            if draw < spec.abandon_fraction + spec.release_fraction:
                calls.append(self.finish(process, message, "release"))
            elif draw < spec.abandon_fraction + spec.release_fraction + spec.extend_fraction:
                calls.append(self._extend_then_ack(process, message))
            else:
                calls.append(self.finish(process, message, "ack"))
        if calls:
            await asyncio.gather(*calls)

    async def _extend_then_ack(self, process: str, message: Message) -> None:
        await self.finish(process, message, "extend")
        await self.finish(process, message, "ack")

    async def finish(self, process: str, message: Message, action: str) -> bool:
        """`action`: ack, release or extend (by EXTEND_VISIBILITY_S; the checker reads no
        verdict from it, the audit checks the replicated step)."""
        operation = self.history.invoke(process, action, message.queue, id=message.id, deliveries=message.deliveries,
                                        node=self.served_by(message))
        call = message.ack() if action == "ack" else message.release() if action == "release" \
            else message.extend(EXTEND_VISIBILITY_S)
        ok, _ = await self._outcome(operation, call, lambda _: {})
        return ok

    async def _consume_pushed(self, spec: QueueSpec, worker: int, node: str, stop: asyncio.Event) -> None:
        """One consumer for the worker's whole life, so that a consumer that stops delivering
        shows in the history as a stall (chaos/liveness.py) instead of being replaced by a new
        one that works (issue 40: replacing an idle consumer hid consumers that hung). It is
        replaced only when it has ended (a non-retriable error, or closed under the worker),
        and the replacement is recorded."""
        client = self.client(node)
        process = f"s-{spec.name}-{worker}@{node}"
        with self._working(process, "consumer", spec.name):
            while not stop.is_set():
                consumer = client.consume(spec.name, prefetch=PUSH_PREFETCH)
                try:
                    ended = await self._take_pushed(spec, process, node, consumer, stop)
                finally:
                    with contextlib.suppress(QueueError, TimeoutError):
                        await asyncio.wait_for(consumer.close(), CONSUMER_CLOSE_TIMEOUT_S)
                if ended is None or stop.is_set():
                    return
                self.history.info(process, "consumer", queue=spec.name, event="replaced", why=ended)
                await asyncio.sleep(ERROR_PAUSE_S)
                with contextlib.suppress(QueueError, TimeoutError):     # follow the queue's master
                    await asyncio.wait_for(client.refresh_placement(), CONSUMER_CLOSE_TIMEOUT_S)

    async def _take_pushed(self, spec: QueueSpec, process: str, node: str, consumer: AsyncIterator[Message],
                           stop: asyncio.Event) -> str | None:
        """Take each message, hold it `spec.push_hold_s`, ack it, until the stop (None) or
        until the consumer ends (why). A retriable error is recorded and the same consumer is
        iterated again: the client subscribes again by itself after one. Pauses between errors
        grow (bounded), so a consumer that raises at once every time does not spin. The wait
        for the next message is never cancelled to look at the stop (the iterator may be in
        the middle of subscribing again), only when the worker ends."""
        error_pause_s = ERROR_PAUSE_S
        next_message: asyncio.Future[Message] | None = None
        try:
            while not stop.is_set():
                if next_message is None:
                    next_message = asyncio.ensure_future(anext(consumer))
                if not (await asyncio.wait({next_message}, timeout=STOP_CHECK_S))[0]:
                    continue
                taken, next_message = next_message, None
                try:
                    message = taken.result()
                except StopAsyncIteration:
                    self.history.info(process, "subscription", queue=spec.name, error="the consumer was closed")
                    return "the consumer was closed"
                except QueueError as error:
                    self.history.info(process, "subscription", queue=spec.name, error=_error_text(error),
                                      retriable=error.retriable)
                    if not error.retriable:
                        return _error_text(error)
                    await asyncio.sleep(error_pause_s)
                    error_pause_s = min(2 * error_pause_s, PUSH_ERROR_PAUSE_MAX_S)
                    continue
                error_pause_s = ERROR_PAUSE_S
                await self._take_one(spec, process, node, message)
            return None
        finally:
            if next_message is not None:
                next_message.cancel()
                await asyncio.gather(next_message, return_exceptions=True)

    async def _take_one(self, spec: QueueSpec, process: str, node: str, message: Message) -> None:
        operation = self.history.invoke(process, "receive", spec.name, node=node)
        self.history.complete(operation, "ok", messages=[self._message_view(message, "push")])
        if spec.push_hold_s:
            await asyncio.sleep(spec.push_hold_s)
        await self.finish(process, message, "ack")

    async def stop_workers(self, tasks: list[asyncio.Task[None]]) -> None:
        """Workers finish the operation they are in (bounded), then stop."""
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.op_timeout_s + WORKER_STOP_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5.0)
        self.clients.clear()

    # --- the end of a run --------------------------------------------------------------------
    async def settle(self, observer: Observer, timeout_s: float) -> dict[str, Any]:
        """Until every running node agrees on every queue's (epoch, master, replica), the pair
        is in sync and the master's replica has caught up; returns how it went."""
        started = self.history.now()
        problems: list[str] = ["not checked yet"]
        while self.history.now() - started < timeout_s:
            problems = await self._unsettled(observer)
            if not problems:
                return {"settled": True, "settle_s": round(self.history.now() - started, 2)}
            await asyncio.sleep(SETTLE_POLL_S)
        return {"settled": False, "settle_s": round(self.history.now() - started, 2), "problems": problems[:10]}

    async def _unsettled(self, observer: Observer) -> list[str]:
        maps = {}
        for node in self.cluster.ids:
            current = await observer.sample(node)
            if current is None:
                return [f"{node} does not answer"]
            maps[node] = current
        problems = []
        for spec in self.queues:
            views = {node: _pair_view(current.get("queues", {}).get(spec.name)) for node, current in maps.items()}
            if len(set(views.values())) != 1:
                problems.append(f"{spec.name}: nodes disagree {views}")
                continue
            epoch, master, replica, in_sync = next(iter(views.values()))
            if not in_sync or master is None or replica is None:
                problems.append(f"{spec.name}: not in sync (master {master}, replica {replica})")
                continue
            lag = await self._lag(master, spec.name)
            if lag != 0:
                problems.append(f"{spec.name}: replica lag {lag}")
        return problems

    async def _lag(self, master: str, queue: str) -> int | None:
        try:
            stats = await observer_stats(self.cluster, master, queue)
        except (QueueError, ValueError):
            return None
        if stats.get("master_status") != "master":
            return None
        return int(stats.get("replica_lag", 0) or 0)

    async def drain(self, final_map: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Take every message left: from the master (under `producer` from each member), dead-
        letter queues too, acking each; done when the member reports the queue empty."""
        self.history.phase = "drain"
        outcome: dict[str, Any] = {}
        for spec in self.queues:
            entry = final_map.get("queues", {}).get(spec.name, {})
            members = [entry.get("master")] + ([entry.get("replica")] if spec.strength == "producer" else [])
            for member in [m for m in members if m]:
                if spec.name in self.forwarded:
                    outcome[f"{spec.name}@{member}"] = await self._forwarded_away(spec.name, member, timeout_s)
                    continue
                for queue in (spec.name, dead_letter_name(spec.name)) if spec.dead_letter else (spec.name,):
                    outcome[f"{queue}@{member}"] = await self._drain_one(queue, member, timeout_s)
        return outcome

    async def _forwarded_away(self, queue: str, member: str, timeout_s: float) -> dict[str, Any]:
        """A forward's source is emptied by its forwarder (taking from it here would take the
        messages from the forward): done when its master reports it empty."""
        started = self.history.now()
        while self.history.now() - started < timeout_s:
            with contextlib.suppress(QueueError, OSError, TimeoutError):
                if int((await observer_stats(self.cluster, member, queue)).get("depth", -1)) == 0:
                    return {"drained": True, "taken": 0}
            await asyncio.sleep(ERROR_PAUSE_S)
        return {"drained": False, "taken": 0}

    async def _drain_one(self, queue: str, member: str, timeout_s: float) -> dict[str, Any]:
        client = self.client(member)
        process = f"drain-{queue}@{member}"
        rng = self._rng("drain", queue, member)
        started = self.history.now()
        taken = 0
        while self.history.now() - started < timeout_s:
            operation = self.history.invoke(process, "receive", queue, node=member)
            ok, received = await self._outcome(operation, client.receive(queue, DRAIN_BATCH, wait_s=RECEIVE_WAIT_S),
                                               self._received, self.op_timeout_s + RECEIVE_WAIT_S)
            if not ok:
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            if received:
                taken += len(received)
                await asyncio.gather(*(self.finish(process, m, "ack") for m in received))
                continue
            try:
                depth = int((await observer_stats(self.cluster, member, queue)).get("depth", 0))
            except QueueError as error:
                if error.code == "E_UNKNOWN_QUEUE":
                    return {"drained": True, "taken": taken}
                depth = -1
            if depth == 0:
                return {"drained": True, "taken": taken}
            await asyncio.sleep(ERROR_PAUSE_S + rng.random() * ERROR_PAUSE_S)   # leased: wait for expiry
        return {"drained": False, "taken": taken}


def _pair_view(entry: dict[str, Any] | None) -> tuple[int, str | None, str | None, bool]:
    if not entry:
        return (0, None, None, False)
    return (int(entry.get("epoch", 0)), entry.get("master"), entry.get("replica"), bool(entry.get("in_sync")))


async def observer_stats(cluster: ChaosCluster, node: str, queue: str) -> dict[str, Any]:
    """A queue's statistics as `node` holds them (asked directly, not through a proxy)."""
    credentials = load_credentials(cluster.credentials_path)
    async with HttpClient(cluster.urls[node], credentials.signer(), request_timeout_s=OBSERVE_TIMEOUT_S * 3,
                          ca_file=credentials.ca_file) as http:
        return await http.queue_stats(queue)


def history_path(run_dir: Path) -> Path:
    return run_dir / "history.jsonl"
