"""Which release this code is, and which versions of each protocol it speaks.

Shared by the node and the client (both import `wire`). docs/OPERATIONS.md ("Upgrades") says
how the pieces fit in a rolling upgrade:

- `RELEASE` is the semantic version of this code (`pyproject.toml` reads it from here, and
  `qserver --version`, `qctl --version` and `/healthz` print it). `releases.toml` records the
  commit of every release.
- Each link (client, replication, membership) offers the range of protocol versions its side
  speaks when it connects; the answer names the responder's range, and both use the highest
  version in both. A side that names no range is a release from before ranges existed
  (0.1.0): it speaks exactly `SILENT_PEER`'s versions.
- The cluster **feature level** is replicated in the cluster map. A map that never recorded one
  is at `OLDEST_FEATURE_LEVEL` (the level of release 0.1.0). An operator raises it with
  `qctl cluster finalize` once every node runs a release that supports the new level; until
  then a node speaks and stores only what the current level's releases understand, and a
  feature of a higher level answers E_FEATURE_DISABLED.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from wire.errors import E_FEATURE_DISABLED, QueueError

RELEASE = "0.3.0.dev0"


@dataclass(frozen=True, slots=True)
class VersionRange:
    """The protocol versions one side speaks, inclusive."""
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"a version range needs 0 < low <= high, not {self.low}..{self.high}")

    def common(self, other: VersionRange) -> int | None:
        """The highest version both ranges hold, or None when they share none."""
        high = min(self.high, other.high)
        return high if high >= max(self.low, other.low) else None

    def render(self) -> str:
        return f"{self.low}-{self.high}"

    @classmethod
    def parse(cls, text: str) -> VersionRange:
        """`"8-9"` or `"8"`; ValueError on anything else."""
        match = re.fullmatch(r"\s*(\d{1,6})(?:\s*-\s*(\d{1,6}))?\s*", text)
        if match is None:
            raise ValueError(f"a version range is LOW-HIGH, not {text[:40]!r}")
        low = int(match.group(1))
        return cls(low, int(match.group(2)) if match.group(2) else low)


# The versions this release speaks on each link.
CLIENT_PROTOCOL = VersionRange(1, 1)           # client frames and REST (wire/protocol.py)
REPLICATION_PROTOCOL = VersionRange(8, 8)      # queue pairs' messages (replication/messages.py)
MEMBERSHIP_PROTOCOL = VersionRange(1, 1)       # the membership layer's Raft messages (replication/raft_codec.py)

# What a side that names no range speaks: release 0.1.0, the last before ranges were offered.
SILENT_PEER = {"client": VersionRange(1, 1), "replication": VersionRange(8, 8), "membership": VersionRange(1, 1)}

# Cluster feature levels: each level names the first release that supports it.
OLDEST_FEATURE_LEVEL = 1
FEATURE_LEVEL = 3                  # the highest level this release can run at
FEATURE_LEVEL_RELEASES = {1: "0.1.0", 2: "0.2.0", 3: "0.3.0"}

# Features that need a cluster feature level above the oldest, and which. A node of this release
# refuses them with E_FEATURE_DISABLED until the map's level reaches theirs.
FEATURES: dict[str, int] = {
    "macro_highest_priority": 2,   # the macro consumer policy `highest_priority`: a map value 0.1.0 refuses
    # PATCH /v1/queues/{q}: a map command (SetQueueOptions) 0.2.0 cannot decode.
    "queue_options_change": 3,
    # The queue options delay_s and receive_wait_s set to anything but 0: names 0.2.0 refuses in a map entry.
    "queue_delay_and_wait": 3,
    # Virtual queues (docs/PROTOCOL.md, "Virtual queues"): the queue option `views`, a name 0.2.0
    # refuses in a map entry, and client ops 23-24, which 0.2.0 cannot decode.
    "virtual_queues": 3,
    # Producers that wait (docs/PROTOCOL.md, "Producers that wait"): client op 21, which 0.2.0 cannot decode.
    "producer_waits": 3,
    # A forward's own bands, weights and fill unit (docs/PROTOCOL.md "Forwards"): a field of
    # PutForward and the map command SetForwardControl (tag 26), which 0.2.0 cannot decode.
    "forward_control": 3,
    # A queue's FAILED state in the map (docs/PROTOCOL.md, "Queue state FAILED"): the map command
    # SetQueueHealth (tag 24), which 0.2.0 cannot decode. Below it: statistics and metrics only.
    "queue_health": 3,
    # A channel's attributes (size, frequency, loss tolerance, skip_last_value: map tag 23, which
    # 0.2.0 cannot decode) and the mechanisms chosen from them (client ops 25-26, push 110).
    "channel_attributes": 3,
    # A channel's leading advertiser by override (docs/PROTOCOL.md "Channels"): op 15's trailing
    # `leader` field, which 0.2.0 refuses (an advertise of 0.2.0's shape needs no level).
    "channel_advertisers": 3,
}


def require_feature(cluster_level: int, feature: str) -> None:
    """Raise E_FEATURE_DISABLED unless the cluster's feature level (the map's) reaches `feature`'s."""
    needed = FEATURES[feature]
    if cluster_level < needed:
        raise QueueError(E_FEATURE_DISABLED,
                         f"{feature} needs cluster feature level {needed}: every node on release "
                         f"{FEATURE_LEVEL_RELEASES[needed]} or later, then `qctl cluster finalize`; the cluster runs at "
                         f"level {cluster_level}")


def release_key(version: str) -> tuple[int, int, int, int]:
    """A sortable key of a release string: "0.2.0" > "0.2.0.dev0" > "0.1.0"."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"not a release version: {version[:40]!r}")
    major, minor, patch, dev = match.groups()
    return int(major), int(minor), int(patch), -1_000_000 + int(dev) if dev is not None else 0


def peer_too_old(cluster_level: int, peer_release: str | None) -> str | None:
    """Why a peer node of `peer_release` (None: it named none, 0.1.0 or older) may not link to a
    cluster at `cluster_level`, or None when it may. A node older than the level's first release
    would skip map commands it cannot read and serve a map that differs from everyone else's; a
    development build of that release (0.2.0.dev0) counts as the release."""
    needed = FEATURE_LEVEL_RELEASES.get(cluster_level, RELEASE)
    try:
        if release_key(peer_release or FEATURE_LEVEL_RELEASES[OLDEST_FEATURE_LEVEL])[:3] >= release_key(needed)[:3]:
            return None
    except ValueError:
        pass
    return (f"the cluster runs at feature level {cluster_level}, which needs release {needed} or later on every "
            f"node; the peer runs {peer_release or '0.1.0 or older'}")

