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

The parser and the entry point are here; the commands are in groups (qctl_cluster.py,
qctl_queues.py, qctl_features.py) and qctl_render.py shows what they produce.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from client.credentials import explain_refusal, find_credentials, load_credentials
from client.http import HttpClient
from client.macro import CONSUMER_POLICIES, FASTEST_BY, PRODUCER_POLICIES
from client.qctl_access_keys import add_parser as add_access_key_parser
from client.qctl_cluster import (
    STATUS_QUEUES_LISTED_MAX,
    cmd_clients_add,
    cmd_clients_list,
    cmd_clients_remove,
    cmd_handoff,
    cmd_journal_export,
    cmd_node_drain,
    cmd_node_undrain,
    cmd_nodes_add,
    cmd_nodes_drain,
    cmd_nodes_remove,
    cmd_nodes_undrain,
    cmd_promote,
    cmd_queue_move,
    cmd_rebalance,
    cmd_status,
)
from client.qctl_console import add_parser as add_console_parser
from client.qctl_definitions import add_parser as add_definitions_parser
from client.qctl_events import add_parser as add_events_parser
from client.qctl_features import (
    RECIPIENT_HELP,
    RECIPIENT_SETUP,
    add_forward_control_options,
    cmd_channel_create,
    cmd_channel_delete,
    cmd_channel_drop,
    cmd_channel_list,
    cmd_channel_listen,
    cmd_channel_publish,
    cmd_channel_subscriptions,
    cmd_channel_typeof,
    cmd_forward_create,
    cmd_forward_delete,
    cmd_forward_list,
    cmd_forward_set,
    cmd_forward_stats,
    cmd_macro_add,
    cmd_macro_create,
    cmd_macro_delete,
    cmd_macro_describe,
    cmd_macro_list,
    cmd_macro_remove,
    cmd_recipient_alternatives,
    cmd_recipient_list,
    cmd_recipient_remove,
)
from client.qctl_node import add_node_stats_parser, with_failed_queues
from client.qctl_peek import add_parser as add_peek_parser
from client.qctl_queues import add_create_options as add_queue_create_options
from client.qctl_queues import add_set_parser as add_queue_set_parser
from client.qctl_queues import (
    cmd_ack,
    cmd_extend,
    cmd_get,
    cmd_put,
    cmd_queue_create,
    cmd_queue_delete,
    cmd_queue_list,
    cmd_queue_purge,
    cmd_queue_redrive,
    cmd_queue_stats,
)
from client.qctl_render import Handler, Outcome
from client.qctl_upgrade import add_parser as add_upgrade_parser
from client.qctl_views import add_view_parser
from wire import versions
from wire.errors import QueueError
from wire.message_input import PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN

