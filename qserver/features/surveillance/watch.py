"""Fault surveillance of recipients, with alternative recipients and return to sender (seed 001).

A **recipient** is a named push consumer of a queue (`consume(queue, recipient="billing-a")`);
the name and its state live in the cluster map (`PutRecipient`), so every node knows them and
a failover of the queue's master keeps them. The queue's options set the intervals (0: off):
- `fault_interval_s`: a recipient that takes no message (acks or releases none) for that long
  while messages offered to it wait for its answer enters the **fault** state. It is judged on
  what the engine pushed to it (Subscription.pushed), never on what waits in the queue: the
  engine serves pull receivers first and fills the first subscription with credit, so a
  healthy second recipient may be offered nothing while the queue holds messages (issue 37,
  item 6). One subscribed nowhere is judged on the messages that waited unleased. The node
  stops pushing to one in fault; what it was pushed and has not taken goes back to the queue,
  except the oldest, its **probe**;
- `defunct_interval_s`: in fault that long, its subscriptions are ended (`E_RECIPIENT_DEFUNCT`):
  **defunct** until it subscribes again;
- `message_interval_s`: each message's delivery deadline from its enqueue: one waiting that long
  fails over on its own, whatever the state, and so does one pushed to a recipient that has not
  answered for it (the watch takes its lease back, journaled as a release by `@cluster`, and
  holds pushing to that recipient until it answers for something; its late ack is refused as
  any ack under an ended lease is).
A recipient that subscribes again or takes a message (its probe) is **ok** again, and
fail-over stops. The map keeps why a recipient is in its state (its `reason`); the master of
its queue restates it when what it says no longer holds (`NoteRecipient`: "nothing waits for it
now" once a purge took what waited), so `qctl recipient list` shows what is true now.

While a recipient is in fault or defunct, the master of its queue **fails over** the messages
waiting there, in order: each goes to the first recipient of its alternatives chain (the map's
`SetAlternatives`, seed 001's directory) that is ok. The chain travels with the message: one
moved before follows the chain of the recipient it was first for (`x-failed-over-from`), past
those it was at (`x-failed-over-tried`), not the chain of the alternative holding it now. It is
enqueued into that recipient's queue by the
cluster itself (signed with the cluster secret as `@cluster`: an administrator chose the
chain), with a dedupe id made of the source queue's incarnation and the message id, so a move
retried after a crash or a lost answer stores it once; the source message is acknowledged only
after that enqueue was. A move whose answer was lost (outcome unknown) is retried at that same
alternative until it answers, whatever its state meanwhile: the next alternative could make a
second copy. When no alternative is ok, the message is **returned to its sender**:
enqueued into the queue its `reply-to` header names (in the producer's own name: with its
grants), or under `two_way` answered as its reply, each carrying the fault (`x-fault`); a
message with neither waits. Every state change is an event: in the map (so in `qctl status`),
in the metrics, in the journal of the recipient's queue (op `recipient`) and, when the channel
`qcluster.events` exists, published to it.

An alternative must consume a queue of its own: one on the same queue is a second consumer of
the same messages, which the mover cannot tell apart (it skips it, and that alternative, offered
nothing while the messages wait, enters fault too). `RemoveRecipient` forgets a recipient at
every node: each forgets what it kept for it, and the mover gives back to the queue what it held.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from qserver.api.auth import CLUSTER_CLIENT, Principal
from qserver.core import commands as c
from qserver.features.surveillance import decide
from qserver.features.surveillance.decide import Clock, ReturnRoute
from qserver.metrics import render_family
from replication.cluster_map import (
    RECIPIENTS_PER_CLIENT_MAX,
    NoteRecipient,
    PutRecipient,
    RecipientEntry,
    RecipientState,
)
from wire import errors as e
from wire.errors import QueueError
from wire.message_input import FAILED_OVER_FROM, FAILED_OVER_TRIED, FAULT, ORIGIN_PRODUCER, REPLY_TO, RETURNED_FROM
from wire.protocol import DeliveredMessage

if TYPE_CHECKING:
    from client.aio import AsyncClient
    from qserver.features.macro.service import MacroService
    from qserver.services import NodeServices, Subscription
    from replication.cluster_map import ClusterMap
    from replication.queue_core import QueueCore

log = logging.getLogger("qserver.features.surveillance.watch")
WATCH_INTERVAL_S = 0.2
MOVE_BATCH = 50                   # messages leased for fail-over at a time
MOVE_VISIBILITY_MS = 30_000       # their lease: a move retried after it runs out stores nothing twice (dedupe)
MOVE_PAUSE_S = 1.0                # when nothing can take a message: look again after this long
EVENTS_CHANNEL = "qcluster.events"
UNSETTLED_MOVES_MAX = 10_000      # moves whose answer was lost, kept until settled (oldest dropped past it)
# A test hook (tests/test_surveillance_moves.py): the path of a file listing queues, one a line;
# while it exists, the answer of a move into one of them is dropped after the enqueue was done,
# as a connection cut after the request would (outcome unknown). Unset in production.
LOSE_MOVE_ANSWERS_ENV = "QSERVER_TEST_LOSE_MOVE_ANSWERS"
REAL_CLOCK = Clock(time.monotonic, lambda: int(time.time() * 1000))


class RecipientWatch:
    """The driver of surveillance: it reads the clock, the map and the queues, asks the pure
    rules (qserver/features/surveillance/decide.py) what to do, and does it."""

    def __init__(self, services: NodeServices, macros: MacroService, clock: Clock = REAL_CLOCK) -> None:
        self._services = services
        self._clock = clock
        self._macros = macros          # its client in the cluster's name moves and returns messages
        self._last_take: dict[tuple[str, str], float] = {}      # (queue, recipient) -> monotonic
        self._waiting_since: dict[str, float] = {}               # queue -> monotonic, since seen not empty
        self._proposing: dict[str, str] = {}                    # recipient -> state proposed, unanswered
        self._noting: set[str] = set()                          # recipients whose reason is proposed
        self._unsettled: dict[str, float] = {}                  # recipient -> since its reason is untrue
        self._movers: dict[str, asyncio.Task[None]] = {}
        self._failing_over: set[str] = set()                    # recipients whose mover is not the overdue one
        self._seen: dict[str, str] = {}                         # recipient -> the state events were made for
        # (queue, recipient) -> since when it holds a message offered to it that it has not
        # answered for: what it is judged on (item 6). Kept when the watch takes an overdue
        # message back: it still owes an answer.
        self._offered_since: dict[tuple[str, str], float] = {}
        # Subscriptions held since an overdue message was taken back, and those given back what
        # they held on entering fault (id -> its queue and the subscription), kept while they exist.
        self._doubted: dict[int, tuple[str, Subscription]] = {}
        self._fault_held: dict[int, tuple[str, Subscription]] = {}
        self._enqueued: dict[tuple[int, int], int | None] = {}   # pushed (queue id, message id) -> enqueued ms
        # (source queue id, message id) -> (alternative, its queue): a move whose answer was lost,
        # settled there before any other alternative is tried (item 9).
        self._unsettled_moves: collections.OrderedDict[tuple[int, int], tuple[str, str]] = collections.OrderedDict()
        self.taken_back: collections.Counter[str] = collections.Counter()           # recipient
        self.moved: collections.Counter[tuple[str, str]] = collections.Counter()     # (recipient, to)
        self.returned: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[tuple[str, str]] = collections.Counter()    # (recipient, state)
        self._task: asyncio.Task[None] | None = None

    # --- the map ----------------------------------------------------------------------------
    def _map(self) -> ClusterMap | None:
        return self._services.cluster_map

    def entry(self, recipient: str) -> RecipientEntry | None:
        cluster = self._map()
        return None if cluster is None else cluster.recipients.get(recipient)

    def _propose(self, recipient: str, queue: str, state: str, reason: str, owner: str = "") -> None:
        """Propose a state (once at a time per recipient); the map is the authority. `owner`:
        the client subscribing, should this bind a new name (the map bounds the names each
        client binds, RECIPIENTS_PER_CLIENT_MAX)."""
        if not self._services.clustered or self._proposing.get(recipient) == state:
            return
        self._proposing[recipient] = state

        def finish(outcome: Any) -> None:
            self._proposing.pop(recipient, None)
            if isinstance(outcome, QueueError):
                log.info("recipient %s: %s not recorded: %s", recipient, state, outcome)
        self._submit(PutRecipient(recipient, queue, state, self._clock.wall_ms(), reason, owner), finish)

    def _note(self, entry: RecipientEntry, reason: str) -> None:
        """Propose a restated reason (once at a time per recipient), for the spell of the state
        the entry is in: a note about a spell that ended meanwhile is refused by the map."""
        if not self._services.clustered or entry.name in self._noting:
            return
        self._noting.add(entry.name)

        def finish(outcome: Any) -> None:
            self._noting.discard(entry.name)
            if isinstance(outcome, QueueError):
                log.info("recipient %s: reason not restated: %s", entry.name, outcome)
        self._submit(NoteRecipient(entry.name, entry.queue, entry.state, entry.since_ms, reason), finish)

    def _submit(self, command: PutRecipient | NoteRecipient, finish: Any) -> None:
        self._services.propose(command, finish, lambda outcomes: outcomes)

    # --- what the recipients do (qserver/api/ws_api.py) --------------------------------------------
    def check_subscribe(self, queue: str, recipient: str, client_id: str) -> None:
        """Refuse a recipient name bound to another queue (by its first subscriber, or by an
        administrator's chain of alternatives, which wins), and a new name from a client that
        bound RECIPIENTS_PER_CLIENT_MAX names already. The map decides again when the name is
        registered (PutRecipient): this answers the subscriber at once."""
        cluster = self._map()
        if cluster is None:
            return
        entry = cluster.recipients.get(recipient)
        bound = entry.queue if entry is not None else cluster.chain_binding(recipient)
        if bound is not None and bound != queue:
            raise QueueError(e.E_INVALID_OPTION, f"recipient {recipient} receives from queue {bound}")
        if entry is None and bound is None and sum(
                1 for other in cluster.recipients.values() if other.owner == client_id) >= RECIPIENTS_PER_CLIENT_MAX:
            raise QueueError(e.E_INVALID_OPTION, f"client {client_id} bound {RECIPIENTS_PER_CLIENT_MAX} recipient "
                                                 "names already: remove one (qctl recipient remove) first")

    def start(self) -> None:
        """Watch from the node's start: a queue mastered here may have recipients in fault
        (after a failover) whose messages fail over though none subscribes here."""
        self._start()

    def subscribed(self, queue: str, recipient: str, client_id: str) -> None:
        self._last_take[(queue, recipient)] = self._clock.monotonic()
        self._offered_since.pop((queue, recipient), None)        # judged afresh on what it is offered now
        entry = self.entry(recipient)
        verdict = decide.on_subscribe(entry.state if entry is not None else None)
        if verdict is not None:
            self._propose(recipient, queue, *verdict, client_id)
        self._start()

    def took(self, queue: str, recipient: str, message_ids: list[int]) -> None:
        """The recipient acknowledged or released messages: it is alive (its probe, in fault)."""
        self._last_take[(queue, recipient)] = self._clock.monotonic()
        subscriptions = self._services.recipient_subscriptions(queue, recipient)
        for subscription in subscriptions:
            for message_id in message_ids:
                subscription.pushed.pop(message_id, None)
            if subscription.subscription_id in self._doubted:       # it answers again: push to it again
                del self._doubted[subscription.subscription_id]
                if subscription.subscription_id not in self._fault_held:
                    subscription.held = False
                    self._services.serve_soon(queue)
        if not any(subscription.pushed for subscription in subscriptions):
            self._offered_since.pop((queue, recipient), None)
        entry = self.entry(recipient)
        verdict = decide.on_take(entry.state if entry is not None else None)
        if verdict is not None:
            self._propose(recipient, queue, *verdict)

    # --- the watch --------------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                self._check()
            except Exception:      # a bug here must not end surveillance for good; it is logged
                log.exception("fault surveillance")

    def _check(self) -> None:
        cluster = self._map()
        if cluster is None:
            return
        services = self._services
        now, now_ms = self._clock.monotonic(), self._clock.wall_ms()
        here = services.recipients_here()
        self._forget_gone(cluster, here, now)
        for (queue, recipient), subscriptions in here.items():
            core = services.master_core(queue)
            if core is None:
                continue
            entry = cluster.recipients.get(recipient)
            state = entry.state if entry is not None else None
            options = core.options
            if options.message_interval_s and state is not None and state != RecipientState.DEFUNCT:
                self._take_back_overdue(core, recipient, subscriptions, now_ms)
            self._apply(queue, state, subscriptions)
            if state == RecipientState.OK and recipient in self._failing_over:
                # Ok again while its mover gives back what it held: what waits is not offered
                # to it yet, so its interval starts once it is (else, with an interval under
                # the mover's pause, it was back in fault before it was offered a message).
                self._last_take[(queue, recipient)] = now
            if decide.watches_idleness(state, options, subscribed_here=True):
                offered = sum(len(subscription.pushed) for subscription in subscriptions)
                verdict = decide.fault_verdict(self._idle_while_offered(queue, recipient, offered, now), offered,
                                               options, subscribed_here=True)
                if verdict is not None:
                    self._propose(recipient, queue, *verdict)
            if options.message_interval_s and state == RecipientState.OK:
                head = core.head()
                enqueued = services.enqueued_ms(core.queue_id, head[0]) if head else None
                if decide.is_overdue(enqueued, now_ms, options):
                    self._ensure_mover(recipient, queue, overdue_only=True)
        for entry in list(cluster.recipients.values()):
            core = services.master_core(entry.queue)
            if core is None:
                self._unsettled.pop(entry.name, None)         # its master judges it
                continue
            options = core.options
            if (entry.queue, entry.name) not in here \
                    and decide.watches_idleness(entry.state, options, subscribed_here=False):
                # Not subscribed at all (gone, or still on a master that died): it takes nothing.
                verdict = decide.fault_verdict(self._idle_while_waiting(core, entry.name, now),
                                               core.depth - core.in_flight, options, subscribed_here=False)
                if verdict is not None:
                    self._propose(entry.name, entry.queue, *verdict)
            verdict = decide.defunct_verdict(entry.state, entry.since_ms, now_ms, options)
            if verdict is not None:
                self._propose(entry.name, entry.queue, *verdict)
            if entry.state != RecipientState.OK:
                self._restate(entry, core, now)
                self._ensure_mover(entry.name, entry.queue, overdue_only=False)
            else:
                self._unsettled.pop(entry.name, None)
        for entry in cluster.recipients.values():
            seen = self._seen.get(entry.name)
            if seen != entry.state:
                if decide.announces(seen, entry.state, master_here=services.is_master(entry.queue)):
                    self._event(entry)
                self._seen[entry.name] = entry.state
        for queue in [queue for queue in self._waiting_since if not services.is_master(queue)]:
            del self._waiting_since[queue]
        self._forget_subscriptions(here)

    def _forget_subscriptions(self, here: dict[tuple[str, str], list[Subscription]]) -> None:
        """Keep what the watch holds per subscription and per pushed message for those that
        still exist (bounded by the node's subscriptions and their credit)."""
        live = {subscription.subscription_id for subscriptions in here.values() for subscription in subscriptions}
        for held in (self._doubted, self._fault_held):
            for subscription_id in [subscription_id for subscription_id in held if subscription_id not in live]:
                # Gone (its connection closed) while in fault or owing an answer: what it still
                # held (its probe) goes back now, not at its visibility timeout, to fail over.
                queue, subscription = held.pop(subscription_id)
                if self._services.master_core(queue) is not None:
                    self._release(queue, subscription, keep_probe=False)
        for key in [key for key in self._offered_since if key not in here]:
            del self._offered_since[key]
        if self._enqueued:
            pushed = {(self._queue_id(queue), message_id) for (queue, _), subscriptions in here.items()
                      for subscription in subscriptions for message_id in subscription.pushed}
            for message_key in [message_key for message_key in self._enqueued if message_key not in pushed]:
                del self._enqueued[message_key]

    def _queue_id(self, queue: str) -> int:
        core = self._services.held_core(queue)
        return -1 if core is None else core.queue_id

    def _take_back_overdue(self, core: QueueCore, recipient: str, subscriptions: list[Subscription],
                           now_ms: int) -> None:
        """The message interval is each message's delivery deadline, also for one pushed to a
        recipient that has not answered for it (item 7): its lease is taken back (a release by
        the cluster, journaled like any), so it is ready to fail over, and pushing to that
        subscription is held until the recipient answers for something (it would otherwise be
        pushed the same message again, and again, up to max_deliveries). Its late ack or
        release is refused (the lease it names ended) and counts as its answer (took)."""
        for subscription in subscriptions:
            if not subscription.pushed:
                continue
            enqueued = {message_id: self._enqueued_ms(core, message_id) for message_id in subscription.pushed}
            late = decide.overdue_pushed(enqueued, now_ms, core.options)
            if not late:
                continue
            for message_id in late:
                receipt = subscription.pushed.pop(message_id)
                self._services.submit(c.Ack(core.name, message_id, receipt, CLUSTER_CLIENT, _Quiet(), release=True))
            self._doubted[subscription.subscription_id] = (core.name, subscription)
            subscription.held = True
            self.taken_back[recipient] += len(late)
            log.info("recipient %s: %d message(s) past the message interval taken back to fail over", recipient,
                     len(late))

    def _enqueued_ms(self, core: QueueCore, message_id: int) -> int | None:
        key = (core.queue_id, message_id)
        if key not in self._enqueued:
            self._enqueued[key] = self._services.enqueued_ms(core.queue_id, message_id)
        return self._enqueued[key]

    def _forget_gone(self, cluster: ClusterMap, here: dict[tuple[str, str], list[Subscription]], now: float) -> None:
        """Forget what this node keeps for recipients the map no longer holds (removed, or gone
        with their queue): every node applies the same map, and each forgets its own. One still
        subscribed here starts afresh, with its whole interval, and is registered again when it
        subscribes again or enters fault. Its mover sees it gone, stops and gives back what it
        holds (_move)."""
        for name in [name for name in self._seen if name not in cluster.recipients]:
            del self._seen[name]
            self._proposing.pop(name, None)
            self._unsettled.pop(name, None)
            self.returned.pop(name, None)
            self.taken_back.pop(name, None)
            for counter in (self.moved, self.events):
                for key in [key for key in counter if key[0] == name]:
                    del counter[key]
            for key in [key for key in self._last_take if key[1] == name and key in here]:
                self._last_take[key] = now
        for key in [key for key in self._last_take if key[1] not in cluster.recipients and key not in here]:
            del self._last_take[key]

    def _restate(self, entry: RecipientEntry, core: QueueCore, now: float) -> None:
        """Keep the reason of a recipient in fault or defunct true to what waits for it. It
        says how many messages waited when it entered the state; once none waits (a purge took
        them, its probe too) it says "nothing waits for it now", and when some wait again, so
        (decide.restated_reason), once it has been untrue for a while (decide.settled)."""
        reason = decide.restated_reason(entry.reason, core.depth > 0)
        if reason is None:            # it says what holds now
            self._unsettled.pop(entry.name, None)
            return
        if decide.settled(self._unsettled.setdefault(entry.name, now), now):
            self._note(entry, reason)

    def _idle_while_offered(self, queue: str, recipient: str, offered: int, now: float) -> float:
        """How long a recipient subscribed here has taken no message while it held some offered
        to it (decide.idle_for): from when it was first seen holding one, or its last take."""
        key = (queue, recipient)
        if offered:
            self._offered_since.setdefault(key, now)
        return decide.idle_for(now, self._offered_since.get(key), self._last_take.setdefault(key, now))

    def _idle_while_waiting(self, core: QueueCore, recipient: str, now: float) -> float:
        """How long a recipient subscribed nowhere has taken no message while its queue held
        messages no one leased (decide.idle_for), keeping when the queue was last seen without
        any and when the recipient took a message as first seen, now, if not known."""
        if not core.has_ready():
            self._waiting_since.pop(core.name, None)
            return 0.0
        waiting_since = self._waiting_since.setdefault(core.name, now)
        return decide.idle_for(now, waiting_since, self._last_take.setdefault((core.name, recipient), now))

    def _apply(self, queue: str, state: str | None, subscriptions: list[Subscription]) -> None:
        """Make the recipient's subscriptions here match its state in the map."""
        services = self._services
        if state == RecipientState.DEFUNCT:
            for subscription in subscriptions:
                self._release(queue, subscription, keep_probe=False)
                services.end_subscription(subscription, QueueError(
                    e.E_RECIPIENT_DEFUNCT, f"recipient {subscription.recipient} is defunct: subscribe again"))
            return
        in_fault = state == RecipientState.FAULT
        for subscription in subscriptions:
            if in_fault and subscription.subscription_id not in self._fault_held:
                self._fault_held[subscription.subscription_id] = (queue, subscription)
                self._release(queue, subscription, keep_probe=True)
            elif not in_fault:
                self._fault_held.pop(subscription.subscription_id, None)
            held = in_fault or subscription.subscription_id in self._doubted
            if held != subscription.held:
                subscription.held = held
                if not held:
                    services.serve_soon(queue)

    def _release(self, queue: str, subscription: Subscription, *, keep_probe: bool) -> None:
        """What the recipient was pushed and has not taken goes back to the queue (to fail
        over), the oldest excepted while in fault: its probe."""
        pushed = sorted(subscription.pushed.items())
        if keep_probe:
            pushed = pushed[1:]
        for message_id, receipt in pushed:
            subscription.pushed.pop(message_id, None)
            self._services.submit(c.Ack(queue, message_id, receipt, CLUSTER_CLIENT, _Quiet(), release=True))

    def _event(self, entry: RecipientEntry) -> None:
        """A state change this node is to announce (it masters the recipient's queue)."""
        self.events[(entry.name, entry.state)] += 1
        log.warning("recipient %s of %s: %s (%s)", entry.name, entry.queue, entry.state, entry.reason)
        core = self._services.held_core(entry.queue)
        if core is not None:
            self._services.journal_event(core, "recipient", entry.name, f"{entry.state}: {entry.reason}")
        cluster = self._map()
        if cluster is not None and EVENTS_CHANNEL in cluster.channels:
            document = json.dumps({"event": "recipient_state", **entry.to_json()}).encode()
            asyncio.get_running_loop().create_task(self._announce(document))

    async def _announce(self, document: bytes) -> None:
        with contextlib.suppress(QueueError, TimeoutError):
            await asyncio.wait_for(self._cluster_client().http.publish_http(EVENTS_CHANNEL, document), 10.0)

    # --- fail-over ----------------------------------------------------------------------------
    def _ensure_mover(self, recipient: str, queue: str, *, overdue_only: bool) -> None:
        if recipient not in self._movers:
            if not overdue_only:
                self._failing_over.add(recipient)
            self._movers[recipient] = asyncio.get_running_loop().create_task(
                self._move(recipient, queue, overdue_only))

    async def _move(self, recipient: str, queue: str, overdue_only: bool) -> None:
        """Fail the queue's waiting messages over, in order, while the recipient is not ok
        (or only those past the message interval) and this node masters its queue. A message
        nothing can take now stays leased to the mover, its lease extended, and is tried again:
        given back and leased anew at each try, its delivery count would grow to the queue's
        max_deliveries and dead-letter it. What the mover holds when it stops goes back."""
        services = self._services
        count = 1 if overdue_only else MOVE_BATCH
        held: list[DeliveredMessage] = []
        leased_at = 0.0
        try:
            while True:
                if not self._may_move(recipient, queue, overdue_only):
                    return
                entry, core = self.entry(recipient), services.held_core(queue)
                assert entry is not None and core is not None, "_may_move holds both"
                if not held:
                    held = await services.call(lambda r: c.Receive(queue, count, 0, MOVE_VISIBILITY_MS,
                                                                 CLUSTER_CLIENT, r))
                    leased_at = self._clock.monotonic()
                    if not held:
                        if overdue_only:
                            return
                        await asyncio.sleep(WATCH_INTERVAL_S)
                        continue
                    if overdue_only and not self._overdue(core, held[0]):
                        return        # given back below
                while held and self._may_move(recipient, queue, overdue_only) \
                        and await self._fail_over(entry, core, held[0]):
                    held.pop(0)
                if held:              # nothing takes it now: hold on, and try again in a moment
                    await self._pause(recipient, queue, overdue_only)
                    if self._clock.monotonic() - leased_at > MOVE_VISIBILITY_MS / 2000:
                        for message in held:
                            await self._settle(queue, message, extend_ms=MOVE_VISIBILITY_MS)
                        leased_at = self._clock.monotonic()
        except QueueError as error:
            log.info("recipient %s: fail-over paused: %s", recipient, error)
        finally:
            for message in held:
                with contextlib.suppress(QueueError, TimeoutError):
                    await asyncio.wait_for(self._settle(queue, message, release=True), 2.0)
            self._movers.pop(recipient, None)
            if not overdue_only:
                self._failing_over.discard(recipient)

    async def _pause(self, recipient: str, queue: str, overdue_only: bool) -> None:
        """MOVE_PAUSE_S, cut short once the mover is to stop (its recipient ok again, or
        removed): what it holds goes back to the queue at once, not up to a second later."""
        deadline = self._clock.monotonic() + MOVE_PAUSE_S
        while self._clock.monotonic() < deadline and self._may_move(recipient, queue, overdue_only):
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _may_move(self, recipient: str, queue: str, overdue_only: bool) -> bool:
        """The overdue mover runs while the recipient is ok, the other while it is not; both
        only on the queue's master."""
        entry = self.entry(recipient)
        if entry is None or self._services.master_core(queue) is None:
            return False
        return decide.mover_runs(entry.state, overdue_only=overdue_only)

    def _overdue(self, core: QueueCore, message: DeliveredMessage) -> bool:
        return decide.is_overdue(self._services.enqueued_ms(core.queue_id, message.message_id),
                                 self._clock.wall_ms(), core.options)

    async def _fail_over(self, entry: RecipientEntry, core: QueueCore, message: DeliveredMessage) -> bool:
        """To the first ok alternative of the chain the message started on, else back to its
        sender; True once it left the queue. An alternative takes the message only in the queue
        the administrator's chain names for it, and only while that administrator may `post`
        there: the cluster enqueues as itself (the headers it sets are its own), on the chain's
        authority, never on a client's. A move whose answer was lost is settled at that
        alternative first (decide.move_answer)."""
        cluster = self._map()
        assert cluster is not None, "movers run in a cluster only (_check)"
        dedupe = f"fo:{core.record.incarnation or core.queue_id}:{message.message_id}"
        given = message.headers or {}
        route = decide.route_of(entry.name, given.get(FAILED_OVER_FROM), given.get(FAILED_OVER_TRIED))
        headers = {**given, FAILED_OVER_FROM: route.origin, FAILED_OVER_TRIED: ",".join(route.tried),
                   ORIGIN_PRODUCER: self._producer_of(core, message)}
        set_by = cluster.alternatives_set_by.get(route.origin, "")
        key = (core.queue_id, message.message_id)
        unsettled = self._unsettled_moves.get(key)
        candidates = [unsettled] if unsettled is not None else decide.ok_alternatives(
            entry, cluster.alternatives.get(route.origin, ()), cluster.alternative_queues.get(route.origin, ()),
            lambda name: cluster.recipients.get(name), route.tried)
        for alternative, queue in candidates:
            if unsettled is None and not self._may_post(set_by, queue):
                log.warning("recipient %s: alternative %s skipped: %s, who set the chain, may not post to %s",
                            route.origin, alternative, set_by or "nobody", queue)
                continue
            try:
                await self._cluster_client().enqueue(queue, message.payload, message.priority, dedupe,
                                                     headers=headers)
                self._lose_answer_for_tests(queue)
            except QueueError as error:
                answer = decide.move_answer(error.code, outcome_unknown=error.outcome_unknown,
                                            retriable=error.retriable, unsettled=unsettled is not None)
                log.info("recipient %s: alternative %s refused message %d: %s (%s)", entry.name, alternative,
                         message.message_id, error, answer.value)
                if answer is decide.MoveAnswer.SETTLE_HERE:
                    # It may hold it, or cannot answer this moment: this alternative again, in a
                    # moment, with the same dedupe id; no other before it answers.
                    self._remember_unsettled(key, alternative, queue)
                    return False
                if answer is decide.MoveAnswer.GONE:
                    self._unsettled_moves.pop(key, None)
                    return False      # the chain again, next time
                continue              # it cannot take it: the next alternative
            self._unsettled_moves.pop(key, None)
            await self._settle(entry.queue, message)
            self.moved[(entry.name, alternative)] += 1
            return True
        chain = cluster.alternatives.get(route.origin, ())
        tried = [(name, self._state_of(name)) for name in (*route.tried, *(a for a in chain if a not in route.tried))]
        return await self._return_to_sender(entry, core, message, dedupe, route, decide.fault_text(tried))

    def _state_of(self, recipient: str) -> str | None:
        entry = self.entry(recipient)
        return None if entry is None else entry.state

    def _remember_unsettled(self, key: tuple[int, int], alternative: str, queue: str) -> None:
        self._unsettled_moves[key] = (alternative, queue)
        while len(self._unsettled_moves) > UNSETTLED_MOVES_MAX:
            dropped, (name, _) = self._unsettled_moves.popitem(last=False)
            log.warning("message %d: its unsettled move to %s is no longer kept (more than %d)", dropped[1], name,
                        UNSETTLED_MOVES_MAX)

    @staticmethod
    def _lose_answer_for_tests(queue: str) -> None:
        """The test hook LOSE_MOVE_ANSWERS_ENV: drop this move's answer (outcome unknown)."""
        path = os.environ.get(LOSE_MOVE_ANSWERS_ENV)
        if not path:
            return
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as listed:
                if queue in listed.read().split():
                    raise QueueError(e.E_TIMEOUT, "the answer of this move was lost (test hook)",
                                     outcome_unknown=True)

    async def _return_to_sender(self, entry: RecipientEntry, core: QueueCore, message: DeliveredMessage,
                                dedupe: str, moved: decide.Route, fault: str) -> bool:
        reply_to = (message.headers or {}).get(REPLY_TO)
        route = decide.return_route(reply_to, core.options.type)
        if route is ReturnRoute.REPLY_TO:
            assert reply_to is not None, "decide.return_route: the reply-to header names it"
            # In its producer's name: the client that enqueued it first, through any moves (a
            # move is the cluster's enqueue, and it may post anywhere).
            producer = self._producer_of(core, message)
            if not producer or not self._may_post(producer, reply_to):
                log.info("recipient %s: message %d not returned: its producer %s may not post to %s", entry.name,
                         message.message_id, producer or "(unknown)", reply_to)
                return False
            headers = {**(message.headers or {}), RETURNED_FROM: moved.origin, FAULT: fault, ORIGIN_PRODUCER: producer}
            if len(moved.tried) > 1:          # it was moved: where it was, up to here
                headers[FAILED_OVER_TRIED] = ",".join(moved.tried)
            headers.pop(REPLY_TO, None)
            try:
                await self._cluster_client().enqueue(reply_to, message.payload, message.priority, dedupe,
                                                     headers=headers)
            except QueueError as error:
                log.info("recipient %s: returning message %d to %s refused: %s", entry.name, message.message_id,
                         reply_to, error)
                return False
            await self._settle(entry.queue, message)
        elif route is ReturnRoute.REPLY:
            reply = json.dumps({"returned": True, "recipient": moved.origin, "fault": fault}).encode()
            await self._settle(entry.queue, message, reply=reply)
        else:
            return False
        self.returned[entry.name] += 1
        return True

    async def _settle(self, queue: str, message: DeliveredMessage, *, release: bool = False,
                      reply: bytes | None = None, extend_ms: int | None = None) -> None:
        """Acknowledge a message the watch leased (or release it, answer it, extend its lease)."""
        await self._services.call(lambda r: c.Ack(queue, message.message_id, message.receipt, CLUSTER_CLIENT, r,
                                                  release=release, reply_payload=reply, extend_ms=extend_ms))

    def _cluster_client(self) -> AsyncClient:
        return self._macros.client_for(CLUSTER_CLIENT)

    def _producer_of(self, core: QueueCore, message: DeliveredMessage) -> str:
        """The client that enqueued the message first: the origin a move recorded, else the
        message's own producer ("" when the storage no longer knows it)."""
        origin = (message.headers or {}).get(ORIGIN_PRODUCER)
        if origin:
            return origin
        return self._services.producer(core.queue_id, message.message_id) or ""

    def _may_post(self, client_id: str, queue: str) -> bool:
        """Whether `client_id`, as the registry holds it now, may post to `queue` (always, with
        authentication off: no client has grants then)."""
        if not self._services.auth_enabled:
            return True
        record = self._services.client_record(client_id)
        return record is not None and Principal(client_id, record["grants"]).allows("post", queue)

    # --- metrics and the end -------------------------------------------------------------------
    def render_metrics(self) -> list[str]:
        cluster = self._map()
        recipients = cluster.recipients.values() if cluster is not None else []
        return (render_family("qserver_recipient_state", "gauge", "recipients by state (1: in it), from the map",
                              [({"recipient": r.name, "queue": r.queue, "state": state}, int(r.state == state))
                               for r in sorted(recipients, key=lambda r: r.name) for state in RecipientState])
                + render_family("qserver_recipient_events_total", "counter",
                                "recipient state changes announced here", [
                                    ({"recipient": name, "state": state}, count)
                                    for (name, state), count in sorted(self.events.items())])
                + render_family("qserver_recipient_failed_over_total", "counter",
                                "messages failed over to an alternative recipient here", [
                                    ({"recipient": name, "to": to}, count)
                                    for (name, to), count in sorted(self.moved.items())])
                + render_family("qserver_recipient_returned_total", "counter",
                                "messages returned to their sender here", [
                                    ({"recipient": name}, count) for name, count in sorted(self.returned.items())])
                + render_family("qserver_recipient_taken_back_total", "counter",
                                "messages pushed to a recipient past their message interval, taken back to fail "
                                "over", [({"recipient": name}, count) for name, count in sorted(self.taken_back.items())])
                + render_family("qserver_recipient_moves_unsettled", "gauge",
                                "moves whose answer was lost, retried at their alternative only",
                                [({}, len(self._unsettled_moves))]))

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._movers.values()) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _Quiet:
    """The replier of the watch's own releases (a lease already ended is fine)."""

    def reply(self, request_id: int, result: Any) -> None:
        pass

    def fail(self, request_id: int, error: QueueError) -> None:
        log.debug("releasing a recipient's message: %s", error)

