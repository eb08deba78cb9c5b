"""The node's listeners: receives and looks at the head waiting for a message, subscriptions
pushed to as messages become ready, and waits for a message's status; serving them, and
answering them when their wait runs out.

Separate from the command steps and the commit pipeline: a listener outlives the turn that
registered it, and is served from whatever makes its queue's messages visible (a commit, the
pair's commit point moving, a timed step), never by a walk over every queue. What serving
leases goes into the open batch like a command's operations, and is answered after commit.
"""
from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.batch import Messages
from qserver.storage.lmdb_store import Storage
from replication.operations import Leased, Operation, SubscriptionDropped, SubscriptionOpened
from replication.queue_core import QueueCore
from wire.errors import (
    E_NOT_MASTER,
    E_OVERLOADED,
    E_SHUTTING_DOWN,
    E_UNKNOWN_MESSAGE,
    E_UNKNOWN_QUEUE,
    E_WAIT_UNSUPPORTED,
    QueueError,
)

if TYPE_CHECKING:
    from qserver.core.pipeline import CommitPipeline
    from qserver.core.registry import QueueRegistry
    from qserver.core.replication_port import Pairs

DEADLINES_COMPACT_MIN = 4_096      # deadline heap entries kept before a rebuild is considered


@dataclass(slots=True)
class Waiter:
    """A receive (or a look at the head) that found nothing and waits for a message until
    `deadline_ms` (the engine's monotonic clock, as every deadline below); `key` is its place in
    its queue's waiters and in the deadline heap."""
    command: c.Receive | c.Head
    deadline_ms: int
    key: int = 0


