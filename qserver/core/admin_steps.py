"""The steps of the queue administration commands: create and delete a queue, put or remove a
client, purge. In a cluster the first three are map commands, proposed through the
coordinator and answered once the map applied them (docs/RAFT.md); purge goes in bounded steps
over several turns.

Separate from qserver/core/steps.py (the message traffic, where the hot path is) because these
change what exists rather than what a queue holds, and they wait on the map, not on a commit.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qserver.core import commands as c
from qserver.core.ports import Redirect
from qserver.core.registry import QueueRegistry
from replication.cluster_map import CreateQueue, DeleteQueue, choose_pair
from replication.cluster_map import PutClient as MapPutClient
from replication.invariants import InvariantViolation
from replication.options import (
    DEAD_LETTER_SUFFIX,
    QueueOptions,
    dead_letter_name,
    is_valid_queue_name,
    mismatched_options,
    options_from_json,
)
from wire.errors import (
    E_CLIENT_EXISTS,
    E_INVALID_NAME,
    E_INVALID_OPTION,
    E_MACRO_REFUSED,
    E_MASTER_EXISTS,
    E_NOT_MASTER,
    E_OPTIONS_MISMATCH,
    E_QUEUE_UNAVAILABLE,
    E_RESERVED_NAME,
    E_UNKNOWN_CLIENT,
    E_UNKNOWN_QUEUE,
    QueueError,
)

if TYPE_CHECKING:
    from qserver.core.steps import CommandSteps

PURGE_STEP_MAX = 5_000      # messages a purge takes out per engine turn (a few ms of work)


class AdminSteps:
    def __init__(self, steps: CommandSteps, submit: Callable[[c.Command], None],
                 continue_later: Callable[[c.Command], None]) -> None:
        self._steps = steps
        self._submit = submit
        self._continue_later = continue_later
        self._pending_creates: dict[str, list[tuple[Any, int]]] = {}   # queue -> (replier, request id)

    def steps(self) -> dict[type, Callable[[Any, int], None]]:
        return {c.CreateQueue: self._create, c.DeleteQueue: self._delete, c.PutClient: self._put_client,
                c.Purge: self._purge}

    @property
    def _registry(self) -> QueueRegistry:
        return self._steps.registry

    def _reply(self, replier: Any, request_id: int, result: Any) -> None:
        """Answered after the open batch commits."""
        self._steps.pipeline.open.replies.append((replier, request_id, result))

    # --- queues ----------------------------------------------------------------------------
    def _create(self, command: c.CreateQueue, now_ms: int) -> None:
        name = command.name
        if not is_valid_queue_name(name):
            raise QueueError(E_INVALID_NAME, "queue names are 1-196 of A-Z a-z 0-9 . _ : - starting alphanumeric")
        if name.endswith(DEAD_LETTER_SUFFIX):
            raise QueueError(E_RESERVED_NAME, f"names ending {DEAD_LETTER_SUFFIX} belong to dead-letter queues")
        registry, pairs = self._registry, self._steps.pairs
        existing = registry.cores.get(name)
        entry = pairs.view.entry(name)
        if existing is not None or entry is not None:
            if command.placement.get("master_required"):
                raise QueueError(E_MASTER_EXISTS, f"queue {name} already has a master")
            options = existing.options if existing is not None else options_from_json(entry.options)  # type: ignore[union-attr]
            different = mismatched_options(options, command.options)
            if different:
                raise QueueError(E_OPTIONS_MISMATCH, f"queue {name} exists with other {', '.join(different)}")
            if existing is None:
                pairs.refuse_if_not_master(name)
                raise QueueError(E_QUEUE_UNAVAILABLE, f"queue {name} is being created; retry")
            self._reply(command.replier, command.request_id, {"created": False, **registry.describe(existing)})
            return
        options = QueueOptions(**command.options)
        if self._steps.gate is not None:
            self._propose_create(command, options)
            return
        core = registry.create_queue(name, options, now_ms)
        self._reply(command.replier, command.request_id, {"created": True, **registry.describe(core)})

    def _propose_create(self, command: c.CreateQueue, options: QueueOptions) -> None:
        """In a cluster a queue exists once the map says so: place it (seed 004 `master` and
        `replica` options, else spread evenly), and the master proposes it. A node that is
        not the chosen master passes the request on (E_NOT_MASTER with the node to ask)."""
        steps = self._steps
        cluster = steps.pairs.view.cluster_map
        if command.name in cluster.macros:
            raise QueueError(E_MACRO_REFUSED, f"{command.name} is a macro queue")
        preferred = steps.config.placement.get(command.name, [None, None])
        wanted = (command.placement.get("master", preferred[0]), command.placement.get("replica", preferred[1]))
        pair = choose_pair(cluster, wanted)
        if pair is None:
            unknown = [node for node in wanted if node and node not in cluster.nodes]
            raise QueueError(E_INVALID_OPTION if unknown else E_QUEUE_UNAVAILABLE,
                             f"no node {unknown[0]} in the cluster" if unknown else
                             f"no two live nodes for {command.name} (asked {wanted[0] or 'any'} / {wanted[1] or 'any'})")
        master, replica = pair
        if master != steps.config.node_id:
            raise Redirect(master, f"queue {command.name} is created by its master {master}", (master, replica))
        gate = steps.gate
        if gate is None:
            raise InvariantViolation(f"queue {command.name} was placed without a membership layer")
        self._pending_creates.setdefault(command.name, []).append((command.replier, command.request_id))
        if len(self._pending_creates[command.name]) > 1:
            return
        create = CreateQueue(command.name, options.to_json(), master, replica, steps.rng.getrandbits(62) | 1)

        def decided(outcomes: Any) -> None:
            waiting = self._pending_creates.pop(command.name, [])
            if isinstance(outcomes, QueueError) or not outcomes[0].applied:
                for replier, request_id in waiting:       # lost a race: it exists now, or try again
                    self._submit(c.CreateQueue(command.name, command.options, {}, replier, request_id))
                return
            registry = self._registry
            registry.created_waiting.setdefault(command.name, []).extend(waiting)
            registry.answer_created(command.name)
        gate.propose_checked(create, decided, lambda outcomes: outcomes)

    def _delete(self, command: c.DeleteQueue, now_ms: int) -> None:
        registry, pairs, gate = self._registry, self._steps.pairs, self._steps.gate
        core = registry.core(command.name)
        if core.record.dead_letter_of is not None:
            raise QueueError(E_RESERVED_NAME, f"{command.name} goes with queue {core.record.dead_letter_of}")
        if gate is not None:
            if command.name not in pairs.masters:
                raise QueueError(E_NOT_MASTER, f"queue {command.name} is deleted by its master "
                                               f"{pairs.masters_hint(command.name)}")
            incarnation = core.record.incarnation or core.queue_id

            def deleted(outcomes: Any) -> None:
                if isinstance(outcomes, QueueError):
                    command.replier.fail(command.request_id, outcomes)
                elif not outcomes[0].applied:
                    command.replier.fail(command.request_id, QueueError(E_UNKNOWN_QUEUE, outcomes[0].reason))
                else:
                    self._reply(command.replier, command.request_id, {"deleted": command.name})
            gate.propose_checked(DeleteQueue(command.name, incarnation), deleted, lambda o: o)
            return
        for victim in filter(None, (core, registry.cores.get(dead_letter_name(core.name)))):
            registry.drop_instance(victim)
        self._reply(command.replier, command.request_id, {"deleted": command.name})

    def _purge(self, command: c.Purge, now_ms: int) -> None:
        """One bounded step of an operator's purge (PURGE_STEP_MAX messages); the rest goes on
        in the engine's next turn, after this batch is on its way to disk, so purging millions
        never holds the loop or grows one batch without bound."""
        core = self._registry.core(command.queue)
        if not command.upto:
            command.upto = core.record.next_index - 1
        pipeline = self._steps.pipeline
        purged, done = core.purge(command.upto, PURGE_STEP_MAX, now_ms, pipeline.open.sealed.operations)
        command.purged += purged
        if purged:
            pipeline.touch(core)
        if done:
            self._reply(command.replier, command.request_id,
                        {"queue": command.queue, "purged": command.purged, "upto": command.upto})
        else:
            asyncio.get_running_loop().call_soon(self._continue_later, command)

    # --- clients ---------------------------------------------------------------------------
    def _put_client(self, command: c.PutClient, now_ms: int) -> None:
        registry, gate = self._registry, self._steps.gate
        clients = registry.clients
        if command.record is None and command.client_id not in clients:
            raise QueueError(E_UNKNOWN_CLIENT, f"no client {command.client_id}")
        name = None if command.record is None else command.record.get("name")
        if name is not None and any(other != command.client_id and record.get("name") == name
                                    for other, record in clients.items()):
            # Checked again here, in the engine's one thread: the handler's check and this step
            # are apart by an await, and two registrations of one name both passed it (issue 32).
            raise QueueError(E_CLIENT_EXISTS, f"a client named {name} exists")
        if gate is not None:
            # The registry is part of the cluster map: every node stores what the map applies.
            def decided(outcomes: Any) -> None:
                if isinstance(outcomes, QueueError):
                    command.replier.fail(command.request_id, outcomes)
                    return
                if outcomes and not outcomes[0].applied:
                    # The map refused it: a registration of the name through another node was
                    # applied first (cluster_map.py, PutClient).
                    command.replier.fail(command.request_id, QueueError(E_CLIENT_EXISTS, outcomes[0].reason))
                    return
                self._registry.store_client(command.client_id, command.record)
                self._reply(command.replier, command.request_id, command.record)
            gate.propose_checked(MapPutClient(command.client_id, command.record), decided, lambda o: o)
            return
        registry.store_client(command.client_id, command.record)
        self._reply(command.replier, command.request_id, command.record)
