"""Which enqueues repeat an earlier one: producers' numbered streams (SEQUENCE_HEADER) and
dedupe ids.

A producer that numbers its messages (a forwarder, issue 16) is answered with the earlier
message's id when it sends a number again, however long between its retries; the numbers
live in the queue's record (`QueueRecord.sequences`). A dedupe id is kept for the queue's
dedupe window: committed ones are read from storage, those of enqueues not yet committed are
held here (`DedupeIds`). Apart from the queue core (replication/queue_core.py) because this is
bookkeeping the master that decides an enqueue and every member that applies it share: the
record and the ids, no heaps, leases or clocks.
"""
from __future__ import annotations

from collections.abc import Callable

from replication.options import producer_key
from replication.queue_record import QueueRecord
from replication.store import StoreReader
from wire.errors import E_INVALID_OPTION, E_OVERLOADED, QueueError

# A producer that sends an ordered stream (a forwarder: issue 16) names it and numbers its
# messages in these headers; the queue stores each number once, however long between retries.
SEQUENCE_KEY_HEADER, SEQUENCE_HEADER = "x-sequence-key", "x-sequence"
# A producer whose numbers do not arrive in order (a forwarder: its source's priorities, delays
# and redeliveries reorder them) declares its floor: every number below it is settled (stored,
# or never to be sent again). Without it a number is its own floor: an in-order stream.
SEQUENCE_FLOOR_HEADER = "x-sequence-floor"
SEQUENCE_KEYS_MAX = 1_000     # streams one queue keeps numbers of
SEQUENCE_KEYS_PER_PRODUCER_MAX = 100  # of them, one producing client's (a forward numbers one per priority and source incarnation)
SEQUENCE_WINDOW_MAX = 4_096   # numbers a stream keeps at or above its floor (beyond: E_OVERLOADED)
SEQUENCE_NUMBERS_PER_PRODUCER_MAX = 8_192   # ... all streams of one producer, once one holds SEQUENCE_STREAM_FEW
SEQUENCE_STREAM_FEW = 256


class DedupeIds:
    """The kept message (index, enqueued at) of each dedupe id (scoped by its producer:
    `producer_key`) for the dedupe window. Reads see committed state only, so the ids of
    enqueues not yet committed are held here: staged (in the batch being built), then sealed
    (in the batch being written) until it commits."""
    __slots__ = ("_reader", "_queue_id", "_window_ms", "_staged", "_sealed")

    def __init__(self, reader: StoreReader, queue_id: int, window_ms: int) -> None:
        self._reader = reader
        self._queue_id = queue_id
        self._window_ms = window_ms
        self._staged: dict[str, tuple[int, int]] = {}
        self._sealed: dict[str, tuple[int, int]] = {}

    def find(self, key: str, now_ms: int, stored: dict[str, tuple[int, int]] | None = None) -> int | None:
        """The kept message of this dedupe id; `stored`: the committed ids already read for
        a batch (StoreReader.dedupe_lookup_many, of `uncommitted_unknown`), else storage is asked."""
        hit = self._staged.get(key) or self._sealed.get(key)
        if hit is None:
            hit = stored.get(key) if stored is not None else self._reader.dedupe_lookup(self._queue_id, key)
        if hit is not None and now_ms - hit[1] <= self._window_ms:
            return hit[0]
        return None

    def uncommitted_unknown(self, keys: list[str | None]) -> list[str]:
        """The ids among `keys` that no enqueue waiting to commit holds: storage knows them, if anyone."""
        staged, sealed = self._staged, self._sealed
        return [k for k in keys if k is not None and k not in staged and k not in sealed]

    def stage(self, key: str, index: int, enqueued_ms: int) -> None:
        self._staged[key] = (index, enqueued_ms)

    def seal(self) -> None:
        """The staged batch is going to disk; its ids stay visible until committed."""
        self._sealed, self._staged = self._staged, {}

    def advance(self) -> None:
        """The sealed batch is committed: the reader sees it now."""
        self._sealed = {}

    def discard_after(self, order: int) -> None:
        """The enqueues past `order` were dropped (QueueCore.discard_after) before they committed."""
        for overlay in (self._staged, self._sealed):
            for key in [k for k, (index, _) in overlay.items() if index > order]:
                del overlay[key]


