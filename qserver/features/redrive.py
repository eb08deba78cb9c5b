"""Redrive: dead-lettered messages go back to the queue they came from (issue 14, item 10).

Each round leases a bounded batch of the dead-letter queue, enqueues copies into the source
queue and only then acknowledges them in the dead-letter queue: three steps through the
engine's ordinary commands, each replicated and journaled as it always is, so a crash or a
failover between them loses nothing. A copy carries the dedupe id
`redrive:<dead-letter queue incarnation>:<its id there>`, so a round run again (its
acknowledgements were lost) stores no message twice within the dedupe window; the journal
links each redriven enqueue to its dead letter through that id, and the dead letter's
consumption is an ordinary lease and ack.

The number of dead letters at the start bounds a redrive: a message that fails again while
it runs waits in the dead-letter queue for the next one instead of going round for ever.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qserver.api.http_common import call
from qserver.core import commands as c
from replication.options import dead_letter_name
from wire.errors import E_INVALID_OPTION, E_UNKNOWN_QUEUE, QueueError
from wire.protocol import DeliveredMessage

if TYPE_CHECKING:
    from qserver.services import NodeServices

ROUND_MESSAGES_MAX = 500         # leased from the dead-letter queue per round
IDS_LISTED_MAX = 10_000          # new ids listed in the answer (the count covers them all)
LEASE_MS = 60_000                # the dead letters' lease while their copies are enqueued
DEDUPE_PREFIX = "redrive:"


async def redrive(services: NodeServices, queue: str, limit: int | None, client: str) -> dict[str, Any]:
    """Move up to `limit` (all when None) of `queue`'s dead letters back into it, in delivery
    order, each at its priority; each step is one engine command with the REST API's deadline
    (it answers POST /v1/queues/{q}/redrive). Raises what the first step raises (E_NOT_MASTER
    at a node that holds neither member: the HTTP layer passes the request on)."""
    source = services.held_core(queue)
    if source is not None and not source.options.dead_letter:
        raise QueueError(E_INVALID_OPTION, f"queue {queue} has no dead-letter queue (dead_letter is off)")
    dead = dead_letter_name(queue)
    budget: int | None = limit
    moved, stopped = 0, None
    new_ids: list[int] = []
    truncated = False
    while budget is None or moved < budget:
        want = ROUND_MESSAGES_MAX if budget is None else min(ROUND_MESSAGES_MAX, budget - moved)
        leased = await _lease_dead_letters(services, queue, want, client)
        if budget is None:
            # The dead letters there are now (this member's copy): later ones wait for the next redrive.
            core = services.held_core(dead)
            budget = len(leased) + (core.record.ready_count if core is not None else 0)
        if not leased:
            break
        incarnation = _incarnation(services, dead)
        kept: list[tuple[int, str]] = []
        give_back: list[tuple[int, str]] = []
        # One batch per priority and headers (the messages keep both), highest priority first.
        groups: dict[tuple[int, tuple[tuple[str, str], ...]], list[DeliveredMessage]] = {}
        for message in leased:
            groups.setdefault((message.priority, tuple(sorted((message.headers or {}).items()))), []).append(message)
        for (priority, headers), group in sorted(groups.items(), key=lambda item: -item[0][0]):
            payloads = tuple(m.payload for m in group)
            ids = tuple(f"{DEDUPE_PREFIX}{incarnation}:{m.message_id}" for m in group)
            _, outcomes = await call(services, _enqueue_many(queue, priority, payloads, ids, client, dict(headers)))
            for message, outcome in zip(group, outcomes, strict=True):
                if isinstance(outcome, list):          # [code, message]: not stored (the queue is full...)
                    stopped = stopped or outcome[0]
                    give_back.append((message.message_id, message.receipt))
                else:
                    kept.append((message.message_id, message.receipt))
                    if len(new_ids) < IDS_LISTED_MAX:
                        new_ids.append(int(outcome))
                    else:
                        truncated = True
        if kept:
            outcomes = await call(services, _ack_many(dead, tuple(kept), client))
            moved += sum(1 for outcome in outcomes if outcome is None)
        for message_id, receipt in give_back:
            try:
                await call(services, _release(dead, message_id, receipt, client))
            except QueueError:
                pass          # its lease runs out instead: it is a dead letter again either way
        if stopped:
            break
    # The new messages' ids in the source queue (a redriven message is a new message there).
    result: dict[str, Any] = {"queue": queue, "redriven": moved, "ids": new_ids}
    if truncated:
        result["ids_truncated"] = True
    if stopped:
        result["stopped"] = stopped
    return result


def _enqueue_many(queue: str, priority: int, payloads: tuple[bytes, ...], ids: tuple[str, ...], client: str,
                  headers: dict[str, str]) -> Callable[[c.FutureReplier], c.Command]:
    return lambda r: c.EnqueueMany(queue, priority, payloads, ids, client, r, headers=headers or None)


def _ack_many(queue: str, items: tuple[tuple[int, str], ...], client: str) -> Callable[[c.FutureReplier], c.Command]:
    return lambda r: c.AckMany(queue, items, client, r)


def _release(queue: str, message_id: int, receipt: str, client: str) -> Callable[[c.FutureReplier], c.Command]:
    return lambda r: c.Ack(queue, message_id, receipt, client, r, release=True)


async def _lease_dead_letters(services: NodeServices, queue: str, want: int, client: str) -> list[DeliveredMessage]:
    """Up to `want` of the queue's dead letters, leased. A queue unknown here is named as the
    caller typed it, not as its dead-letter queue (which the caller never named)."""
    try:
        return list(await call(services, lambda r: c.Receive(dead_letter_name(queue), want, 0, LEASE_MS, client, r)))
    except QueueError as error:
        if error.code == E_UNKNOWN_QUEUE.code and services.entry(queue) is None \
                and services.held_core(queue) is None:
            raise QueueError(E_UNKNOWN_QUEUE, f"no queue named {queue!r}") from None
        raise


def _incarnation(services: NodeServices, name: str) -> int:
    core = services.held_core(name)
    return 0 if core is None else core.record.incarnation or core.record.queue_id
