"""`qctl queue view create|delete|list` and `qctl get|peek QUEUE --view VIEW`: virtual queues
(docs/PROTOCOL.md, "Virtual queues"; client/views.py makes the calls).

One of the command groups client/qctl.py's parser dispatches to (qctl_render.py renders).
"""
from __future__ import annotations

import argparse
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome, format_fields, format_table, payload_fields
from client.views import ViewCalls
from wire.errors import E_INVALID_OPTION, QueueError


class _Views(ViewCalls):
    def __init__(self, http: HttpClient) -> None:
        self.http = http


def _filter_of(args: argparse.Namespace) -> dict[str, Any]:
    given = [name for name in ("header", "producer", "origin") if getattr(args, name) is not None]
    if len(given) != 1:
        raise QueueError(E_INVALID_OPTION, "name one filter: --header NAME=VALUE[,VALUE...], --producer CLIENT_ID "
                                           "or --origin direct|moved|failed_over|returned")
    if args.producer is not None:
        return {"producer": args.producer}
    if args.origin is not None:
        return {"origin": args.origin}
    name, equals, values = args.header.partition("=")
    if not equals or not name or not values:
        raise QueueError(E_INVALID_OPTION, f"--header takes NAME=VALUE or NAME=VALUE,VALUE..., not {args.header!r}")
    listed = values.split(",")
    return {"header": name, "equals": listed[0]} if len(listed) == 1 else {"header": name, "in": listed}


async def cmd_view_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await _Views(http).create_view(args.queue, args.view, _filter_of(args))
    return Outcome(answer, format_fields({"queue": answer["queue"], "view": answer["view"], "filter": answer["filter"]}))


async def cmd_view_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await _Views(http).delete_view(args.queue, args.view)
    return Outcome(answer, f"deleted view {args.view} of {args.queue}")


async def cmd_view_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    views = await _Views(http).list_views(args.queue)
    rows = [[name, view["filter"], f"{view['depth']}{'' if view['depth_exact'] else '+'}"]
            for name, view in views.items()]
    text = format_table(["view", "filter", "depth"], rows) if rows else f"queue {args.queue} has no views"
    return Outcome({"queue": args.queue, "views": views}, text)


async def cmd_get_view(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """`qctl get QUEUE --view VIEW [--ack]` (a receive through a view does not wait)."""
    if args.wait_s:
        raise QueueError(E_INVALID_OPTION, "a receive through a view does not wait: leave out --wait-s")
    found = await _Views(http).receive_view(args.queue, args.view, 1, args.visibility_timeout_s)
    if not found:
        return Outcome(None, "no message")
    [message] = found
    if args.ack:
        await message.ack()
    document = {"queue": args.queue, "view": args.view, "id": message.id, "receipt": message.receipt,
                "priority": message.priority, "deliveries": message.deliveries, "headers": message.headers,
                "acked": bool(args.ack), **payload_fields(message.payload)}
    shown = {key: value for key, value in document.items() if key not in ("payload", "payload_b64")}
    shown["payload"] = message.payload.decode(errors="backslashreplace")
    return Outcome(document, format_fields(shown))


async def peek_view_page(http: HttpClient, args: argparse.Namespace) -> dict[str, Any]:
    """The page `qctl peek QUEUE --view VIEW` shows (client/qctl_peek.py renders it as a queue's)."""
    return await _Views(http).peek_view(args.queue, args.view, args.after, args.limit, args.preview)


def add_view_parser(queue_commands: Any, command: Any) -> None:
    """`qctl queue view ACTION ...` (client/qctl.py's `command` adds the global options)."""
    view = queue_commands.add_parser("view", help="virtual queues: named, filtered views of a queue")
    actions = view.add_subparsers(dest="view_command", required=True, metavar="ACTION")
    create = command(actions, "create", cmd_view_create,
                     "define a view of a queue (or change its filter; admin grant; cluster feature level 3)")
    create.add_argument("queue")
    create.add_argument("view")
    create.add_argument("--header", metavar="NAME=VALUE[,VALUE...]", help="messages with this header value (or one of these)")
    create.add_argument("--producer", metavar="CLIENT_ID", help="messages this client enqueued")
    create.add_argument("--origin", choices=("direct", "moved", "failed_over", "returned"),
                        help="messages enqueued by a producer (direct) or moved here by the cluster")
    delete = command(actions, "delete", cmd_view_delete, "delete a view (its messages stay in the queue)")
    delete.add_argument("queue")
    delete.add_argument("view")
    command(actions, "list", cmd_view_list, "a queue's views with their depths").add_argument("queue")
