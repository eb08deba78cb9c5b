"""A channel's attributes in the cluster map (issue 37, items 10 and 11): what its publisher
says of its data (seed 002 characterize: size, frequency, loss tolerance), from which the
channel's master chooses how each message travels (qserver/features/channels/transport.py),
and whether subscribing sends the last value. Kept out of replication/cluster_map.py (near its
size limit). `SetChannelAttributes` (tag 23) replaces them; it is refused below cluster feature
level 3 on every node: release 0.2.0 cannot decode it, so a proposal that bypassed the route's
gate must leave every copy of the map the same."""
from __future__ import annotations

from typing import Any

from replication.map_commands import Outcome, SetChannelAttributes
from replication.map_entries import ChannelEntry
from wire.versions import FEATURES

SIZE_BYTES_MAX = 64 * 1024 * 1024          # a channel message's size is bounded by the node's body limit anyway
PER_SECOND_MAX = 1_000_000.0
# Each attribute, its type and bounds; absent means 0 / false.
ATTRIBUTES: dict[str, tuple[type, float, float]] = {
    "size_bytes": (int, 0, SIZE_BYTES_MAX),           # the typical payload's size
    "per_second": (float, 0.0, PER_SECOND_MAX),       # how often the publishers publish
    "loss_tolerant": (bool, 0, 1),                    # a lost message is replaced by the next one soon enough
    "skip_last_value": (bool, 0, 1),                  # subscribing does not send the last value
}


def attributes_problem(attributes: Any) -> str | None:
    """Why these attributes are not a channel's (None: they are)."""
    if not isinstance(attributes, dict):
        return "a channel's attributes are an object"
    for name, value in attributes.items():
        rule = ATTRIBUTES.get(name)
        if rule is None:
            return f"unknown channel attribute {str(name)[:40]!r} (known: {', '.join(ATTRIBUTES)})"
        kind, low, high = rule
        if kind is bool:
            if type(value) is not bool:
                return f"{name} is true or false"
        elif type(value) is bool or not isinstance(value, int | float) or (kind is int and type(value) is not int) \
                or not low <= value <= high:
            return f"{name} is a{'n integer' if kind is int else ' number'} from {low:g} to {high:g}"
    return None


def normalized(attributes: dict[str, Any]) -> dict[str, Any]:
    """Only what differs from the defaults, per_second as a float: equal attributes encode
    equally, and a channel with none encodes as release 0.2.0's does."""
    out: dict[str, Any] = {}
    for name, value in sorted(attributes.items()):
        if value:
            out[name] = float(value) if ATTRIBUTES[name][0] is float else value
    return out


def set_channel_attributes(channels: dict[str, ChannelEntry], feature_level: int,
                           command: SetChannelAttributes) -> Outcome:
    entry = channels.get(command.name)
    if entry is None:
        return Outcome(command.name, False, "no such channel")
    if feature_level < FEATURES["channel_attributes"]:
        return Outcome(command.name, False, f"a channel's attributes need cluster feature level "
                                            f"{FEATURES['channel_attributes']}")
    problem = attributes_problem(command.attributes)
    if problem is not None:
        return Outcome(command.name, False, problem)
    attributes = normalized(command.attributes)
    if entry.attributes == attributes:
        return Outcome(command.name, False, "unchanged")
    entry.attributes = attributes
    return Outcome(command.name, True)
