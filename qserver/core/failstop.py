"""Fail-stop: what a node does when it can no longer trust its own memory.

A broken invariant (`InvariantViolation`), the engine's task ending on an error, or the
writer failing in a way that leaves memory and storage apart means the node's state in
memory may differ from what LMDB holds. Going on would answer clients from that memory, so
the process ends at once with `EXIT_BROKEN_INVARIANT` (70, EX_SOFTWARE): nothing is
committed on the way out (no `finally`, no atexit, no orderly stop; LMDB keeps exactly its
last committed transaction), the log is flushed so the reason can be read, and the
supervisor (systemd's `Restart=on-failure`, compose's restart policy, `python -m
qserver.dev.local`) starts it again, when recovery rebuilds every core from storage and the
pairs reconcile through the ordinary Open handshake.

Bad input never comes here: it is refused with an `E_*` code where it arrives.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any, NoReturn

from replication.invariants import InvariantViolation

log = logging.getLogger("qserver.core.failstop")

EXIT_BROKEN_INVARIANT = 70      # sysexits.h EX_SOFTWARE: an internal software error


def stop_process(reason: str, error: BaseException | None = None) -> NoReturn:
    """Log why and end the process now, without running any cleanup."""
    log.critical("stopping the node: %s", reason, exc_info=error)
    logging.shutdown()                   # flush the log's handlers: the reason must be readable
    sys.stderr.flush()
    os._exit(EXIT_BROKEN_INVARIANT)


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's handler: a callback or task that died on a broken invariant stops
    the node (the loop would log it and go on); anything else gets the default treatment."""
    error = context.get("exception")
    if isinstance(error, InvariantViolation):
        stop_process(f"a broken invariant in {context.get('message', 'a loop callback')}", error)
    loop.default_exception_handler(context)
