"""`qserver backup` and `qserver restore` (qserver/storage/backup.py; docs/OPERATIONS.md,
"Backup and restore"). A backup runs beside the node, which keeps serving; a restore runs with
the node stopped (it takes the node's own lock on the data directory)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from qserver.config import load_config
from qserver.migrate_cli import fail_command
from qserver.storage import backup as b


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("backup", help="copy a node's data directory, while it runs, into a new directory")
    p.add_argument("--config", type=Path, help="the node's TOML file (its data directory; copied into the backup)")
    p.add_argument("--data-dir", type=Path, help="the node's data directory (over the config's)")
    p.add_argument("--to", type=Path, required=True, help="the backup's directory (new or empty)")
    p.add_argument("--json", action="store_true", help="print the manifest as one JSON document on stdout")
    r = sub.add_parser("restore", help="put a backup back as a stopped node's data directory; the node then "
                                       "rejoins as a node that lost its disk")
    r.add_argument("--from", dest="source", type=Path, required=True, help="the backup's directory")
    r.add_argument("--config", type=Path, help="the node's TOML file (its data directory and node id)")
    r.add_argument("--data-dir", type=Path, help="the node's data directory (over the config's)")
    r.add_argument("--force", action="store_true",
                   help="restore over a directory that holds data (it is moved aside, never deleted)")
    r.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def run(args: argparse.Namespace) -> int:
    if args.config is None and args.data_dir is None:
        return fail_command(args, "E_INVALID_OPTION", f"{args.command} needs --config or --data-dir")
    try:
        config = load_config(args.config, data_dir=None if args.data_dir is None else str(args.data_dir))
    except (OSError, ValueError) as error:
        return fail_command(args, "E_INVALID_OPTION", str(error))
    data_dir = Path(config.data_dir)
    try:
        if args.command == "backup":
            manifest = b.take_backup(data_dir, args.to, args.config)
            if args.json:
                print(json.dumps(manifest, indent=2, sort_keys=True))
            else:
                size = sum(f["size"] for f in manifest["files"].values())
                print(f"backup of {manifest['node_id']} (storage id {manifest['storage_id']:016x}, layout "
                      f"{manifest['storage_layout']}) in {args.to}: {len(manifest['files'])} files, {size} bytes, "
                      f"{manifest['seconds']} s")
            return 0
        return _restore(args, data_dir, config.node_id if args.config is not None else None)
    except b.BackupError as error:
        return fail_command(args, error.code, error.message)


def _restore(args: argparse.Namespace, data_dir: Path, node_id: str | None) -> int:
    from qserver.node import DataDirInUse, lock_data_dir  # the node's own lock: never under a running node
    existed = data_dir.exists()
    try:
        lock = lock_data_dir(data_dir)
    except DataDirInUse as error:
        return fail_command(args, "E_UNAVAILABLE", str(error))
    try:
        report = b.restore_backup(args.source, data_dir, node_id=node_id, force=args.force)
    except b.BackupError:
        if not existed:                  # the lock made it: leave nothing behind a refusal
            lock.close()
            (data_dir / "qserver.lock").unlink(missing_ok=True)
            data_dir.rmdir()
        raise
    finally:
        lock.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(f"restored {report.node_id} into {report.data_dir} (layout {report.storage_layout}); new storage id "
              f"{report.new_storage_id:016x} (was {report.old_storage_id:016x}): on start it rejoins as a node that "
              "lost its disk and catches up from its peers"
              + (f"; the old directory is now {report.moved_aside}" if report.moved_aside else ""))
    return 0

