"""A payload is stored once (issue 11): an enqueue's op-log entry carries it, its message row
names the entry, and the entry outlives the log's floor while it holds a live payload, up to
`payload_hold_bytes` per queue; past that, live payloads move into their rows before the
entry goes. Pinned on the LMDB storage alone: every read path (a lease's payload, a client
read, a dead letter, a snapshot) gets the bytes back, nothing below the log start is served,
and after every message is acknowledged nothing of the kept records is left."""
from __future__ import annotations

from pathlib import Path

import msgpack

from qserver.storage.lmdb_store import SealedBatch, Storage
from replication.messages import encode_entry
from replication.operations import Acked, DeadLettered, Enqueued, Operation
from replication.options import QueueOptions
from replication.queue_core import QueueRecord
from replication.snapshot import ROW_MESSAGE

QUEUE_ID, DEAD_ID = 1, 2
AT_MS = 1_700_000_000_000


def payload(index: int) -> bytes:
    return f"message {index} ".encode() * 20


def enqueues(first: int, last: int, queue_id: int = QUEUE_ID) -> list[Operation]:
    return [Enqueued(queue_id, index, 4, AT_MS, f"d{index}", "c", payload(index)) for index in range(first, last + 1)]


def entry_batch(*runs: tuple[int, int], floor: int | None = None) -> SealedBatch:
    """Enqueues of `runs` (first, last), one log entry each, as a master's batch."""
    batch = SealedBatch(queue_records={"q": QueueRecord(QUEUE_ID, "q", QueueOptions(), AT_MS).to_json()})
    for first, last in runs:
        ops = enqueues(first, last)
        batch.operations += ops
        batch.oplog_rows.append((QUEUE_ID, first, last, bytes([last % 256]) * 16, encode_entry(ops)))
    if floor is not None:
        batch.log_floors = {QUEUE_ID: floor}
    return batch


def acks(first: int, last: int, floor: int | None = None) -> SealedBatch:
    batch = SealedBatch(operations=[Acked(QUEUE_ID, index, 4, "c", AT_MS, False) for index in range(first, last + 1)])
    if floor is not None:
        batch.log_floors = {QUEUE_ID: floor}
    return batch


def stored_rows(storage: Storage) -> dict[int, list[object]]:
    with storage.env.begin(db=storage.db["messages"]) as txn:
        return {int.from_bytes(key[8:], "big"): msgpack.unpackb(value) for key, value in txn.cursor()}


def log_records(storage: Storage) -> list[int]:
    """Orders of the op-log records stored for the queue (the log-start record left out)."""
    with storage.env.begin(db=storage.db["oplog"]) as txn:
        return [int.from_bytes(key[8:], "big") for key, _ in txn.cursor() if int.from_bytes(key[8:], "big") > 0]


def read_payload(storage: Storage, queue_id: int, index: int) -> bytes | None:
    storage.begin_read()
    try:
        return storage.read_client_payload(queue_id, index)
    finally:
        storage.end_read()


