"""Forwarders: store-and-forward from a local queue into a queue of another cluster (seed 003).

A forward (the map's `ForwardEntry`, made by `qctl forward create`) runs on the master of its
source queue, and moves with it on handoff and failover: this node's `Forwarders` start one
for each forward whose source it masters and stop it when it masters it no more.

Each message crosses in the paper's three separate transactions (§3.1): the producer stored
it in the source (1); the forwarder leases it, enqueues it at the destination, and acks it
at the source only once the destination answered it stored (2); a consumer takes it at the
destination (3). A crash, a partition or a failover between the enqueue and the ack sends it
again: the destination stores it once, because each message is numbered in the forward's
**stream** (`<forward>@<source incarnation>`, its number the source message id) and the
destination keeps the stream's numbers (replication/queue_core.py `x-sequence-*`) however long
the forward exists, not just a dedupe window. The numbers do not arrive in order (priorities,
delays, redeliveries reorder the source), so each data message also carries the stream's
**floor**: the lowest id the source still held when the forwarder last knew its acks committed
(every number below it is settled), which bounds what the destination keeps.

The **session** (§3.2): the forwarder opens it with the root (qserver/features/forwards/root.py, the
destination queue's master), keeps it alive, reports its weight (its source's fill level in
the root's bands) in every data message and keepalive, and paces its sends to the rate the
root assigns (§3.3) with a token bucket. A root silent for its hold time, or a session the
root no longer knows, is opened again (at the queue's master of the moment). Messages the
forwarder leased stay leased across sessions (their leases extended): released at every
reconnection, their delivery counts would grow to max_deliveries and dead-letter them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.aio import AsyncClient
from client.credentials import Credentials
from qserver.api.auth import CLUSTER_CLIENT
from qserver.core import commands as c
from qserver.features.forwards.decide import Fill, fill_of
from qserver.metrics import render_family
from qserver.sealing import SEALED_PREFIX, open_sealed, seal
from replication.cluster_map import ForwardEntry
from wire import errors as e
from wire.errors import QueueError
from wire.protocol import DeliveredMessage

if TYPE_CHECKING:
    from qserver.features.macro.service import MacroService
    from qserver.services import NodeServices
    from replication.queue_core import QueueCore

log = logging.getLogger("qserver.features.forwards.forwarder")
RECONCILE_INTERVAL_S = 0.5       # how often a node looks for forwards to start or stop
BATCH_MAX = 250                  # messages received at a time (one data message per priority among them ...
DATA_BYTES_MAX = 1 << 20         # ... or more: a data message holds at most this many payload bytes, or one message
PIPELINE_DEPTH = 4               # batches sent and not yet answered (issue 38; bench/bench_forward_pipeline.py)
HELD_MAX = 1_000                 # messages held while the destination's stream window is full
RECEIVE_WAIT_MS = 500            # an idle source is waited on this long per receive
VISIBILITY_MS = 10_000           # the forwarder's lease on what it sends; extended while held
RETRY_PAUSE_S = 0.2              # after the destination could not take a message this moment
BACKOFF_MAX_S = 5.0              # between attempts at a session
BURST_S = 0.1                    # a token bucket holds at least this long's worth of its rate ...
CYCLE_SPAN_MAX_S = 2.0           # ... and at most this long's (a send cycle's, when longer)
TRACE_MAX = 2_000                # rate changes kept per forwarder (stats)
# A fill in bytes (a forward's control `fill_unit: bytes`) is measured by browsing the source
# (qserver/core/peek.py: one page, its scan bounded to ~3 ms of the loop) at most this often:
# the sizes of the page's messages, and their mean for any beyond it (exact up to a page).
BYTES_MEASURE_S = 0.5
BYTES_PAGE = 1_000
# Item errors that end the session (the whole forward cannot go on there) rather than the item.
SESSION_ERRORS = frozenset({e.E_UNKNOWN_FORWARD.code, e.E_NOT_MASTER.code, e.E_FORBIDDEN.code,
                            e.E_UNKNOWN_QUEUE.code, e.E_UNAUTHENTICATED.code})
# Item errors that refuse the message for good: given back to the source (max_deliveries then
# dead-letters it there), not retried without end.
MESSAGE_ERRORS = frozenset({e.E_PAYLOAD_TOO_LARGE.code, e.E_INVALID_OPTION.code, e.E_WRONG_QUEUE_TYPE.code})


FORWARD_CA_DIR = "forward-ca"    # under the data directory: each forward's own CA file, written from the map


# --- a forward's credentials at rest (docs/PROTOCOL.md "Forwards", "The other cluster's key") --------
# Sealed by qserver/sealing.py: AES-256-GCM under HKDF-SHA256(cluster secret, info b"qcluster forward
# credentials v1"), bound to the forward's name and client id, stored as "sealed1:" + base64 (the
# format forwards have always stored: maps written before the module existed open).
FORWARD_SEALING_PURPOSE = "forward credentials"


def seal_secret(cluster_secret: bytes, name: str, client_id: str, private_key: str, ca: str = "") -> str:
    """What the map keeps of a forward's credentials in another cluster: its private key (and
    that cluster's CA certificate, if given), encrypted, bound to the forward's name and client
    id. Without a cluster secret (a node outside a cluster runs no forwarders) it stays as given."""
    if not cluster_secret:
        return private_key
    document = json.dumps({"private_key": private_key, "ca": ca}).encode()
    return seal(cluster_secret, FORWARD_SEALING_PURPOSE, f"{name}\x1f{client_id}", document)


def open_secret(cluster_secret: bytes, name: str, client_id: str, stored: str) -> tuple[str, str]:
    """(private key, CA certificate or "") of a forward as the map keeps it; an entry made
    before credentials were sealed holds the plain key (and no CA)."""
    if not stored.startswith(SEALED_PREFIX):
        return stored, ""
    document = json.loads(open_sealed(cluster_secret, FORWARD_SEALING_PURPOSE, f"{name}\x1f{client_id}", stored))
    return str(document["private_key"]), str(document.get("ca") or "")


class TokenBucket:
    """Paces sends to `rate` messages/s (None: unpaced; 0: nothing until a rate is given),
    holding at most `span_s` worth (at least one message): BURST_S, or as long as one send
    cycle of its forwarder takes (a cycle waits for two commits: over a slow link a bucket of
    0.1 s would cap the forwarder below its rate)."""

    def __init__(self, rate: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.rate = rate
        self.span_s = BURST_S
        self._tokens = 0.0
        self._at = clock()
        self._changed = asyncio.Event()

    def _capacity(self) -> float:
        return max(1.0, (self.rate or 0.0) * self.span_s)

    def _refill(self) -> None:
        now = self._clock()
        if self.rate:
            self._tokens = min(self._capacity(), self._tokens + (now - self._at) * self.rate)
        self._at = now

    def set_rate(self, rate: float | None) -> None:
        self._refill()
        self.rate = rate
        self._tokens = min(self._tokens, self._capacity())
        self._changed.set()          # a waiting acquire looks again at once

    def take(self, most: int) -> int:
        """Up to `most` whole tokens available now (all of `most` when unpaced)."""
        if self.rate is None:
            return most
        self._refill()
        count = min(most, int(self._tokens))
        self._tokens -= count
        return count

    def give_back(self, count: int) -> None:
        if self.rate is not None:
            self._tokens = min(self._capacity(), self._tokens + count)

    def wait_s(self) -> float:
        """How long until a token is there (a moment, when no rate is given: it may come)."""
        if self.rate is None:
            return 0.0
        if self.rate <= 0:
            return 1.0
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self.rate)

    async def acquire(self, most: int) -> int:
        while True:
            count = self.take(most)
            if count:
                return count
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.001, self.wait_s()))


def weight_of(depth: int, max_depth: int, bands: int) -> int:
    """Seed 003 §4.2: fill level X·10% up to (X+1)·10% is weight X (with 10 bands)."""
    return min(bands - 1, depth * bands // max(1, max_depth))


# The commands the forwarder sends the engine, each made by a factory of its replier; built by
# these functions so that each binds the values of its moment, not a loop's variables.
Factory = Callable[[c.FutureReplier], c.Command]


def _receive(source: str, most: int, wait_ms: int) -> Factory:
    return lambda r: c.Receive(source, most, wait_ms, VISIBILITY_MS, CLUSTER_CLIENT, r)


def _ack_many(source: str, acks: tuple[tuple[int, str], ...]) -> Factory:
    return lambda r: c.AckMany(source, acks, CLUSTER_CLIENT, r)


def _extend(source: str, message: DeliveredMessage) -> Factory:
    return lambda r: c.Ack(source, message.message_id, message.receipt, CLUSTER_CLIENT, r, extend_ms=VISIBILITY_MS)


class Forwarder:
    """One forward's task on the master of its source queue."""

    def __init__(self, services: NodeServices, macros: MacroService, entry: ForwardEntry) -> None:
        self._services = services
        self._macros = macros        # its client in the cluster's name sends into a queue of this cluster
        self.entry = entry
        self.state = "starting"
        self.error = ""
        self.rate: float | None = None
        self.terms: dict[str, Any] = {}
        self.weight = 0
        self.fill: Fill | None = None
        self._queue_bytes = 0
        self._bytes_measured = float("-inf")
        self.sent = self.stored = self.refused = self.sessions = 0
        self.trace: collections.deque[tuple[float, float | None, int]] = collections.deque(maxlen=TRACE_MAX)
        self._bucket = TokenBucket(0.0)
        # The root's bands, from its terms: a weight beyond them is refused (E_INVALID_OPTION,
        # docs/PROTOCOL.md "Forwards"); until a session told them (None) the open reports 0.
        self._bands: int | None = None
        self._held: list[DeliveredMessage] = []      # leased at the source, not yet stored at the destination
        self._resend: list[DeliveredMessage] = []    # of them, those the root did not take: sent again
        self._kept_codes: dict[int, str] = {}         # ... and the code each was refused with
        self._leased_at = 0.0
        # Per priority (each its own stream: the source hands out a priority in id order, so
        # only delays and redeliveries reorder one): every id below it settled, and committed.
        self._floors: dict[int, int] = {}
        self._window_full = False
        self._client: AsyncClient | None = None
        self._url_turn = 0

    # --- the source -------------------------------------------------------------------------
    def _core(self) -> QueueCore:
        core = self._services.master_core(self.entry.source)
        if core is None:
            raise QueueError(e.E_NOT_MASTER, f"this node is not the master of {self.entry.source}")
        return core

    async def _weight(self) -> int:
        """The weight to report: the source's fill in the forward's own bands and weights (its
        control, seed 003 figure 6), else in the root's uniform bands; capped by the root's
        ceiling (bands - 1). 0 until a session told the root's bands."""
        core = self._core()
        control = self.entry.control
        if control.get("fill_unit") == "bytes":
            await self._measure_bytes(core)
        if self._bands is None:
            self.weight = 0
            return 0
        self.fill = fill_of(control, core.depth, core.options.max_depth, self._queue_bytes, self._bands)
        self.weight = self.fill.weight
        return self.weight

    async def _measure_bytes(self, core: QueueCore) -> None:
        now = time.monotonic()
        if now - self._bytes_measured < BYTES_MEASURE_S:
            return
        self._bytes_measured = now
        depth = core.depth
        if depth == 0:
            self._queue_bytes = 0
            return
        page = await self._services.call(lambda r: c.Peek(self.entry.source, 0, BYTES_PAGE, True, 0, r))
        sizes = [int(m["size"]) for m in page["messages"]]
        seen = sum(sizes)
        self._queue_bytes = seen + (max(0, depth - len(sizes)) * seen // len(sizes) if sizes else 0)

    def _set_rate(self, rate: float | None) -> None:
        if rate != self.rate or not self.trace:
            self.trace.append((time.time(), rate, self.weight))
        self.rate = rate
        self._bucket.set_rate(rate)

    # --- the destination -----------------------------------------------------------------------
    def _destination(self) -> AsyncClient:
        if not self.entry.urls:          # a queue of this cluster: the cluster itself sends
            return self._macros.client_for(CLUSTER_CLIENT)
        if self._client is None:
            url = self.entry.urls[self._url_turn % len(self.entry.urls)]
            key, ca_file = self._credentials()
            self._client = AsyncClient(url, Credentials(self.entry.client_id, key, url, ca_file),
                                       request_timeout_s=10.0)
        return self._client

    def _credentials(self) -> tuple[str, str]:
        """The forward's private key and the CA its TLS checks the other cluster's nodes
        against: its own (that cluster's, given at creation), else this cluster's (an older
        forward, or one made without it), else the system's."""
        entry = self.entry
        key, ca = open_secret(self._services.cluster_secret, entry.name, entry.client_id, entry.secret)
        if ca:
            folder = Path(self._services.config.data_dir) / FORWARD_CA_DIR
            folder.mkdir(mode=0o700, exist_ok=True)
            path = folder / f"{entry.identity}.pem"
            path.write_text(ca)
            return key, str(path)
        return key, self._services.tls_ca_file()

    async def _drop_client(self) -> None:
        """After a failed session: the next attempt starts afresh, at the next URL given."""
        client, self._client = self._client, None
        self._url_turn += 1
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    # --- the task ---------------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = 0.1
        try:
            while True:
                try:
                    await self._session()
                except QueueError as error:
                    self.error = f"{error.code}: {error.message}"
                    log.info("forward %s: session ended: %s", self.entry.name, self.error)
                    if error.code == e.E_INVALID_OPTION.code:
                        self._bands = None      # the root's bands changed, say: learned again on open
                except (OSError, TimeoutError) as error:
                    self.error = f"{type(error).__name__}: {error}"
                except Exception as error:    # a bug: logged, and the forward goes on after the pause
                    log.exception("forward %s", self.entry.name)
                    self.error = f"{type(error).__name__}: {error}"
                if self.state == "open":
                    backoff = 0.1
                self.state = "reconnecting"
                self._set_rate(0.0)
                await self._drop_client()
                await asyncio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                with contextlib.suppress(QueueError):
                    await self._keep_leases()
        finally:
            await self._give_back()
            await self._drop_client()
            client = self._destination() if not self.entry.urls else None
            if client is not None:
                client.forget_forward(self.entry.destination, self.entry.identity)

    async def _session(self) -> None:
        client = self._destination()
        entry = self.entry
        terms = await client.forward_session(entry.destination, entry.identity, await self._weight(), open=True,
                                             on_rate=self._set_rate)
        self.terms = dict(terms)
        self._bands = max(1, int(terms.get("bands") or 10))
        self.sessions += 1
        self.state, self.error = "open", ""
        self._set_rate(terms.get("rate"))
        await self._weight()          # in the root's bands, now known: reported from the next message
        log.info("forward %s: session open with the root of %s (rate %s)", entry.name, entry.destination, self.rate)
        pump = asyncio.get_running_loop().create_task(self._pump(client))
        keeper = asyncio.get_running_loop().create_task(
            self._keepalive(client, float(terms.get("keepalive_s", 1.0)), float(terms.get("hold_s", 3.0))))
        try:
            done, _ = await asyncio.wait({pump, keeper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (pump, keeper):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, QueueError, OSError, TimeoutError):
                    await task

    async def _keepalive(self, client: AsyncClient, every_s: float, hold_s: float) -> None:
        """Keep the session alive and the weight known; a root silent for the hold time is lost."""
        while True:
            await asyncio.sleep(every_s)
            try:
                rate = await asyncio.wait_for(client.forward_session(
                    self.entry.destination, self.entry.identity, await self._weight(), open=False), hold_s)
            except TimeoutError:
                raise QueueError(e.E_UNAVAILABLE, f"the root did not answer for {hold_s:g} s") from None
            self._set_rate(rate)

    async def _pump(self, client: AsyncClient) -> None:
        """A pipeline (issue 38): while up to PIPELINE_DEPTH data messages are in flight, the
        next batch is being taken from the source and the answered ones acked there; data
        messages are settled in the order sent. A number the root refuses holds back every
        later one of its stream there (the queue's stream fences: replication/queue_streams.py),
        so what the pipeline sent past a refusal is refused too; all of it is sent again, lowest
        first, once nothing is in flight."""
        core = self._core()
        incarnation = core.record.incarnation or core.queue_id
        loop = asyncio.get_running_loop()
        pending: collections.deque[tuple[list[DeliveredMessage], asyncio.Task[list[Any]], float]] = collections.deque()
        taking: asyncio.Task[list[DeliveredMessage]] | None = None
        acking: set[asyncio.Task[None]] = set()
        self._resend = sorted(self._held, key=_in_stream_order)      # held over from the last session
        found_none = False      # the last take, made while answers were due, found nothing
        try:
            while True:
                batch: list[DeliveredMessage] = []
                busy = bool(pending) or bool(acking)
                if self._resend and not busy and taking is None:
                    batch = await self._again()
                elif taking is None and not self._resend and len(pending) < PIPELINE_DEPTH and \
                        not (busy and (found_none or self._bucket.wait_s() > 0)):
                    # While answers are due a take waits for nothing: neither the source (an empty
                    # one is asked again once something settled) nor the rate's next token.
                    taking = loop.create_task(self._take(waiting=busy))
                if batch:
                    self._start_send(client, incarnation, await self._weight(), batch, pending)
                    continue
                waited = {task for task in (taking, pending[0][1] if pending else None) if task is not None} | acking
                if not waited:
                    continue
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                for acked in [ack for ack in acking if ack.done()]:
                    acking.discard(acked)
                    acked.result()                  # an ack that failed ends the session
                    found_none = False
                if taking is not None and taking.done():
                    got, taking = taking.result(), None
                    found_none = not got
                    if got:
                        self._start_send(client, incarnation, await self._weight(), got, pending)
                while pending and pending[0][1].done():
                    messages, answered, sent_at = pending.popleft()
                    self._settle(messages, answered.result(), sent_at, acking)
                    found_none = False
        finally:
            # What is in flight stays held (leased at the source) and is sent again next session.
            in_flight: list[asyncio.Task[Any]] = [sending for _, sending, _ in pending]
            for left in [*in_flight, *acking, *([taking] if taking else [])]:
                left.cancel()
                left.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _start_send(self, client: AsyncClient, incarnation: int, weight: int, batch: list[DeliveredMessage],
                    pending: collections.deque[tuple[list[DeliveredMessage], asyncio.Task[list[Any]], float]]) -> None:
        self.sent += len(batch)
        task = asyncio.get_running_loop().create_task(self._send(client, incarnation, weight, batch))
        pending.append((batch, task, time.monotonic()))

    async def _take(self, *, waiting: bool) -> list[DeliveredMessage]:
        """The next batch from the source; `waiting`: other work is due, so nothing is waited for."""
        await self._keep_leases()
        wanted = self._bucket.take(BATCH_MAX) if waiting else await self._bucket.acquire(BATCH_MAX)
        if wanted == 0:
            return []
        got = await self._services.call(_receive(self.entry.source, wanted, 0 if waiting else RECEIVE_WAIT_MS))
        self._bucket.give_back(wanted - len(got))
        if got:
            if not self._held:
                self._leased_at = time.monotonic()
            self._held = self._held + list(got)
        return list(got)

    async def _again(self) -> list[DeliveredMessage]:
        """What the root refused, to send again (the pipeline is empty: `_held` is all of it),
        with more from the source while a stream's window is full: the message holding its
        floor down may be among them."""
        await asyncio.sleep(RETRY_PAUSE_S)
        # Why a stream was refused is what its lowest refused number was told: the later ones
        # were held back behind it (E_OVERLOADED from the stream's fence, whatever the cause).
        lowest: dict[int, DeliveredMessage] = {}
        for message in self._resend:
            if message.priority not in lowest or message.message_id < lowest[message.priority].message_id:
                lowest[message.priority] = message
        self._window_full = any(self._kept_codes.get(m.message_id) == e.E_OVERLOADED.code for m in lowest.values())
        self._kept_codes = {}
        if self._window_full and len(self._held) >= HELD_MAX:
            await self._make_room()
        elif self._window_full:
            await self._take(waiting=True)          # held with the rest, sent below
        await self._keep_leases()
        self._resend = []
        return sorted(self._held, key=_in_stream_order)

    async def _send(self, client: AsyncClient, incarnation: int, weight: int,
                    batch: list[DeliveredMessage]) -> list[Any]:
        """Data messages per priority (each its own stream), each of at most BATCH_MAX messages
        within DATA_BYTES_MAX (or one message), all sent at once; outcomes in `batch`'s order."""
        entry = self.entry
        by_priority: dict[int, list[DeliveredMessage]] = {}
        for message in batch:
            by_priority.setdefault(message.priority, []).append(message)
        parts: list[tuple[int, list[DeliveredMessage]]] = []
        for priority, messages in by_priority.items():
            part: list[DeliveredMessage] = []
            size = 0
            for message in messages:
                if part and (size + len(message.payload) > DATA_BYTES_MAX or len(part) >= BATCH_MAX):
                    parts.append((priority, part))
                    part, size = [], 0
                part.append(message)
                size += len(message.payload)
            parts.append((priority, part))
        answers = await asyncio.gather(*(client.forward_data(
            entry.destination, entry.identity, f"{entry.identity}@{incarnation}/p{priority}", weight,
            self._floors.get(priority, 1), [(m.payload, m.priority, m.message_id, 0, m.headers) for m in part])
            for priority, part in parts))
        outcome = {m.message_id: result for (_, part), results in zip(parts, answers, strict=True)
                   for m, result in zip(part, results, strict=True)}
        return [outcome[m.message_id] for m in batch]

    def _settle(self, batch: list[DeliveredMessage], outcomes: list[Any], sent_at: float,
                acking: set[asyncio.Task[None]]) -> None:
        """A data message answered: ack at the source what the root stored (a task: the
        pipeline goes on meanwhile), give back what it refused for good, keep the rest to send again."""
        # Read before the acks: once they are committed, so is every removal before.
        candidates = {priority: self._core().lowest_index(priority) for priority in {m.priority for m in batch}}
        stored, kept, refused = [], [], []
        failure: QueueError | None = None
        for message, outcome in zip(batch, outcomes, strict=True):
            if not isinstance(outcome, QueueError):
                stored.append(message)
            elif outcome.code in MESSAGE_ERRORS and not outcome.outcome_unknown:
                refused.append((message, outcome))
            else:
                kept.append(message)
                self._kept_codes[message.message_id] = outcome.code
                if outcome.code in SESSION_ERRORS:
                    failure = failure or outcome
        settled = {m.message_id for m in stored} | {m.message_id for m, _ in refused}
        self._held = [m for m in self._held if m.message_id not in settled]
        if stored or refused:
            acking.add(asyncio.get_running_loop().create_task(self._ack(stored, refused, candidates)))
        self._resend.extend(kept)
        self._bucket.span_s = min(CYCLE_SPAN_MAX_S, max(BURST_S, time.monotonic() - sent_at))
        if failure is not None:
            raise failure

    async def _ack(self, stored: list[DeliveredMessage], refused: list[tuple[DeliveredMessage, QueueError]],
                   candidates: dict[int, int]) -> None:
        entry = self.entry
        if stored:
            # An ack refused (its lease ran out) leaves the message to be sent again: a repeat there.
            await self._services.call(_ack_many(entry.source, tuple((m.message_id, m.receipt) for m in stored)))
            self.stored += len(stored)
            for priority in {m.priority for m in stored}:
                self._floors[priority] = max(self._floors.get(priority, 1), candidates[priority])
        for message, error in refused:
            log.warning("forward %s: the destination refused message %d: %s", entry.name, message.message_id, error)
            self.refused += 1
            with contextlib.suppress(QueueError):
                await self._release(message)

    async def _make_room(self) -> None:
        """As many held as may be, their streams' windows full: once the message holding a
        stream's floor down is ready (its delay over) but cannot be taken for lack of room,
        that priority's held messages go back to the source (each one delivery more, once per
        such stall), so it comes next."""
        core = self._core()
        stuck = {m.priority for m in self._held
                 if core.ready_head(m.priority) is not None and core.ready_head(m.priority) == core.lowest_index(m.priority)}
        if not stuck:
            return
        back = [m for m in self._held if m.priority in stuck]
        self._held = [m for m in self._held if m.priority not in stuck]
        for message in back:
            with contextlib.suppress(QueueError):
                await self._release(message)

    async def _release(self, message: DeliveredMessage) -> None:
        """Give a held message back to the source (one delivery more)."""
        await self._services.call(lambda r: c.Ack(self.entry.source, message.message_id, message.receipt,
                                                  CLUSTER_CLIENT, r, release=True))

    async def _keep_leases(self) -> None:
        """Extend the leases of what the forwarder holds (also between sessions: a partition
        from the root may last long). A lease that ran out anyway (the forwarder was stopped
        longer) has put its message back in the source: it is no longer held (sent again
        later, a repeat at the destination if it got there)."""
        if not self._held or time.monotonic() - self._leased_at < VISIBILITY_MS / 2000:
            return
        self._leased_at = time.monotonic()
        expired = set()
        for message in list(self._held):       # the pipeline may settle some meanwhile
            try:
                await self._services.call(_extend(self.entry.source, message))
            except QueueError as error:
                if error.code != e.E_LEASE_EXPIRED.code:
                    raise
                expired.add(message.message_id)
        if expired:
            self._held = [m for m in self._held if m.message_id not in expired]
            self._resend = [m for m in self._resend if m.message_id not in expired]

    async def _give_back(self) -> None:
        """The forwarder stops here (the source's master moved, the forward was deleted): what
        it holds goes back to the source, for the next master's forwarder."""
        held, self._held = self._held, []
        for message in held:
            with contextlib.suppress(QueueError, TimeoutError):
                await asyncio.wait_for(self._release(message), 2.0)

    def stats(self) -> dict[str, Any]:
        core = self._services.held_core(self.entry.source)
        return {**self.entry.to_json(), "node": self._services.node_id, "state": self.state, "error": self.error,
                "rate": self.rate, "weight": self.weight, "terms": self.terms, "sent": self.sent,
                "fill": self.fill._asdict() if self.fill is not None else None,
                "stored": self.stored, "refused": self.refused, "sessions": self.sessions, "held": len(self._held),
                "floors": {str(priority): floor for priority, floor in sorted(self._floors.items())},
                "source_depth": core.depth if core is not None else None,
                "source_max_depth": core.options.max_depth if core is not None else None,
                "overflows": core.overflows if core is not None else None,
                "rate_trace": [[round(at, 3), rate, weight] for at, rate, weight in list(self.trace)[-50:]]}


def _in_stream_order(message: DeliveredMessage) -> tuple[int, int]:
    return message.priority, message.message_id


class Forwarders:
    """This node's forwarders: one per forward whose source queue it masters."""

    def __init__(self, services: NodeServices, macros: MacroService) -> None:
        self._services = services
        self._macros = macros
        self.running: dict[str, tuple[Forwarder, asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                self._reconcile()
            except Exception:         # a bug here must not end forwarding for good; it is logged
                log.exception("forwarders")
            await asyncio.sleep(RECONCILE_INTERVAL_S)

    def _reconcile(self) -> None:
        cluster = self._services.cluster_map
        if cluster is None:
            return
        wanted = {name: entry for name, entry in cluster.forwards.items()
                  if self._services.master_core(entry.source) is not None}
        for name, (forwarder, task) in list(self.running.items()):
            entry = wanted.get(name)
            if entry is None or entry.created_ms != forwarder.entry.created_ms or task.done():
                task.cancel()
                del self.running[name]
            else:
                forwarder.entry = entry     # its control may have changed (SetForwardControl): used from the next report
        for name, entry in wanted.items():
            if name not in self.running:
                forwarder = Forwarder(self._services, self._macros, entry)
                log.info("forward %s: starting here (%s -> %s)", name, entry.source, entry.destination)
                self.running[name] = (forwarder, asyncio.get_running_loop().create_task(forwarder.run()))

    def stats(self, name: str) -> dict[str, Any] | None:
        running = self.running.get(name)
        return None if running is None else running[0].stats()

    def render_metrics(self) -> list[str]:
        rows = [(name, forwarder) for name, (forwarder, _) in sorted(self.running.items())]
        return (render_family("qserver_forward_rate", "gauge", "each forwarder's assigned rate (messages/s; -1: none)",
                              [({"forward": n}, -1 if f.rate is None else f.rate) for n, f in rows])
                + render_family("qserver_forward_weight", "gauge", "each forwarder's last reported weight",
                                [({"forward": n}, f.weight) for n, f in rows])
                + render_family("qserver_forward_band", "gauge", "the fill band each forwarder's source is in",
                                [({"forward": n}, f.fill.band) for n, f in rows if f.fill is not None])
                + render_family("qserver_forward_fill", "gauge",
                                "each forwarder's source fill (messages or bytes, its fill_unit) against its capacity",
                                [({"forward": n, "unit": f.fill.unit, "of": which},
                                  f.fill.amount if which == "amount" else f.fill.capacity)
                                 for n, f in rows if f.fill is not None for which in ("amount", "capacity")])
                + render_family("qserver_forward_stored_total", "counter",
                                "messages each forwarder had stored at its destination and acked here",
                                [({"forward": n}, f.stored) for n, f in rows])
                + render_family("qserver_forward_sessions_total", "counter", "sessions each forwarder opened",
                                [({"forward": n}, f.sessions) for n, f in rows]))

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *(t for _, t in self.running.values())) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
