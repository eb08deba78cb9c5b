"""The leader's side of Raft log replication (docs/RAFT.md "Replication", "Snapshots").

A leader keeps a `Progress` per follower and sends it a probe until they agree on a point of
the log, then a bounded pipeline of appends (or the snapshot, when the follower is behind the
log's start); heartbeats carry the commit index; answers move each follower's match index and,
by counting only the disks the configuration names, the commit index. Apart from elections
and the follower's side (replication/raft.py), which only start this (`_become_leader`) and
feed it (`_append_as_leader`, `_on_configuration_changed`).
"""
from __future__ import annotations

from replication.invariants import InvariantViolation
from replication.raft_contract import Refusal
from replication.raft_messages import (
    ENTRY_OVERHEAD_BYTES,
    AppendRequest,
    AppendResponse,
    Entry,
    EntryKind,
    SnapshotRequest,
)
from replication.raft_progress import Progress, ProgressState
from replication.raft_state import RaftState, Role


class LeaderReplication(RaftState):
    """The leader's side of log replication: what a leader appends, what it sends each
    follower (a probe, a pipeline of appends, a snapshot, a heartbeat), what their answers
    tell it, and how the commit index moves."""

    # --- messages: the leader -----------------------------------------------------------------
    def _on_rival_leader(self, message: AppendRequest | SnapshotRequest) -> None:
        raise InvariantViolation(f"{self._node_id} leads term {self._term} and so does {message.sender}")

    def _on_append_response(self, message: AppendResponse) -> None:
        progress = self._progress.get(message.sender)
        if progress is None:
            self.stale_messages_ignored += 1          # no longer a member
            return
        if message.sender_storage_id != progress.storage_id:
            # Another disk answers for this node: nothing the old one acknowledged stands.
            self._reset_progress(progress, message.sender_storage_id)
        progress.heard_tick = self._tick_count
        progress.lease_context = max(progress.lease_context, message.lease_context)
        if message.success:
            self._on_append_accepted(message.sender, progress, message.match_index)
        else:
            self._on_append_rejected(message.sender, progress, message)

    def _reset_progress(self, progress: Progress, storage_id: bytes) -> None:
        progress.move_to(ProgressState.PROBE)
        progress.storage_id = storage_id
        progress.match_index = 0
        progress.commit_sent = 0
        progress.lease_context = 0
        progress.next_index = self._log.last_index + 1

    def _on_append_accepted(self, node_id: str, progress: Progress, match_index: int) -> None:
        if match_index > self._log.last_index:
            self.bad_messages_ignored += 1
            return
        advanced = match_index > progress.match_index
        if advanced:
            progress.match_index = match_index
            progress.progress_tick = self._tick_count
        if progress.state is ProgressState.REPLICATE:
            progress.in_flight = [last for last in progress.in_flight if last > match_index]
            progress.next_index = max(progress.next_index, match_index + 1)
        elif progress.state is ProgressState.PROBE or progress.match_index >= progress.snapshot_index:
            progress.move_to(ProgressState.REPLICATE)
            progress.next_index = progress.match_index + 1
            progress.progress_tick = self._tick_count
        if advanced:
            committed = self._commit
            self._advance_commit()
            if self._commit > committed and self._role is Role.LEADER:
                for other_id, other in self._progress.items():
                    if other_id != node_id:
                        self._tell_commit(other_id, other)
        if self._role is Role.LEADER:
            self._replicate(node_id, progress)
            self._tell_commit(node_id, progress)

    def _tell_commit(self, node_id: str, progress: Progress) -> None:
        """Send a follower in step the commit index it can take now (as etcd's bcastAppend
        does), not at the next heartbeat: a map change should reach every node's copy within
        a round trip, or a node asked right after a handoff still names the old master. The
        append goes after the follower's match index, which it holds, so it is never refused;
        a follower takes the commit index only up to what the append vouches for."""
        if progress.state is ProgressState.REPLICATE and progress.match_index >= self._log.snapshot.index \
                and min(self._commit, progress.match_index) > progress.commit_sent:
            self._send_append(node_id, progress.match_index, ())
            progress.last_sent_tick = self._tick_count

    def _on_append_rejected(self, node_id: str, progress: Progress, message: AppendResponse) -> None:
        if progress.state is ProgressState.REPLICATE:
            if message.rejected_index <= progress.match_index:
                self.stale_messages_ignored += 1
                return
            progress.move_to(ProgressState.PROBE)
        elif progress.state is ProgressState.PROBE:
            if message.rejected_index != progress.next_index - 1:
                self.stale_messages_ignored += 1
                return
        else:
            return                                  # the snapshot's answer decides
        agreed_index, _ = self._log.last_at_or_below(message.hint_index, message.hint_term)
        progress.next_index = max(progress.match_index + 1, min(message.rejected_index, agreed_index + 1))
        self._send_probe(node_id, progress)

    def _advance_commit(self) -> None:
        """Commit the highest index a majority of counted voters hold, if it is of our term."""
        configuration = self._log.configuration
        matches = []
        for member in configuration.voters:
            if member.node_id == self._node_id:
                matches.append(self._log.last_index if member.storage_id == self._storage_id else 0)
                continue
            progress = self._progress.get(member.node_id)
            counted = progress is not None and progress.storage_id == member.storage_id
            matches.append(progress.match_index if counted and progress is not None else 0)
        matches.sort(reverse=True)
        candidate = matches[configuration.quorum - 1]
        if candidate <= self._commit or self._log.term_at(candidate) != self._term:
            return
        self._commit = candidate
        if not configuration.is_voter(self._node_id, self._storage_id) and self._commit >= self._log.configuration_index:
            self._step_down()         # our removal is committed: let the others elect a leader

    # --- replication --------------------------------------------------------------------------
    def _refusal_to_append(self, size_bytes: int) -> Refusal | None:
        if self._role is not Role.LEADER:
            return Refusal.NOT_LEADER
        if size_bytes + ENTRY_OVERHEAD_BYTES > self._limits.append_bytes_max:
            return Refusal.TOO_LARGE
        if self._log.last_index - self._commit >= self._limits.uncommitted_entries_max:
            return Refusal.TOO_MANY_UNCOMMITTED
        return None

    def _refusal_to_promote(self, node_id: str) -> Refusal | None:
        progress = self._progress.get(node_id)
        configuration = self._log.configuration
        if progress is None or progress.storage_id != configuration.storage_id_of(node_id):
            return Refusal.LEARNER_BEHIND
        if progress.match_index + self._limits.learner_lag_max_entries < self._commit:
            return Refusal.LEARNER_BEHIND
        return None

    def _append_as_leader(self, entry: Entry) -> None:
        self._log.append(entry)
        if entry.kind is EntryKind.CONFIGURATION:
            self._on_configuration_changed()
        self._replication_pending = True
        self._advance_commit()     # a single voter commits alone

    def _on_configuration_changed(self) -> None:
        if self._role is Role.LEADER:
            self._sync_progress_with_configuration()

    def _sync_progress_with_configuration(self) -> None:
        configuration = self._log.configuration
        # Sorted, never a set's order: the order messages leave in must not depend on hashing.
        members = [node_id for node_id in configuration.node_ids() if node_id != self._node_id]
        for node_id in list(self._progress):
            if not configuration.is_member(node_id):
                del self._progress[node_id]
        for node_id in members:
            if node_id not in self._progress:
                storage_id = configuration.storage_id_of(node_id) or b""
                self._progress[node_id] = Progress(storage_id=storage_id, next_index=self._log.last_index + 1,
                                                   progress_tick=self._tick_count, heard_tick=self._tick_count)

    def _replicate_to_all(self) -> None:
        for node_id, progress in self._progress.items():
            self._replicate(node_id, progress)

    def _replicate(self, node_id: str, progress: Progress) -> None:
        if progress.state is ProgressState.REPLICATE:
            self._send_pipelined(node_id, progress)
        elif progress.state is ProgressState.PROBE and not progress.probe_outstanding:
            self._send_probe(node_id, progress)

    def _heartbeat(self, node_id: str, progress: Progress) -> None:
        """Every heartbeat interval each follower hears from us: a probe or a snapshot sent
        again when its answer is overdue, or an empty append that carries the commit index."""
        overdue = self._tick_count - progress.sent_tick >= self._limits.resend_after_ticks
        if progress.state is ProgressState.PROBE and (not progress.probe_outstanding or overdue):
            self._send_probe(node_id, progress)
        elif progress.state is ProgressState.SNAPSHOT and overdue:
            self._send_snapshot(node_id, progress)
        elif (progress.state is ProgressState.REPLICATE and progress.in_flight
              and self._tick_count - progress.progress_tick >= self._limits.resend_after_ticks):
            progress.move_to(ProgressState.PROBE)     # the pipeline stalled: something was lost
            progress.next_index = progress.match_index + 1
            self._send_probe(node_id, progress)
        elif self._tick_count - progress.last_sent_tick >= self._limits.heartbeat_interval_ticks:
            previous_index = max(progress.match_index, self._log.snapshot.index)
            self._send_append(node_id, previous_index, ())
            progress.last_sent_tick = self._tick_count

    def _send_probe(self, node_id: str, progress: Progress) -> None:
        if progress.next_index <= self._log.snapshot.index:
            self._send_snapshot(node_id, progress)
            return
        entries = self._log.entries_for_append(progress.next_index, self._limits.append_entries_max,
                                               self._limits.append_bytes_max)
        self._send_append(node_id, progress.next_index - 1, entries)
        progress.probe_outstanding = True
        progress.sent_tick = progress.last_sent_tick = self._tick_count

    def _send_pipelined(self, node_id: str, progress: Progress) -> None:
        limits = self._limits
        while len(progress.in_flight) < limits.in_flight_appends_max and progress.next_index <= self._log.last_index:
            if progress.next_index <= self._log.snapshot.index:
                self._send_snapshot(node_id, progress)
                return
            entries = self._log.entries_for_append(progress.next_index, limits.append_entries_max,
                                                   limits.append_bytes_max)
            if not progress.in_flight:
                progress.progress_tick = self._tick_count
            self._send_append(node_id, progress.next_index - 1, entries)
            progress.in_flight.append(entries[-1].index)
            progress.next_index = entries[-1].index + 1
            progress.last_sent_tick = self._tick_count

    def _send_append(self, node_id: str, previous_index: int, entries: tuple[Entry, ...]) -> None:
        previous_term = self._log.term_at(previous_index)
        if previous_term is None:
            raise InvariantViolation(f"no term for index {previous_index} to send after")
        progress = self._progress.get(node_id)
        if progress is not None:
            progress.commit_sent = max(progress.commit_sent, min(self._commit, previous_index + len(entries)))
        self._send(AppendRequest(self._term, self._node_id, node_id, self._storage_id,
                                 previous_index, previous_term, entries, self._commit, self._tick_count))

    def _send_snapshot(self, node_id: str, progress: Progress) -> None:
        snapshot = self._log.snapshot
        if progress.state is not ProgressState.SNAPSHOT:
            progress.move_to(ProgressState.SNAPSHOT)
        progress.snapshot_index = snapshot.index
        progress.sent_tick = progress.last_sent_tick = self._tick_count
        self._send(SnapshotRequest(self._term, self._node_id, node_id, self._storage_id, snapshot))
