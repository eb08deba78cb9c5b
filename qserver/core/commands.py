"""Commands the API handlers push into the engine's inbox, and how answers come back.

Handlers never touch a queue core: they validate input, build one of these and hand it to
`Engine.submit`. The engine answers through the command's `Replier` once the effects are
durable. A WebSocket connection is itself a Replier (its replies batch into frames); an HTTP
request uses a `FutureReplier`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from wire.errors import QueueError


class Replier(Protocol):
    def reply(self, request_id: int, result: Any) -> None: ...
    def fail(self, request_id: int, error: QueueError) -> None: ...


class FutureReplier:
    """Answers one request through a future (the HTTP path)."""
    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def reply(self, request_id: int, result: Any) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, request_id: int, error: QueueError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(slots=True)
class Enqueue:
    queue: str
    payload: bytes
    priority: int
    dedupe_id: str | None
    client: str
    replier: Replier
    request_id: int = 0
    ttl_ms: int = 0         # the message's time to live; 0: the queue's message_ttl_s
    delay_ms: int = 0       # its delivery delay; 0: ready at once
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class EnqueueMany:
    """One coalesced batch from a client: answered once, with a result per payload."""
    queue: str
    priority: int
    payloads: tuple[bytes, ...]
    dedupe_ids: tuple[str | None, ...] | None
    client: str
    replier: Replier
    request_id: int = 0
    ttl_ms: int = 0         # every message's time to live; 0: the queue's message_ttl_s
    delay_ms: int = 0       # every message's delivery delay; 0: ready at once
    headers: dict[str, str] | None = None    # every message's


@dataclass(slots=True)
class AckMany:
    queue: str
    items: tuple[tuple[int, str], ...]
    client: str
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class Receive:
    queue: str
    max_messages: int
    wait_ms: int
    visibility_ms: int | None
    client: str
    replier: Replier
    request_id: int = 0
    view: str | None = None      # through this virtual queue only (qserver/core/view_scan.py)


@dataclass(slots=True)
class Head:
    """Look at the message a receive would lease next, without leasing it; wait up to
    `wait_ms` for one (the consumer side of a macro queue)."""
    queue: str
    wait_ms: int
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class Peek:
    """Browse a queue's messages without taking them (qserver/core/peek.py): a page after cursor
    `after` (`message_id` 0), or the one message `message_id`. Changes nothing."""
    queue: str
    after: int
    limit: int
    preview: bool
    message_id: int
    replier: Replier
    request_id: int = 0
    view: str | None = None      # the page through this virtual queue (qserver/core/view_scan.py)


@dataclass(slots=True)
class Ack:
    queue: str
    message_id: int
    receipt: str
    client: str
    replier: Replier
    request_id: int = 0
    release: bool = False          # give the lease back instead of deleting
    reply_payload: bytes | None = None   # two_way reply (acks too)
    extend_ms: int | None = None   # keep the lease: give it this duration from now instead


@dataclass(slots=True)
class Purge:
    """An operator's purge, run in bounded steps (qserver/core/admin_steps.py)."""
    queue: str
    replier: Replier
    request_id: int = 0
    upto: int = 0                  # set at the first step: what is enqueued after it stays
    purged: int = 0                # so far, over the steps (and a relay to a new master)


@dataclass(slots=True)
class DurableSubscription:
    """A durable subscription's replicated step on a channel's queue: `open` it (idempotent),
    `ack` message `message_id` of its backlog, `acks` a run of them (`message_ids`: answered
    with each one's outcome), or `drop` it for good (qserver/features/channels/hub.py)."""
    queue: str
    action: str
    subscription: str
    message_id: int
    client: str
    replier: Replier
    request_id: int = 0
    message_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Subscribe:
    queue: str
    credit: int
    visibility_ms: int | None
    client: str
    replier: Any                   # the WebSocket connection (it receives pushes)
    request_id: int = 0
    recipient: str | None = None   # a named push consumer under fault surveillance (qserver/features/surveillance/watch.py)


@dataclass(slots=True)
class Credit:
    subscription_id: int
    credit: int
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class Unsubscribe:
    subscription_id: int
    replier: Replier | None
    request_id: int = 0


@dataclass(slots=True)
class CreateQueue:
    name: str
    options: dict[str, Any]
    placement: dict[str, Any]
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class DeleteQueue:
    name: str
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class MessageStatus:
    queue: str
    message_id: int
    wait_ms: int
    until: frozenset[str]
    client: str          # the caller: only the message's producer, or an admin (`admin`), reads it
    admin: bool
    replier: Replier
    request_id: int = 0
    # A producer's wait (docs/PROTOCOL.md, "Producers that wait"): "ack" or "reply", refused
    # with E_WAIT_UNSUPPORTED on a queue whose type keeps no such completion; None: a status look.
    completion: str | None = None


@dataclass(slots=True)
class PutClient:
    client_id: str
    record: dict[str, Any] | None   # None removes the client
    replier: Replier
    request_id: int = 0


@dataclass(slots=True)
class PeerMessage:
    """A replication message from a peer node (already authenticated by the transport)."""
    peer: str
    data: bytes
    replier: None = None
    request_id: int = 0


@dataclass(slots=True)
class LinkChange:
    peer: str
    up: bool
    replier: None = None
    request_id: int = 0
    going_away: bool = False        # down because the peer said it stops (qserver/transport/peers.py went_away)


@dataclass(slots=True)
class Invoke:
    """Run `action(now_ms)` on the engine's task (map changes, proposal outcomes, operator
    commands): everything that touches cores or roles happens there."""
    action: Any
    replier: None = None
    request_id: int = 0


Command = (Enqueue | EnqueueMany | AckMany | Receive | Head | Peek | Ack | Purge | DurableSubscription | Subscribe | Credit | Unsubscribe | CreateQueue | DeleteQueue | MessageStatus | PutClient | PeerMessage | LinkChange | Invoke)
# A client's operations on a queue's messages: in a pair, routed by the queue's role here (a
# replica passes some on to its master: qserver/cluster/relay.py).
QUEUE_TRAFFIC = frozenset({Enqueue, EnqueueMany, Receive, Ack, AckMany, Purge, Subscribe, DurableSubscription})
WRITES = frozenset({Enqueue, EnqueueMany})      # always ordered by the master
