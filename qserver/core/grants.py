"""Grants as the core reads them: the client id the cluster acts under, and whether a list of
grants gives a privilege on a queue (docs/PROTOCOL.md, "Grants").

Separate from qserver/api/auth.py (which authenticates requests and builds on this) because the
engine checks a message's `reply-to` against its producer's grants while stepping an enqueue,
and the core imports nothing of api/ (docs/ARCHITECTURE.md, "Rooms").
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

CLUSTER_CLIENT = "@cluster"     # the client id of a node acting for the cluster itself (never a client's)
CLUSTER_WIDE = "*"          # the "queue" of cluster-wide privileges: only a grant of exactly "*" covers it


def grants_allow(grants: Iterable[Mapping[str, Any]], privilege: str, queue: str) -> bool:
    """Whether one of `grants` gives `privilege` on `queue`. "*" is no queue name: asked for it,
    a privilege is cluster-wide (clients, nodes, the journal), which only a grant of exactly "*"
    gives; as a pattern matched against "*", `?` or `[*]` would give it too (issue 32, Low)."""
    return any(privilege in g["privileges"] and (
        g["pattern"] == CLUSTER_WIDE if queue == CLUSTER_WIDE else fnmatch.fnmatchcase(queue, g["pattern"]))
        for g in grants)
