"""`qctl`: the operator's command line for a qserver cluster.

Every command is one or two signed REST calls (`client/http.py`); there is no state beyond
the credentials file, which is found like the library finds it (`--credentials`, then
`$QSERVER_CREDENTIALS`, `./.qserver/credentials.json`, `~/.config/qserver/credentials.json`);
a refusal as an unknown client, or a URL no node answers, names the file used and whose it is.
Output is a plain aligned table or `key: value` lines for people, or with `--json` exactly
one JSON document on stdout for scripts. Errors print `error: CODE: message` on stderr and
exit 1 (with `--json` the error envelope is also the one document on stdout); usage errors
exit 2. `channel listen` that heard fewer than --count messages prints them (or their
document) and then its error, and exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from client.aio import AsyncClient
from client.credentials import Credentials, explain_refusal, find_credentials, load_credentials, save_credentials
from client.http import HttpClient
from client.macro import CONSUMER_POLICIES, FASTEST_BY, PRODUCER_POLICIES
from replication.options import QueueOptions
from wire.errors import E_INVALID_OPTION, E_TIMEOUT, QueueError
from wire.signing import new_private_key, private_key_to_text, public_key_text

PRIVILEGES = ("post", "get", "delete", "admin")
DEFAULT_OPTIONS = QueueOptions().to_json()     # `queue create` shows the options that differ from these
QUEUE_TYPES = ("one_way", "one_way_ack", "queued_ack", "two_way")
STRENGTHS = ("producer", "full")
# Queue statistics shown in `status` and `queue list` (header, dotted key in the stats), in
# this order; a column is shown when any queue reports it.
QUEUE_COLUMNS = (("NAME", "name"), ("STRENGTH", "options.strength"), ("TYPE", "options.type"),
                 ("DEPTH", "depth"), ("READY", "ready"), ("DELAYED", "delayed"), ("IN_FLIGHT", "in_flight"),
                 ("ENQUEUED", "total_enqueued"), ("ACKED", "total_acked"),
                 ("DEAD_LETTERED", "total_dead_lettered"), ("EXPIRED", "total_expired"),
                 ("REPLICATION", "replication_state"),
                 ("MASTER", "master"), ("REPLICA", "replica"), ("EPOCH", "epoch"), ("IN_SYNC", "in_sync"))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a command produced: the JSON document, and its rendering for people. `shortfall`:
    an error reported after them (both are still printed), which makes qctl exit 1."""

    document: Any
    human: str
    shortfall: QueueError | None = None


# --- rendering ------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; None shows as '-'."""
    text_rows = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [list(headers), *text_rows]]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def format_fields(document: dict[str, Any]) -> str:
    """`key: value` lines, nested objects flattened with dots."""
    pairs = list(_flatten(document, ""))
    width = max((len(key) for key, _ in pairs), default=0)
    return "\n".join(f"{key + ':':<{width + 1}} {_cell(value)}" for key, value in pairs)


def _flatten(document: dict[str, Any], prefix: str) -> Iterable[tuple[str, Any]]:
    for key, value in document.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def format_grants(grants: Any) -> str:
    if not isinstance(grants, list):
        return _cell(grants)
    return "; ".join(f"{g.get('pattern')}:{','.join(g.get('privileges', []))}"
                     for g in grants if isinstance(g, dict))


def _lookup(document: dict[str, Any], dotted_key: str) -> Any:
    value: Any = document
    for part in dotted_key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def queue_table(queues: list[dict[str, Any]], placement: dict[str, Any] | None = None) -> str:
    """One row per queue with the statistics it reports; `placement` (the cluster map's
    queues) fills in master, replica and epoch where the statistics lack them."""
    rows = []
    for stats in queues:
        pair = (placement or {}).get(str(stats.get("name")), {})
        rows.append({key: _lookup(stats, key) if _lookup(stats, key) is not None else pair.get(key)
                     for _, key in QUEUE_COLUMNS})
    shown = [(header, key) for header, key in QUEUE_COLUMNS if any(row[key] is not None for row in rows)]
    return format_table([header for header, _ in shown], [[row[key] for _, key in shown] for row in rows])


def payload_fields(payload: bytes) -> dict[str, Any]:
    """A payload in JSON: as text when it is UTF-8, always as base64."""
    try:
        text: str | None = payload.decode()
    except UnicodeDecodeError:
        text = None
    return {"payload": text, "payload_b64": base64.b64encode(payload).decode()}


