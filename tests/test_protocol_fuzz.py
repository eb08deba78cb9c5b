"""The WebSocket frame codec under random input (wire/protocol.py, docs/PROTOCOL.md).

A client frame of garbage must cost the server nothing but a `FrameError`; a bad item in a
good frame fails only its own request; every item type survives a round trip. Hypothesis
runs derandomized and bounded so the suite stays fast and repeatable.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from wire import protocol
from wire.protocol import (
    INT64_MAX,
    PROTOCOL_VERSION,
    AckOp,
    ChannelMessage,
    Closing,
    CreditOp,
    DeliveredMessage,
    Delivery,
    EnqueueOp,
    ErrorReply,
    FrameError,
    OkReply,
    PingOp,
    ReceiveOp,
    ReleaseOp,
    SubscribeOp,
    UnsubscribeOp,
    decode_client_frame,
    decode_server_frame,
    encode_frame,
    messages_from_result,
)

BOUNDED = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- random msgpack-shaped values -----------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(
    scalars,
    lambda children: (st.lists(children, max_size=6)
                      | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=4)
                      | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))),
    max_leaves=30)
small_values = st.recursive(scalars, lambda children: st.lists(children, max_size=3), max_leaves=6)
# Items that look nearly right, so decoding gets past the first checks into every field.
tags = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 101, -1]) | scalars
request_ids = st.sampled_from([1, 7, INT64_MAX, 0, -1, INT64_MAX + 1]) | scalars
near_items = st.builds(lambda tag, request_id, rest: [tag, request_id, *rest], tags, request_ids,
                       st.lists(small_values, max_size=6))
versions = st.sampled_from([PROTOCOL_VERSION]) | scalars


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def decode_or_frame_error(data: bytes) -> list[Any] | None:
    try:
        items = decode_client_frame(data)
    except FrameError:
        return None
    assert isinstance(items, list)
    return items


@BOUNDED
@given(st.binary(max_size=200))
@example(b"")
@example(b"\xc1")                               # never used in msgpack
@example(b"\x92\x01\x91\xdd\xff\xff\xff\xff")   # an array claiming 4 billion items
@example(b"\x92\x01\x91\xc6\xff\xff\xff\xff")   # a bin claiming 4 GiB
@example(b"\x92\x01\x91\xd4\xff\x00")           # a timestamp extension of the wrong length
@example(b"\x92\x01\x91\x81\x01\x02")           # a map with an integer key
@example(b"\x91" * 5_000 + b"\xc0")             # nesting deeper than any decoder stack
def test_random_bytes_only_ever_raise_a_frame_error(data: bytes) -> None:
    decode_or_frame_error(data)


@BOUNDED
@given(values)
def test_random_msgpack_values_only_ever_raise_a_frame_error(value: Any) -> None:
    decode_or_frame_error(pack(value))


@BOUNDED
@given(versions, st.lists(near_items | small_values, max_size=6))
def test_frames_of_nearly_valid_items_decode_every_item_or_a_frame_error_in_its_place(
        version: Any, rows: list[Any]) -> None:
    items = decode_or_frame_error(pack([version, rows]))
    if items is not None:
        assert len(items) == len(rows)


@BOUNDED
@given(st.data())
def test_a_truncated_or_corrupted_good_frame_only_ever_raises_a_frame_error(data: st.DataObject) -> None:
    frame = bytearray(encode_frame(data.draw(st.lists(client_ops(), min_size=1, max_size=4))))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    decode_or_frame_error(bytes(frame[:data.draw(st.integers(0, len(frame)))]))


@pytest.mark.parametrize("data", ["[1, []] as text", None, 12, bytearray(pack([1, [[8, 5]]])),
                                  memoryview(pack([1, [[8, 5]]]))])
def test_a_frame_must_be_binary(data: Any) -> None:
    if isinstance(data, (bytearray, memoryview)):
        assert decode_client_frame(bytes(data)) == [PingOp(5)]
        assert decode_client_frame(data) == [PingOp(5)]  # type: ignore[arg-type]
    else:
        with pytest.raises(FrameError):
            decode_client_frame(data)


@pytest.mark.parametrize("version", [2, 0, "1", None, True, 1.0])
def test_a_frame_of_another_protocol_version_is_refused(version: Any) -> None:
    with pytest.raises(FrameError):
        decode_client_frame(pack([version, [[8, 1]]]))


@pytest.mark.parametrize("frame", [[1], [1, [], []], {"1": []}, [1, {"a": 1}], [1, "items"], 1])
def test_a_frame_that_is_not_version_and_item_list_is_refused(frame: Any) -> None:
    with pytest.raises(FrameError):
        decode_client_frame(pack(frame))


# --- round trips --------------------------------------------------------------------------------
ids = st.integers(1, INT64_MAX)
names = st.text(max_size=30)
visibility = st.none() | st.integers(0, 43_200_000)
credits = st.integers(1, 100_000)


CLIENT_OP_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    EnqueueOp: st.builds(EnqueueOp, ids, names, st.binary(max_size=64), st.integers(0, 9), st.none() | names),
    ReceiveOp: st.builds(ReceiveOp, ids, names, st.integers(1, 10_000), st.integers(0, 3_600_000), visibility),
    AckOp: st.builds(AckOp, ids, names, ids, names),
    ReleaseOp: st.builds(ReleaseOp, ids, names, ids, names),
    protocol.ExtendOp: st.builds(protocol.ExtendOp, ids, names, ids, names, st.integers(0, 43_200_000)),
    SubscribeOp: st.builds(SubscribeOp, ids, names, credits, visibility),
    CreditOp: st.builds(CreditOp, ids, ids, credits),
    UnsubscribeOp: st.builds(UnsubscribeOp, ids, ids),
    PingOp: st.builds(PingOp, ids),
    protocol.ChannelSubscribeOp: st.builds(protocol.ChannelSubscribeOp, ids,
                                           st.lists(names, min_size=1, max_size=4).map(tuple), st.booleans()),
    protocol.AdvertiseOp: st.builds(protocol.AdvertiseOp, ids, st.lists(names, min_size=1, max_size=4).map(tuple),
                                    st.booleans(), st.booleans()),
    protocol.ChannelAckOp: st.builds(protocol.ChannelAckOp, ids, names, ids),
    protocol.ReportOp: st.builds(protocol.ReportOp, ids, names, ids),
    protocol.PublishOp: st.builds(protocol.PublishOp, ids, names, st.binary(max_size=64), st.none() | names),
}
# The batch operations (tags 9 and 10) are newer than the rest; cover them where they exist.
if hasattr(protocol, "EnqueueBatchOp"):
    payload_lists = st.lists(st.binary(max_size=16), min_size=1, max_size=8).map(tuple)
    CLIENT_OP_STRATEGIES[protocol.EnqueueBatchOp] = payload_lists.flatmap(lambda payloads: st.builds(
        protocol.EnqueueBatchOp, ids, names, st.integers(0, 9), st.just(payloads),
        st.none() | st.lists(st.none() | names, min_size=len(payloads), max_size=len(payloads)).map(tuple)))
if hasattr(protocol, "AckBatchOp"):
    CLIENT_OP_STRATEGIES[protocol.AckBatchOp] = st.builds(
        protocol.AckBatchOp, ids, names, st.lists(st.tuples(ids, names), min_size=1, max_size=8).map(tuple))
CLIENT_OP_STRATEGIES[protocol.ForwardSessionOp] = st.builds(protocol.ForwardSessionOp, ids, names, names,
                                                            st.integers(0, protocol.WEIGHT_MAX), st.booleans())
CLIENT_OP_STRATEGIES[protocol.ForwardDataOp] = st.builds(
    protocol.ForwardDataOp, ids, names, names, names, st.integers(0, protocol.WEIGHT_MAX), ids,
    st.lists(st.tuples(st.binary(max_size=16), st.integers(0, 9), ids, st.integers(0, protocol.TTL_MS_MAX),
                       st.none() | st.dictionaries(names, names, max_size=3)), min_size=1, max_size=4).map(tuple))
# Browsing (tags 19 and 20, issue 35): the limit's range is the node's to check (E_INVALID_OPTION).
CLIENT_OP_STRATEGIES[protocol.PeekOp] = st.builds(protocol.PeekOp, ids, names, st.integers(0, INT64_MAX),
                                                  st.integers(0, INT64_MAX), st.booleans())
CLIENT_OP_STRATEGIES[protocol.ReadOp] = st.builds(protocol.ReadOp, ids, names, ids)
# Virtual queues (tags 23 and 24, issue 37 item 5; wire/view_ops.py).
CLIENT_OP_STRATEGIES[protocol.ViewReceiveOp] = st.builds(protocol.ViewReceiveOp, ids, names, names,
                                                         st.integers(1, 10_000), visibility)
CLIENT_OP_STRATEGIES[protocol.ViewPeekOp] = st.builds(protocol.ViewPeekOp, ids, names, names, st.integers(0, INT64_MAX),
                                                      st.integers(0, INT64_MAX), st.booleans())
# Producer waits (tag 21, issue 37 item 1; client/waits.py).
CLIENT_OP_STRATEGIES[protocol.CompletionWaitOp] = st.builds(protocol.CompletionWaitOp, ids, names,
                                                            st.integers(1, INT64_MAX), st.integers(0, INT64_MAX),
                                                            st.sampled_from(["ack", "reply"]))

# Channel mechanisms (tags 25 and 26, issue 37 item 10; wire/channel_ops.py).
CLIENT_OP_STRATEGIES[protocol.ChannelFetchOp] = st.builds(protocol.ChannelFetchOp, ids, names, st.integers(1, INT64_MAX))
CLIENT_OP_STRATEGIES[protocol.ChannelOffersOp] = st.builds(protocol.ChannelOffersOp, ids)


def client_ops() -> st.SearchStrategy[Any]:
    return st.one_of(*CLIENT_OP_STRATEGIES.values())


def test_every_client_operation_type_has_a_round_trip_strategy() -> None:
    assert set(get_args(protocol.ClientOp)) == set(CLIENT_OP_STRATEGIES)


delivered_messages = st.builds(DeliveredMessage, ids, names, st.integers(0, 9), st.integers(1, 1_000_000),
                               st.binary(max_size=64))
batch_outcomes = st.lists(ids | st.lists(names, min_size=2, max_size=2), max_size=4)
ok_results = (st.none() | ids | st.lists(ids, min_size=2, max_size=2)
              | st.lists(delivered_messages, min_size=1, max_size=5)
              | st.tuples(ids, batch_outcomes).map(list) | st.lists(st.none() | st.lists(names, min_size=2, max_size=2)))
server_items = st.one_of(
    st.builds(OkReply, ids, ok_results),
    st.builds(ErrorReply, st.integers(0, INT64_MAX), st.sampled_from(["E_BAD_FRAME", "E_QUEUE_FULL"]), names,
              st.booleans()),
    st.builds(Delivery, ids, st.lists(delivered_messages, max_size=5).map(tuple)),
    st.builds(Closing, st.sampled_from(["E_SHUTTING_DOWN", "E_FORBIDDEN"]), names),
    st.builds(protocol.ChannelMessage, names, ids, st.binary(max_size=64), st.booleans()),
    st.builds(protocol.ChannelEnded, names, st.sampled_from(["E_NOT_MASTER", "E_UNKNOWN_CHANNEL"]), names),
    st.builds(protocol.ForwardRate, names, names, st.none() | st.floats(0, 1e6)),
    st.builds(protocol.ChannelOffer, names, ids, st.sampled_from(["volatile", "reference", "relay"]),
              st.integers(0, 2**40), st.binary(max_size=64), st.booleans()))


@pytest.mark.parametrize("op", [EnqueueOp(1, "q", b"x"), EnqueueOp(2, "q", b"", 9, "d"), ReceiveOp(3, "q"),
                                ReceiveOp(4, "q", 10_000, 3_600_000, 43_200_000), AckOp(5, "q", 1, "r"),
                                ReleaseOp(6, "q", INT64_MAX, ""), SubscribeOp(7, "q", 1), SubscribeOp(8, "q", 2, 0),
                                CreditOp(9, 1, 100_000), UnsubscribeOp(10, 3), PingOp(INT64_MAX)],
                         ids=lambda op: type(op).__name__)
def test_every_client_operation_type_round_trips(op: Any) -> None:
    assert decode_client_frame(encode_frame([op])) == [op]


@BOUNDED
@given(st.lists(client_ops(), max_size=20))
def test_random_client_frames_round_trip(ops: list[Any]) -> None:
    assert decode_client_frame(encode_frame(ops)) == ops


def test_the_optional_trailing_fields_of_enqueue_and_receive_take_their_defaults() -> None:
    assert decode_client_frame(pack([1, [[1, 1, "q", b"x", 4], [2, 2, "q"], [2, 3, "q", None, None, None],
                                         [5, 4, "q", 8]]])) == [
        EnqueueOp(1, "q", b"x", 4, None), ReceiveOp(2, "q", 1, 0, None), ReceiveOp(3, "q", 1, 0, None),
        SubscribeOp(4, "q", 8, None)]


def same_server_item(sent: Any, received: Any) -> bool:
    if isinstance(sent, OkReply) and isinstance(sent.result, list) and sent.result \
            and isinstance(sent.result[0], DeliveredMessage):
        return received.request_id == sent.request_id and messages_from_result(received.result) == sent.result
    return bool(received == sent)


@BOUNDED
@given(st.lists(server_items, max_size=10))
def test_every_server_item_type_round_trips(items: list[Any]) -> None:
    decoded = decode_server_frame(encode_frame(items))
    assert len(decoded) == len(items)
    assert all(same_server_item(sent, received) for sent, received in zip(items, decoded, strict=True))


# --- one bad item in a good frame ------------------------------------------------------------------
def row_of(op: Any) -> list[Any]:
    [row] = msgpack.unpackb(encode_frame([op]))[1]
    return list(row)


def wrong_type(row: list[Any]) -> list[Any]:
    """The third field made wrong: a queue name that is a number, or an id that is negative."""
    if row[0] in (EnqueueOp.TAG, ReceiveOp.TAG, AckOp.TAG, ReleaseOp.TAG, SubscribeOp.TAG, 9, 10):
        return [*row[:2], 5, *row[3:]]
    return [*row[:2], -1, *row[3:]]


def fields_missing(row: list[Any]) -> list[Any]:
    # Ops with nothing past the request id cannot lose a field: one too many breaks them instead.
    return [row[0], row[1], 0] if row[0] in (PingOp.TAG, protocol.ChannelOffersOp.TAG) else row[:2]


# (how to break an item, whether its request id can still be read)
BREAKAGES: dict[str, tuple[Callable[[list[Any]], Any], bool]] = {
    "unknown tag": (lambda row: [99, *row[1:]], True),
    "a field of the wrong type": (wrong_type, True),
    "fields too many": (lambda row: [*row, 0, 0, 0, 0, 0], True),
    "fields missing": (fields_missing, True),
    "request id zero": (lambda row: [row[0], 0, *row[2:]], False),
    "request id negative": (lambda row: [row[0], -5, *row[2:]], False),
    "request id a string": (lambda row: [row[0], "7", *row[2:]], False),
    "request id true": (lambda row: [row[0], True, *row[2:]], False),
    "request id too large": (lambda row: [row[0], INT64_MAX + 1, *row[2:]], False),
    "not a list": (lambda row: {"tag": row[0]}, False),
    "too short": (lambda row: [row[0]], False),
}


@BOUNDED
@given(st.lists(client_ops(), min_size=1, max_size=6), st.data(), st.sampled_from(sorted(BREAKAGES)))
def test_one_bad_item_in_a_good_frame_fails_only_its_own_request(ops: list[Any], data: st.DataObject,
                                                                 breakage: str) -> None:
    position = data.draw(st.integers(0, len(ops) - 1))
    break_row, request_id_readable = BREAKAGES[breakage]
    rows: list[Any] = [row_of(op) for op in ops]
    rows[position] = break_row(rows[position])
    items = decode_client_frame(pack([PROTOCOL_VERSION, rows]))
    assert [item for n, item in enumerate(items) if n != position] == [op for n, op in enumerate(ops) if n != position]
    error = items[position]
    assert isinstance(error, FrameError), breakage
    assert error.request_id == (ops[position].request_id if request_id_readable else 0)


@pytest.mark.parametrize(("row", "field"), [
    ([1, 3, "q", "text, not binary", 4, None], "payload"),
    ([1, 3, "q", b"x", 10, None], "priority"),
    ([1, 3, "q", b"x", 4, 17], "dedupe_id"),
    ([2, 3, "q", 0], "max_messages"),
    ([2, 3, "q", 1, -1], "wait_ms"),
    ([2, 3, "q", 1, 0, 43_200_001], "visibility_ms"),
    ([3, 3, "q", 0, "r"], "message_id"),
    ([4, 3, "q", 1, None], "receipt"),
    ([5, 3, "q", 0], "credit"),
    ([6, 3, 0, 1], "subscription_id"),
    ([6, 3, 1, 100_001], "credit"),
    ([7, 3, "1"], "subscription_id"),
])
def test_a_bad_field_is_named_and_carries_the_request_id(row: list[Any], field: str) -> None:
    [ping, error] = decode_client_frame(pack([PROTOCOL_VERSION, [[8, 1], row]]))
    assert ping == PingOp(1)
    assert isinstance(error, FrameError) and error.request_id == 3
    assert field in str(error)


# --- the client's side ---------------------------------------------------------------------------
@BOUNDED
@given(st.lists(near_items | small_values, max_size=6))
@example([[101]])
@example([[102, 1, "E_X"]])
@example([[103, 1, [[1, "r", "not a number", 1, b""]]]])
@example([[103, 1, 5]])
def test_a_malformed_server_frame_only_ever_raises_a_frame_error(rows: list[Any]) -> None:
    # The client catches FrameError alone (client/connection.py); anything else kills its reader.
    try:
        decode_server_frame(pack([PROTOCOL_VERSION, rows]))
    except FrameError:
        pass


@pytest.mark.parametrize("frame", [
    [1, [[ChannelMessage.TAG, "prices", 7, 2**64 - 1, False]]],         # overflowed bytes(int): the fuzzer's find
    [1, [[ChannelMessage.TAG, "prices", 7, 10**9, False]]],            # would have allocated a gigabyte
    [1, [[Delivery.TAG, 1, [[5, "r", 4, 1, 10**9]]]]],                 # a delivered message's payload likewise
], ids=["overflow", "channel-gigabyte", "delivery-gigabyte"])
def test_a_server_frame_whose_payload_is_not_bytes_is_a_frame_error(frame: list[Any]) -> None:
    with pytest.raises(FrameError, match="payload is bytes"):
        decode_server_frame(msgpack.packb(frame))
