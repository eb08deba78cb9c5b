"""The op log holds entries (runs of operations), not one record per operation.

A frame of enqueues that the master decides in one step is one log entry: encoded, digested,
streamed and stored once on each member. Entries split at ENTRY_OPERATIONS_MAX operations or
ENTRY_BYTES_MAX payload bytes, an Append stays within APPEND_BYTES_MAX after its first entry,
the LMDB log serves whole entries from any entry boundary, and a replica refuses an entry that
straddles what it applied (both members' entries are the same by construction)."""
from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.digest import EMPTY_DIGEST, fold
from replication.invariants import InvariantViolation, history_disagreements
from replication.master import APPEND_BYTES_MAX, MasterRole
from replication.messages import (
    Append,
    AppendAck,
    MessageError,
    Open,
    decode_entry,
    decode_message,
    encode_entry,
    encode_message,
)
from replication.operations import Operation
from replication.oplog import ENTRY_BYTES_MAX, ENTRY_OPERATIONS_MAX, runs
from replication.options import Strength
from replication.replica import ReplicaRole
from tests.test_snapshot import LIMITS, Member


def decided(member: Member, count: int, size: int = 8) -> list[Operation]:
    ops: list[Operation] = []
    for _ in range(count):
        member.core.enqueue(bytes(size), 4, None, "c", 0, ops)
    member.store.apply(ops)
    return ops


def pair() -> tuple[Member, MasterRole, Member, ReplicaRole]:
    source = Member(1, Strength.FULL)
    master = MasterRole(source.core, source.oplog, node_id="n1", replica_id="n2", epoch=1, incarnation=1,
                        recorded_in_sync=True, last_order=0, digest=EMPTY_DIGEST, limits=LIMITS, snapshots=source)
    target = Member(7, Strength.FULL)
    replica = ReplicaRole(target.core, target.oplog, node_id="n2", master_id="n1", epoch=1, incarnation=1,
                          applied_order=0, digest=EMPTY_DIGEST, last_epoch=1, limits=LIMITS)
    replica.start(0)
    master.receive(replica.outbox.pop()[1], 1)       # Open at 0: it follows from the start
    for _, message in master.outbox:
        replica.receive(decode_message(encode_message(message)), 2)
    master.outbox.clear()
    for _, message in replica.outbox:
        master.receive(message, 2)
    replica.outbox.clear()
    return source, master, target, replica


def test_a_frame_of_100_enqueues_is_one_entry_streamed_and_applied_once() -> None:
    source, master, target, replica = pair()
    ops = decided(source, 100)
    master.replicate(ops, 3)
    [entry] = master.to_log
    assert (entry.first, entry.last, len(entry.ops)) == (1, 100, 100)
    assert master.digest == fold(EMPTY_DIGEST, *ops), "one fold over the whole entry"
    [(_, append)] = master.outbox
    assert isinstance(append, Append) and append.entries == (entry.encoded,)
    replica.receive(decode_message(encode_message(append)), 4)
    [applied] = replica.applied
    assert (applied.first, applied.last, applied.digest, applied.encoded) == (1, 100, entry.digest, entry.encoded)
    assert replica.applied_order == 100 and target.core.record.next_index == 101
    assert [op.queue_id for op in applied.ops] == [7] * 100, "the replica's own storage id"


