"""`qctl` commands of queues and their messages: queue create, set, list, stats, delete, purge,
redrive, and put, get, ack, extend (with reading a payload from the command line or stdin).

One of the command groups client/qctl.py's parser dispatches to (qctl_render.py renders).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome, format_fields, payload_fields, queue_table
from replication.options import CHANGEABLE_OPTIONS, QueueOptions
from wire.errors import E_INVALID_OPTION, QueueError

DEFAULT_OPTIONS = QueueOptions().to_json(every=True)     # `queue create` shows the options that differ from these


async def cmd_queue_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    description = await http.create_queue(
        args.name, strength=args.strength, type=args.queue_type, max_depth=args.max_depth,
        visibility_timeout_s=args.visibility_timeout_s, max_deliveries=args.max_deliveries,
        dead_letter=args.dead_letter, min_in_sync=args.min_in_sync, message_ttl_s=args.message_ttl_s,
        fault_interval_s=args.fault_interval_s, defunct_interval_s=args.defunct_interval_s,
        message_interval_s=args.message_interval_s, forward_rate=args.forward_rate,
        forward_interval_s=args.forward_interval_s, forward_mode=args.forward_mode, forward_bands=args.forward_bands,
        delay_s=getattr(args, "delay_s", None), receive_wait_s=getattr(args, "receive_wait_s", None))
    return Outcome(description, format_fields(created_summary(description)))


# `qctl queue create` and `qctl queue set`: the options added in 0.3.0 (feature level 3).
LEVEL3_ARGUMENTS = (
    ("--delay-s", float, "every message put without its own delay waits this long before it is delivered "
                         "(0-900, default 0; SQS DelaySeconds; needs cluster feature level 3)"),
    ("--receive-wait-s", float, "a REST receive that names no wait waits this long for a message (0-20, default 0; "
                                "SQS ReceiveMessageWaitTimeSeconds; needs cluster feature level 3)"),
)
# `qctl queue set`: each changeable option (replication/options.py CHANGEABLE_OPTIONS) as a flag.
SET_ARGUMENTS = (
    ("--visibility-timeout-s", float, "the lease of receives from now on that name none"),
    ("--max-deliveries", int, "deliveries before a message goes to the dead-letter queue"),
    ("--message-ttl-s", float, "the time to live of messages put from now on without their own (0: none)"),
    ("--max-depth", int, "the most messages it holds"),
    *LEVEL3_ARGUMENTS,
    ("--fault-interval-s", float, "fault surveillance: a recipient idle this long while messages wait is in fault"),
    ("--defunct-interval-s", float, "in fault this long: its subscriptions end"),
    ("--message-interval-s", float, "a message waiting this long fails over on its own"),
    ("--forward-rate", float, "as the root of forwards: the messages/s they share (0: no control)"),
    ("--forward-interval-s", float, "how often the root sends their rates"),
    ("--forward-mode", str, "adaptive or static"),
    ("--forward-bands", int, "the fill-level bands a weight counts"),
)


def add_create_options(create: argparse.ArgumentParser) -> None:
    """The options `queue create` takes beyond those client/qctl.py declares."""
    for flag, kind, help_text in LEVEL3_ARGUMENTS:
        create.add_argument(flag, type=kind, help=help_text)


def add_set_parser(queue_commands: Any, command: Any) -> None:
    """`qctl queue set NAME --option VALUE ...` (client/qctl.py's `command` adds the global options)."""
    changer = command(queue_commands, "set", cmd_queue_set,
                      "change options of an existing queue (PATCH /v1/queues/{q}; cluster feature level 3); "
                      "strength, type, min_in_sync and dead_letter are fixed at creation")
    changer.add_argument("name")
    for flag, kind, help_text in SET_ARGUMENTS:
        changer.add_argument(flag, type=kind, help=help_text)


async def cmd_queue_set(http: HttpClient, args: argparse.Namespace) -> Outcome:
    changes = {name: getattr(args, name) for name in sorted(CHANGEABLE_OPTIONS) if getattr(args, name, None) is not None}
    if not changes:
        raise QueueError(E_INVALID_OPTION, "name at least one option to change, e.g. --visibility-timeout-s 60")
    answer = await http.set_queue_options(args.name, **changes)
    options = answer.get("options") or {}
    shown = {"queue": answer.get("name", args.name), **{name: options.get(name) for name in changes},
             "changed": ", ".join(answer.get("changed", [])) or "nothing: the queue had these values already"}
    return Outcome(answer, format_fields(shown))


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
    match = getattr(args, "match", "")
    if match:           # filtered on the node, page after page (docs/PROTOCOL.md, "Listings")
        queues: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page = await http.queue_page_around(1000, after, match=match)
            queues += page.get("queues", [])
            after = page.get("next")
            if not after:
                break
        return Outcome({"queues": queues}, queue_table(queues) if queues else f"no queue name contains {match!r}")
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


async def cmd_queue_redrive(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.redrive(args.name, args.limit)
    stopped = f"; stopped by {answer['stopped']}" if answer.get("stopped") else ""
    return Outcome(answer, f"moved {answer['redriven']} dead letters back into {args.name}{_each_member(answer)}{stopped}")


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
    if getattr(args, "wait", None) is not None:        # a producer that waits (client/waits.py)
        from client.waits import enqueue_rest_waiting
        done = await enqueue_rest_waiting(http, args.queue, payload, args.wait, args.timeout_s, priority=args.priority,
                                          dedupe_id=args.dedupe_id, ttl_s=args.ttl_s, delay_s=args.delay_s,
                                          headers=_headers(args.header))
        reply = done.pop("reply", None)
        shown = {} if reply is None else {"reply": reply.decode(errors="replace"),
                                          "reply_b64": payload_fields(reply)["payload_b64"]}
        document = {"queue": args.queue, **done, **shown}
        text = f"id: {done['id']}, {done['state']} after {done.get('deliveries', 0)} deliveries"
        return Outcome(document, text + ("" if reply is None else f"\nreply: {reply.decode(errors='backslashreplace')}"))
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
    if getattr(args, "view", None) is not None:       # through a virtual queue (client/qctl_views.py)
        from client.qctl_views import cmd_get_view
        return await cmd_get_view(http, args)
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
