"""Fault surveillance of recipients, with alternative recipients and return to sender (seed 001).

A **recipient** is a named push consumer of a queue (`consume(queue, recipient="billing-a")`);
the name and its state live in the cluster map (`PutRecipient`), so every node knows them and
a failover of the queue's master keeps them. The queue's options set the intervals (0: off):
- `fault_interval_s`: a recipient that takes no message (acks or releases none) for that long
  while messages wait enters the **fault** state. The node stops pushing to it; what it was
  pushed and has not taken goes back to the queue, except the oldest, its **probe**;
- `defunct_interval_s`: in fault that long, its subscriptions are ended (`E_RECIPIENT_DEFUNCT`):
  **defunct** until it subscribes again;
- `message_interval_s`: a message waiting that long fails over on its own, whatever the state.
A recipient that subscribes again or takes a message (its probe) is **ok** again, and
fail-over stops. The map keeps why a recipient is in its state (its `reason`); the master of
its queue restates it when what it says no longer holds (`NoteRecipient`: "nothing waits for it
now" once a purge took what waited), so `qctl recipient list` shows what is true now.

While a recipient is in fault or defunct, the master of its queue **fails over** the messages
waiting there, in order: each goes to the first recipient of its alternatives chain (the map's
`SetAlternatives`, seed 001's directory) that is ok, enqueued into that recipient's queue by the
cluster itself (signed with the cluster secret as `@cluster`: an administrator chose the
chain), with a dedupe id made of the source queue's incarnation and the message id, so a move
retried after a crash or a lost answer stores it once; the source message is acknowledged only
after that enqueue was. When no alternative is ok, the message is **returned to its sender**:
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
from wire.message_input import FAILED_OVER_FROM, FAULT, ORIGIN_PRODUCER, REPLY_TO, RETURNED_FROM
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
        entry = self.entry(recipient)
        verdict = decide.on_subscribe(entry.state if entry is not None else None)
        if verdict is not None:
            self._propose(recipient, queue, *verdict, client_id)
        self._start()

    def took(self, queue: str, recipient: str, message_ids: list[int]) -> None:
        """The recipient acknowledged or released messages: it is alive (its probe, in fault)."""
        self._last_take[(queue, recipient)] = self._clock.monotonic()
        for subscription in self._services.recipient_subscriptions(queue, recipient):
            for message_id in message_ids:
                subscription.pushed.pop(message_id, None)
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
            self._apply(queue, state, subscriptions)
            if state == RecipientState.OK and recipient in self._failing_over:
                # Ok again while its mover gives back what it held: what waits is not offered
                # to it yet, so its interval starts once it is (else, with an interval under
                # the mover's pause, it was back in fault before it was offered a message).
                self._last_take[(queue, recipient)] = now
            options = core.options
            if decide.watches_idleness(state, options, subscribed_here=True):
                verdict = decide.fault_verdict(self._idle_while_waiting(core, recipient, now), core.depth, options,
                                               subscribed_here=True)
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
                verdict = decide.fault_verdict(self._idle_while_waiting(core, entry.name, now), core.depth, options,
                                               subscribed_here=False)
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

    def _idle_while_waiting(self, core: QueueCore, recipient: str, now: float) -> float:
        """How long the recipient has taken no message while its queue held some
        (decide.idle_for), keeping when the queue was last seen empty and when the recipient
        took a message as first seen, now, if not known."""
        if core.depth == 0:
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
        held = state == RecipientState.FAULT
        for subscription in subscriptions:
            if held and not subscription.held:
                subscription.held = True
                self._release(queue, subscription, keep_probe=True)
            elif not held and subscription.held:
                subscription.held = False
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
        """To the first ok alternative, else back to its sender; True once it left the queue.
        An alternative takes the message only in the queue the administrator's chain names for
        it, and only while that administrator may `post` there: the cluster enqueues as itself
        (the headers it sets are its own), on the chain's authority, never on a client's."""
        cluster = self._map()
        assert cluster is not None, "movers run in a cluster only (_check)"
        dedupe = f"fo:{core.record.incarnation or core.queue_id}:{message.message_id}"
        headers = {**(message.headers or {}), FAILED_OVER_FROM: entry.name,
                   ORIGIN_PRODUCER: self._producer_of(core, message)}
        set_by = cluster.alternatives_set_by.get(entry.name, "")
        for alternative, queue in decide.ok_alternatives(
                entry, cluster.alternatives.get(entry.name, ()), cluster.alternative_queues.get(entry.name, ()),
                lambda name: cluster.recipients.get(name)):
            if not self._may_post(set_by, queue):
                log.warning("recipient %s: alternative %s skipped: %s, who set the chain, may not post to %s",
                            entry.name, alternative, set_by or "nobody", queue)
                continue
            try:
                await self._cluster_client().enqueue(queue, message.payload, message.priority, dedupe,
                                                     headers=headers)
            except QueueError as error:
                log.info("recipient %s: alternative %s refused message %d: %s", entry.name, alternative,
                         message.message_id, error)
                if error.outcome_unknown or (error.retriable and error.code != e.E_QUEUE_FULL.code):
                    # It may hold it (the next alternative would make two copies), or cannot
                    # answer this moment: this alternative again, in a moment (same dedupe id).
                    return False
                continue              # it cannot take it: the next alternative
            await self._settle(entry.queue, message)
            self.moved[(entry.name, alternative)] += 1
            return True
        return await self._return_to_sender(entry, core, message, dedupe)

    async def _return_to_sender(self, entry: RecipientEntry, core: QueueCore, message: DeliveredMessage,
                                dedupe: str) -> bool:
        fault = decide.fault_text(entry)
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
            headers = {**(message.headers or {}), RETURNED_FROM: entry.name, FAULT: fault, ORIGIN_PRODUCER: producer}
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
            reply = json.dumps({"returned": True, "recipient": entry.name, "fault": fault}).encode()
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
                                    ({"recipient": name}, count) for name, count in sorted(self.returned.items())]))

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