def test_entries_split_at_their_operation_and_byte_limits() -> None:
    member = Member(1, Strength.FULL)
    many = decided(member, ENTRY_OPERATIONS_MAX + 1)
    assert [len(run) for run in runs(many)] == [ENTRY_OPERATIONS_MAX, 1]
    big = decided(member, 3, size=ENTRY_BYTES_MAX // 2)
    assert [len(run) for run in runs(big)] == [2, 1]
    assert runs([]) == []


def test_an_append_holds_one_entry_at_least_and_stays_within_its_byte_bound() -> None:
    source, master, _, _ = pair()
    master.link_down()          # nothing streams until the replica opens again
    for _ in range(6):
        master.replicate(decided(source, 2, size=ENTRY_BYTES_MAX // 2), 3)   # one entry of ~512 KiB each
    master.outbox.clear()
    master.receive(Open(source.core.name, 1, 1, 1, 0, EMPTY_DIGEST, session=9), 4)
    appends = [m for _, m in master.outbox if isinstance(m, Append) and m.entries]
    assert appends and all(len(a.entries) >= 1 for a in appends)
    for append in appends:
        assert sum(len(e) for e in append.entries[:-1]) < APPEND_BYTES_MAX


def test_a_replica_refuses_an_entry_that_straddles_what_it_applied() -> None:
    source, master, target, replica = pair()
    ops = decided(source, 4)
    master.replicate(ops[:2], 3)
    [(_, first)] = master.outbox
    replica.receive(first, 4)
    assert replica.applied_order == 2
    other = Append(source.core.name, 1, 1, 2, (encode_entry(ops[1:]),), 0)   # 2..4: other bounds
    with pytest.raises(InvariantViolation, match="straddles"):
        replica.receive(other, 5)


def test_a_malformed_entry_is_never_applied_and_the_master_is_asked_to_stream_again() -> None:
    source, master, target, replica = pair()
    before = (replica.applied_order, replica.digest, target.core.record.next_index)
    for garbage in (b"\xc1", b"\x90", b"\x91\x92\x01\x02"):
        replica.receive(Append(source.core.name, 1, 1, 0, (garbage,), 0), 3)
    assert (replica.applied_order, replica.digest, target.core.record.next_index) == before
    assert not replica.applied
    [(_, ack)] = replica.outbox                     # one gap report for the position, not three
    assert isinstance(ack, AppendAck) and ack.gap and ack.durable_order == 0
    replica.outbox.clear()
    master.receive(ack, 4)
    ops = decided(source, 2)
    master.replicate(ops, 5)
    for _, message in master.outbox:
        replica.receive(decode_message(encode_message(message)), 6)
    assert replica.applied_order == 2, "the stream goes on"


def test_the_lmdb_log_serves_whole_entries_from_any_entry_boundary(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        entries = [(1, 100), (101, 101), (102, 250)]
        batch = SealedBatch(oplog_rows=[(5, first, last, bytes([last % 256]) * 16, f"e{last}".encode())
                                        for first, last in entries])
        storage.commit(batch)
        storage.begin_read()
        assert storage.read(5, 0, 1) == [(1, 100, b"e100")]
        assert storage.read(5, 100, 10**6) == [(101, 101, b"e101"), (102, 250, b"e250")]
        assert storage.read(5, 0, 10**6, bytes_max=1) == [(1, 100, b"e100")], "one entry at least"
        assert storage.digest_at(5, 101) == bytes([101]) * 16
        assert storage.digest_at(5, 150) is None, "no digest inside an entry"
        assert storage.last(5) == (250, bytes([250]) * 16)
    finally:
        storage.close()


def test_members_whose_entries_differ_in_bounds_disagree() -> None:
    same = [(1, 2, b"a"), (3, 3, b"b")]
    assert history_disagreements(same, same) == []
    assert history_disagreements([(1, 3, b"ab")], same) == [3]
    assert history_disagreements([(1, 2, b"a"), (3, 3, b"c")], same) == [3]


@pytest.mark.parametrize("row", [[[1], 1], [1, "q", 1, 4, 0, None, "c", b"x"], [1.5], [True, 1]],
                         ids=["tag-a-list", "field-of-another-type", "tag-a-float", "tag-a-bool"])
def test_a_log_entry_row_of_the_wrong_shape_is_a_message_error_not_a_type_error(row: list[object]) -> None:
    """Found by the coverage-guided fuzzer (tests/fuzz_targets.py log_entry): a list as the tag
    raised TypeError (unhashable), which on a replica would have stopped the node."""
    with pytest.raises(MessageError):
        decode_entry(msgpack.packb([row], use_bin_type=True))


def test_a_dead_letter_queue_whose_dead_letters_ran_ahead_of_its_own_stream_takes_both_again() -> None:
    """Under `full` a dead-letter queue's indexes come from its own stream and from its
    queue's (each dead letter's index). A member that followed the queue's stream while the
    dead-letter queue's was not open yet has placed dead letters past indexes its own stream
    still holds (a chaos run, seed 41: "ordering index 5 below 19", the node crash-looping).
    It asks for both states from one snapshot of its queue instead of stopping the node."""
    source, master, target, replica = pair()
    target.core.record.dead_letter_of = "orders"
    target.core.accept_dead_letter(4, 0, index=18)       # placed through its queue's stream
    assert target.core.record.next_index == 19
    master.replicate(decided(source, 5), 3)              # its own stream: orders 1..5
    [(_, append)] = master.outbox
    replica.receive(decode_message(encode_message(append)), 4)
    assert replica.resync_source and replica.dead_letter_resyncs == 1
    assert replica.applied_order == 0 and not replica.applied, "nothing of the stream was applied"
    assert target.core.record.next_index == 19


def test_a_replica_whose_node_says_it_stops_is_recorded_out_of_sync_at_once() -> None:
    # A broken link waits out replica_lag_max_ms of silence (a redial may mend it); a replica
    # whose node closed the link going away (an orderly stop: the last step of a drain in a
    # rolling upgrade) is recorded out of sync now, so writes that need it pause for one map
    # commit instead of the lag bound (docs/OPERATIONS.md, "Rolling upgrade").
    _, master, _, _ = pair()
    master.link_down()
    master.tick(LIMITS.replica_lag_max_ms // 2)
    assert not master.proposals, "a broken link alone proposes nothing before the lag bound"
    _, master, _, _ = pair()
    master.link_down(going_away=True)
    assert [(p.replica, p.in_sync) for p in master.proposals] == [("n2", False)]
