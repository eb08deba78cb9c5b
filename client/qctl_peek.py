"""`qctl peek QUEUE [--after CURSOR] [--limit N] [--preview]` and `qctl peek QUEUE --id ID`: a
queue's messages in delivery order, or one by id, without taking them (docs/PROTOCOL.md,
"Browsing messages (peek)"): nothing is leased, no delivery counted.

One of the command groups client/qctl.py's parser dispatches to (a coroutine of the HttpClient
and the parsed arguments that returns an Outcome: qctl_render.py).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome, duration_text, format_fields, format_table, payload_fields

PREVIEW_CHARACTERS = 40


def shown_json(message: dict[str, Any]) -> dict[str, Any]:
    """A message for --json: the payload as text when it is UTF-8, always as base64."""
    return {**{key: value for key, value in message.items() if key != "payload"}, **payload_fields(message["payload"])}


def printable(payload: bytes) -> str:
    """A payload as text on one terminal line: UTF-8 where it is, escapes for the rest and for
    control characters (a line break in a payload would break the table)."""
    text = payload.decode(errors="backslashreplace")
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def short_preview(payload: bytes, truncated: bool) -> str:
    text = printable(payload[:PREVIEW_CHARACTERS * 4])
    cut = truncated or len(payload) > PREVIEW_CHARACTERS * 4 or len(text) > PREVIEW_CHARACTERS
    return text[:PREVIEW_CHARACTERS] + ("..." if cut else "")


def age_text(enqueued_at_ms: int, now_s: float) -> str:
    return duration_text(max(0.0, now_s - enqueued_at_ms / 1000))


async def cmd_peek(http: HttpClient, args: argparse.Namespace) -> Outcome:
    now_s = time.time()
    if args.id is not None:
        message = await http.read_message(args.queue, args.id)
        shown = {key: value for key, value in message.items() if key not in ("payload", "served_by")}
        shown["age"] = age_text(message["enqueued_at_ms"], now_s)
        shown["served_by"] = f"{message['served_by'].get('node')} ({message['served_by'].get('role')})"
        shown["payload"] = printable(message["payload"])
        return Outcome(shown_json(message), format_fields(shown))
    if args.view is not None:            # through a virtual queue (client/qctl_views.py)
        from client.qctl_views import peek_view_page
        page = await peek_view_page(http, args)
    else:
        page = await http.peek(args.queue, args.after, args.limit, args.preview)
    document = {**page, "messages": [shown_json(message) for message in page["messages"]]}
    messages = page["messages"]
    served = page["served_by"]
    rows = [[m["id"], m["state"], m["priority"], m["deliveries"], age_text(m["enqueued_at_ms"], now_s), m["size"],
             short_preview(m["payload"], m["truncated"])] for m in messages]
    lines = [format_table(["id", "state", "priority", "deliveries", "age", "size", "payload"], rows) if rows
             else "no messages"]
    lines.append(f"(served by {served.get('node')} as {served.get('role')}"
                 + (f"; next page: --after {page['next_after']})" if page["next_after"] is not None else ")"))
    return Outcome(document, "\n".join(lines))


def add_parser(commands: Any, command: Any) -> None:
    """`qctl peek` (client/qctl.py's `command` adds the global options)."""
    peek = command(commands, "peek", cmd_peek,
                   "list a queue's messages in delivery order, or one by id, without taking them (nothing is "
                   "leased, no delivery counted)")
    peek.add_argument("queue")
    peek.add_argument("--after", type=int, default=0,
                      help="the cursor a previous page printed (its next_after); 0: from the start")
    peek.add_argument("--limit", type=int, default=100, help="at most this many messages (1-1000, default 100)")
    peek.add_argument("--preview", action="store_true", help="only the first KiB of each payload")
    peek.add_argument("--id", type=int, help="show this one message, in full")
    peek.add_argument("--view", help="only the messages of this virtual queue of QUEUE")