def test_a_row_names_the_entry_that_holds_its_payload_and_every_read_gets_the_bytes(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        storage.commit(entry_batch((1, 10), (11, 12)))
        rows = stored_rows(storage)
        assert [row[4] for row in rows.values()] == [10] * 10 + [12] * 2       # no second copy
        # a lease in the same batch as its enqueue, and one in a later batch
        batch = entry_batch((13, 13))
        batch.payload_reads = [(QUEUE_ID, 13), (QUEUE_ID, 3), (QUEUE_ID, 12)]
        assert storage.commit(batch).payloads == [payload(13), payload(3), payload(12)]
        assert read_payload(storage, QUEUE_ID, 7) == payload(7)
        # a dead letter moves the bytes themselves into the dead-letter queue's row
        storage.commit(SealedBatch(operations=[DeadLettered(QUEUE_ID, 5, 4, 3, DEAD_ID, 1, AT_MS, False)]))
        assert read_payload(storage, DEAD_ID, 1) == payload(5) and read_payload(storage, QUEUE_ID, 5) is None
        # a snapshot of the queue carries the bytes
        view = storage.open_snapshot("q", QUEUE_ID, consumption=True, after_index=0, dead_letter=None)
        assert view is not None
        try:
            sent = {row[1]: row[6] for row in view.next_rows(1 << 20) if row[0] == ROW_MESSAGE}
        finally:
            view.close()
        assert sent == {index: payload(index) for index in range(1, 14) if index != 5}
    finally:
        storage.close()


def test_an_entry_below_the_floor_stays_while_it_holds_a_live_payload_and_goes_once_none_is_left(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        storage.commit(entry_batch((1, 10), (11, 20), (21, 30)))
        storage.commit(acks(1, 10, floor=30))
        # 1..10 are acknowledged: their entry goes; 11..20 are live: theirs stays, below the log start
        assert log_records(storage) == [20, 30]
        storage.begin_read()
        try:
            assert storage.first(QUEUE_ID) == 30
            assert [last for _, last, _ in storage.read(QUEUE_ID, 0, 1000)] == [30]    # not served
            assert storage.digest_at(QUEUE_ID, 20) is None                              # nor compared
        finally:
            storage.end_read()
        assert read_payload(storage, QUEUE_ID, 15) == payload(15)
        storage.commit(acks(11, 19))
        assert log_records(storage) == [20, 30]                  # 20 is still live
        storage.commit(acks(20, 20))
        storage.commit(SealedBatch())                            # the next batch finds none left
        assert log_records(storage) == [30]
        assert storage.moved_payloads == 0                       # every payload was written once
    finally:
        storage.close()


def test_past_the_hold_live_payloads_move_into_their_rows_before_their_entry_goes(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1", payload_hold_bytes=0)
    try:
        storage.commit(entry_batch((1, 10), (11, 20), (21, 30)))
        storage.commit(acks(1, 5, floor=30))
        assert log_records(storage) == [30]
        rows = stored_rows(storage)
        assert sorted(rows) == list(range(6, 31)) and storage.moved_payloads == 15
        assert all(rows[index][4] == payload(index) for index in range(6, 21))   # the bytes, in the row
        assert all(rows[index][4] == 30 for index in range(21, 31))
        assert [read_payload(storage, QUEUE_ID, index) for index in (6, 20, 25)] == [payload(6), payload(20), payload(25)]
    finally:
        storage.close()


def test_a_restarted_node_counts_what_it_kept_and_lets_it_go_once_acknowledged(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    storage.commit(entry_batch((1, 10), (11, 20)))
    storage.commit(SealedBatch(log_floors={QUEUE_ID: 20}))
    assert log_records(storage) == [10, 20]
    storage.close()
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        assert read_payload(storage, QUEUE_ID, 4) == payload(4)
        storage.commit(acks(1, 20))
        storage.commit(entry_batch((21, 21), floor=21))
        assert log_records(storage) == [21] and stored_rows(storage).keys() == {21}
    finally:
        storage.close()


def test_a_backlog_past_half_the_hold_keeps_new_payloads_in_their_rows_and_moves_only_the_kept(tmp_path: Path) -> None:
    entry_bytes = len(encode_entry(enqueues(1, 10))) + 24
    storage = Storage(tmp_path / "lmdb", node_id="n1", payload_hold_bytes=entry_bytes + entry_bytes // 2)
    try:
        storage.commit(entry_batch((1, 10), (11, 20), floor=20))       # 1..10 kept: past half the hold
        storage.commit(entry_batch((21, 30), floor=30))                # 11..20 kept too: past the hold
        rows = stored_rows(storage)
        assert all(rows[index][4] == payload(index) for index in range(21, 31))   # a backlog: in the row
        assert all(rows[index][4] == payload(index) for index in range(1, 11))    # moved out of its entry
        assert all(rows[index][4] == 20 for index in range(11, 21))
        assert log_records(storage) == [20, 30] and storage.moved_payloads == 10
        storage.commit(acks(1, 30, floor=30))
        assert log_records(storage) == [30] and stored_rows(storage) == {}
    finally:
        storage.close()


def test_records_are_kept_one_by_one_and_a_backlog_keeps_its_payloads_in_its_rows(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1", payload_hold_bytes=1 << 20)
    try:
        storage.commit(entry_batch((1, 10), (11, 20), (21, 30), (31, 40)))
        storage.commit(acks(11, 20, floor=40))
        assert log_records(storage) == [10, 30, 40]             # the acknowledged one between goes
        storage.commit(acks(1, 10))
        assert log_records(storage) == [30, 40]
        # a queue with more ready bytes than half the hold is a backlog: its rows hold the bytes
        batch = entry_batch((41, 50))
        batch.queue_records["q"]["ready_count"] = 10_000
        storage.commit(batch)
        rows = stored_rows(storage)
        assert all(rows[index][4] == payload(index) for index in range(41, 51))
        assert all(rows[index][4] == 30 for index in range(21, 31))
    finally:
        storage.close()


def test_an_entry_of_one_enqueue_leaves_the_payload_in_its_row_and_goes_with_the_floor(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "lmdb", node_id="n1")
    try:
        storage.commit(entry_batch((1, 1), (2, 2), (3, 3), floor=3))
        assert all(row[4] == payload(index) for index, row in stored_rows(storage).items())
        assert log_records(storage) == [3]
    finally:
        storage.close()
