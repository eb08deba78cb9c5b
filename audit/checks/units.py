"""The units the audit's checks work on, and how a queue's records are told apart.

  * a *journal*: one node's append-only record stream (node id + journal id: a node that lost
    its disk starts a new journal). audit/checks/journals.py checks its sequence numbers.
  * a *queue group*: a queue and its dead-letter queue (`q` and `q.dlq`), every incarnation,
    every member's records. audit/checks/group.py runs every per-queue check on it.
Inside a group:
  * a *stream* is one member's records of one local queue instance: (node, journal, queue,
    local queue id), in journal order (`StreamKey`);
  * streams of different nodes that share a replicated operation (same ordering index, op,
    message id, time and dedupe id) belong to the same *incarnation* of the queue, and so does
    a dead-letter queue's stream with its source's stream on the same node
    (audit/checks/incarnations.py).

Dead-letter queues have no enqueue records of their own: a message arrives there when its
source journals `dead_letter`, and the audit derives an arrival record (`ARRIVAL_OP`) for it.

A module of its own because every check names these and none of them owns them.
"""
from __future__ import annotations

from replication.options import base_name

StreamKey = tuple[str, str, str, int]     # (node, journal_id, queue, local queue id)
ARRIVAL_OP = "dead_letter_arrival"       # derived, never stored

# The queue group a queue belongs to: a dead-letter queue goes with its source.
group_of = base_name
