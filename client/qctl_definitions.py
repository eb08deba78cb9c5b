"""`qctl definitions export` and `qctl definitions import`: what a cluster defines (queues and
their options, channels, macro queues and members, recipients' chains, forwards without secrets,
clients' public keys and grants) as one JSON file, and that file brought into a cluster
(docs/OPERATIONS.md, "Definitions: export and import").

One of the command groups client/qctl.py's parser dispatches to (qctl_render.py renders).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from client.credentials import load_credentials
from client.http import HttpClient
from client.qctl_render import Outcome, format_table
from wire.errors import E_INVALID_DEFINITIONS, E_INVALID_OPTION, QueueError

SECTIONS = ("queues", "channels", "macros", "recipients", "forwards", "clients")


def counts_text(document: dict[str, Any]) -> str:
    return ", ".join(f"{len(document.get(section) or [])} {section}" for section in SECTIONS)


async def cmd_definitions_export(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """The document on stdout (for `> defs.json`), or written to --out (owner-only, like
    credentials: it names every client and grant) with a line saying what it holds."""
    document = await http.export_definitions()
    text = json.dumps(document, indent=2)
    if args.out is None:
        return Outcome(document, text)
    out = Path(args.out)
    temporary = out.with_name(out.name + ".tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as file:
        file.write(text + "\n")
    os.replace(temporary, out)
    return Outcome({"file": str(out), "counts": {section: len(document.get(section) or []) for section in SECTIONS},
                    "release": document.get("release"), "map_version": document.get("map_version")},
                   f"wrote {counts_text(document)} to {out}")


def _read_document(source: str) -> Any:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise QueueError(E_INVALID_OPTION, f"cannot read {source}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except ValueError as error:
        raise QueueError(E_INVALID_DEFINITIONS, f"{source} is not JSON ({error}): nothing was changed") from None


def _forward_credentials(given: list[str]) -> dict[str, dict[str, str]]:
    """NAME=FILE (a credentials file of the forward's client in the destination's cluster, as
    `qctl forward create --remote-credentials` takes) -> what the import sends for NAME."""
    found: dict[str, dict[str, str]] = {}
    for text in given:
        name, separator, path = text.partition("=")
        if not separator or not name or not path:
            raise QueueError(E_INVALID_OPTION, f"--forward-credentials is NAME=FILE, not {text!r}")
        remote = load_credentials(path)
        found[name] = {"client_id": remote.client_id, "private_key": remote.private_key_text,
                       "ca_file": remote.ca_file}
    return found


async def cmd_definitions_import(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """Each item's result in a table, then the counts; a failed item makes qctl exit 1 (the
    others were still done); a conflict is reported and left as it is."""
    document = _read_document(args.file)
    if not isinstance(document, dict):
        raise QueueError(E_INVALID_DEFINITIONS, f"{args.file} is not a definitions document (a JSON object): "
                                                "nothing was changed")
    answer = await http.import_definitions(document, dry_run=args.dry_run,
                                           forward_credentials=_forward_credentials(args.forward_credentials))
    results = answer.get("results", [])
    rows = [[result.get("kind"), result.get("name") + (f" <- {result['member']}" if result.get("member") else ""),
             result.get("status"), (f"{result['code']}: " if result.get("code") else "") + result.get("detail", "")]
            for result in results]
    counts = answer.get("counts", {})
    summary = ("dry run, nothing changed: " if answer.get("dry_run") else "") + ", ".join(
        f"{value} {key.replace('_', ' ')}" for key, value in counts.items())
    human = (format_table(["KIND", "NAME", "STATUS", "DETAIL"], rows) + "\n" if rows else "") + summary
    failed = [result for result in results if result.get("status") == "failed"]
    shortfall = QueueError(str(failed[0].get("code") or "E_INTERNAL"),
                           f"{len(failed)} of {len(results)} items failed; the first: {failed[0].get('kind')} "
                           f"{failed[0].get('name')}: {failed[0].get('detail', '')}") if failed else None
    return Outcome(answer, human, shortfall)


def add_parser(commands: Any, command: Any) -> None:
    """`qctl definitions export|import` in qctl's parser (`command` makes a subcommand with the
    global options, as client/qctl.py does for its own)."""
    definitions = commands.add_parser("definitions", help="export the cluster's definitions to a JSON file, or "
                                                          "import one (queues, channels, macro queues, recipients' "
                                                          "chains, forwards, clients)")
    actions = definitions.add_subparsers(dest="definitions_command", required=True, metavar="ACTION")
    export = command(actions, "export", cmd_definitions_export,
                     "print the definitions document (queues and options, channels, macro queues and members, "
                     "recipients' chains, forwards without secrets, clients' public keys and grants)")
    export.add_argument("--out", metavar="FILE", help="write it to FILE (readable by its owner only) instead of stdout")
    load = command(actions, "import", cmd_definitions_import,
                   "create what FILE defines and the cluster lacks; what exists as defined is left, what exists "
                   "otherwise is reported as a conflict and left as it is; nothing is deleted. An invalid file "
                   "changes nothing (E_INVALID_DEFINITIONS lists every problem)")
    load.add_argument("file", metavar="FILE", help="the definitions document, or - for stdin")
    load.add_argument("--dry-run", action="store_true", help="check the file and say what would be created")
    load.add_argument("--forward-credentials", action="append", default=[], metavar="NAME=FILE",
                      help="for forward NAME to another cluster (created by this import): a credentials file of its "
                           "client there, which no export holds (repeat per forward)")
