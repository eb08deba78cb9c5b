"""Relaying between the members of a pair: a replica's clients, served by its master.

A replica relays what only the master may decide (every enqueue; under `full` also
receives, acks, releases, lease extensions and purges) in a RelayRequest message
(docs/PROTOCOL.md, "Replication messages"); the master runs it like a request of its own
clients and answers, once committed, with a RelayResult naming the commit point the replica
must reach before it answers its client. These helpers translate between the core's commands
(qserver/core/commands.py) and the [kind, args...] requests relayed.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qserver.core import commands as c
from wire.errors import E_BAD_REQUEST, E_NOT_MASTER, E_TIMEOUT, E_UNAVAILABLE, QueueError
from wire.protocol import DeliveredMessage


def relayed_request(command: Any) -> list[Any]:
    """A replica's client operation as the request it relays (in a RelayRequest message)."""
    kind = type(command)
    if kind is c.Enqueue:
        return ["enqueue", command.priority, [command.payload], [command.dedupe_id], command.client,
                command.ttl_ms, command.delay_ms, command.headers]
    if kind is c.EnqueueMany:
        return ["enqueue", command.priority, list(command.payloads),
                None if command.dedupe_ids is None else list(command.dedupe_ids), command.client, command.ttl_ms,
                command.delay_ms, command.headers]
    if kind is c.Receive:
        return ["receive", command.max_messages, command.wait_ms, command.visibility_ms, command.client]
    if kind is c.AckMany:
        return ["ack", [list(item) for item in command.items], command.client]
    if kind is c.Ack and command.release:
        return ["release", command.message_id, command.receipt, command.client]
    if kind is c.Ack and command.extend_ms is not None:
        return ["extend", command.message_id, command.receipt, command.extend_ms, command.client]
    if kind is c.Ack and command.reply_payload is None:
        return ["ack", [[command.message_id, command.receipt]], command.client]
    if kind is c.Purge:
        return ["purge", command.upto, command.purged]
    raise QueueError(E_NOT_MASTER, f"send this to the master of {command.queue}")


class RelayReplier:
    """Answers a relayed request back to the replica (after commit, like any answer)."""

    def __init__(self, pairs: Any, role: Any, request: Any) -> None:
        self.pairs, self.role, self.request = pairs, role, request

    def reply(self, request_id: int, result: Any) -> None:
        if isinstance(result, list) and result and isinstance(result[0], DeliveredMessage):
            result = [[m.message_id, m.receipt, m.priority, m.deliveries, m.payload, m.headers] for m in result]
        self._answer(result)

    def fail(self, request_id: int, error: QueueError) -> None:
        self._answer([error.code, error.message])

    def _answer(self, outcome: Any) -> None:
        self.role.answer_relay(self.request, [self.role.commit_order, outcome])
        self.pairs.flush(self.role)


def command_from_relay(request: Any, replier: Any) -> c.Command:
    """The core's command for a relayed request (a RelayRequest message's; the inverse of relayed_request)."""
    kind, *args = request.request
    name = request.queue
    if kind == "enqueue":
        priority, payloads, dedupe_ids, client, ttl_ms, delay_ms, headers = args
        return c.EnqueueMany(name, priority, tuple(payloads), None if dedupe_ids is None else tuple(dedupe_ids),
                             client, replier, ttl_ms=int(ttl_ms), delay_ms=int(delay_ms), headers=headers)
    if kind == "receive":
        max_messages, wait_ms, visibility_ms, client = args
        return c.Receive(name, max_messages, wait_ms, visibility_ms, client, replier)
    if kind == "ack":
        items, client = args
        return c.AckMany(name, tuple((int(i), str(r)) for i, r in items), client, replier)
    if kind == "release":
        message_id, receipt, client = args
        return c.Ack(name, message_id, receipt, client, replier, release=True)
    if kind == "purge":
        upto, purged = args
        return c.Purge(name, replier, upto=int(upto), purged=int(purged))
    if kind == "extend":
        message_id, receipt, extend_ms, client = args
        return c.Ack(name, message_id, receipt, client, replier, extend_ms=int(extend_ms))
    raise QueueError(E_BAD_REQUEST, f"unknown forwarded request {kind!r}")


def relayed_error(code: str, message: Any) -> QueueError:
    """The error a relayed request was answered with. Its [code, message] form cannot say
    whether the operation was applied, and E_NOT_MASTER comes from a master deposed while the
    request was held, or from this node failing the relays still in flight when it became
    the master (qserver/cluster/relay_answers.py `RelayAnswers.fail`), E_UNAVAILABLE from the link to the master
    lost while the relay was in flight (`on_link_change`), and E_TIMEOUT from a relay the
    master never answered (`expire_waiting`): each may have been applied, so its outcome is
    unknown (the client retries with the same dedupe id, or reports it unknown)."""
    return QueueError(code, str(message), outcome_unknown=code in (E_NOT_MASTER.code, E_TIMEOUT.code,
                                                                   E_UNAVAILABLE.code))


def answer_from_master(command: Any) -> Callable[[Any], None]:
    """How to answer the replica's client from the master's result for its command."""
    kind, replier, request_id = type(command), command.replier, command.request_id

    def answer(outcome: Any) -> None:
        if isinstance(outcome, QueueError):   # the answer was held here and refused (PairDriver.hold)
            replier.fail(request_id, outcome)
        elif isinstance(outcome, list) and len(outcome) == 2 and isinstance(outcome[0], str) \
                and outcome[0].startswith("E_"):
            replier.fail(request_id, relayed_error(outcome[0], outcome[1]))
        elif kind is c.Enqueue:
            epoch, [single] = outcome
            if isinstance(single, list):
                replier.fail(request_id, relayed_error(single[0], single[1]))
            else:
                replier.reply(request_id, [single, epoch])
        elif kind is c.Receive:
            replier.reply(request_id, [DeliveredMessage(*row) for row in outcome])
        elif kind is c.Ack and not command.release and command.extend_ms is None:
            [single] = outcome          # relayed as a one-item ack batch
            if single is None:
                replier.reply(request_id, None)
            else:
                replier.fail(request_id, QueueError(single[0], str(single[1])))
        else:
            replier.reply(request_id, outcome)
    return answer
