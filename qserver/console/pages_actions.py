"""The console's actions on queues (docs/CONSOLE.md, "Actions"): create and delete a queue, hand
off, move a member, purge, redrive and put a test message.

Each is a POST registered through ConsoleRoutes.action (frame.py), which checks the session's
CSRF token and asks the visitor to confirm on a page of its own (for a purge or a delete, by
typing the queue's name) before the handler here runs. A handler only reads the form into the
arguments of one client library call made through `view.client`, in the signed-in client's name:
the grant check happens where the call lands (qserver/api/auth.py), so the console offers every
action and shows the server's refusal (`E_FORBIDDEN`) in words. A form that does not read
(a number that is not one, a header line without `=`) answers `E_INVALID_OPTION` and calls
nothing. The forms are in templates/queue_actions.html and templates/queues_actions.html.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from qserver.console.frame import PREFIX, ConsoleRoutes, View
from wire import errors as e
from wire.errors import QueueError

QUEUES = PREFIX + "/queues"
CREATE_PATH = PREFIX + "/create-queue"
# The options of a create the form offers (docs/PROTOCOL.md, PUT /v1/queues/{q}), by how each reads.
CHOICE_OPTIONS = {"strength": ("full", "producer"), "type": ("queued_ack", "one_way", "one_way_ack", "two_way")}
INT_OPTIONS = ("max_depth", "max_deliveries", "min_in_sync")
FLOAT_OPTIONS = ("visibility_timeout_s", "message_ttl_s")
PAYLOAD_CHARS_MAX = 200_000           # a test message's text (the form itself is bounded in frame.py)


def queue_of(view: View) -> str:
    return view.request.match_info["name"]


def _number(form: Mapping[str, str], name: str, kind: type[int] | type[float]) -> int | float | None:
    text = form.get(name, "").strip()
    if not text:
        return None                   # left empty: the server's default
    try:
        number = kind(text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):           # float() reads "nan" and "inf", which JSON cannot carry
        raise QueueError(e.E_INVALID_OPTION, f"{name} must be a {'whole ' if kind is int else ''}number, "
                                             f"not {text[:40]!r}")
    return number


def create_options(form: Mapping[str, str]) -> dict[str, Any]:
    """The options a create form names (empty fields: the server's defaults)."""
    options: dict[str, Any] = {}
    for name, allowed in CHOICE_OPTIONS.items():
        value = form.get(name, "").strip()
        if value:
            if value not in allowed:
                raise QueueError(e.E_INVALID_OPTION, f"{name} is one of {', '.join(allowed)}, not {value[:40]!r}")
            options[name] = value
    for name in INT_OPTIONS:
        options[name] = _number(form, name, int)
    for name in FLOAT_OPTIONS:
        options[name] = _number(form, name, float)
    dead_letter = form.get("dead_letter", "").strip()
    if dead_letter:                   # on by default (a queue keeps what it gave up on in NAME.dlq)
        if dead_letter not in ("on", "off"):
            raise QueueError(e.E_INVALID_OPTION, f"dead_letter is on or off, not {dead_letter[:40]!r}")
        options["dead_letter"] = dead_letter == "on"
    return {name: value for name, value in options.items() if value is not None}


def parse_headers(text: str) -> dict[str, str]:
    """Headers as `name=value` lines (blank lines skipped); the server checks names and sizes."""
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, equals, value = line.partition("=")
        if not equals or not name.strip():
            raise QueueError(e.E_INVALID_OPTION, f"header line {number} is not name=value: {line[:60]!r}")
        headers[name.strip()] = value.strip()
    return headers


def _options_in_words(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in options.items()) or "the server's default options"


# --- create and delete ------------------------------------------------------------------------------
def describe_create(view: View, form: Mapping[str, str]) -> str:
    name = form.get("name", "").strip()
    try:
        options = _options_in_words(create_options(form))
    except QueueError as error:
        options = f"options that do not read ({error.message})"
    return f"Create the queue {name!r} with {options} (if it exists with these options, it is only opened)."


async def create(view: View, form: Mapping[str, str]) -> str:
    name = form.get("name", "").strip()
    if not name:
        raise QueueError(e.E_INVALID_NAME, "the queue needs a name")
    options = create_options(form)
    described = await view.client.create_queue(name, **options)
    return f"Queue {name} is there{_placement(described)}."


def describe_delete(view: View, form: Mapping[str, str]) -> str:
    return (f"Delete the queue {queue_of(view)!r} and every message in it (its dead-letter queue goes with it). "
            "This cannot be undone.")


async def delete(view: View, form: Mapping[str, str]) -> str:
    answer = await view.client.delete_queue(queue_of(view))
    return f"Queue {answer.get('deleted', queue_of(view))} deleted."


# --- hand off and move ---------------------------------------------------------------------------------
def describe_handoff(view: View, form: Mapping[str, str]) -> str:
    return (f"Hand off the queue {queue_of(view)!r}: its master and its replica swap places "
            "(writes pause for a moment while they do).")


async def handoff(view: View, form: Mapping[str, str]) -> str:
    answer = await view.client.handoff(queue_of(view))
    return (f"Queue {queue_of(view)} handed off: master {answer.get('master')}, replica {answer.get('replica')}, "
            f"epoch {answer.get('epoch')}.")


def describe_move(view: View, form: Mapping[str, str]) -> str:
    return (f"Move the {form.get('member', 'replica')} of the queue {queue_of(view)!r} to node "
            f"{form.get('to', '').strip()!r} (a new member catches up by state transfer; "
            "moving a master also hands the queue off twice).")


async def move(view: View, form: Mapping[str, str]) -> str:
    member, to = form.get("member", ""), form.get("to", "").strip()
    if member not in ("master", "replica"):
        raise QueueError(e.E_INVALID_OPTION, f"the member to move is master or replica, not {member[:40]!r}")
    if not to:
        raise QueueError(e.E_INVALID_OPTION, "name the node to move the member to")
    answer = await view.client.move_queue(queue_of(view), member, to)
    return (f"Queue {queue_of(view)}: {member} on {to} ({answer.get('how', 'moved')}); now master "
            f"{answer.get('master')}, replica {answer.get('replica')}.")


# --- purge and redrive ---------------------------------------------------------------------------------
def describe_purge(view: View, form: Mapping[str, str]) -> str:
    return (f"Purge the queue {queue_of(view)!r}: every message it holds now, ready or leased, is gone for good "
            "(messages enqueued after the purge begins stay).")


async def purge(view: View, form: Mapping[str, str]) -> str:
    answer = await view.client.purge(queue_of(view))
    return f"Queue {queue_of(view)} purged: {answer.get('purged', 0)} messages taken out{_members(answer)}."


def describe_redrive(view: View, form: Mapping[str, str]) -> str:
    limit = form.get("limit", "").strip()
    how_many = f"up to {limit} of its dead letters" if limit else "every dead letter it has now"
    return (f"Redrive the queue {queue_of(view)!r}: {how_many} go from {queue_of(view)}.dlq back into it "
            "as new messages, each at its priority.")


async def redrive(view: View, form: Mapping[str, str]) -> str:
    limit = _number(form, "limit", int)
    answer = await view.client.redrive(queue_of(view), None if limit is None else int(limit))
    stopped = f" (stopped early: {answer['stopped']})" if answer.get("stopped") else ""
    return f"Queue {queue_of(view)}: {answer.get('redriven', 0)} dead letters redriven{stopped}{_members(answer)}."


# --- a test message ----------------------------------------------------------------------------------
def describe_put(view: View, form: Mapping[str, str]) -> str:
    payload = form.get("payload", "")
    shown = payload if len(payload) <= 80 else payload[:80] + "…"
    return (f"Put a test message into the queue {queue_of(view)!r} at priority {form.get('priority', '4') or '4'}: "
            f"{shown!r} ({len(payload.encode())} bytes).")


async def put(view: View, form: Mapping[str, str]) -> str:
    # A browser sends a textarea's line breaks as CRLF (the HTML form encoding): the text typed had LF.
    payload = form.get("payload", "").replace("\r\n", "\n")
    if len(payload) > PAYLOAD_CHARS_MAX:
        raise QueueError(e.E_PAYLOAD_TOO_LARGE, f"a test message from the console is at most {PAYLOAD_CHARS_MAX} "
                                                "characters: use the client library or qctl for more")
    priority = _number(form, "priority", int)
    priority = 4 if priority is None else int(priority)
    if not 0 <= priority <= 9:
        raise QueueError(e.E_INVALID_OPTION, f"priority is 0-9, not {priority}")
    headers = parse_headers(form.get("headers", ""))
    message_id = await view.client.enqueue(queue_of(view), payload.encode(), priority, headers=headers or None)
    return f"Test message {message_id} put into {queue_of(view)} at priority {priority}."


# --- words of an answer ------------------------------------------------------------------------------
def _placement(described: Mapping[str, Any]) -> str:
    master, replica = described.get("master"), described.get("replica")
    return f" (master {master}, replica {replica})" if master or replica else ""


def _members(answer: Mapping[str, Any]) -> str:
    members = answer.get("members")
    if not isinstance(members, Mapping) or not members:
        return ""
    return " (" + ", ".join(f"{node}: {count}" for node, count in sorted(members.items())) + ")"


def add_routes(routes: ConsoleRoutes) -> None:
    routes.action(CREATE_PATH, create, describe_create, back=QUEUES)
    one = QUEUES + "/{name}"
    routes.action(one + "/handoff", handoff, describe_handoff)
    routes.action(one + "/move", move, describe_move)
    routes.action(one + "/purge", purge, describe_purge, typed=lambda view, form: queue_of(view))
    routes.action(one + "/redrive", redrive, describe_redrive)
    routes.action(one + "/put", put, describe_put)
    routes.action(one + "/delete", delete, describe_delete, back=QUEUES, typed=lambda view, form: queue_of(view))
