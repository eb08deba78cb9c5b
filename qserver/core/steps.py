"""The steps of commands: how each command the engine takes from its inbox is routed (to this
node's core, to the queue's master, or refused with where to go) and stepped into its queue
core, its operations going into the open batch and its answer queued for after commit.

Separate from qserver/core/engine.py, which owns the task, the inbox and the turn: this module
says what one command does, the engine says when. The queue administration steps (create,
delete, clients, purge) are in qserver/core/admin_steps.py.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core import peek, view_scan
from qserver.core.admin_steps import AdminSteps
from qserver.core.grants import CLUSTER_CLIENT, grants_allow
from qserver.core.listeners import Listeners
from qserver.core.pipeline import CommitPipeline
from qserver.core.ports import Redirect
from qserver.core.registry import QueueRegistry
from qserver.core.replication_port import HandoffGate, Pairs, Relay
from qserver.core.space import StorageRoom
from replication.operations import DeadLettered
from replication.options import QueueType, base_name
from replication.queue_core import QueueCore
from wire.errors import E_INVALID_OPTION, E_NOT_MASTER, QueueError
from wire.message_input import (
    REPLY_TO,
    check_not_reserved,
    checked_headers,
    dedupe_id_refusal,
    payload_refusal,
    reply_to_refusal,
)

if TYPE_CHECKING:
    from replication.master import MasterRole
    from replication.messages import RelayRequest

# Commands whose answer waits for everything the queue decided so far, not only their own
# operations: a repeated dedupe id answers with an earlier id, which may not be committed yet;
# a purge's last step answers for the operations of its earlier steps too; a repeated
# subscription step answers for one decided a moment ago, maybe uncommitted.
ANSWERED_AFTER_EVERYTHING_DECIDED = frozenset({*c.WRITES, c.Purge, c.DurableSubscription})


class CommandSteps:
    pairs: Pairs                     # given by connect
    gate: HandoffGate | None
    relay: Relay

    def __init__(self, config: NodeConfig, rng: random.Random, *, clock_ms: Callable[[], int],
                 monotonic_ms: Callable[[], int], registry: QueueRegistry, pipeline: CommitPipeline,
                 listeners: Listeners, room: StorageRoom, submit: Callable[[c.Command], None],
                 continue_later: Callable[[c.Command], None]) -> None:
        """`submit`: a command into the inbox again; `continue_later`: its next step in the
        engine's next turn."""
        self.config = config
        self.rng = rng
        self.clock_ms = clock_ms
        self.monotonic_ms = monotonic_ms
        self.registry = registry
        self.pipeline = pipeline
        self.listeners = listeners
        self.room = room
        self.admin = AdminSteps(self, submit, continue_later)
        self._other: dict[type, Callable[[Any, int], None]] = {
            c.Subscribe: self._subscribe, c.Credit: self._credit, c.Unsubscribe: self._unsubscribe,
            c.MessageStatus: self._status, c.PeerMessage: self._peer_message, c.LinkChange: self._link_change,
            c.Invoke: self._invoke, c.Head: self._head, c.DurableSubscription: self._durable_subscription,
            c.Peek: self._peek, **self.admin.steps(),
        }

    def connect(self, pairs: Pairs, gate: HandoffGate | None, relay: Relay) -> None:
        self.pairs, self.gate, self.relay = pairs, gate, relay

    # --- routing ---------------------------------------------------------------------------
    def step(self, command: c.Command, now_ms: int) -> None:
        kind = type(command)
        queue = getattr(command, "queue", None)
        if queue is not None and self.pairs.clustered and kind in c.QUEUE_TRAFFIC:
            if self._step_clustered(command, queue, now_ms):
                return
        self.step_local(command, now_ms)

    def _step_clustered(self, command: c.Command, queue: str, now_ms: int) -> bool:
        """Route a client's queue operation in a cluster: True when it was handled here (a
        replica relays it to its master); raises for a node that holds neither member."""
        pairs, gate = self.pairs, self.gate
        if gate is not None and gate.handoffs and gate.parks(queue):
            gate.park(queue, command)      # a handoff: no new index until it ends
            return True
        if queue in pairs.replicas:
            return self._step_at_replica(command, queue)
        master = pairs.admit(queue, write=type(command) in c.WRITES)
        if master is None:
            return False
        batch = self.pipeline.open
        op_mark, reply_mark = len(batch.sealed.operations), len(batch.replies)
        self.step_local(command, now_ms)
        required = pairs.note_decided(master.core, batch.sealed.operations[op_mark:])
        if type(command) in ANSWERED_AFTER_EVERYTHING_DECIDED:
            required = max(required, master.core.record.next_index - 1)
        if required:
            for position in range(reply_mark, len(batch.replies)):
                batch.holds.setdefault(position, (queue, required))
            if type(command) in c.WRITES:
                batch.write_holds.update(range(reply_mark, len(batch.replies)))
        return True

    def _step_at_replica(self, command: Any, queue: str) -> bool:
        """At the replica: enqueues always go to the master (it orders them); under `full`
        consumption too. Under `producer` this member serves its own consumers (False)."""
        full = self.registry.cores[queue].options.strength.value == "full"
        if type(command) is c.Subscribe and full:
            raise QueueError(E_NOT_MASTER, f"subscribe to {queue} at its master {self.pairs.masters_hint(queue)}")
        if full and type(command) is c.Receive and command.view is not None:    # a relay carries no view
            raise QueueError(E_NOT_MASTER, f"receive through a view of {queue} at its master "
                                           f"{self.pairs.masters_hint(queue)}")
        if type(command) not in c.WRITES and not full:
            return False
        self.pairs.refuse_relay_when_full(queue)
        self.relay.relay(queue, command)
        return True

    def run_relayed(self, role: MasterRole, request: RelayRequest) -> None:
        """At the master: run a request a replica relayed, as if its client were here; the
        answer (sent after commit) carries the commit point the replica must reach first."""
        self.relay.run_relayed(role, request, lambda command: self.step(command, self.clock_ms()))

    def step_local(self, command: c.Command, now_ms: int) -> None:
        kind = type(command)
        if kind is c.EnqueueMany:
            self._enqueue_many(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.AckMany:
            self._ack_many(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Enqueue:
            self._enqueue(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Ack:
            self._ack(command, now_ms)  # type: ignore[arg-type]
        elif kind is c.Receive:
            self._receive(command, now_ms)  # type: ignore[arg-type]
        else:
            self._other[kind](command, now_ms)

    # --- messages --------------------------------------------------------------------------
    def _core(self, name: str) -> QueueCore:
        core = self.registry.cores.get(name)
        if core is None:
            raise self.registry.missing(name)
        return core

    def _refuse_when_full(self) -> None:
        """New messages are refused before anything is decided while the storage is full: in a
        pair nothing reaches the replica that this member might not store."""
        if self.room.storage_full is not None:
            raise self.room.full_error()

    def _enqueue(self, command: c.Enqueue, now_ms: int) -> None:
        self._refuse_when_full()
        core = self._core(command.queue)
        pipeline = self.pipeline
        batch = pipeline.open
        index, _ = core.enqueue(command.payload, command.priority, command.dedupe_id, command.client,
                                now_ms, batch.sealed.operations, command.ttl_ms, command.delay_ms,
                                self._producer_headers(command.client, command.headers))
        pipeline.touch(core)
        result = [index, core.record.epoch]
        if core.options.type is QueueType.ONE_WAY:
            command.replier.reply(command.request_id, result)   # seed 004 One_Way: no durable ack
        else:
            batch.replies.append((command.replier, command.request_id, result))
        self.listeners.to_serve.add(core.name)

    def _producer_headers(self, client: str, raw: Any) -> dict[str, str] | None:
        """A message's headers, checked against its producer (docs/PROTOCOL.md, "Message
        headers"): the headers the cluster sets on the messages it moves are the cluster's
        alone, and a `reply-to` must name a queue the producer may post to (a message returned
        to its sender is enqueued there; naming any queue would write where the producer may not)."""
        headers = checked_headers(raw)
        if headers is None or client == CLUSTER_CLIENT:
            return headers
        check_not_reserved(headers)
        reply_to = headers.get(REPLY_TO)
        record = self.registry.clients.get(client)
        if reply_to is not None and record is not None and not grants_allow(record["grants"], "post", reply_to):
            raise reply_to_refusal(client, reply_to)
        return headers

    def _enqueue_many(self, command: c.EnqueueMany, now_ms: int) -> None:
        self._refuse_when_full()
        core = self._core(command.queue)
        pipeline = self.pipeline
        batch = pipeline.open
        payloads, dedupe_ids = command.payloads, command.dedupe_ids or (None,) * len(command.payloads)
        if len(dedupe_ids) != len(payloads):
            raise QueueError(E_INVALID_OPTION, "dedupe ids must match the messages one for one")
        # Refused items (too large, a malformed dedupe id) keep their place in the answer.
        body_bytes_max = self.config.body_bytes_max
        outcomes: list[Any] = [None] * len(payloads)
        placed: list[int] = []
        for position, (payload, dedupe_id) in enumerate(zip(payloads, dedupe_ids, strict=True)):
            refusal = payload_refusal(payload, body_bytes_max) or dedupe_id_refusal(dedupe_id)
            if refusal is not None:
                outcomes[position] = [refusal.code, refusal.message]
            else:
                placed.append(position)
        results = core.enqueue_many([payloads[p] for p in placed], command.priority, [dedupe_ids[p] for p in placed],
                                    command.client, now_ms, batch.sealed.operations, command.ttl_ms, command.delay_ms,
                                    self._producer_headers(command.client, command.headers))
        for position, outcome in zip(placed, results, strict=True):
            outcomes[position] = [outcome.code, outcome.message] if type(outcome) is QueueError else outcome
        pipeline.touch(core)
        result = [core.record.epoch, outcomes]
        if core.options.type is QueueType.ONE_WAY:
            command.replier.reply(command.request_id, result)
        else:
            batch.replies.append((command.replier, command.request_id, result))
        self.listeners.to_serve.add(core.name)

    def _ack_many(self, command: c.AckMany, now_ms: int) -> None:
        core = self._core(command.queue)
        batch = self.pipeline.open
        operations = batch.sealed.operations
        ack, client = core.ack, command.client
        outcomes: list[Any] = []
        for message_id, receipt in command.items:
            try:
                ack(message_id, receipt, client, now_ms, operations)
                outcomes.append(None)
            except QueueError as error:
                outcomes.append([error.code, error.message])
        self.pipeline.touch(core)
        batch.replies.append((command.replier, command.request_id, outcomes))

    def _receive(self, command: c.Receive, now_ms: int) -> None:
        core = self._core(command.queue)
        listeners = self.listeners
        if command.view is not None:
            self._receive_through_view(core, command, now_ms)
            return
        leased = listeners.lease(core, command.max_messages, command.visibility_ms, command.client, now_ms)
        if leased:
            listeners.answer_with_messages(core, command.replier, command.request_id, leased)
        elif command.wait_ms > 0:
            listeners.wait(core.name, command, command.client)
        else:
            command.replier.reply(command.request_id, [])

    def _receive_through_view(self, core: QueueCore, command: c.Receive, now_ms: int) -> None:
        """A receive through a virtual queue (qserver/core/view_scan.py): what it finds now,
        never a wait (a wait would need its own wake-ups per view: refused at the surfaces)."""
        operations = self.pipeline.open.sealed.operations
        mark = len(operations)
        leased = view_scan.lease_through_view(self.registry.storage, core, command.view or "", command.max_messages,
                                              command.visibility_ms, command.client, now_ms, operations)
        if len(operations) - mark > len(leased):      # messages past their time to live, expired on the way
            self.pipeline.decided(core, operations[mark:])
        if leased:
            self.listeners.answer_with_messages(core, command.replier, command.request_id, leased)
        else:
            command.replier.reply(command.request_id, [])

    def _head(self, command: c.Head, now_ms: int) -> None:
        """The message a receive here would lease next, leased by no one: `[]` when none (after
        `wait_ms`), else `[{"id", "priority", "enqueued_ms"}]`. Where a receive would be
        relayed (a `full` queue's replica) or a node holds no member, the master answers."""
        pairs = self.pairs
        if pairs.clustered:
            if command.queue in pairs.replicas and self.registry.cores[command.queue].options.strength.value == "full":
                entry = pairs.view.entry(command.queue)
                if entry is not None:
                    raise Redirect(entry.master, f"queue {command.queue} is served by its master {entry.master}")
            pairs.refuse_if_not_master(command.queue)
        core = self._core(command.queue)
        if not self.listeners.answer_head(core, command, now_ms):
            if command.wait_ms > 0:
                self.listeners.wait(core.name, command, None)
            else:
                command.replier.reply(command.request_id, [])

    def _peek(self, command: c.Peek, now_ms: int) -> None:
        """Browse without taking (qserver/core/peek.py): at the master, or at a `full` queue's
        replica (it holds the same consumption state); elsewhere E_NOT_MASTER sends the caller to
        the master. Nothing is decided, so the answer goes at once."""
        pairs, base, role = self.pairs, base_name(command.queue), "master"
        if pairs.clustered:
            if base in pairs.replicas:
                if self.registry.cores[base].options.strength.value != "full":
                    entry = pairs.view.entry(base)
                    raise Redirect(entry.master if entry is not None else "",
                                   f"queue {command.queue} is browsed at its master {pairs.masters_hint(base)}")
                role = "replica"
            else:
                pairs.refuse_if_not_master(base)
        core = self._core(command.queue)
        storage = self.registry.storage
        if command.view is not None:
            result = view_scan.peek_view(storage, core, command.view, command.after, command.limit, command.preview)
        elif command.message_id:
            result = peek.read(storage, core, command.message_id)
        else:
            result = peek.peek(storage, core, command.after, command.limit, command.preview)
        result["served_by"] = {"node": self.config.node_id, "role": role}
        command.replier.reply(command.request_id, result)

    def _ack(self, command: c.Ack, now_ms: int) -> None:
        core = self._core(command.queue)
        pipeline = self.pipeline
        operations = pipeline.open.sealed.operations
        mark = len(operations)
        try:
            if command.release:
                core.release(command.message_id, command.receipt, now_ms, operations)
                self.listeners.to_serve.add(core.name)
            elif command.extend_ms is not None:
                core.extend(command.message_id, command.receipt, command.extend_ms, command.client, now_ms,
                            operations)
            elif command.reply_payload is not None:
                core.reply(command.message_id, command.receipt, command.reply_payload, command.client, now_ms, operations)
            else:
                core.ack(command.message_id, command.receipt, command.client, now_ms, operations)
        finally:
            pipeline.touch(core)   # a refused ack may still have ended an overdue lease
            dead = core.dead_letter_core
            if dead is not None and any(type(op) is DeadLettered for op in operations[mark:]):
                # The lease it ended was the message's last delivery: the dead-letter queue's
                # record (its counter) goes into this commit with the message's new row.
                pipeline.touch(dead)
                self.listeners.to_serve.add(dead.name)
        pipeline.open.replies.append((command.replier, command.request_id, None))

    def _durable_subscription(self, command: c.DurableSubscription, now_ms: int) -> None:
        core = self._core(command.queue)
        batch = self.pipeline.open
        operations = batch.sealed.operations
        if command.action == "open":
            result: Any = core.open_subscription(command.subscription, command.client, now_ms, operations)
        elif command.action == "ack":
            result = core.subscriber_ack(command.subscription, command.message_id, command.client, now_ms, operations)
        elif command.action == "acks":
            result = core.subscriber_acks(command.subscription, command.message_ids, command.client, now_ms, operations)
        else:
            core.drop_subscription(command.subscription, command.client, now_ms, operations)
            result = None
        self.pipeline.touch(core)
        batch.replies.append((command.replier, command.request_id, result))

    # --- listeners -------------------------------------------------------------------------
    def _subscribe(self, command: c.Subscribe, now_ms: int) -> None:
        self.listeners.subscribe(self._core(command.queue), command)

    def _credit(self, command: c.Credit, now_ms: int) -> None:
        self.listeners.credit(command)

    def _unsubscribe(self, command: c.Unsubscribe, now_ms: int) -> None:
        self.listeners.unsubscribe(command)

    def _status(self, command: c.MessageStatus, now_ms: int) -> None:
        self.listeners.wait_for_status(self._core(command.queue), command)

    # --- the node's own ----------------------------------------------------------------------
    def _peer_message(self, command: c.PeerMessage, now_ms: int) -> None:
        self.pairs.on_peer_message(command.peer, command.data, self.monotonic_ms())

    def _link_change(self, command: c.LinkChange, now_ms: int) -> None:
        self.pairs.on_link_change(command.peer, command.up, self.monotonic_ms(), going_away=command.going_away)

    def _invoke(self, command: c.Invoke, now_ms: int) -> None:
        command.action(now_ms)

