"""A queue member's options follow its map entry's (docs/PROTOCOL.md, "Changing a queue's options").

The map's `SetQueueOptions` changes an entry's options; every node that holds a member of the
queue gives its core the entry's options when the map changes for that queue (`PairDriver.reconcile`,
qserver/cluster/pairs.py, after a command or a snapshot of the map) and when it attaches a core it
loaded at a start: a node that was down while the options changed takes them once its map has
the change. The core's record holds them, written with the open batch, so a restart loads them.
"""
from __future__ import annotations

from qserver.core.ports import Staging
from replication.cluster_map import QueueEntry
from replication.options import CHANGEABLE_OPTIONS, options_from_json
from replication.queue_core import QueueCore


def follow_entry_options(core: QueueCore, entry: QueueEntry, staging: Staging) -> bool:
    """Give `core` (a queue's member, not its dead-letter queue's: those keep their own) the
    changeable options of its entry; whether any changed. Options fixed at creation are never
    taken from here: they cannot differ, and a core's strength must not change under its role."""
    if core.record.dead_letter_of is not None:
        return False
    wanted = options_from_json(entry.options)
    current = core.record.options
    changes = {name: getattr(wanted, name) for name in CHANGEABLE_OPTIONS
               if getattr(wanted, name) != getattr(current, name)}
    if not changes:
        return False
    core.record.options = options_from_json({**current.to_json(every=True), **changes})
    staging.touch(core)
    return True