class Listening:
    """The replier of a request that waits in the engine (a receive or a status wait): it
    holds the request's place under its connection's and its client's listener bounds until
    the answer goes out (docs/PROTOCOL.md, "Errors": E_OVERLOADED)."""
    __slots__ = ("inner", "holders", "counts")

    def __init__(self, inner: Any, holders: tuple[Any, ...], counts: dict[Any, int]) -> None:
        self.inner, self.holders, self.counts = inner, holders, counts

    def reply(self, request_id: int, result: Any) -> None:
        self._done()
        self.inner.reply(request_id, result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self._done()
        self.inner.fail(request_id, error)

    def _done(self) -> None:
        holders, self.holders = self.holders, ()
        for holder in holders:
            _count_down(self.counts, holder)


def _count_down(counts: dict[Any, int], holder: Any) -> None:
    left = counts.get(holder, 0) - 1
    if left > 0:
        counts[holder] = left
    else:
        counts.pop(holder, None)


@dataclass(slots=True)
class Subscription:
    subscription_id: int
    queue: str
    connection: Any
    credit: int
    visibility_ms: int | None
    client: str
    # A recipient (fault surveillance, qserver/features/surveillance/watch.py): what it was pushed and has not
    # taken (id -> receipt), and whether pushing to it is held (in fault).
    recipient: str | None = None
    pushed: dict[int, str] = field(default_factory=dict)
    held: bool = False


@dataclass(slots=True)
class StatusWaiter:
    command: c.MessageStatus
    queue_id: int
    deadline_ms: int
    tracks_status: bool = False      # the queue keeps completion statuses (QueueOptions.tracks_status)


def check_completion_kind(core: QueueCore, kind: str) -> None:
    """A producer may wait for an ack only where acks leave a completion (one_way_ack, two_way:
    QueueOptions.tracks_status; on queued_ack and one_way an acked message simply goes), and for
    a reply only on two_way (seed 004 One_Way_Acknowledged, Two_Way)."""
    queue_type = core.options.type.value
    if kind == "reply" and queue_type != "two_way":
        raise QueueError(E_WAIT_UNSUPPORTED, f"queue {core.name} is {queue_type}: only a two_way queue's consumers "
                                             "reply")
    if kind == "ack" and not core.options.tracks_status:
        raise QueueError(E_WAIT_UNSUPPORTED, f"queue {core.name} is {queue_type}, which keeps no completion of its "
                                             "messages: wait for an ack on a one_way_ack or two_way queue")


def no_status(command: c.MessageStatus) -> QueueError:
    """One answer for an id never issued, a status no longer kept and another producer's
    message (docs/PROTOCOL.md, "Grants"): the caller learns nothing about ids not its own."""
    return QueueError(E_UNKNOWN_MESSAGE, f"queue {command.queue} has no message {command.message_id} whose status "
                                         f"client {command.client} may read")


class Listeners:
    """Every listener of the node's queues, and `to_serve`: the queues something happened to
    in this turn, whose listeners are served at its end (`serve`)."""

    pairs: Pairs                     # given by Engine.connect

    def __init__(self, config: NodeConfig, storage: Storage, monotonic_ms: Callable[[], int],
                 wake: Callable[[], None]) -> None:
        self.config = config
        self.storage = storage
        self.monotonic_ms = monotonic_ms
        self._wake = wake
        self.pipeline: CommitPipeline           # set by the engine once made (they refer to each other)
        self.registry: QueueRegistry
        self.to_serve: set[str] = set()
        # Each queue's waiting receives in arrival order, by Waiter.key (a receive answered or
        # timed out leaves in O(1)); their deadlines in a heap, so a turn looks at due ones only.
        self.waiters: dict[str, collections.OrderedDict[int, Waiter]] = {}
        self.waiter_deadlines: list[tuple[int, int, Waiter]] = []
        self.status_deadlines: list[tuple[int, int, StatusWaiter]] = []
        self._waiter_keys = itertools.count(1)
        self._compact_deadlines_at = DEADLINES_COMPACT_MIN      # heap entries (see _compact_deadlines)
        # Listeners held per connection (its replier) and per ("client", id): issue 32, item 11.
        self._listening: dict[Any, int] = {}
        # Each queue's subscriptions by id, in subscription order (an unsubscribe is O(1)).
        self.subscriptions: dict[str, dict[int, Subscription]] = {}
        self._subscriptions_by_id: dict[int, Subscription] = {}
        self._next_subscription_id = 1
        self.status_waiters: dict[tuple[int, int], list[StatusWaiter]] = {}

    # --- registering -----------------------------------------------------------------------
    def hold_listener(self, command: Any, client: str | None) -> None:
        """Count one more listener (a waiting receive or status wait, a subscription) of the
        command's connection and of `client`, or refuse it with E_OVERLOADED past either bound
        (issue 32, item 11: one client held every turn of the node). A waiting request's
        replier becomes a Listening, which gives the place back with its answer."""
        listening, config = self._listening, self.config
        # A wrapped replier (a producer wait's, qserver/api/completion_waits.py) names its connection.
        connection = ("connection", id(getattr(command.replier, "connection", command.replier)))
        if listening.get(connection, 0) >= config.listeners_per_connection_max:
            raise QueueError(E_OVERLOADED, f"this connection holds {config.listeners_per_connection_max} waiting "
                                           "receives, status waits and subscriptions, the most a connection may")
        holders: tuple[Any, ...] = (connection,)
        if client is not None:
            if listening.get(("client", client), 0) >= config.listeners_per_client_max:
                raise QueueError(E_OVERLOADED, f"client {client} holds {config.listeners_per_client_max} waiting "
                                               "receives, status waits and subscriptions, the most a client may")
            holders = (connection, ("client", client))
        for holder in holders:
            listening[holder] = listening.get(holder, 0) + 1
        if type(command) is not c.Subscribe:
            command.replier = Listening(command.replier, holders, listening)

    def wait(self, name: str, command: c.Receive | c.Head, client: str | None) -> None:
        self.hold_listener(command, client)
        waiter = Waiter(command, self.monotonic_ms() + command.wait_ms, next(self._waiter_keys))
        self.waiters.setdefault(name, collections.OrderedDict())[waiter.key] = waiter
        heapq.heappush(self.waiter_deadlines, (waiter.deadline_ms, waiter.key, waiter))

    def subscribe(self, core: QueueCore, command: c.Subscribe) -> None:
        self.hold_listener(command, command.client)
        subscription = Subscription(self._next_subscription_id, core.name, command.replier,
                                    min(command.credit, self.config.subscription_credit_max),
                                    command.visibility_ms, command.client, command.recipient)
        self._next_subscription_id += 1
        self.subscriptions.setdefault(core.name, {})[subscription.subscription_id] = subscription
        self._subscriptions_by_id[subscription.subscription_id] = subscription
        command.replier.subscription_started(subscription)
        command.replier.reply(command.request_id, subscription.subscription_id)
        self.to_serve.add(core.name)

    def credit(self, command: c.Credit) -> None:
        subscription = self._subscriptions_by_id.get(command.subscription_id)
        if subscription is None:
            raise QueueError(E_UNKNOWN_QUEUE, f"no subscription {command.subscription_id}")
        subscription.credit = min(subscription.credit + command.credit, self.config.subscription_credit_max)
        self.to_serve.add(subscription.queue)
        command.replier.reply(command.request_id, None)

    def unsubscribe(self, command: c.Unsubscribe) -> None:
        subscription = self._subscriptions_by_id.pop(command.subscription_id, None)
        if subscription is not None:
            self._forget_subscription(subscription)
        if command.replier is not None:
            command.replier.reply(command.request_id, None)

    def wait_for_status(self, core: QueueCore, command: c.MessageStatus) -> None:
        """A status look (or wait): read after the batch in flight lands, so the answer never
        shows uncommitted state."""
        if command.completion is not None:
            check_completion_kind(core, command.completion)
        if not 1 <= command.message_id < core.record.next_index:
            raise no_status(command)
        if command.wait_ms > 0:
            self.hold_listener(command, command.client)
        waiter = StatusWaiter(command, core.queue_id, self.monotonic_ms() + command.wait_ms,
                              core.record.options.tracks_status)
        self.pipeline.open.after_commit.append(lambda: self.check_status(waiter, final=command.wait_ms == 0))

    # --- recipients (fault surveillance: qserver/features/surveillance/watch.py) ----------------
    def recipient_subscriptions(self, queue: str, recipient: str) -> list[Subscription]:
        return [s for s in self.subscriptions.get(queue, {}).values() if s.recipient == recipient]

    def recipients_here(self) -> dict[tuple[str, str], list[Subscription]]:
        """(queue, recipient) -> its subscriptions on this node."""
        out: dict[tuple[str, str], list[Subscription]] = {}
        for queue, subscriptions in self.subscriptions.items():
            for subscription in subscriptions.values():
                if subscription.recipient is not None:
                    out.setdefault((queue, subscription.recipient), []).append(subscription)
        return out

    def end_subscription(self, subscription: Subscription, error: QueueError) -> None:
        """Stop pushing to a subscription (a defunct recipient): its client is told."""
        if self._subscriptions_by_id.pop(subscription.subscription_id, None) is not None:
            self._forget_subscription(subscription)
            subscription.connection.subscription_ended(subscription.subscription_id, error)

    def _forget_subscription(self, subscription: Subscription) -> None:
        subscriptions = self.subscriptions[subscription.queue]
        del subscriptions[subscription.subscription_id]
        if not subscriptions:       # only queues with listeners are looked at (listeners_may_see_more)
            del self.subscriptions[subscription.queue]
        self._subscription_gone(subscription)

    def _subscription_gone(self, subscription: Subscription) -> None:
        """Its place under its connection's and client's listener bounds (hold_listener)."""
        _count_down(self._listening, ("connection", id(subscription.connection)))
        _count_down(self._listening, ("client", subscription.client))

    # --- queues going away -----------------------------------------------------------------
    def drop_queue_listeners(self, name: str, error: QueueError | None = None) -> None:
        """Waiting receivers and subscribers of a queue this node no longer serves."""
        error = error or QueueError(E_UNKNOWN_QUEUE, f"queue {name} was deleted")
        for waiter in self.waiters.pop(name, {}).values():
            waiter.command.replier.fail(waiter.command.request_id, error)
        for subscription in self.subscriptions.pop(name, {}).values():
            self._subscriptions_by_id.pop(subscription.subscription_id, None)
            self._subscription_gone(subscription)
            subscription.connection.subscription_ended(subscription.subscription_id, error)

    def master_left(self, core: QueueCore, new_master: str) -> None:
        """This node stopped mastering a `full` queue: its waiters and subscribers go to the
        new master (the client follows E_NOT_MASTER)."""
        if core.options.strength.value == "full":
            moved = QueueError(E_NOT_MASTER, f"queue {core.name} is now mastered by {new_master}")
            self.drop_queue_listeners(core.name, moved)
            self.drop_status_waiters(core.queue_id, moved)

    def drop_connection_status_waiters(self, connection: Any) -> None:
        """A closed connection's producer waits (their replier wraps it: qserver/api/completion_waits.py)
        go now, giving back their places under the listener bounds; answered into the closed
        socket, which drops the answer."""
        for key in list(self.status_waiters):
            held = self.status_waiters[key]
            gone = [w for w in held  # a held wait's replier is a Listening around the wait's own
                    if getattr(getattr(w.command.replier, "inner", w.command.replier), "connection", None) is connection]
            if not gone:
                continue
            for waiter in gone:
                held.remove(waiter)
                waiter.command.replier.fail(waiter.command.request_id, QueueError(E_SHUTTING_DOWN, "connection closed"))
            if not held:
                del self.status_waiters[key]

    def drop_status_waiters(self, queue_id: int, error: QueueError) -> None:
        """Status waits (a producer waiting for its message's completion) on a queue this node
        stopped mastering: the completion will be decided at the new master, where the client
        registers the wait again (client/waits.py). Their deadline heap entries go as they come up."""
        for key in [key for key in self.status_waiters if key[0] == queue_id]:
            for status_waiter in self.status_waiters.pop(key):
                status_waiter.command.replier.fail(status_waiter.command.request_id, error)

    def fail_on_stop(self) -> None:
        for name in list(self.waiters):
            for waiter in self.waiters.pop(name).values():
                waiter.command.replier.fail(waiter.command.request_id, QueueError(E_SHUTTING_DOWN))
        for status_waiters in self.status_waiters.values():
            for status_waiter in status_waiters:
                status_waiter.command.replier.fail(status_waiter.command.request_id, QueueError(E_SHUTTING_DOWN))
        self.status_waiters.clear()

    # --- serving ---------------------------------------------------------------------------
    def listened(self) -> list[str]:
        """The queues with a waiting receive or a subscription."""
        return [*self.waiters, *self.subscriptions]

    def listeners_may_see_more(self, name: str) -> None:
        """In a pair, ready is not enough: only committed messages are visible, and the commit
        point moves with the replica's acknowledgements. The pair driver calls this whenever
        something happened to the queue's role; a queue with listeners is served then."""
        if name in self.waiters or name in self.subscriptions:
            self.to_serve.add(name)

    def serve_soon(self, queue: str) -> None:
        """Look at the queue's waiting receives and subscriptions in this turn (one unheld)."""
        self.to_serve.add(queue)
        self._wake()

    def serve(self, now_ms: int, may_decide: bool) -> None:
        """Hand ready messages to waiting receives, then to subscriptions with credit: of the
        queues something happened to in this turn (never a walk over every queue).
        `may_decide`: whether a `full` master may take ordering indices now (the engine's
        full_master_may_decide)."""
        pairs, cores = self.pairs, self.registry.cores
        # A lease may dead-letter expired messages on its way: their queues are served next turn.
        serving, self.to_serve = self.to_serve, set()
        for name in serving:
            core = cores.get(name)
            if core is None or not core.has_ready():
                continue
            if not may_decide and core.options.strength.value == "full" and name in pairs.masters:
                continue          # see Engine.full_master_may_decide; the waiters wait on
            if pairs.restarting(name):
                continue          # its new epoch first (Pairs.restarting)
            waiters = self.waiters.get(name)
            while waiters:
                command = next(iter(waiters.values())).command
                if not isinstance(command, c.Receive):        # a look at the head (c.Head)
                    if not self.answer_head(core, command, now_ms):
                        break
                    waiters.popitem(last=False)
                    continue
                leased = self.lease(core, command.max_messages, command.visibility_ms, command.client, now_ms)
                if not leased:
                    break       # nothing visible yet: the waiter keeps waiting
                waiters.popitem(last=False)
                self.answer_with_messages(core, command.replier, command.request_id, leased)
            if waiters is not None and not waiters:
                del self.waiters[name]
            for subscription in self.subscriptions.get(name, {}).values():
                if subscription.credit > 0 and not subscription.held:
                    leased = self.lease(core, subscription.credit, subscription.visibility_ms, subscription.client,
                                        now_ms)
                    if not leased:
                        break
                    subscription.credit -= len(leased)
                    if subscription.recipient is not None and (core.options.fault_interval_s
                                                               or core.options.message_interval_s):
                        subscription.pushed.update((op.index, op.receipt) for op in leased)
                    self._push(core, subscription, leased)
        if self.to_serve:
            self._wake()

    def lease(self, core: QueueCore, max_messages: int, visibility_ms: int | None, client: str,
              now_ms: int) -> list[Leased]:
        """A lease that may take messages past their time to live out of the queue on its way
        (QueueCore.lease): those operations are decided as the expiry sweep's are."""
        operations = self.pipeline.open.sealed.operations
        mark = len(operations)
        leased = core.lease(max_messages, visibility_ms, client, now_ms, operations)
        if len(operations) - mark > len(leased):
            self.pipeline.decided(core, operations[mark:])
        return leased

    def answer_with_messages(self, core: QueueCore, replier: Any, request_id: int, leased: list[Leased]) -> None:
        pipeline = self.pipeline
        batch = pipeline.open
        reads = batch.sealed.payload_reads
        required = self.pairs.replicated_order(core, list(leased))
        if required:
            batch.holds[len(batch.replies)] = (core.name, required)
        batch.replies.append((replier, request_id, Messages(len(reads), leased)))
        reads.extend((op.queue_id, op.index) for op in leased)
        pipeline.touch(core)

    def _push(self, core: QueueCore, subscription: Subscription, leased: list[Leased]) -> None:
        pipeline = self.pipeline
        batch = pipeline.open
        reads = batch.sealed.payload_reads
        required = self.pairs.replicated_order(core, list(leased))
        if required:
            batch.push_holds[len(batch.pushes)] = (core.name, required)
        batch.pushes.append((subscription, len(reads), leased))
        reads.extend((op.queue_id, op.index) for op in leased)
        pipeline.touch(core)

    def answer_head(self, core: QueueCore, command: c.Head, now_ms: int) -> bool:
        head = core.head()
        if head is None:
            return False
        index, priority = head
        with_read = not self.storage.reading
        if with_read:
            self.storage.begin_read()
        try:
            enqueued_ms = self.storage.enqueued_ms(core.queue_id, index)
        finally:
            if with_read:
                self.storage.end_read()
        # Not stored yet: enqueued in the batch now going to disk (answers wait for it).
        found = {"id": index, "priority": priority, "enqueued_ms": now_ms if enqueued_ms is None else enqueued_ms}
        self.pipeline.open.replies.append((command.replier, command.request_id, [found]))
        return True

    # --- waits running out -----------------------------------------------------------------
    def expire(self, now_ms: int) -> None:
        """Answer receives whose wait ran out (empty) and status waits (with the state now):
        only those due, from the deadline heaps (issue 32, item 11: every turn walked every
        waiter). A heap entry of a waiter answered meanwhile is dropped as it comes up."""
        heap = self.waiter_deadlines
        while heap and heap[0][0] <= now_ms:
            _, key, waiter = heapq.heappop(heap)
            name = waiter.command.queue
            waiters = self.waiters.get(name)
            if waiters is None or waiters.get(key) is not waiter:
                continue                          # answered already
            del waiters[key]
            if not waiters:
                del self.waiters[name]
            waiter.command.replier.reply(waiter.command.request_id, [])
        if len(self.waiter_deadlines) + len(self.status_deadlines) > self._compact_deadlines_at:
            self._compact_deadlines()
        status_heap = self.status_deadlines
        while status_heap and status_heap[0][0] <= now_ms:
            status_waiter = heapq.heappop(status_heap)[2]
            held_key = (status_waiter.queue_id, status_waiter.command.message_id)
            held = self.status_waiters.get(held_key, [])
            position = next((i for i, w in enumerate(held) if w is status_waiter), None)
            if position is None:
                continue                          # answered already, or held again (a later entry)
            del held[position]
            if not held:
                del self.status_waiters[held_key]
            self.check_status(status_waiter, final=True)

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heaps from the waiters still waiting: an entry of a waiter
        answered early stays until its deadline, and would hold its request (and reply) that
        long. Run when the heaps pass twice what they held after the last rebuild: amortized
        O(1) per waiter."""
        self.waiter_deadlines = [(w.deadline_ms, w.key, w) for waiters in self.waiters.values()
                                 for w in waiters.values()]
        heapq.heapify(self.waiter_deadlines)
        self.status_deadlines = [(w.deadline_ms, next(self._waiter_keys), w) for held in self.status_waiters.values()
                                 for w in held]
        heapq.heapify(self.status_deadlines)
        self._compact_deadlines_at = max(DEADLINES_COMPACT_MIN,
                                         2 * (len(self.waiter_deadlines) + len(self.status_deadlines)))

    def next_deadline(self) -> int | None:
        """The first wait to run out (the engine's timer wakes for it)."""
        deadlines = [heap[0][0] for heap in (self.waiter_deadlines, self.status_deadlines) if heap]
        return min(deadlines) if deadlines else None

    # --- message status (seed 004 CheckMsgCompletion) --------------------------------------
    def check_status(self, waiter: StatusWaiter, *, final: bool) -> None:
        command = waiter.command
        with_read = not self.storage.reading
        if with_read:
            self.storage.begin_read()
        try:
            found = self.storage.message_status(waiter.queue_id, command.message_id)
            producer = None if found is None or command.admin else \
                self.storage.status_producer(waiter.queue_id, command.message_id)
        finally:
            if with_read:
                self.storage.end_read()
        # Only the producer, or an admin of the queue, reads a status and its reply
        # (docs/PROTOCOL.md, "Grants"; issue 32, item 13). Checked on every look, a waiter's too.
        if found is None:
            if waiter.tracks_status:
                # A queue that keeps statuses holds none for this id: never a message's (under
                # `full` consumption steps take ids too), or its status passed the retention.
                command.replier.fail(command.request_id, no_status(command))
                return
            found = ("acked", 0, None)   # no status kept: a message that left leaves no record
        elif not command.admin and (producer is None or producer != command.client):
            # Another producer's message (or a status row older than the producer field: an
            # admin's): answered as an unknown id, so ids and their states are not revealed.
            command.replier.fail(command.request_id, no_status(command))
            return
        state, deliveries, reply = found
        if final or state in command.until:
            result: dict[str, Any] = {"id": command.message_id, "state": state, "deliveries": deliveries}
            if reply is not None:
                result["reply"] = reply
            command.replier.reply(command.request_id, result)
        else:
            self.status_waiters.setdefault((waiter.queue_id, command.message_id), []).append(waiter)
            heapq.heappush(self.status_deadlines, (waiter.deadline_ms, next(self._waiter_keys), waiter))

    def wake_status_waiters(self, operations: list[Operation]) -> None:
        """After a commit: the status waits on the messages its operations changed look again."""
        if not self.status_waiters:
            return
        for op in operations:
            if isinstance(op, SubscriptionOpened | SubscriptionDropped):
                continue                 # a subscription's step names no message
            waiters = self.status_waiters.pop((op.queue_id, op.index), None)
            for waiter in waiters or ():
                self.check_status(waiter, final=False)
