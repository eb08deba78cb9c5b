"""What a message may carry, checked in one place (wire/message_input.py): each check answers
with the code every surface has always answered, and the limits the frame codec and the queue
options bound by are the same ones."""
from __future__ import annotations

import pytest

from replication import options
from wire import message_input as m
from wire import protocol
from wire.errors import QueueError


def code_of(action: object) -> str:
    with pytest.raises(QueueError) as refused:
        action()  # type: ignore[operator]
    return refused.value.code


def test_a_payload_over_the_limit_is_refused_and_one_at_it_is_taken() -> None:
    assert m.payload_refusal(b"x" * 10, 10) is None
    refusal = m.payload_refusal(b"x" * 11, 10)
    assert refusal is not None and refusal.code == "E_PAYLOAD_TOO_LARGE" and refusal.message == "message over 10 bytes"
    assert code_of(lambda: m.check_payload(b"x" * 11, 10)) == "E_PAYLOAD_TOO_LARGE"


def test_dedupe_ids_are_1_to_128_printable_characters_and_none_is_no_id() -> None:
    m.check_dedupe_id(None)
    m.check_dedupe_id("a" * 128)
    for bad in ("", "a" * 129, "tab\there", "\udcff"):
        assert not m.valid_dedupe_id(bad)
        refusal = m.dedupe_id_refusal(bad)
        assert refusal is not None and refusal.code == "E_INVALID_OPTION" and refusal.message == m.DEDUPE_ID_RULE


def test_a_priority_as_rest_carries_it() -> None:
    assert m.priority_from_text(None) == m.PRIORITY_DEFAULT == 4
    assert [m.priority_from_text(str(p)) for p in range(10)] == list(range(10))
    for bad in ("", "10", "-1", "4.0", " 4"):
        assert code_of(lambda bad=bad: m.priority_from_text(bad)) == "E_INVALID_OPTION"


def test_headers_from_rest_name_the_header_and_what_is_wrong() -> None:
    assert m.headers_from_json(None) is None and m.headers_from_json("{}") is None
    assert m.headers_from_json('{"k": "v"}') == {"k": "v"}
    for bad in ("not json", '["k", "v"]', '{"k": 1}'):
        with pytest.raises(QueueError) as refused:
            m.headers_from_json(bad)
        assert refused.value.code == "E_INVALID_OPTION"
        assert refused.value.message.startswith("X-Headers must be a JSON object of names to strings: ")


def test_the_headers_the_cluster_sets_are_refused_from_a_producer() -> None:
    m.check_not_reserved({"trace": "1", m.REPLY_TO: "answers"})
    for name in sorted(m.RESERVED_HEADERS):
        with pytest.raises(QueueError) as refused:
            m.check_not_reserved({name: "x"})
        assert refused.value.code == "E_RESERVED_HEADER" and name in refused.value.message
    assert m.reply_to_refusal("c-1", "elsewhere").code == "E_FORBIDDEN"


def test_the_codec_and_the_queue_options_bound_by_the_same_limits() -> None:
    assert protocol.TTL_MS_MAX == m.TTL_MS_MAX == int(options.TTL_MAX_S * 1000)
    assert protocol.DELAY_MS_MAX == m.DELAY_MS_MAX
    assert options.PRIORITY_MAX == m.PRIORITY_MAX
    with pytest.raises(options.OptionError):
        options.parse_options({"visibility_timeout_s": m.VISIBILITY_MAX_S + 1})
    assert options.parse_options({"visibility_timeout_s": m.VISIBILITY_MAX_S})[0] == {
        "visibility_timeout_s": m.VISIBILITY_MAX_S}
