"""How `qctl` shows what a command produced: its Outcome (the JSON document and the text for
people), aligned tables, `key: value` lines, grants, payloads, moments and durations.

Apart from the commands (qctl_cluster.py, qctl_queues.py, qctl_features.py) because every group
renders with it, and from client/qctl.py (the parser and entry point), which only prints.
"""
from __future__ import annotations

import argparse
import base64
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from client.http import HttpClient
from wire.errors import QueueError

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


Handler = Callable[[HttpClient, argparse.Namespace], Awaitable[Outcome]]


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
