"""Virtual queues: named, filtered views of one queue (seed 000; docs/PROTOCOL.md, "Virtual queues").

A view is a name and one filter over the queue's messages; it holds no message of its own. A
receive through a view leases the first ready message, in the queue's own order (priority 9
first, then by id), that the filter accepts, exactly as a receive of the queue would lease it
(`lease_matching`): the same lease, receipt, delivery count and operation (`Leased`), so an ack
or a release goes through the queue as usual and a plain consumer of the queue still gets every
other message in order.

The filters (one per view):
- `{"producer": "<client id>"}`: the client that enqueued the message; for a message the cluster
  moved (fault surveillance enqueues it as itself), the producer the move recorded in its
  `x-origin-producer` header, i.e. the client that enqueued it first. The client id is stored
  with every message (the message row, since 0.1.0), so no stored format changes.
- `{"header": "<name>", "equals": "<value>"}` or `{"header": "<name>", "in": ["<value>", ...]}`:
  a header of the message (set by its producer) with that value, or one of those values.
- `{"origin": "direct" | "moved" | "failed_over" | "returned"}`: where the message came from, as
  seed 000's virtual queues sort messages by the network they came from. `direct`: a producer
  enqueued it into this queue; `moved`: the cluster moved it here from another queue (fault
  surveillance), `failed_over` (to an alternative recipient: it has `x-failed-over-from`) or
  `returned` (back to its sender: `x-returned-from`) being the two kinds of move.

The definitions are the queue option `views` (replication/options.py): stored in the queue's map
entry and record like every option, replicated with the map, followed by each member's core
(qserver/cluster/options_sync.py), so a failover or a handoff keeps them. At most VIEWS_MAX per
queue. Pure: no I/O; the node reads what a filter looks at from its storage
(qserver/core/view_scan.py). Leasing through a view is replication/view_lease.py's.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wire.message_input import FAILED_OVER_FROM, HEADER_NAME_CHARS_MAX, ORIGIN_PRODUCER, RETURNED_FROM

VIEWS_MAX = 16              # views per queue: each is looked up by name and listed in the queue's stats
VIEW_VALUES_MAX = 16        # values of one `in` filter
VIEW_VALUE_CHARS_MAX = 256  # a header value or a client id a filter names
VIEW_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
ORIGINS = ("direct", "moved", "failed_over", "returned")
# A grant names a view as "<queue>/<view>": "/" is in no queue name (replication/options.py
# QUEUE_NAME_PATTERN), so such a pattern never matches a queue and a queue's never a view's by accident.
VIEW_SEPARATOR = "/"


class ViewError(ValueError):
    """A view's definition is malformed; the message says what a filter may be."""


FILTER_RULE = ('a view\'s filter is {"producer": "<client id>"}, {"header": "<name>", "equals": "<value>"}, '
               '{"header": "<name>", "in": ["<value>", ...]} or {"origin": "direct|moved|failed_over|returned"}')


@dataclass(frozen=True, slots=True)
class View:
    """One view: `kind` "producer" (values: the client id), "header" (header: the name, values:
    the accepted values) or "origin" (values: the origin)."""
    name: str
    kind: str
    values: tuple[str, ...]
    header: str = ""

    def to_json(self) -> dict[str, Any]:
        if self.kind == "header":
            if len(self.values) == 1:
                return {"header": self.header, "equals": self.values[0]}
            return {"header": self.header, "in": list(self.values)}
        return {self.kind: self.values[0]}

    def matches(self, client: str, headers: Mapping[str, str] | None) -> bool:
        """Whether a message enqueued by `client` with `headers` is in the view."""
        headers = headers or {}
        if self.kind == "producer":
            return (headers.get(ORIGIN_PRODUCER) or client) == self.values[0]
        if self.kind == "header":
            return headers.get(self.header) in self.values
        origin = self.values[0]
        failed_over, returned = FAILED_OVER_FROM in headers, RETURNED_FROM in headers
        if origin == "direct":
            return not (failed_over or returned)
        if origin == "moved":
            return failed_over or returned
        return failed_over if origin == "failed_over" else returned


def grant_name(queue: str, view: str) -> str:
    """What a grant's pattern matches to give a privilege through one view only: "orders/eu"."""
    return f"{queue}{VIEW_SEPARATOR}{view}"


def check_view_name(name: Any) -> str:
    if not isinstance(name, str) or not VIEW_NAME_PATTERN.fullmatch(name):
        raise ViewError("a view name is 1-64 characters: letters, digits and . _ : -, starting with a letter or digit")
    return name


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= VIEW_VALUE_CHARS_MAX or not value.isprintable():
        raise ViewError(f"{what} is 1-{VIEW_VALUE_CHARS_MAX} printable characters")
    return value


def parse_view(name: Any, raw: Any) -> View:
    """A view from its name and its filter as JSON (ViewError saying what is wrong)."""
    name = check_view_name(name)
    if not isinstance(raw, dict) or not raw:
        raise ViewError(FILTER_RULE)
    keys = set(raw)
    if keys == {"producer"}:
        return View(name, "producer", (_text(raw["producer"], "a producer's client id"),))
    if keys == {"origin"}:
        if raw["origin"] not in ORIGINS:
            raise ViewError(f"origin is one of {', '.join(ORIGINS)}")
        return View(name, "origin", (raw["origin"],))
    if keys in ({"header", "equals"}, {"header", "in"}):
        header = raw["header"]
        if not isinstance(header, str) or not 0 < len(header) <= HEADER_NAME_CHARS_MAX or not header.isprintable():
            raise ViewError(f"a header name is 1-{HEADER_NAME_CHARS_MAX} printable characters")
        if "equals" in raw:
            return View(name, "header", (_text(raw["equals"], "a header value"),), header)
        values = raw["in"]
        if not isinstance(values, list) or not 0 < len(values) <= VIEW_VALUES_MAX:
            raise ViewError(f"in is a list of 1-{VIEW_VALUES_MAX} header values")
        return View(name, "header", tuple(dict.fromkeys(_text(value, "a header value") for value in values)), header)
    raise ViewError(FILTER_RULE)


def parse_views(raw: Any) -> tuple[View, ...]:
    """The queue option `views`: {name: filter}, at most VIEWS_MAX, by name."""
    if not isinstance(raw, dict):
        raise ViewError('views is a JSON object {"<view name>": <filter>}')
    if len(raw) > VIEWS_MAX:
        raise ViewError(f"a queue has at most {VIEWS_MAX} views")
    return tuple(parse_view(name, raw[name]) for name in sorted(raw))


def views_json(views: tuple[View, ...]) -> dict[str, Any]:
    return {view.name: view.to_json() for view in views}


def find_view(views: tuple[View, ...], name: str) -> View | None:
    for view in views:
        if view.name == name:
            return view
    return None


def with_view(views: tuple[View, ...], view: View) -> dict[str, Any]:
    """The option `views` (JSON) with `view` put (added, or its filter replaced)."""
    return {**views_json(views), view.name: view.to_json()}


def without_view(views: tuple[View, ...], name: str) -> dict[str, Any]:
    return {kept.name: kept.to_json() for kept in views if kept.name != name}
