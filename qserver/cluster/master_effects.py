"""What a master role asks for, performed on the node: the requests its replica relayed run in
the core, its replica recorded in or out of sync in the map, then answers and messages out.

Separate from the pair driver for the same reason as `replica_effects.py`: the driver decides
which role a queue has and when it runs; this module carries out a master role's requests
(docs/PROTOCOL.md, "Replica out of sync: `min_in_sync`").
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from qserver.cluster.holds import HeldAnswers
from qserver.cluster.proposals import MapProposals
from qserver.cluster.replica_effects import RoleOutput
from qserver.cluster.view import ClusterView
from qserver.core.ports import PairEvents, Scheduler
from replication.cluster_map import ChangePair, Outcome, Reason
from replication.master import InSyncProposal, MasterRole

log = logging.getLogger("qserver.cluster.pairs")


class MasterEffects:
    def __init__(self, output: RoleOutput, masters: Mapping[str, MasterRole], *, view: ClusterView,
                 proposals: MapProposals, holds: HeldAnswers, scheduler: Scheduler, events: PairEvents) -> None:
        self.output = output
        self.masters = masters          # the pair driver's: queue name -> master role
        self.view = view
        self.proposals = proposals
        self.holds = holds
        self.scheduler = scheduler
        self.events = events

    def drain(self, role: MasterRole) -> None:
        """Carry out what the role asked for in its last step, then answer and send."""
        forwarded, role.relayed = role.relayed, []
        for request in forwarded:
            self.events.run_relayed(role, request)
        for proposal in role.proposals:
            self._propose_in_sync(role, proposal)
        role.proposals.clear()
        # Answers first: a commit point that moved on an AppendAck is what the clients wait
        # for; the replica's notice of it (in the outbox) only widens what it may expose.
        self.output.release_committed(role.core.name)
        self.output.flush(role)

    def _propose_in_sync(self, role: MasterRole, proposal: InSyncProposal) -> None:
        """Record the replica in (or out of) sync: a compare-and-set on the map; until the
        outcome is known the role holds acknowledgements (see MasterRole.commit_order)."""
        if self.view.membership is None:
            return
        name = role.core.name
        if role.core.record.dead_letter_of is not None:
            # A dead-letter queue shares its queue's map entry: that queue's role proposes.
            entry = self.view.entry(name)
            role.membership_decided(entry.in_sync if entry is not None else role.recorded_in_sync)
            return
        node_id = self.view.node_id
        change = ChangePair(name, (proposal.epoch, node_id, proposal.replica, proposal.expected_in_sync),
                            (proposal.epoch, node_id, proposal.replica, proposal.in_sync), Reason.IN_SYNC.value)

        def decided(outcomes: list[Outcome] | None) -> None:
            def settle(now_ms: int) -> None:
                if self.masters.get(name) is not role:
                    return
                entry = self.view.entry(name)
                applied = bool(outcomes) and outcomes[0].applied    # type: ignore[index]
                recorded = proposal.in_sync if applied else (entry.in_sync if entry is not None
                                                              and entry.epoch == role.epoch else role.recorded_in_sync)
                role.membership_decided(recorded)
                log.info("queue %s: replica %s recorded %s%s", name, proposal.replica,
                         "in sync" if recorded else "out of sync", "" if applied else " (proposal not applied)")
                if not recorded and role.core.options.min_in_sync >= 2:
                    self.holds.refuse_unreplicated_writes(role)
                self.drain(role)
            self.scheduler.invoke(settle)
        self.proposals.propose_in_sync(change, decided)
