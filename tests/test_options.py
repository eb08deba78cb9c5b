"""Queue options and names, validated in one place (replication/options.py, docs/PROTOCOL.md "REST")."""
from __future__ import annotations

from typing import Any

import pytest

from replication.options import (
    DEAD_LETTER_SUFFIX,
    OptionError,
    QueueOptions,
    QueueType,
    Strength,
    dead_letter_name,
    is_valid_queue_name,
    mismatched_options,
    options_from_json,
    parse_options,
)


def test_every_valid_option_is_accepted_and_typed() -> None:
    given, placement = parse_options({
        "strength": "full", "max_depth": 5, "type": "two_way", "visibility_timeout_s": 2,
        "max_deliveries": 3, "dead_letter": False, "min_in_sync": 2,
        "master_required": True, "master": "n1", "replica": "n2"})
    assert given == {"strength": Strength.FULL, "max_depth": 5, "type": QueueType.TWO_WAY,
                     "visibility_timeout_s": 2.0, "max_deliveries": 3, "dead_letter": False, "min_in_sync": 2}
    assert isinstance(given["visibility_timeout_s"], float)
    assert placement == {"master_required": True, "master": "n1", "replica": "n2"}
    assert QueueOptions(**given).type is QueueType.TWO_WAY


def test_only_the_options_named_are_returned() -> None:
    assert parse_options({}) == ({}, {})
    assert parse_options({"max_depth": 10}) == ({"max_depth": 10}, {})


@pytest.mark.parametrize(("name", "value"), [
    ("max_depth", 1), ("max_depth", 2**40), ("max_deliveries", 1), ("max_deliveries", 1_000_000),
    ("visibility_timeout_s", 0), ("visibility_timeout_s", 0.25), ("visibility_timeout_s", 43_200),
    ("min_in_sync", 1), ("min_in_sync", 2), ("strength", "producer"), ("type", "one_way"),
    ("type", "one_way_ack"), ("type", "queued_ack"), ("dead_letter", True)])
def test_the_edges_of_every_range_are_accepted(name: str, value: Any) -> None:
    given, _ = parse_options({name: value})
    assert given[name] == value


@pytest.mark.parametrize(("name", "value"), [
    ("max_depth", 0), ("max_depth", 2**40 + 1), ("max_depth", -1), ("max_depth", 5.0), ("max_depth", "5"),
    ("max_depth", True), ("max_depth", None), ("max_depth", [5]),
    ("max_deliveries", 0), ("max_deliveries", 1_000_001), ("max_deliveries", 2.5), ("max_deliveries", False),
    ("visibility_timeout_s", -0.001), ("visibility_timeout_s", 43_200.001), ("visibility_timeout_s", "30"),
    ("visibility_timeout_s", True), ("visibility_timeout_s", float("nan")), ("visibility_timeout_s", float("inf")),
    ("min_in_sync", 0), ("min_in_sync", 3), ("min_in_sync", True), ("min_in_sync", 1.0),
    ("strength", "strong"), ("strength", 1), ("strength", None), ("strength", "FULL"),
    ("type", "three_way"), ("type", ""), ("type", None),
    ("dead_letter", 1), ("dead_letter", "true"), ("dead_letter", None),
    ("master_required", "yes"), ("master_required", 1), ("master", 7), ("replica", None)])
def test_an_invalid_option_is_refused_with_its_name(name: str, value: Any) -> None:
    with pytest.raises(OptionError) as caught:
        parse_options({name: value, "max_depth" if name != "max_depth" else "max_deliveries": 10})
    assert name in str(caught.value)


@pytest.mark.parametrize("name", ["depth", "maxDepth", "visibility_timeout_ms", "", "epoch"])
def test_an_unknown_option_is_refused_with_its_name(name: str) -> None:
    with pytest.raises(OptionError) as caught:
        parse_options({"max_depth": 10, name: 1})
    assert "unknown" in str(caught.value) and repr(name)[1:-1] in str(caught.value)


@pytest.mark.parametrize("raw", [None, [], "max_depth=5", 5, [("max_depth", 5)]])
def test_options_that_are_not_an_object_are_refused(raw: Any) -> None:
    with pytest.raises(OptionError):
        parse_options(raw)


def test_stored_options_come_back_equal() -> None:
    options = QueueOptions(strength=Strength.FULL, type=QueueType.ONE_WAY, visibility_timeout_s=1.5)
    assert options_from_json(options.to_json()) == options
    assert options.to_json()["strength"] == "full" and options.to_json()["type"] == "one_way"
    assert options.visibility_timeout_ms == 1_500
    # Only the acknowledged types (seed 004) keep a completion record after an ack.
    assert [QueueOptions(type=kind).tracks_status for kind in QueueType] == [False, True, False, True]


def test_mismatched_options_lists_only_the_names_that_differ() -> None:
    existing = QueueOptions(max_depth=100, strength=Strength.FULL)
    given, _ = parse_options({"max_depth": 100, "strength": "producer", "visibility_timeout_s": 30,
                              "type": "two_way", "master": "n3"})
    assert mismatched_options(existing, given) == ["strength", "type"]
    assert mismatched_options(existing, parse_options({"max_depth": 100, "visibility_timeout_s": 30.0})[0]) == []
    assert mismatched_options(existing, {}) == []


def test_mismatched_options_compares_every_option_name() -> None:
    existing = QueueOptions()
    different: dict[str, Any] = {"strength": Strength.FULL, "max_depth": 1, "type": QueueType.TWO_WAY, "visibility_timeout_s": 1.0,
                 "max_deliveries": 1, "dead_letter": False, "min_in_sync": 2}
    assert mismatched_options(existing, parse_options(QueueOptions(**different).to_json())[0]) == sorted(different)


@pytest.mark.parametrize("name", ["a", "orders", "Orders-2024_x.y:z", "0", "a" * 196, "a.dlq", "a" * 196 + ".dlq", "9-lives"])
def test_a_valid_queue_name_is_accepted(name: str) -> None:
    assert is_valid_queue_name(name)


@pytest.mark.parametrize("name", [
    "", "a" * 197, "a" * 201, "a/b", "/a", "a/", ".hidden", "..", "-dash-first", "_under", ":colon",
    "with space", " lead", "trail ", "tab\there", "nul\x00", "bell\x07", "del\x7f", "orders\n", "\norders",
    "line\nbreak", "orders\r", "é", "naïve", "q?x", "q#x", "q%2F"])
def test_an_invalid_queue_name_is_refused(name: str) -> None:
    assert not is_valid_queue_name(name)


def test_a_dead_letter_queue_is_named_after_its_queue() -> None:
    assert dead_letter_name("orders") == "orders" + DEAD_LETTER_SUFFIX == "orders.dlq"


@pytest.mark.parametrize("length", [1, 100, 196])
def test_the_dead_letter_queue_of_every_valid_name_has_a_valid_name(length: int) -> None:
    # Clients reach a dead-letter queue by its name, which the HTTP and WebSocket APIs check.
    name = "q" * length
    assert is_valid_queue_name(name)
    assert is_valid_queue_name(dead_letter_name(name))