# --- argument parsing ---------------------------------------------------------------------------
def parse_grant(text: str) -> dict[str, Any]:
    """'orders.*:get,delete' -> {"pattern": "orders.*", "privileges": ["get", "delete"]}."""
    pattern, separator, privileges_text = text.rpartition(":")
    privileges = [p.strip() for p in privileges_text.split(",") if p.strip()]
    if not separator or not pattern or not privileges:
        raise argparse.ArgumentTypeError(f"a grant is PATTERN:PRIVILEGE[,PRIVILEGE...], not {text!r}")
    unknown = [p for p in privileges if p not in PRIVILEGES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown privilege {unknown[0]!r} (one of {', '.join(PRIVILEGES)})")
    return {"pattern": pattern, "privileges": privileges}


def _priority(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 9:
        raise argparse.ArgumentTypeError("a priority is 0 (lowest) to 9 (highest)")
    return value


def _add_globals(parser: argparse.ArgumentParser, *, in_subcommand: bool) -> None:
    """Global options, accepted before or after the command. In subcommands they default to
    SUPPRESS so an option given before the command is not overwritten by the default."""
    default: Any = argparse.SUPPRESS if in_subcommand else None
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS if in_subcommand else False,
                        help="print one JSON document on stdout")
    parser.add_argument("--credentials", metavar="PATH", default=default, help="credentials file")
    parser.add_argument("--url", default=default, help="node URL (default: the credentials' url)")
    parser.add_argument("--ca-file", metavar="PATH", default=default,
                        help="CA of the nodes' TLS certificates (default: the credentials' ca_file)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qctl", description="Operate a qserver cluster.")
    _add_globals(parser, in_subcommand=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
        _add_globals(sub, in_subcommand=True)
        sub.set_defaults(handler=handler)
        return sub

    status = command(commands, "status", cmd_status,
                     "the cluster map: nodes, membership leader, every queue's pair and lag (on a map of more than "
                     f"{STATUS_QUEUES_LISTED_MAX} queues: counts, and `qctl queue list` lists them)")
    status.add_argument("--all", action="store_true",
                        help=f"list every queue even on a map of more than {STATUS_QUEUES_LISTED_MAX} (slow on a large map)")
    handoff = command(commands, "handoff", cmd_handoff, "swap a queue's master and replica")
    handoff.add_argument("queue")
    handoff.add_argument("--initiator", choices=("master", "replica"), default="master",
                         help="which member asks (a replica's request may be refused)")
    promote = command(commands, "promote", cmd_promote, "promote the replica of a queue whose master is lost")
    promote.add_argument("queue")
    promote.add_argument("--unclean", action="store_true", required=True,
                         help="the replica is not known to be in sync: acknowledged messages may be lost "
                              "(recorded; the audit flags it)")
    command(commands, "rebalance", cmd_rebalance, "move replicas onto up nodes that hold fewer members (one back "
            "from a drain holds none), then hand masters over: both spread evenly")
    journal = commands.add_parser("journal", help="the node's audit journal")
    journal_commands = journal.add_subparsers(dest="journal_command", required=True, metavar="ACTION")
    command(journal_commands, "export", cmd_journal_export,
            "write the node's journal to Parquet now (for qaudit; --url picks the node)")
    nodes = commands.add_parser("nodes", help="add, drain and remove cluster nodes")
    node_commands = nodes.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")
    node_add = command(node_commands, "add", cmd_nodes_add, "enter a node in the cluster map")
    node_add.add_argument("node_id")
    node_add.add_argument("url")
    command(node_commands, "drain", cmd_nodes_drain,
            "hand off the node's masters and move its replicas away").add_argument("node_id")
    undrain_help = "a draining node serves again (up); then `qctl rebalance` brings it members and masters"
    undrain = node_commands.add_parser("undrain", aliases=["resume"], help=undrain_help, description=undrain_help)
    _add_globals(undrain, in_subcommand=True)
    undrain.set_defaults(handler=cmd_nodes_undrain)
    undrain.add_argument("node_id")
    command(node_commands, "remove", cmd_nodes_remove, "remove a drained node for good").add_argument("node_id")
    queue = commands.add_parser("queue", help="create, list, inspect and delete queues")
    queue_commands = queue.add_subparsers(dest="queue_command", required=True, metavar="ACTION")
    create = command(queue_commands, "create", cmd_queue_create, "create or open a queue")
    create.add_argument("name")
    create.add_argument("--strength", choices=STRENGTHS,
                        help="producer (default): an enqueue is on both members, each serves its own consumers; "
                             "full: consumption is replicated too")
    create.add_argument("--type", dest="queue_type", choices=QUEUE_TYPES,
                        help="queued_ack (default); one_way answers before the message is durable; one_way_ack and "
                             "two_way keep a completion status (two_way: with the consumer's reply)")
    create.add_argument("--max-depth", type=int, help="the most messages it holds; an enqueue past it is refused "
                                                      "with E_QUEUE_FULL (default 1,000,000)")
    create.add_argument("--visibility-timeout-s", type=float,
                        help="a received message's lease unless the receive names one (default 30)")
    create.add_argument("--max-deliveries", type=int,
                        help="deliveries before a message goes to the dead-letter queue NAME.dlq (default 10)")
    create.add_argument("--dead-letter", action=argparse.BooleanOptionalAction, default=None,
                        help="keep messages past --max-deliveries in NAME.dlq (default) or drop them")
    create.add_argument("--min-in-sync", type=int, choices=(1, 2),
                        help="2: refuse writes while the replica is out of sync instead of going on alone (default 1)")
    create.add_argument("--message-ttl-s", type=float, help="each message's time to live unless put with --ttl-s")
    create.add_argument("--fault-interval-s", type=float,
                        help="fault surveillance: a recipient that takes nothing this long while messages wait "
                             "is in fault, and its messages fail over to its alternatives")
    create.add_argument("--defunct-interval-s", type=float, help="in fault this long: its subscriptions end")
    create.add_argument("--message-interval-s", type=float, help="a message waiting this long fails over on its own")
    create.add_argument("--forward-rate", type=float,
                        help="as the root of forwards (seed 003): the messages/s they share (0: no control)")
    create.add_argument("--forward-interval-s", type=float, help="how often the root sends their rates (T, 2 s)")
    create.add_argument("--forward-mode", choices=("adaptive", "static"),
                        help="rates by the forwarders' fill levels (adaptive, the default) or R/n (static)")
    create.add_argument("--forward-bands", type=int, help="the fill-level bands a weight counts (10)")
    command(queue_commands, "list", cmd_queue_list, "every queue with its statistics")
    command(queue_commands, "stats", cmd_queue_stats, "one queue's statistics").add_argument("name")
    command(queue_commands, "delete", cmd_queue_delete, "delete a queue and its messages").add_argument("name")
    command(queue_commands, "purge", cmd_queue_purge,
            "take every message the queue holds now out of it, for good").add_argument("name")
    redrive = command(queue_commands, "redrive", cmd_queue_redrive, "move the queue's dead letters back into it")
    redrive.add_argument("name")
    redrive.add_argument("--limit", type=int, help="at most this many (default: all there are now)")
    move = command(queue_commands, "move", cmd_queue_move,
                   "put one member of a queue's pair on another node: afterwards NODE holds that member")
    move.add_argument("name")
    move.add_argument("--member", choices=("master", "replica"), required=True,
                      help="replica: a new member on NODE takes the queue by state transfer; master: the same for "
                           "the master's member, then a handoff makes NODE master (waits for the state transfer, "
                           "30 s at most); a member already on NODE: nothing to do; the other one: a handoff")
    move.add_argument("--to", required=True, metavar="NODE", help="the node it moves to")

    macro = commands.add_parser("macro", help="macro queues: one name over member queues (put and get use them "
                                              "as queues)")
    macro_commands = macro.add_subparsers(dest="macro_command", required=True, metavar="ACTION")
    macro_create = command(macro_commands, "create", cmd_macro_create, "define a macro queue and its policies")
    macro_create.add_argument("name")
    macro_create.add_argument("--producer", choices=PRODUCER_POLICIES, default="round_robin",
                              help="where an enqueue goes (default round_robin)")
    macro_create.add_argument("--consumer", choices=CONSUMER_POLICIES, default="prioritized",
                              help="where a receive leases from (default prioritized)")
    macro_create.add_argument("--fastest-by", choices=FASTEST_BY, default="response_time",
                              help="what the fastest producer policy compares")
    command(macro_commands, "list", cmd_macro_list, "every macro queue with its members")
    command(macro_commands, "describe", cmd_macro_describe, "one macro queue: policies, members, their pairs"
            ).add_argument("name")
    command(macro_commands, "delete", cmd_macro_delete, "forget a macro queue (its members stay)").add_argument("name")
    macro_add = command(macro_commands, "add", cmd_macro_add, "add a member queue, or set its priority and weight")
    macro_add.add_argument("name")
    macro_add.add_argument("queue")
    macro_add.add_argument("--priority", type=_priority, default=0, help="prioritized consumers drain 9 first")
    macro_add.add_argument("--weight", type=int, default=1, help="round_robin producers give it this many turns")
    macro_remove = command(macro_commands, "remove", cmd_macro_remove, "take a member queue out of a macro queue")
    macro_remove.add_argument("name")
    macro_remove.add_argument("queue")

    channel = commands.add_parser("channel", help="publish/subscribe channels: define, publish, listen")
    channel_commands = channel.add_subparsers(dest="channel_command", required=True, metavar="ACTION")
    channel_create = command(channel_commands, "create", cmd_channel_create,
                             "define a channel, or change its class or resend interval")
    channel_create.add_argument("name")
    channel_create.add_argument("--class", dest="delivery_class", choices=("latest", "acked", "durable"),
                                help="latest (default): the last value, best effort; acked: subscribers acknowledge")
    channel_create.add_argument("--resend-interval-s", type=float,
                                help="send the last value again after this long without a publish (0: never)")
    command(channel_commands, "list", cmd_channel_list, "every channel")
    command(channel_commands, "typeof", cmd_channel_typeof, "a channel's class, resend interval and master"
            ).add_argument("name")
    command(channel_commands, "delete", cmd_channel_delete, "delete a channel").add_argument("name")
    channel_publish = command(channel_commands, "publish", cmd_channel_publish, "publish one message")
    channel_publish.add_argument("name")
    channel_publish.add_argument("data", nargs="?", default="-",
                                 help="the payload, or - (default) to read it from stdin")
    channel_publish.add_argument("--empty", action="store_true",
                                 help="allow an empty payload from stdin (\"\" is one too)")
    channel_listen = command(channel_commands, "listen", cmd_channel_listen,
                             "subscribe and print what arrives (the last value first)")
    channel_listen.add_argument("names", nargs="+", metavar="name")
    channel_listen.add_argument("--durable", metavar="SUBSCRIPTION",
                                help="read this durable subscription (opened the first time), acknowledging "
                                     "each message once printed")
    channel_listen.add_argument("--count", type=int, default=1,
                                help="stop after this many messages (default 1); fewer within --wait-s: exit 1")
    channel_listen.add_argument("--wait-s", type=float, default=10.0,
                                help="give up when no message came for this long (default 10 s), printing what "
                                     "came and exiting 1 if that is fewer than --count")
    command(channel_commands, "subscriptions", cmd_channel_subscriptions,
            "a durable channel's subscriptions: floor, messages waiting, reader").add_argument("name")
    channel_drop = command(channel_commands, "drop", cmd_channel_drop, "end a durable subscription for good")
    channel_drop.add_argument("name")
    channel_drop.add_argument("subscription")

    recipient = commands.add_parser("recipient", help="push recipients: states and alternatives (fault surveillance)",
                                    description=RECIPIENT_HELP, epilog=RECIPIENT_SETUP,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    recipient_commands = recipient.add_subparsers(dest="recipient_command", required=True, metavar="ACTION")
    alternatives = command(recipient_commands, "alternatives", cmd_recipient_alternatives,
                           "show a recipient's chain of alternatives, or set it (--set, in order; --clear)")
    alternatives.epilog, alternatives.formatter_class = RECIPIENT_SETUP, argparse.RawDescriptionHelpFormatter
    alternatives.add_argument("name")
    alternatives.add_argument("--set", nargs="+", metavar="ALTERNATIVE[=QUEUE]", dest="chain",
                              help="the recipients that take over, in order; each consumes a queue of its own, "
                                   "which the chain binds it to (=QUEUE: needed for one that has not subscribed yet)")
    alternatives.add_argument("--clear", action="store_true", help="remove every alternative")
    command(recipient_commands, "list", cmd_recipient_list, "every recipient: its queue, state (ok, fault, "
            "defunct), why, and alternatives")
    command(recipient_commands, "remove", cmd_recipient_remove,
            "forget a recipient: its state and alternatives (what fault surveillance holds for it goes back to "
            "its queue)").add_argument("name")

    forward = commands.add_parser("forward", help="store-and-forward into a queue of another cluster (seed 003)")
    forward_commands = forward.add_subparsers(dest="forward_command", required=True, metavar="ACTION")
    forward_create = command(forward_commands, "create", cmd_forward_create,
                             "forward a `full` queue of this cluster into a queue of another cluster (or this one)")
    forward_create.add_argument("name")
    forward_create.add_argument("--source", required=True, help="the queue here whose messages are forwarded")
    forward_create.add_argument("--destination", required=True, help="the queue they go to (the root)")
    forward_create.add_argument("--remote-credentials", metavar="FILE",
                                help="a credentials file of a client registered in the destination's cluster "
                                     "(its url names that cluster); none: the destination is a queue of this cluster")
    forward_create.add_argument("--remote-url", action="append", default=[], dest="urls",
                                help="a node of the destination's cluster (repeat for more; default: the "
                                     "credentials' url)")
    command(forward_commands, "list", cmd_forward_list, "every forward and the node it runs on")
    command(forward_commands, "stats", cmd_forward_stats,
            "a forwarder's state, rate, weight and counts, from where it runs").add_argument("name")
    command(forward_commands, "delete", cmd_forward_delete, "stop and forget a forward").add_argument("name")

    put = command(commands, "put", cmd_put, "enqueue one message")
    put.add_argument("queue")
    put.add_argument("data", nargs="?", default="-", help="the payload, or - (default) to read it from stdin")
    put.add_argument("--empty", action="store_true", help="allow an empty payload from stdin (\"\" is one too)")
    put.add_argument("--priority", type=_priority, default=4, help="0 (lowest) to 9 (highest), default 4")
    put.add_argument("--dedupe-id", help="a put with the same id within the dedupe window is stored once")
    put.add_argument("--ttl-s", type=float, help="the message's time to live (default: the queue's)")
    put.add_argument("--delay-s", type=float, help="deliver it no sooner than this (at most 900)")
    put.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                     help="a header delivered with the message (repeat for more)")
    get = command(commands, "get", cmd_get, "lease (and with --ack delete) the next message")
    get.add_argument("queue")
    get.add_argument("--wait-s", type=float, default=0.0,
                     help="wait this long for a message when none is ready (default 0: answer at once)")
    get.add_argument("--visibility-timeout-s", type=float,
                     help="the lease: the message is invisible this long unless acked (default: the queue's)")
    get.add_argument("--ack", action="store_true",
                     help="acknowledge the message at once (needs the delete grant; without it the lease is released)")
    ack = command(commands, "ack", cmd_ack, "acknowledge (delete) a leased message")
    ack.add_argument("queue")
    ack.add_argument("message_id", type=int)
    ack.add_argument("receipt")
    extend = command(commands, "extend", cmd_extend, "give a leased message's lease a new duration from now")
    extend.add_argument("queue")
    extend.add_argument("message_id", type=int)
    extend.add_argument("receipt")
    extend.add_argument("--visibility-timeout-s", type=float, required=True,
                        help="the lease's new duration, counted from now (0: give the message back)")

    clients = commands.add_parser("clients", help="add, list and remove clients (key pairs and grants)")
    client_commands = clients.add_subparsers(dest="clients_command", required=True, metavar="ACTION")
    add = command(client_commands, "add", cmd_clients_add, "register a client with a new key pair")
    add.add_argument("name")
    add.add_argument("--grant", dest="grants", type=parse_grant, action="append", required=True,
                     metavar="PATTERN:PRIVILEGES",
                     help="privileges post, get, delete, admin on the queues PATTERN matches, e.g. a consumer's "
                          "'orders.*:get,delete' or a producer's 'orders.*:post' (repeatable)")
    add.add_argument("--out", type=Path, help="write the new client's credentials file here")
    command(client_commands, "list", cmd_clients_list, "registered clients and their grants")
    command(client_commands, "remove", cmd_clients_remove, "remove a client").add_argument("client_id")
    return parser


# --- commands ----------------------------------------------------------------------------------
Handler = Callable[[HttpClient, argparse.Namespace], Awaitable[Outcome]]


STATUS_QUEUES_LISTED_MAX = 200     # beyond this many queues `qctl status` shows the map's counts


async def cmd_status(http: HttpClient, args: argparse.Namespace) -> Outcome:
    if not args.all:
        # The map's counts first: they cost the nodes, not the map. A small map is then listed
        # whole as before; a large one is summarized (GET /v1/cluster?summary=1).
        summary = await http.cluster_summary()
        counts = summary.get("counts")
        if isinstance(counts, dict) and counts.get("queues", 0) > STATUS_QUEUES_LISTED_MAX:
            return status_summary(summary)
    cluster = await http.cluster()
    nodes = cluster.get("nodes", [])
    if not nodes or "version" not in cluster:          # a single node outside a cluster
        queues = await http.list_queues()
        node_table = format_table(["NODE", "URL", "STATE"], [[n.get("id"), n.get("url"), n.get("state")] for n in nodes])
        human = node_table + "\n\n" + (queue_table(queues, cluster.get("queues", {})) if queues else "no queues")
        return Outcome({"cluster": cluster, "queues": queues}, human)
    # Each master's node knows its replica's lag: ask every node that is up.
    lag: dict[str, Any] = {}
    for node in nodes:
        if node.get("state") != "up":
            continue
        try:
            async with HttpClient(node["url"], http._signer, ca_file=http.ca_file) as other:
                for name, entry in (await other.cluster()).get("queues", {}).items():
                    if "lag" in entry and entry.get("master") == node["id"]:
                        lag[name] = entry["lag"]
        except QueueError:
            continue
    leader = cluster.get("leader")
    raft = cluster.get("membership", {})
    voters, learners = set(raft.get("voters", [])), set(raft.get("learners", []))

    def membership_role(node_id: str | None) -> str:
        role = "voter" if node_id in voters else "learner" if node_id in learners else "-"
        return f"{role}, leader" if node_id == leader else role
    node_table = format_table(["NODE", "URL", "STATE", "MEMBERSHIP"],
                              [[n.get("id"), n.get("url"), n.get("state"), membership_role(n.get("id"))]
                               for n in nodes])
    queues = cluster.get("queues", {})
    for name, entry in queues.items():
        entry["lag"] = lag.get(name)
    queue_rows = [[name, e.get("options", {}).get("strength"), e.get("master"), e.get("replica"), e.get("epoch"),
                   "yes" if e.get("in_sync") else "NO", e.get("lag"), e.get("last_reason"),
                   e.get("unclean_promotions") or ""] for name, e in sorted(queues.items())]
    queue_text = format_table(["QUEUE", "STRENGTH", "MASTER", "REPLICA", "EPOCH", "IN_SYNC", "LAG", "LAST_CHANGE",
                               "UNCLEAN"], queue_rows) if queue_rows else "no queues"
    human = f"membership leader: {leader or 'none'} (term {cluster.get('term')})\n\n{node_table}\n\n{queue_text}"
    macros = cluster.get("macros", {})
    if macros:
        human += "\n\n" + format_table(["MACRO", "PRODUCER", "CONSUMER", "MEMBERS"], [
            [name, m["producer"] + (f" ({m['fastest_by']})" if m["producer"] == "fastest" else ""), m["consumer"],
             ", ".join(member["queue"] for member in m["members"]) or "-"] for name, m in sorted(macros.items())])
    channels = cluster.get("channels", {})
    if channels:
        human += "\n\n" + format_table(["CHANNEL", "CLASS", "RESEND_S", "MASTER"], [
            [name, c["class"], c.get("resend_interval_s") or "", queues.get(c["queue"], {}).get("master")]
            for name, c in sorted(channels.items())])
    recipients = cluster.get("recipients", {})
    if recipients:
        human += "\n\n" + format_table(["RECIPIENT", "QUEUE", "STATE", "SINCE", "REASON"], [
            [name, r["queue"], r["state"].upper() if r["state"] != "ok" else "ok",
             time.strftime("%H:%M:%S", time.localtime(r["since_ms"] / 1000)), r.get("reason") or ""]
            for name, r in sorted(recipients.items())])
    return Outcome(cluster, human)


def status_summary(summary: dict[str, Any]) -> Outcome:
    """`qctl status` on a large map: its nodes with how many queues each masters and
    replicates, and the map's counts; the JSON document is the server's summary."""
    counts = summary["counts"]
    leader = summary.get("leader")
    raft = summary.get("membership", {})
    voters, learners = set(raft.get("voters", [])), set(raft.get("learners", []))
    nodes = summary.get("nodes", [])
    if "version" not in summary:          # a single node outside a cluster
        return Outcome(summary, format_table(["NODE", "URL", "STATE"], [[n.get("id"), n.get("url"), n.get("state")]
                                                                        for n in nodes])
                       + f"\n\n{counts['queues']} queues: `qctl queue list` lists them")

    def membership_role(node_id: str | None) -> str:
        role = "voter" if node_id in voters else "learner" if node_id in learners else "-"
        return f"{role}, leader" if node_id == leader else role
    node_table = format_table(["NODE", "URL", "STATE", "MEMBERSHIP", "MASTERS", "REPLICAS"],
                              [[n.get("id"), n.get("url"), n.get("state"), membership_role(n.get("id")),
                                n.get("masters"), n.get("replicas")] for n in nodes])
    lines = [f"membership leader: {leader or 'none'} (term {summary.get('term')})", "", node_table, "",
             f"{counts['queues']} queues, {counts['out_of_sync']} with a replica out of sync; "
             f"{counts['macros']} macro queues, {counts['channels']} channels, {counts['forwards']} forwards, "
             f"{counts['recipients']} recipients ({counts['recipients_not_ok']} not ok)",
             "`qctl queue list` lists every queue, `qctl status --all` the whole map"]
    out_of_sync = summary.get("out_of_sync") or []
    if out_of_sync:
        more = counts["out_of_sync"] - len(out_of_sync)
        lines.append("out of sync: " + ", ".join(out_of_sync) + (f" (and {more} more)" if more > 0 else ""))
    not_ok = summary.get("recipients_not_ok") or []
    if not_ok:
        more = counts["recipients_not_ok"] - len(not_ok)
        lines.append("recipients not ok: " + ", ".join(not_ok) + (f" (and {more} more)" if more > 0 else ""))
    return Outcome(summary, "\n".join(lines))


async def cmd_handoff(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.handoff(args.queue, args.initiator)
    return Outcome(answer, f"{args.queue}: master {answer.get('master')}, replica {answer.get('replica')}, "
                           f"epoch {answer.get('epoch')}" + (f", writes paused {answer['pause_ms']} ms"
                                                             if "pause_ms" in answer else ""))


async def cmd_promote(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.promote(args.queue, unclean=args.unclean)
    return Outcome(answer, f"{args.queue}: {answer.get('master')} promoted (epoch {answer.get('epoch')}, unclean)")


MOVE_DONE = {
    "already_there": "{to} holds the {member} already: nothing moved",
    "moved": "the new replica on {to} catches up by state transfer",
    "handed_off": "{to} held the other member: a handoff swapped them",
    "moved_and_handed_off": "a member on {to} took the queue by state transfer, then a handoff made it master",
}


async def cmd_queue_move(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.move_queue(args.name, args.member, args.to)
    done = MOVE_DONE.get(answer.get("how", "moved"), "").format(to=args.to, member=args.member)
    return Outcome(answer, f"{args.name}: master {answer.get('master')}, replica {answer.get('replica')} "
                           f"(epoch {answer.get('epoch')}); {done}")


async def cmd_rebalance(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.rebalance()
    moves, chosen = answer.get("moves", []), answer.get("handoffs", [])
    catching_up = answer.get("catching_up", [])
    lines = [f"moved the replica of {m['queue']} from {m['from']} to {m['to']}" for m in moves]
    if chosen:
        lines.append(f"handing off {len(chosen)} queue(s) to their replicas: {', '.join(chosen)} (see qctl status)")
    if catching_up:
        lines.append(f"still catching up (no handoff for them yet): {', '.join(catching_up)}; "
                     "run qctl rebalance again once qctl status shows them in sync")
    return Outcome(answer, "\n".join(lines) or "already balanced: no replica move or handoff would "
                                               "spread members or masters more evenly")


async def cmd_journal_export(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.export_journal()
    written = answer.get("segments_written", [])
    return Outcome(answer, f"{answer.get('node')}: {len(written)} segment(s) written to {answer.get('destination')}, "
                           f"exported through sequence {answer.get('exported_through')}, "
                           f"{answer.get('pruned', 0)} record(s) pruned")


KNOWN_NODE_HINTS = {
    "up": "nothing to do",
    "draining": "to make it serve again: qctl nodes undrain {node}",
    "down": "it is set up again by itself once it runs and renews its lease",
}


async def cmd_nodes_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.add_node(args.node_id, args.url)
    if not answer.get("known"):
        return Outcome(answer, f"node {args.node_id} added")
    state = answer.get("state", "?")
    hint = KNOWN_NODE_HINTS.get(state, "").format(node=args.node_id)
    url = f"its url is now {answer.get('url')}" if answer.get("url_changed") else f"url {answer.get('url')}"
    return Outcome(answer, f"node {args.node_id} is already in the cluster (state {state}, {url})"
                           + (f"; {hint}" if hint else ""))


async def cmd_nodes_drain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.drain_node(args.node_id),
                   f"node {args.node_id} draining: its masters hand off, its replicas move (see qctl status); "
                   f"qctl nodes undrain {args.node_id} makes it serve again")


async def cmd_nodes_undrain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.undrain_node(args.node_id),
                   f"node {args.node_id} is up again: it takes new queues, and qctl rebalance moves members "
                   "and masters onto it")


async def cmd_nodes_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.remove_node(args.node_id), f"node {args.node_id} removed")


async def cmd_queue_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    description = await http.create_queue(
        args.name, strength=args.strength, type=args.queue_type, max_depth=args.max_depth,
        visibility_timeout_s=args.visibility_timeout_s, max_deliveries=args.max_deliveries,
        dead_letter=args.dead_letter, min_in_sync=args.min_in_sync, message_ttl_s=args.message_ttl_s,
        fault_interval_s=args.fault_interval_s, defunct_interval_s=args.defunct_interval_s,
        message_interval_s=args.message_interval_s, forward_rate=args.forward_rate,
        forward_interval_s=args.forward_interval_s, forward_mode=args.forward_mode, forward_bands=args.forward_bands)
    return Outcome(description, format_fields(created_summary(description)))


def created_summary(description: dict[str, Any]) -> dict[str, Any]:
    """What a person set when creating a queue: its name, strength, type, the options that
    differ from the defaults and where its pair lives. The rest (counters, replication
    internals) is in --json and `qctl queue stats`."""
    options = description.get("options") or {}
    state = "created" if description.get("created") else "it existed: opened"
    summary: dict[str, Any] = {"queue": f"{description.get('name')} ({state})",
                               "strength": options.get("strength"), "type": options.get("type")}
    summary.update({name: value for name, value in options.items()
                    if name not in ("strength", "type") and name in DEFAULT_OPTIONS and value != DEFAULT_OPTIONS[name]})
    summary.update(master=description.get("master"), replica=description.get("replica"))
    return summary


async def cmd_queue_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    queues = await http.list_queues()
    return Outcome({"queues": queues}, queue_table(queues) if queues else "no queues")


async def cmd_queue_stats(http: HttpClient, args: argparse.Namespace) -> Outcome:
    stats = await http.queue_stats(args.name)
    return Outcome(stats, format_fields(stats))


async def cmd_queue_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.delete_queue(args.name)
    return Outcome(answer, f"deleted {args.name}")


async def cmd_queue_purge(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.purge(args.name)
    return Outcome(answer, f"purged {answer['purged']} messages from {args.name}{_each_member(answer)}")


def _each_member(answer: dict[str, Any]) -> str:
    """What each member did, when the operation ran on each member's own copy (`producer`)."""
    members = answer.get("members")
    return "" if not members else " (" + ", ".join(f"{node}: {did}" for node, did in sorted(members.items())) + ")"


def read_payload(args: argparse.Namespace) -> bytes:
    """The payload argument, or stdin for "-". A terminal is told that stdin is read (it would
    otherwise wait in silence), and an empty stdin (say /dev/null, or a pipe whose writer failed)
    is refused unless --empty says it is meant; an explicit "" argument is meant."""
    if args.data != "-":
        return args.data.encode()
    if sys.stdin.isatty():
        print("reading the payload from stdin: end it with Ctrl-D (or give it as an argument)", file=sys.stderr)
    payload = sys.stdin.buffer.read()
    if not payload and not args.empty:
        raise QueueError(E_INVALID_OPTION, 'the payload from stdin is empty: pass --empty (or "") to send an empty '
                                           "message")
    return payload


async def cmd_put(http: HttpClient, args: argparse.Namespace) -> Outcome:
    payload = read_payload(args)
    answer = await http.enqueue_answer(args.queue, payload, args.priority, args.dedupe_id, ttl_s=args.ttl_s,
                                       delay_s=args.delay_s, headers=_headers(args.header))
    if "macro" not in answer:
        return Outcome({"queue": args.queue, "id": answer["id"]}, f"id: {answer['id']}")
    copies = answer["copies"]          # a macro queue: its producer policy chose the member(s)
    return Outcome(answer, f"id: {answer['id']} in {answer['queue']}" + (f" (copies: {copies})" if len(copies) > 1
                                                                          else ""))


def _headers(given: list[str]) -> dict[str, str] | None:
    """--header NAME=VALUE, repeated."""
    headers = {}
    for item in given:
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise QueueError(E_INVALID_OPTION, f"--header takes NAME=VALUE, not {item!r}")
        headers[name] = value
    return headers or None


async def cmd_get(http: HttpClient, args: argparse.Namespace) -> Outcome:
    found = await http.receive_from(args.queue, args.wait_s, args.visibility_timeout_s)
    if found is None:
        return Outcome(None, "no message")
    queue, message = found          # on a macro queue, the member its consumer policy chose
    if args.ack:
        await http.ack_http(queue, message.message_id, message.receipt)
    document = {"queue": queue, "id": message.message_id, "receipt": message.receipt,
                "priority": message.priority, "deliveries": message.deliveries,
                "headers": message.headers or {}, "acked": bool(args.ack), **payload_fields(message.payload)}
    shown = {key: value for key, value in document.items() if key not in ("payload", "payload_b64")}
    shown["payload"] = message.payload.decode(errors="backslashreplace")
    return Outcome(document, format_fields(shown))


async def cmd_ack(http: HttpClient, args: argparse.Namespace) -> Outcome:
    await http.ack_http(args.queue, args.message_id, args.receipt)
    return Outcome({"queue": args.queue, "acked": args.message_id}, f"acked {args.message_id}")


async def cmd_extend(http: HttpClient, args: argparse.Namespace) -> Outcome:
    await http.extend_http(args.queue, args.message_id, args.receipt, args.visibility_timeout_s)
    return Outcome({"queue": args.queue, "extended": args.message_id, "visibility_timeout_s": args.visibility_timeout_s},
                   f"extended {args.message_id} by {args.visibility_timeout_s:g} s from now")


async def cmd_forward_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    urls, credentials = list(args.urls), None
    if args.remote_credentials:
        remote = load_credentials(args.remote_credentials)
        credentials = {"client_id": remote.client_id, "private_key": remote.private_key_text,
                       "ca_file": remote.ca_file}       # the other cluster's CA, for the forward's TLS
        urls = urls or [remote.url]
    answer = await http.create_forward(args.name, args.source, args.destination, urls=urls, credentials=credentials)
    where = f" at {', '.join(answer['urls'])} as {answer['client_id']}" if answer.get("urls") else ""
    return Outcome(answer, f"forward {args.name}: {args.source} -> {args.destination}{where}")


async def cmd_forward_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    forwards = await http.forwards()
    lines = [f"{f['name']}: {f['source']} -> {f['destination']}"
             + (f" at {', '.join(f['urls'])}" if f["urls"] else "") + f" (runs on {f['runs_on']})" for f in forwards]
    return Outcome({"forwards": forwards}, "\n".join(lines) or "no forwards")


async def cmd_forward_stats(http: HttpClient, args: argparse.Namespace) -> Outcome:
    stats = await http.forward_stats(args.name)
    return Outcome(stats, format_fields(forward_stats_shown(stats, time.time())))


def forward_stats_shown(stats: dict[str, Any], now_s: float) -> dict[str, Any]:
    """Forward statistics for people: times as local ISO times with their age, the streams'
    floors by priority; the rate trace and the root's terms stay in --json."""
    shown: dict[str, Any] = {}
    for key, value in stats.items():
        if key in ("rate_trace", "terms"):
            continue
        if key.endswith("_ms") and isinstance(value, (int, float)) and value > 0:
            shown[key.removesuffix("_ms")] = when_text(value / 1000, now_s)
        elif key == "floors" and isinstance(value, dict):
            # A stream's floor: the lowest id of its priority the source still held (docs/PROTOCOL.md).
            shown["floors"] = ", ".join(f"priority {priority} from id {floor}" for priority, floor in value.items()) \
                or "-"
        else:
            shown[key] = value
    return shown


def when_text(at_s: float, now_s: float) -> str:
    """'2026-05-04T10:16:44+02:00 (3 min ago)': a moment in local time, and how long ago."""
    stamp = datetime.fromtimestamp(at_s).astimezone().isoformat(timespec="seconds")
    return f"{stamp} ({duration_text(now_s - at_s)} ago)" if now_s >= at_s else f"{stamp} (in {duration_text(at_s - now_s)})"


def duration_text(seconds: float) -> str:
    """In its largest whole unit: '45 s', '3 min', '2 h', '5 d'."""
    for unit_s, unit in ((86_400, "d"), (3_600, "h"), (60, "min")):
        if seconds >= unit_s:
            return f"{int(seconds // unit_s)} {unit}"
    return f"{int(seconds)} s"


async def cmd_forward_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.delete_forward(args.name), f"forward {args.name} deleted")


RECIPIENT_HELP = """\
Fault surveillance of push recipients (seed 001). A recipient consumes a queue under a name
(consume(queue, recipient=NAME) in the client library); if it takes no message for its queue's
--fault-interval-s while messages wait, it is in fault, and what waits fails over to the first of
its alternatives that is ok (else back to its sender), until it takes a message again."""
RECIPIENT_SETUP = """\
the setup that works: each alternative consumes a queue of its own
  qctl queue create invoices --strength full --fault-interval-s 5
  qctl queue create invoices-b --strength full --fault-interval-s 5
  qctl recipient alternatives billing-a --set billing-b=invoices-b
  # billing-a consumes invoices, billing-b consumes invoices-b
While billing-a is in fault, what waits in invoices moves to invoices-b; once billing-a takes
a message again, what comes next is its own again. An alternative that consumes the same queue
(billing-b on invoices) is a second consumer of the same messages, which the mover cannot tell
apart: it moves none to billing-b, and billing-b, judged by what waits in invoices (billing-a's
probe, what the mover holds) though offered none of it, ends in fault too; the messages then
stay with the mover."""


async def cmd_recipient_alternatives(http: HttpClient, args: argparse.Namespace) -> Outcome:
    if args.clear or args.chain:
        answer = await http.set_alternatives(args.name, [] if args.clear else args.chain)
    else:
        answer = {"recipient": args.name, "alternatives": await http.alternatives(args.name)}
    named = [f"{name} ({queue})" for name, queue in zip(answer["alternatives"], answer.get("queues", ()), strict=False)]
    return Outcome(answer, f"{args.name}: " + (" -> ".join(named or answer["alternatives"]) or "no alternatives"))


async def cmd_recipient_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    recipients = await http.recipients()
    queues = {r["recipient"]: r.get("queue") for r in recipients}
    return Outcome({"recipients": recipients},
                   "\n".join(_recipient_text(r, queues) for r in recipients) or "no recipients")


def _recipient_text(recipient: dict[str, Any], queues: dict[str, str | None]) -> str:
    """One line; an alternative that consumes the recipient's own queue is marked: the mover
    never moves a message to it (see RECIPIENT_SETUP)."""
    state = f"{recipient['state']} on {recipient['queue']}" if recipient.get("state") else "never subscribed"
    why = f" ({recipient['reason']})" if recipient.get("reason") and recipient.get("state") != "ok" else ""
    chain = " -> ".join(other + (" (same queue: never used)" if recipient.get("queue")
                                 and queues.get(other) == recipient["queue"] else "")
                        for other in recipient["alternatives"])
    return f"{recipient['recipient']}: {state}{why}" + (f", alternatives {chain}" if chain else "")


async def cmd_recipient_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_recipient(args.name)
    named_by = answer.get("named_by") or []
    still = f"; still named in the alternatives of {', '.join(named_by)}" if named_by else ""
    return Outcome(answer, f"recipient {args.name} removed{still}")


async def cmd_channel_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.put_channel(args.name, args.delivery_class, args.resend_interval_s)
    return Outcome(answer, _channel_text(answer))


async def cmd_channel_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    channels = await http.list_channels()
    return Outcome({"channels": channels}, "\n".join(_channel_text(c) for c in channels) or "no channels")


async def cmd_channel_typeof(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.channel(args.name)
    return Outcome(answer, _channel_text(answer))


async def cmd_channel_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.delete_channel(args.name), f"deleted channel {args.name}")


async def cmd_channel_publish(http: HttpClient, args: argparse.Namespace) -> Outcome:
    payload = read_payload(args)
    answer = await http.publish_http(args.name, payload)
    return Outcome(answer, f"id: {answer['id']}")


async def cmd_channel_listen(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """A subscriber through the client library (subscribing is on the WebSocket)."""
    received: list[dict[str, Any]] = []
    async with AsyncClient(http.url, load_credentials(args.credentials), ca_file=args.ca_file) as client:
        await client.subscribe(*args.names, durable=args.durable)
        while len(received) < args.count:
            try:
                message = await asyncio.wait_for(client.next_channel_message(), args.wait_s)
            except TimeoutError:
                break
            received.append({"channel": message.channel, "id": message.id, "resent": message.resent,
                             **payload_fields(message.payload)})
            if args.durable is not None:
                await message.ack()
    lines = [f"{m['channel']} {m['id']}{' (resent)' if m['resent'] else ''}: "
             + (m.get("payload") or m.get("payload_b64", "")) for m in received]
    shortfall = None if len(received) >= args.count else QueueError(
        E_TIMEOUT, f"{len(received)} of {args.count} messages came, then none for {args.wait_s:g} s (--wait-s)")
    return Outcome({"messages": received}, "\n".join(lines) or "no message", shortfall)


async def cmd_channel_subscriptions(http: HttpClient, args: argparse.Namespace) -> Outcome:
    listed = await http.subscriptions(args.name)
    lines = [f"{s['name']}: {s['waiting']} waiting, acknowledged up to {s['floor']}, "
             + (f"read here ({s['unacknowledged']} unacknowledged)" if s["attached"] else "no reader")
             for s in listed]
    return Outcome({"channel": args.name, "subscriptions": listed}, "\n".join(lines) or "no durable subscription")


async def cmd_channel_drop(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.drop_subscription(args.name, args.subscription)
    return Outcome(answer, f"dropped durable subscription {args.subscription} of {args.name}")


def _channel_text(channel: dict[str, Any]) -> str:
    resend = f", resent every {channel['resend_interval_s']:g} s" if channel.get("resend_interval_s") else ""
    return (f"{channel['name']}: {channel['class']}{resend}, master {channel.get('master', '?')}, "
            f"replica {channel.get('replica', '?')}")


async def cmd_macro_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.create_macro(args.name, args.producer, args.consumer, args.fastest_by)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    macros = await http.list_macros()
    return Outcome({"macros": macros}, "\n\n".join(_macro_text(m) for m in macros) or "no macro queues")


async def cmd_macro_describe(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.macro(args.name)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.delete_macro(args.name)
    return Outcome(answer, f"deleted macro queue {args.name} (its members stay)")


async def cmd_macro_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.add_macro_member(args.name, args.queue, args.priority, args.weight)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_macro_member(args.name, args.queue)
    return Outcome(answer, _macro_text(answer))


def _macro_text(macro: dict[str, Any]) -> str:
    lines = [f"{macro['name']}: producer {macro['producer']}"
             + (f" by {macro['fastest_by']}" if macro["producer"] == "fastest" else "")
             + f", consumer {macro['consumer']}"]
    for member in macro.get("members", []):
        lines.append(f"  {member['queue']}: priority {member['priority']}, weight {member['weight']}, "
                     f"master {member.get('master', '?')}, replica {member.get('replica', '?')}")
    return "\n".join(lines)


async def cmd_queue_redrive(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.redrive(args.name, args.limit)
    stopped = f"; stopped by {answer['stopped']}" if answer.get("stopped") else ""
    return Outcome(answer, f"moved {answer['redriven']} dead letters back into {args.name}{_each_member(answer)}{stopped}")


async def cmd_clients_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """The key pair is made here, so the server only ever sees the public key."""
    key = new_private_key()
    answer = await http.register_client(args.name, args.grants, public_key_text(key))
    private_text = answer.pop("private_key", None) or private_key_to_text(key)
    document = dict(answer)
    if args.out is not None:
        save_credentials(args.out, Credentials(str(answer["id"]), private_text, http.url, http.ca_file))
        document["credentials_file"] = str(args.out)
    else:
        document["private_key"] = private_text  # shown once: nowhere else keeps it
    document["grants"] = answer.get("grants", args.grants)
    human = format_fields({**document, "grants": format_grants(document["grants"])})
    return Outcome(document, human)


async def cmd_clients_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    clients = await http.list_clients()
    rows = [[c.get("id"), c.get("name"), format_grants(c.get("grants"))] for c in clients]
    return Outcome({"clients": clients}, format_table(["ID", "NAME", "GRANTS"], rows))


async def cmd_clients_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_client(args.client_id)
    return Outcome(answer or {"removed": args.client_id}, f"removed {args.client_id}")


# --- entry point ---------------------------------------------------------------------------------
async def run_command(args: argparse.Namespace) -> Outcome:
    source = find_credentials(args.credentials)
    creds = load_credentials(source)
    url = args.url or creds.url
    try:
        async with HttpClient(url, creds.signer(), ca_file=args.ca_file or creds.ca_file) as http:
            handler: Handler = args.handler
            return await handler(http, args)
    except QueueError as error:
        # An unknown client or an unreachable URL is most often a credentials file of another
        # cluster: say which file was used, whose it is, and how to get the right one.
        raise explain_refusal(error, source, creds, url) from None


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return exc.code if isinstance(exc.code, int) else 2
    try:
        outcome = asyncio.run(run_command(args))
    except QueueError as error:
        if args.json:
            print(json.dumps(error.envelope()), file=out)
        print(f"error: {error.code}: {error.message}", file=err)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        if args.json:
            print(json.dumps(outcome.document, indent=2, sort_keys=True), file=out)
        else:
            print(outcome.human, file=out)
        out.flush()
    except BrokenPipeError:  # `qctl ... | head`: the reader left; nothing more to say
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - keeps Python's exit flush quiet
    if outcome.shortfall is not None:
        print(f"error: {outcome.shortfall.code}: {outcome.shortfall.message}", file=err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
