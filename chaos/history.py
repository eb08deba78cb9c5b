"""The history of a chaos run: every client operation with its invoke time and its outcome.

Jepsen's vocabulary: an operation is *invoked*, then completes *ok*, *fail* (it certainly did
not happen) or *unknown* (it may have happened: a timeout, a lost connection, an error with
`outcome_unknown`). Nemesis actions are recorded too, with status *info*.

One JSON object per line and per operation, written when the operation completes (one still
open when the run ends is written as unknown). An enqueue line is exactly a qaudit history
entry (docs/AUDIT.md, "History file": `queue`, `status`, `id`, `dedupe_id`, `payload_crc32`,
`at_ms`, `client`), so the file is given to qaudit as is; it skips lines whose `op` is not
`enqueue`. Extra fields:

    invoke_ms, at_ms       wall-clock milliseconds of invocation and completion
    t_invoke, t_complete   seconds since the run started (monotonic clock; what checks use)
    process                the worker (`client` repeats it for qaudit)
    phase                  run | recovery | drain
    error                  "E_CODE: message" when the operation did not complete ok
    messages               (receive) [{id, tag, deliveries, priority, node, via}]
    node                   the node that served the operation, where known

The payload of every enqueue starts with its dedupe id (the *tag*) and a "|", so a delivered
message names the enqueue it came from, whatever id the server gave it (a dead-letter queue
gives its own).
"""
from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

TAG_SEPARATOR = b"|"
TAG_BYTES_MAX = 200
STATUSES = ("ok", "fail", "unknown", "info")


def payload_for(tag: str, size_bytes: int) -> bytes:
    """A payload that names its enqueue: the tag, "|", then filler up to `size_bytes`."""
    head = tag.encode() + TAG_SEPARATOR
    return head + b"x" * max(0, size_bytes - len(head))


def tag_of(payload: bytes) -> str | None:
    head, separator, _ = payload[:TAG_BYTES_MAX + 1].partition(TAG_SEPARATOR)
    return head.decode(errors="replace") if separator else None


def crc32(payload: bytes) -> int:
    return zlib.crc32(payload)


@dataclass
class Operation:
    process: str
    op: str                       # enqueue | receive | ack | release | handoff | nemesis
    queue: str | None
    t_invoke: float
    invoke_ms: int
    phase: str = "run"
    status: str = "invoke"
    t_complete: float | None = None
    at_ms: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {"op": self.op, "queue": self.queue, "status": self.status, "client": self.process,
                                "process": self.process, "phase": self.phase, "invoke_ms": self.invoke_ms,
                                "at_ms": self.at_ms, "t_invoke": round(self.t_invoke, 6),
                                "t_complete": None if self.t_complete is None else round(self.t_complete, 6)}
        line.update(self.fields)
        return line


class History:
    """Operations in completion order, appended to a JSON-lines file as they complete."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.phase = "run"
        self.completed: list[dict[str, Any]] = []
        self._open: dict[int, Operation] = {}
        self._file: IO[str] | None = path.open("w")

    def now(self) -> float:
        return time.monotonic() - self.started

    def invoke(self, process: str, op: str, queue: str | None, **fields: Any) -> Operation:
        operation = Operation(process, op, queue, self.now(), int(time.time() * 1000), self.phase, fields=fields)
        self._open[id(operation)] = operation
        return operation

    def complete(self, operation: Operation, status: str, **fields: Any) -> dict[str, Any]:
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self._open.pop(id(operation), None)
        operation.status = status
        operation.t_complete = self.now()
        operation.at_ms = int(time.time() * 1000)
        operation.fields.update(fields)
        line = operation.to_json()
        self.completed.append(line)
        if self._file is not None:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        return line

    def info(self, process: str, op: str, **fields: Any) -> dict[str, Any]:
        """A nemesis or runner event: invoked and completed at once."""
        return self.complete(self.invoke(process, op, None), "info", **fields)

    def close(self) -> None:
        """Operations still open become unknown (they may have happened); the file is closed."""
        for operation in list(self._open.values()):
            self.complete(operation, "unknown", error="still open when the run ended")
        if self._file is not None:
            self._file.close()
            self._file = None


def read_history(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)
