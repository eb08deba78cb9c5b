"""The root of store-and-forward (seed 003): the master of a queue that forwards send into.

Each forwarder (qserver/features/forwards/forwarder.py, on the master of its source queue, maybe in another
cluster) holds a **session** with the root over its WebSocket (§3.2): it opens it, keeps it
alive, and reports its **weight** (its source's fill level in the root queue's bands, 0..bands-1)
in every data message and keepalive. The root keeps the weight table of its queue's sessions
and, every `forward_interval_s` (T), sends each its **rate** (§3.3):

    adaptive: Rᵢ = R · wᵢ / Σw          (Σw = 0: R/n)
    static:   Rᵢ = R / n                (only when sessions open or close)

with R = the queue's `forward_rate` messages/s and n the open sessions; a new session starts at
R/n. A queue without a rate (0) controls nothing: every session is told nil (as fast as it
can). A session not heard from for its hold time is dropped (its share goes to the others),
as is every session of a connection that closes; the forwarder opens it again. A root that
stops being the queue's master ends its sessions: their next message gets E_NOT_MASTER and
the forwarder opens a session at the new master.

Data messages become the queue's ordinary enqueues, each numbered in the forwarder's stream
(replication/queue_core.py, `x-sequence-*`): a repeat of a number stored before, however long
ago, is answered with success and stores nothing.

Any client with `post` on the queue may hold sessions (docs/PROTOCOL.md "Forwards", "Who may
hold a session"), so nothing one client does may reach another's: a session is the pair
(client id, forward id), a forward id is public (shown in `GET /v1/forwards`, the queue's stats
and every forwarded message), and so another client opening the same forward id gets a session
of its own, never the honest one (refusing it instead would let the first opener squat the id
while the honest forwarder reconnects); the queue keeps its streams' numbers per client too
(replication/queue_core.py, `producer_key`). Weights are
bounded by the queue's bands, forward ids are checked like queue names, and one client holds at
most SESSIONS_PER_CLIENT_MAX sessions of a queue (its admins excepted).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qserver.core import commands as c
from qserver.features.forwards.decide import TICK_MAX_S, Heard, compute_rates, hold_s, keepalive_s, review
from qserver.metrics import render_family
from replication.options import is_valid_queue_name
from replication.queue_core import SEQUENCE_FLOOR_HEADER, SEQUENCE_HEADER, SEQUENCE_KEY_HEADER
from wire import errors as e
from wire.errors import QueueError
from wire.message_input import payload_refusal
from wire.protocol import ForwardDataOp, ForwardRate, ForwardSessionOp

if TYPE_CHECKING:
    from qserver.services import NodeServices
    from replication.options import QueueOptions
    from replication.queue_core import QueueCore

log = logging.getLogger("qserver.features.forwards.root")
SESSIONS_MAX = 256          # forward sessions one root queue holds (the map's forwards of one cluster, at most)
SESSIONS_PER_CLIENT_MAX = 32   # ... of them one client holds (a client with `admin` on the queue: any number)
TOKEN_CHARS = 16            # a forward id is `<forward name>.<16 hex digits>` (replication/cluster_map.py ForwardEntry)
STREAM_CHARS_MAX = 256      # `<forward id>@<source incarnation>/p<priority>` (qserver/features/forwards/forwarder.py)
Key = tuple[str, str]       # a session: (client id, forward id)


@dataclass(slots=True)
class Session:
    queue: str
    forward: str
    client: str
    connection: Any
    weight: int
    opened: float
    heard: float
    rate: float | None = None
    received: int = 0          # messages in its data messages here


class ForwardRoot:
    """The driver of the root: it keeps the sessions, reads the clock (`clock`: monotonic
    seconds), and sends the rates and drops the sessions the pure rules
    (qserver/features/forwards/decide.py) decide."""

    def __init__(self, services: NodeServices, clock: Callable[[], float] = time.monotonic) -> None:
        self._services = services
        self._clock = clock
        self._sessions: dict[str, dict[Key, Session]] = {}    # queue -> (client, forward) -> session
        self._computed: dict[str, float] = {}                 # queue -> when its rates were last sent
        self._task: asyncio.Task[None] | None = None

    # --- the session (ForwardSessionOp) ------------------------------------------------------
    def session(self, connection: Any, op: ForwardSessionOp) -> Any:
        _check_forward_id(op.forward)
        core = self._master_core(op.queue)
        options = core.options
        _check_weight(op.weight, options)
        now = self._clock()
        client = connection.principal.client_id
        key = (client, op.forward)
        sessions = self._sessions.setdefault(op.queue, {})
        session = sessions.get(key)
        if op.open:
            if session is None:
                if len(sessions) >= SESSIONS_MAX:
                    raise QueueError(e.E_OVERLOADED, f"{op.queue} holds {SESSIONS_MAX} forward sessions")
                if sum(1 for other, _ in sessions if other == client) >= SESSIONS_PER_CLIENT_MAX \
                        and not connection.principal.allows("admin", op.queue):
                    raise QueueError(e.E_OVERLOADED, f"client {client} holds {SESSIONS_PER_CLIENT_MAX} forward "
                                                     f"sessions into {op.queue}")
            # Opening again (a new socket after a reconnection) replaces only this client's own.
            session = sessions[key] = Session(op.queue, op.forward, client, connection, op.weight, now, now)
            log.info("forward %s of client %s opened a session into %s (weight %d)", op.forward, client, op.queue,
                     op.weight)
            self._assign(op.queue, options, opening=session)
            self._start()
            return {"rate": session.rate, "interval_s": options.forward_interval_s, "bands": options.forward_bands,
                    "mode": options.forward_mode, "keepalive_s": keepalive_s(options.forward_interval_s),
                    "hold_s": hold_s(options.forward_interval_s)}
        if session is None or session.connection is not connection:
            raise QueueError(e.E_UNKNOWN_FORWARD, f"no session of forward {op.forward} into {op.queue} here")
        session.weight, session.heard = op.weight, now
        return session.rate

    def data(self, connection: Any, op: ForwardDataOp) -> None:
        """A data message: the weight, then its messages as enqueues, answered together."""
        _check_forward_id(op.forward)
        core = self._master_core(op.queue)
        client = connection.principal.client_id
        session = self._sessions.get(op.queue, {}).get((client, op.forward))
        if session is None or session.connection is not connection:
            raise QueueError(e.E_UNKNOWN_FORWARD, f"no session of forward {op.forward} into {op.queue} here")
        _check_weight(op.weight, core.options)
        if not op.stream.startswith(f"{op.forward}@") or len(op.stream) > STREAM_CHARS_MAX \
                or not op.stream.isprintable():
            raise QueueError(e.E_INVALID_OPTION, f"a stream of forward {op.forward} is `{op.forward}@...`, "
                                                 f"at most {STREAM_CHARS_MAX} printable characters")
        session.weight, session.heard = op.weight, self._clock()
        session.received += len(op.items)
        body_bytes_max = self._services.config.body_bytes_max
        gathered = _Gathered(connection, op.request_id, len(op.items))
        submit = self._services.submit
        for position, (payload, priority, number, ttl_ms, headers) in enumerate(op.items):
            refusal = payload_refusal(payload, body_bytes_max)
            if refusal is not None:
                gathered.fail(position, refusal)
                continue
            numbered = {**(headers or {}), SEQUENCE_KEY_HEADER: op.stream, SEQUENCE_HEADER: str(number),
                        SEQUENCE_FLOOR_HEADER: str(min(op.floor, number))}
            submit(c.Enqueue(op.queue, payload, priority, None, client, gathered, position, ttl_ms, 0, numbered))

    def connection_closed(self, connection: Any) -> None:
        for queue, sessions in list(self._sessions.items()):
            for key in [k for k, s in sessions.items() if s.connection is connection]:
                del sessions[key]
                log.info("forward %s of client %s: its connection to the root of %s closed", key[1], key[0], queue)

    def _master_core(self, queue: str) -> QueueCore:
        services = self._services
        core = services.held_core(queue)
        if core is None:
            cluster = services.cluster_map
            if cluster is not None and queue not in cluster.queues:
                raise QueueError(e.E_UNKNOWN_QUEUE, f"no queue {queue}")
            raise QueueError(e.E_NOT_MASTER, f"queue {queue} is not held here")
        if services.clustered and not services.is_master(queue):
            raise QueueError(e.E_NOT_MASTER, f"this node is not the master of {queue}")
        return core

    # --- rates ---------------------------------------------------------------------------------
    def _assign(self, queue: str, options: QueueOptions, *, opening: Session | None = None) -> None:
        """Compute the queue's rates and send them (a session being opened learns its own in
        the answer: the paper's initial R/n)."""
        sessions = self._sessions.get(queue, {})
        rates = compute_rates(options.forward_rate, options.forward_mode,
                              {key: s.weight for key, s in sessions.items()},
                              opening=(opening.client, opening.forward) if opening is not None else None)
        for key, session in sessions.items():
            if key not in rates:
                continue          # static, or an adaptive session's rate between two intervals
            session.rate = rates[key]
            if session is not opening:
                session.connection.emit(ForwardRate(queue, session.forward, session.rate))
        self._computed[queue] = self._clock()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self._sessions:
            interval = TICK_MAX_S
            for queue in list(self._sessions):
                try:
                    interval = min(interval, self._check(queue))
                except Exception:     # a bug here must not end rate control for good; it is logged
                    log.exception("forward root of %s", queue)
            await asyncio.sleep(interval)
        self._task = None

    def _check(self, queue: str) -> float:
        """Drop silent sessions (and all of a queue mastered here no more); send the rates
        every T. Returns how soon to look again."""
        sessions = self._sessions[queue]
        services = self._services
        core = services.held_core(queue)
        if core is None or (services.clustered and not services.is_master(queue)):
            del self._sessions[queue]
            self._computed.pop(queue, None)
            return TICK_MAX_S
        options = core.options
        now = self._clock()
        plan = review({key: Heard(session.heard, session.connection.closed) for key, session in sessions.items()},
                      now, computed_at=self._computed.get(queue, 0.0), forward_interval_s=options.forward_interval_s,
                      mode=options.forward_mode)
        for key in plan.silent:
            log.info("forward %s of client %s: silent for %.1f s, its session into %s is dropped", key[1], key[0],
                     hold_s(options.forward_interval_s), queue)
            del sessions[key]
        if plan.emptied:
            del self._sessions[queue]
            self._computed.pop(queue, None)
            return plan.next_look_s
        if plan.rates_at_once:
            self._assign(queue, options, opening=None)
        if plan.rates_due:
            self._assign(queue, options)
        return plan.next_look_s

    # --- what it shows ------------------------------------------------------------------------
    def sessions_of(self, queue: str) -> list[dict[str, Any]]:
        now = self._clock()
        return [{"forward": s.forward, "client": s.client, "weight": s.weight, "rate": s.rate, "received": s.received,
                 "open_s": round(now - s.opened, 3), "heard_s_ago": round(now - s.heard, 3)}
                for s in sorted(self._sessions.get(queue, {}).values(), key=lambda s: (s.forward, s.client))]

    def render_metrics(self) -> list[str]:
        rows = [s for sessions in self._sessions.values() for s in sessions.values()]
        return (render_family("qserver_forward_root_weight", "gauge", "each forward session's last reported weight",
                              [({"queue": s.queue, "forward": s.forward, "client": s.client}, s.weight) for s in rows])
                + render_family("qserver_forward_root_rate", "gauge",
                                "each forward session's rate (messages/s; -1: no control)",
                                [({"queue": s.queue, "forward": s.forward, "client": s.client},
                                  -1 if s.rate is None else s.rate)
                                 for s in rows])
                + render_family("qserver_forward_root_received_total", "counter",
                                "messages in each forward session's data messages",
                                [({"queue": s.queue, "forward": s.forward, "client": s.client}, s.received)
                                 for s in rows]))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _check_forward_id(forward: str) -> None:
    """A forward id is a forward's name (checked like a queue name, as at its creation:
    qserver/features/forwards/api.py) and its token: no megabyte names kept, logged or put in /metrics."""
    name, dot, token = forward.rpartition(".")
    if is_valid_queue_name(forward) or (dot and len(token) == TOKEN_CHARS and is_valid_queue_name(name)
                                        and all(ch in "0123456789abcdef" for ch in token)):
        return
    raise QueueError(e.E_INVALID_NAME, f"a forward id is a forward's name (like a queue's) and its token: "
                                       f"{forward[:40]!r}")


def _check_weight(weight: int, options: QueueOptions) -> None:
    """A weight is a fill band of the queue's `forward_bands` (qserver/features/forwards/forwarder.py weight_of):
    a larger one would take the others' share (docs/PROTOCOL.md "Forwards")."""
    if not 0 <= weight < options.forward_bands:
        raise QueueError(e.E_INVALID_OPTION, f"a weight is a band, 0..{options.forward_bands - 1}: {weight}")


class _Gathered:
    """The replier of a data message's enqueues: one answer, one entry per item, once all are in."""

    def __init__(self, connection: Any, request_id: int, count: int) -> None:
        self._connection, self._request_id = connection, request_id
        self._results: list[Any] = [None] * count
        self._left = count

    def reply(self, position: int, result: Any) -> None:
        self._settle(position, result[0])

    def fail(self, position: int, error: QueueError) -> None:
        self._settle(position, [error.code, error.message])

    def _settle(self, position: int, outcome: Any) -> None:
        if self._results[position] is not None:
            return
        self._results[position] = outcome
        self._left -= 1
        if self._left == 0:
            self._connection.reply(self._request_id, self._results)
