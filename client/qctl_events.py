"""`qctl events`: the cluster event feed of the node the credentials name (docs/PROTOCOL.md,
"Events"): handoffs, failovers, recipients' states, nodes down and up, the membership leader,
queues created and deleted, as far as this client's grants let it see them.

One of the command groups client/qctl.py's parser dispatches to (a coroutine of the HttpClient
and the parsed arguments that returns an Outcome: qctl_render.py). With `--follow` it prints
each event as it comes (with `--json`, one JSON document per line) until interrupted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome
from wire.errors import QueueError

FOLLOW_WAIT_S = 20.0          # each long poll of --follow (the node's maximum)
FOLLOW_RETRY_S = 1.0          # after a retriable error (the node restarting)


def event_line(event: dict[str, Any]) -> str:
    moment = datetime.fromtimestamp(event["at_ms"] / 1000).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return f"{event['seq']:>6}  {moment}  {event['kind']:<16}  {event['text']}"


async def cmd_events(http: HttpClient, args: argparse.Namespace) -> Outcome:
    if args.follow:
        await follow(http, args)
    answer = await http.events(args.after, args.limit, 0.0)
    lines = [event_line(event) for event in answer["events"]]
    human = "\n".join(lines) if lines else f"no event after {args.after}"
    return Outcome(answer, human + f"\n(next: --after {answer['next_after']})")


async def follow(http: HttpClient, args: argparse.Namespace) -> None:
    """Print events as they come, until interrupted (Ctrl-C exits 130). A node that restarted
    (its `started_ms` changed) numbers its events from 1 again: follow it from its oldest."""
    after, started = args.after, None
    while True:
        try:
            answer = await http.events(after, args.limit, FOLLOW_WAIT_S)
        except QueueError as error:
            if not error.retriable:
                raise
            await asyncio.sleep(FOLLOW_RETRY_S)
            continue
        if started is not None and answer["started_ms"] != started and after > 0:
            after = 0       # the node restarted: its numbers begin again
            started = answer["started_ms"]
            continue
        started = answer["started_ms"]
        for event in answer["events"]:
            print(json.dumps(event, sort_keys=True) if args.json else event_line(event), flush=True)
        after = answer["next_after"]


def add_parser(commands: Any, command: Any) -> None:
    """`qctl events [--follow] [--after N] [--limit N]` (client/qctl.py's `command` adds the
    global options)."""
    events = command(commands, "events", cmd_events,
                     "the cluster's events as the node saw them: handoffs, failovers, recipients' states, nodes "
                     "down and up, the membership leader, queues created and deleted")
    events.add_argument("--after", type=_count, default=0, metavar="SEQ",
                        help="only events after this sequence number (the `next` of a previous call)")
    events.add_argument("--limit", type=_count, default=100, metavar="N", help="at most N events (1-1000)")
    events.add_argument("--follow", action="store_true",
                        help="keep printing events as they come (one JSON document per line with --json) until "
                             "interrupted")


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count is a whole number, not {text!r}")
    return int(text)
