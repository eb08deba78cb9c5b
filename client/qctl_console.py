"""`qctl console`: a one-time sign-in link to a node's web console (docs/CONSOLE.md), minted with
this client's own key, printed, and opened in a browser where there is a screen to open it on.

One of the command groups client/qctl.py's parser dispatches to (a coroutine of the HttpClient
and the parsed arguments that returns an Outcome: qctl_render.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import webbrowser
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome
from wire.console_link import LINK_VALID_MS


def can_open_browser() -> bool:
    """Only where a graphical browser can come up: on a bare terminal, Python's webbrowser would
    start a text browser inside the terminal qctl runs in."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


async def cmd_console(http: HttpClient, args: argparse.Namespace) -> Outcome:
    link = http.console_link()
    opened = bool(args.open and can_open_browser() and webbrowser.open(link))
    expires_at_ms = int(time.time() * 1000) + LINK_VALID_MS
    human = (f"Sign in to the console of {http.url} within a minute (the link works once):\n\n  {link}\n"
             + ("\n(opened in your browser)" if opened else ""))
    return Outcome({"url": link, "console": http.url + "/console/", "expires_at_ms": expires_at_ms,
                    "opened": opened}, human)


def add_parser(commands: Any, command: Any) -> None:
    """`qctl console [--no-open]` (client/qctl.py's `command` adds the global options)."""
    console = command(commands, "console", cmd_console,
                      "print a one-time link that signs this client in to the node's web console (valid for "
                      "a minute), and open it where a browser can come up")
    console.add_argument("--no-open", dest="open", action="store_false", help="print the link only")