PRIVILEGES = ("post", "get", "delete", "admin")
QUEUE_TYPES = ("one_way", "one_way_ack", "queued_ack", "two_way")
STRENGTHS = ("producer", "full")


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
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise argparse.ArgumentTypeError(f"a priority is {PRIORITY_MIN} (lowest) to {PRIORITY_MAX} (highest)")
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
    parser.add_argument("--version", action="version",
                        version=f"qctl {versions.RELEASE} (client protocol {versions.CLIENT_PROTOCOL.render()})")
    _add_globals(parser, in_subcommand=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
        _add_globals(sub, in_subcommand=True)
        sub.set_defaults(handler=handler)
        return sub

    status = command(commands, "status", with_failed_queues(cmd_status),
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
            "decommissioning drain: hand off the node's masters and move its replicas away (for a node "
            "leaving for good; for maintenance or an upgrade: qctl node drain)").add_argument("node_id")
    undrain_help = "a draining node serves again (up); then `qctl rebalance` brings it members and masters"
    undrain = node_commands.add_parser("undrain", aliases=["resume"], help=undrain_help, description=undrain_help)
    _add_globals(undrain, in_subcommand=True)
    undrain.set_defaults(handler=cmd_nodes_undrain)
    undrain.add_argument("node_id")
    command(node_commands, "remove", cmd_nodes_remove, "remove a drained node for good").add_argument("node_id")
    node = commands.add_parser("node", help="maintenance of one node: drain it before a stop or an upgrade, "
                                            "undrain it after")
    one_node = node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    node_drain = command(one_node, "drain", cmd_node_drain,
                         "maintenance drain: hand the node's masters off to their in-sync replicas and wait until it "
                         "masters none; its replicas stay (it catches up by log after a restart). Refused "
                         "(E_DRAIN_REFUSED) when a queue would be left without an in-sync copy")
    node_drain.add_argument("node_id")
    node_drain.add_argument("--timeout-s", type=float, default=60.0,
                            help="give up (E_TIMEOUT, the node stays in maintenance) after this long (default 60)")
    node_drain.add_argument("--move-replicas", action="store_true",
                            help="the decommissioning drain instead (= qctl nodes drain): replicas move away too")
    node_undrain = command(one_node, "undrain", cmd_node_undrain,
                           "end the node's maintenance (or a decommissioning drain): it may take masters again")
    node_undrain.add_argument("node_id")
    node_undrain.add_argument("--rebalance", action="store_true", help="then hand masters back to spread them evenly")
    add_node_stats_parser(one_node, command)    # node stats (GET /v1/node, client/qctl_node.py)
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
    add_queue_create_options(create)                # --delay-s, --receive-wait-s (client/qctl_queues.py)
    add_queue_set_parser(queue_commands, command)   # queue set: change options of an existing queue
    add_view_parser(queue_commands, command)        # queue view create|delete|list (client/qctl_views.py)
    command(queue_commands, "list", cmd_queue_list, "every queue with its statistics").add_argument(
        "--match", default="", help="only the queues whose name contains this (filtered on the node; 0.3.0 nodes)")
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
                              help="where a receive leases from (default prioritized; highest_priority: "
                                   "the message's own priority across members, after `qctl cluster finalize`)")
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
                             "define a channel, or change its class, resend interval or attributes")
    channel_create.add_argument("name")
    channel_create.add_argument("--class", dest="delivery_class", choices=("latest", "acked", "durable"),
                                help="latest (default): the last value, best effort; acked: subscribers acknowledge")
    channel_create.add_argument("--resend-interval-s", type=float,
                                help="send the last value again after this long without a publish (0: never)")
    # What the data is like (seed 002 characterize): the channel's master chooses how it travels.
    channel_create.add_argument("--size-bytes", type=int, help="the typical payload's size")
    channel_create.add_argument("--per-second", type=float, help="how many publishes a second")
    channel_create.add_argument("--loss-tolerant", action=argparse.BooleanOptionalAction, default=None,
                                help="a lost message is replaced by the next one soon enough")
    channel_create.add_argument("--skip-last-value", action=argparse.BooleanOptionalAction, default=None,
                                help="subscribing does not send the last value")
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
    add_forward_control_options(forward_create)
    forward_set = command(forward_commands, "set", cmd_forward_set,
                          "change a forward's own fill bands, weights and fill unit (seed 003 figure 6)")
    forward_set.add_argument("name")
    add_forward_control_options(forward_set, changing=True)
    command(forward_commands, "list", cmd_forward_list, "every forward and the node it runs on")
    command(forward_commands, "stats", cmd_forward_stats,
            "a forwarder's state, rate, weight and counts, from where it runs").add_argument("name")
    command(forward_commands, "delete", cmd_forward_delete, "stop and forget a forward").add_argument("name")

    put = command(commands, "put", cmd_put, "enqueue one message")
    put.add_argument("queue")
    put.add_argument("data", nargs="?", default="-", help="the payload, or - (default) to read it from stdin")
    put.add_argument("--empty", action="store_true", help="allow an empty payload from stdin (\"\" is one too)")
    put.add_argument("--priority", type=_priority, default=PRIORITY_DEFAULT, help="0 (lowest) to 9 (highest), default 4")
    put.add_argument("--dedupe-id", help="a put with the same id within the dedupe window is stored once")
    put.add_argument("--ttl-s", type=float, help="the message's time to live (default: the queue's)")
    put.add_argument("--delay-s", type=float, help="deliver it no sooner than this (at most 900)")
    put.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                     help="a header delivered with the message (repeat for more)")
    put.add_argument("--wait", choices=("ack", "reply"),
                     help="then wait for the consumer: ack (one_way_ack, two_way queues) or reply (two_way)")
    put.add_argument("--timeout-s", type=float, default=30.0,
                     help="with --wait: give up after this long (E_WAIT_TIMEOUT; the message stays queued)")
    get = command(commands, "get", cmd_get, "lease (and with --ack delete) the next message")
    get.add_argument("queue")
    get.add_argument("--wait-s", type=float, default=0.0,
                     help="wait this long for a message when none is ready (default 0: answer at once)")
    get.add_argument("--visibility-timeout-s", type=float,
                     help="the lease: the message is invisible this long unless acked (default: the queue's)")
    get.add_argument("--ack", action="store_true",
                     help="acknowledge the message at once (needs the delete grant; without it the lease is released)")
    get.add_argument("--view", help="through this virtual queue of QUEUE (no --wait-s)")
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

    clients = commands.add_parser("clients", aliases=["client"],
                                  help="add, list and remove clients (key pairs and grants), their access keys")
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
    add_access_key_parser(client_commands, command)     # clients access-key create|list|revoke
    add_upgrade_parser(commands, command)       # cluster versions, cluster finalize
    add_definitions_parser(commands, command)   # definitions export, definitions import
    add_console_parser(commands, command)       # console (a sign-in link to the web console)
    add_peek_parser(commands, command)          # peek (browse a queue's messages without taking them)
    add_events_parser(commands, command)        # events (the cluster event feed)
    return parser


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