def sequence_repeat(record: QueueRecord, headers: dict[str, str], client: str) -> int | None:
    """The message id to answer with when the message's number is settled already (its own
    id when the stream still lists it, else the stream's latest), else None; refuses
    malformed numbers and a stream with no room. A stream is its producer's own (the key
    is scoped by the client id): another client naming the same key numbers another stream."""
    key, number, _ = _sequence_of(headers, client)
    stream = record.sequences.get(key)
    if stream is None:
        sequences = record.sequences
        if len(sequences) >= SEQUENCE_KEYS_MAX:
            raise QueueError(E_INVALID_OPTION, f"queue {record.name} keeps {SEQUENCE_KEYS_MAX} streams' numbers")
        prefix = producer_key(client, "")
        if sum(1 for other in sequences if other.startswith(prefix)) >= SEQUENCE_KEYS_PER_PRODUCER_MAX:
            raise QueueError(E_INVALID_OPTION, f"client {client} numbers {SEQUENCE_KEYS_PER_PRODUCER_MAX} streams "
                                               f"in queue {record.name} already")
        return None
    floor, stored = stream
    if number in stored:
        return stored[number]    # type: ignore[no-any-return]
    if number < floor:
        return max(stored.values(), default=0)
    if len(stored) >= SEQUENCE_WINDOW_MAX:
        raise QueueError(E_OVERLOADED, f"stream {key} of queue {record.name} holds {SEQUENCE_WINDOW_MAX} numbers "
                                       f"above its floor {floor}: retry once its producer's floor moves")
    # The numbers live in the queue's record, written with every batch: what one producer
    # keeps there is bounded over all its streams too (counted only once a stream holds
    # many: an in-order producer's stream holds one).
    if len(stored) >= SEQUENCE_STREAM_FEW and _numbers_held(record, client) >= SEQUENCE_NUMBERS_PER_PRODUCER_MAX:
        raise QueueError(E_OVERLOADED, f"client {client} holds {SEQUENCE_NUMBERS_PER_PRODUCER_MAX} numbers above "
                                       f"its streams' floors in queue {record.name}: retry once its floors move")
    return None


class StreamFences:
    """Nothing later in a stream is stored after one of its numbers was refused (issue 38): a
    producer that keeps several data messages in flight (a forwarder's pipeline) sends numbers
    beyond one the queue is refusing at this moment (its window full, the queue at max_depth),
    and those must wait for it. The master that decides enqueues keeps, per stream, the lowest
    number it refused; a later number is refused too (E_OVERLOADED) until that one is stored or
    repeated, or the producer's declared floor passes it (the source no longer holds it). Kept
    on the deciding member only, in memory: a new master knows none, and a forwarder opens its
    session there again and sends what it holds, lowest first."""
    __slots__ = ("_refused",)

    def __init__(self) -> None:
        self._refused: dict[str, int] = {}

    def enqueue(self, record: QueueRecord, headers: dict[str, str], client: str,
                place: Callable[[], int]) -> tuple[int, bool]:
        """A numbered enqueue: (message id, whether it repeats a stored number)."""
        key, number, declared = _sequence_of(headers, client)
        fence = self._refused.get(key)
        if fence is not None and declared > fence:
            del self._refused[key]          # settled at the source: the stream goes on without it
            fence = None
        if fence is not None and number > fence:
            raise QueueError(E_OVERLOADED, f"stream {key} of queue {record.name}: number {fence} was refused, "
                                           "and nothing later in the stream is stored before it")
        try:
            earlier = sequence_repeat(record, headers, client)
            placed = earlier if earlier is not None else place()
        except QueueError:
            if fence is None and (key in record.sequences or len(self._refused) < SEQUENCE_KEYS_MAX):
                self._refused[key] = number
            elif fence is not None:
                self._refused[key] = min(fence, number)
            raise
        if fence == number:
            del self._refused[key]
        return placed, earlier is not None


def note_sequence(record: QueueRecord, headers: dict[str, str], client: str, index: int) -> None:
    """Record a stored number and raise the floor to what its producer declared (the
    master placing it and every member applying it do the same)."""
    key, number, declared = _sequence_of(headers, client)
    record.changed_streams.add(key)
    stream = record.sequences.setdefault(key, [0, {}])
    if declared > stream[0]:      # numbers below a raised floor are settled: forgotten
        stream[0] = declared
        stream[1] = {n: i for n, i in stream[1].items() if n >= declared}
    stream[1][number] = index


def forget_numbers_after(record: QueueRecord, order: int) -> None:
    """The messages past `order` were dropped (QueueCore.discard_after): a number one of them
    stored is not stored any more, and its producer, never answered, sends it again. The floor
    stays: it is the producer's word about numbers below it (a forwarder declares only what its
    source committed), not this queue's data."""
    for key, numbered in record.sequences.items():
        kept_numbers = {number: index for number, index in numbered[1].items() if index <= order}
        if len(kept_numbers) != len(numbered[1]):
            numbered[1] = kept_numbers
            record.changed_streams.add(key)


def _numbers_held(record: QueueRecord, client: str) -> int:
    prefix = producer_key(client, "")
    return sum(len(stream[1]) for key, stream in record.sequences.items() if key.startswith(prefix))


def _sequence_of(headers: dict[str, str], client: str) -> tuple[str, int, int]:
    """(stream key, scoped by its producer; number; declared floor) of a numbered message, or
    E_INVALID_OPTION."""
    key, raw = headers.get(SEQUENCE_KEY_HEADER), headers[SEQUENCE_HEADER]
    raw_floor = headers.get(SEQUENCE_FLOOR_HEADER, raw)
    if not key or not _is_number(raw) or not _is_number(raw_floor) or int(raw_floor) > int(raw):
        raise QueueError(E_INVALID_OPTION, f"{SEQUENCE_HEADER} is a number from 1, with {SEQUENCE_KEY_HEADER} "
                                           f"naming the stream (and {SEQUENCE_FLOOR_HEADER}, if any, at most it)")
    return producer_key(client, key), int(raw), int(raw_floor)


def _is_number(raw: str) -> bool:
    return raw.isdigit() and 0 < len(raw) <= 18 and int(raw) >= 1
