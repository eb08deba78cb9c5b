"""`qserver migrate`: bring a stopped node's data directory to this release's storage layout,
or say with --dry-run what that would do, or with --to bring it back to an older layout this
release can still write (qserver/storage/migrate.py; docs/OPERATIONS.md, "Storage layouts and
migration"). A node migrates its directory at start by itself: this command is for doing it
ahead of the start, for seeing what it would do, and for rolling back."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qserver.config import load_config
from qserver.storage import migrate as m
from qserver.storage.rows import SCHEMA_VERSION
from wire.versions import RELEASE


def add_parser(sub: Any) -> None:
    p = sub.add_parser("migrate", help="migrate a stopped node's data directory to this release's storage layout")
    p.add_argument("--config", type=Path, help="the node's TOML file (its data directory)")
    p.add_argument("--data-dir", type=Path, help="the node's data directory (over the config's)")
    p.add_argument("--dry-run", action="store_true", help="say what it would do and change nothing")
    p.add_argument("--to", type=int, default=SCHEMA_VERSION, metavar="LAYOUT",
                   help=f"the layout to bring it to (default {SCHEMA_VERSION}, this release's; "
                        f"{min(m.DOWNGRADES) - 1} to roll back)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def run(args: argparse.Namespace) -> int:
    from qserver.node import DataDirInUse, lock_data_dir  # the node's own lock: never under a running node
    if args.config is None and args.data_dir is None:
        return fail_command(args, "E_INVALID_OPTION", "migrate needs --config or --data-dir")
    try:
        config = load_config(args.config, data_dir=None if args.data_dir is None else str(args.data_dir))
    except (OSError, ValueError) as error:
        return fail_command(args, "E_INVALID_OPTION", str(error))
    data_dir = Path(config.data_dir)
    if not (data_dir / "lmdb").is_dir():
        return fail_command(args, "E_INVALID_OPTION", f"{data_dir} is not a node's data directory (no lmdb/)")
    if not m.OLDEST_LAYOUT <= args.to <= SCHEMA_VERSION:
        return fail_command(args, "E_INVALID_OPTION", f"--to {args.to}: this release (qserver {RELEASE}) writes layouts "
                                               f"{m.OLDEST_LAYOUT} to {SCHEMA_VERSION}")
    try:
        lock = lock_data_dir(data_dir)
    except DataDirInUse as error:
        return fail_command(args, "E_UNAVAILABLE", str(error))
    try:
        env, dbs = m.open_environment(str(data_dir / "lmdb"), dry_run=args.dry_run)
        try:
            report = m.migrate(env, dbs, str(data_dir / "lmdb"), target=args.to, readable=SCHEMA_VERSION,
                               dry_run=args.dry_run)
            if report.stored_layout is not None and not args.dry_run:
                with env.begin(db=dbs["meta"]) as txn:
                    report.history = m.read_history(txn, dbs["meta"])
        finally:
            env.close()
    except m.StorageLayoutError as error:
        return fail_command(args, "E_VERSION_MISMATCH", str(error))
    finally:
        lock.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print(report)
    return 0


def fail_command(args: argparse.Namespace, code: str, message: str) -> int:
    """A `qserver` command's refusal: the envelope on stdout under --json, the words on stderr,
    exit status 2 (also for qserver/backup_cli.py)."""
    if args.json:
        print(json.dumps({"error": {"code": code, "message": message}}))
    print(f"qserver {args.command}: {code}: {message}", file=sys.stderr)
    return 2


def _print(report: m.MigrationReport) -> None:
    print(f"data directory {report.path}: layout {report.stored_layout}"
          + (f", last written by qserver {report.written_by}" if report.written_by else ""))
    print(f"this is qserver {RELEASE}, which reads layout {SCHEMA_VERSION}; target layout {report.target_layout}")
    for entry in report.history:
        was = "created" if entry.get("from") is None else f"layout {entry['from']} ->"
        print(f"  history: {entry.get('at')} qserver {entry.get('release')}: {was} layout {entry.get('to')}")
    if not report.steps:
        print("nothing to do" if report.stored_layout is not None else "a new directory: nothing to migrate")
        return
    for step in report.steps:
        done = "would rewrite" if report.dry_run else "rewrote"
        print(f"  step {step.from_layout} -> {step.to_layout}: {step.summary}")
        print(f"    read {_counts(step.examined)}; {done} {_counts(step.rewritten)}; "
              f"extra disk up to ~{step.extra_disk_bytes} bytes; {step.seconds:.3f} s")
    print("dry run: nothing was changed" if report.dry_run else f"migrated to layout {report.target_layout}")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name} rows" for name, n in sorted(counts.items())) or "no rows"
