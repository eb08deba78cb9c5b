"""A forward's own bands, weights and fill unit in the cluster map (seed 003 figure 6; issue 37
item 12): how `PutForward.control` and `SetForwardControl` (tag 26) apply. Kept out of
replication/cluster_map.py (near its size limit); the values are checked by the route that
proposes them (qserver/features/forwards/decide.py checked_control), and stored here as given,
the same on every copy of the map.

Both are refused below cluster feature level 3 on every node: release 0.2.0 cannot decode them,
so a proposal that bypassed the route's gate must leave every copy of the map the same."""
from __future__ import annotations

import copy

from replication.map_commands import Outcome, SetForwardControl
from replication.map_entries import ForwardEntry
from wire.versions import FEATURES


def control_refusal(feature_level: int, name: str, control: dict[str, object]) -> Outcome | None:
    """Why a forward's control may not be stored at this level (None: it may)."""
    if control and feature_level < FEATURES["forward_control"]:
        return Outcome(name, False, f"a forward's own bands and weights need cluster feature level "
                                    f"{FEATURES['forward_control']}")
    return None


def set_forward_control(forwards: dict[str, ForwardEntry], feature_level: int,
                        command: SetForwardControl) -> Outcome:
    entry = forwards.get(command.name)
    if entry is None or entry.created_ms != command.created_ms:
        return Outcome(command.name, False, "no such forward")
    if feature_level < FEATURES["forward_control"]:
        return Outcome(command.name, False, f"changing a forward's bands and weights needs cluster feature "
                                            f"level {FEATURES['forward_control']}")
    if entry.control == command.control:
        return Outcome(command.name, False, "unchanged")
    entry.control = copy.deepcopy(command.control)
    return Outcome(command.name, True)
