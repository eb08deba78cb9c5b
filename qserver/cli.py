"""`qserver init`, `qserver admin-credential` and `qserver run`."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from client.credentials import Credentials, save_credentials
from client.http import HttpClient
from qserver import backup_cli, migrate_cli
from qserver.api.auth import ADMIN_GRANTS, CLUSTER_CLIENT, DelegatedSigner
from qserver.config import NodeConfig, load_config
from qserver.storage.lmdb_store import SealedBatch, Storage, read_clients
from qserver.storage.raft_store import RaftStore
from qserver.storage.rows import SCHEMA_VERSION
from qserver.transport.tls import DEFAULT_HOSTS, make_tls_files
from wire import versions
from wire.errors import E_INVALID_OPTION, E_UNAUTHENTICATED, E_UNAVAILABLE, QueueError
from wire.signing import new_private_key, private_key_to_text, public_key_text

DEFAULT_CREDENTIALS = Path.home() / ".config" / "qserver" / "credentials.json"


def join(data_dir: Path, node_id: str, existing: Path, tls_hosts: tuple[str, ...] | None = None,
         tls_ca: Path | None = None) -> int:
    """Initialise a further node of a cluster: the same cluster secret and client registry as
    an existing node's data directory (until the membership layer replicates the registry)."""
    secret_path = data_dir / "cluster.secret"
    if secret_path.exists():
        print(f"error: {data_dir} is already initialised", file=sys.stderr)
        return 1
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)       # owner only (issue 32)
    secret_path.write_text((existing / "cluster.secret").read_text())
    os.chmod(secret_path, 0o600)
    clients = read_clients(existing / "lmdb")
    storage = Storage(data_dir / "lmdb", node_id=node_id)
    try:
        storage.commit(SealedBatch(client_puts=clients))
    finally:
        storage.close()
    if tls_hosts is not None:
        _report_tls(make_tls_files(data_dir, node_id, tls_hosts, ca_from=tls_ca or existing))
    print(f"initialised {data_dir} as {node_id}, joining the cluster of {existing} ({len(clients)} clients)")
    return 0


def _report_tls(files: dict[str, str]) -> None:
    print(f"TLS: certificate {files['tls_cert_file']} (CA {files['tls_ca_file']}); `qserver run --data-dir` "
          "finds them there, or name them in node.toml as tls_cert_file, tls_key_file, tls_ca_file")


def init(data_dir: Path, node_id: str, credentials_path: Path, url: str, force: bool,
         tls_hosts: tuple[str, ...] | None = None, tls_ca: Path | None = None) -> int:
    """Create the cluster secret and the first admin client, and write its credentials; with
    `tls_hosts`, a local CA and this node's certificate for those host names too."""
    secret_path = data_dir / "cluster.secret"
    if secret_path.exists() and not force:
        print(f"error: {data_dir} is already initialised (use --force to add a new admin credential)", file=sys.stderr)
        return 1
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)       # owner only (issue 32)
    if not secret_path.exists():
        secret_path.write_text(secrets.token_hex(32) + "\n")
        os.chmod(secret_path, 0o600)
    key = new_private_key()
    client_id = "admin" if not force else "admin-" + secrets.token_hex(3)
    record = {"id": client_id, "name": client_id, "public_key": public_key_text(key), "grants": ADMIN_GRANTS,
              "created_ms": int(time.time() * 1000)}
    storage = Storage(data_dir / "lmdb", node_id=node_id)
    try:
        storage.commit(SealedBatch(client_puts={client_id: record}))
        membership = RaftStore(storage)
        if membership.is_empty():
            # This node founds the cluster: the membership layer's first configuration is this
            # node alone; every other node (init --join) asks it, or its successor, to be added.
            membership.bootstrap(node_id, storage.storage_id)
    finally:
        storage.close()
    ca_file = ""
    if tls_hosts is not None:
        files = make_tls_files(data_dir, node_id, tls_hosts, ca_from=tls_ca)
        ca_file = str(Path(files["tls_ca_file"]).resolve())
        url = url.replace("http://", "https://", 1)
        _report_tls(files)
    save_credentials(credentials_path, Credentials(client_id, private_key_to_text(key), url, ca_file,
                                                   cluster=str(data_dir.resolve())))
    print(f"initialised {data_dir}: cluster secret and admin client {client_id!r}; credentials in {credentials_path}")
    return 0


def mint_admin_credential(config: NodeConfig, url: str | None = None, name: str | None = None) -> Credentials:
    """Register a new admin client through the running node of `config` and return its
    credential (nothing is written). The node's data directory holds the cluster secret, with
    which nodes act for the cluster itself (qserver/api/auth.py, CLUSTER_CLIENT): the registration
    is signed so, and goes through the membership layer like `qctl clients add`. Raises
    QueueError (E_UNAVAILABLE: no node answers at the URL; E_UNAUTHENTICATED: it refused the
    secret; E_INVALID_OPTION: no cluster secret in the data directory)."""
    data_dir = Path(config.data_dir)
    secret_path = data_dir / "cluster.secret"
    if not secret_path.is_file():
        raise QueueError(E_INVALID_OPTION, f"{data_dir} is not a node's data directory (no cluster.secret)")
    tls = config.tls_files()
    ca_file = str(Path(tls[2]).resolve()) if tls else ""
    url = (url or config.own_url).rstrip("/")
    key = new_private_key()
    name = name or "admin-" + secrets.token_hex(3)
    signer = DelegatedSigner(CLUSTER_CLIENT, secret_path.read_text().strip().encode())

    async def register() -> dict[str, object]:
        async with HttpClient(url, signer, ca_file=ca_file) as http:
            return await http.register_client(name, ADMIN_GRANTS, public_key_text(key))
    answer = asyncio.run(register())
    return Credentials(str(answer["id"]), private_key_to_text(key), url, ca_file, cluster=str(data_dir.resolve()))


def admin_credential(config: NodeConfig, url: str | None, out: Path, name: str | None, as_json: bool) -> int:
    """`qserver admin-credential`: mint an admin credential into `out`, and say what was done."""
    if out.exists():
        print(f"error: E_INVALID_OPTION: {out} exists (it may be the only admin credential of a cluster): choose "
              "another --out, or remove it first", file=sys.stderr)
        return 1
    try:
        creds = mint_admin_credential(config, url, name)
    except QueueError as error:
        print(f"error: {error.code}: {error.message}{_mint_advice(error, config, url)}", file=sys.stderr)
        return 1
    save_credentials(out, creds)
    if as_json:
        print(json.dumps({"client_id": creds.client_id, "url": creds.url, "cluster": creds.cluster,
                          "credentials_file": str(out)}, indent=2, sort_keys=True))
    else:
        print(f"registered admin client {creds.client_id} (every privilege on every queue) through {creds.url}, "
              f"signed with the cluster secret of {config.data_dir}; credentials in {out} "
              f"(try: qctl --credentials {out} status)")
    return 0


def _mint_advice(error: QueueError, config: NodeConfig, url: str | None) -> str:
    """What to do about a mint that failed, for the two ways it fails in practice."""
    where = (url or config.own_url).rstrip("/")
    if error.code == E_UNAVAILABLE.code:
        return (f"\n  no node answers at {where}: a credential is minted through a running node of the cluster "
                "(start it, or name another of its nodes with --url, or its node.toml with --config)")
    if error.code == E_UNAUTHENTICATED.code:
        return (f"\n  the node at {where} refused the cluster secret of {config.data_dir}: it is a node of another "
                "cluster, or one running alone (no [cluster.nodes]: stop it, then `qserver init --force "
                f"--data-dir {config.data_dir}` adds an admin credential)")
    return ""


def version_text() -> str:
    """The release and what it reads and speaks: an operator compares these before a roll."""
    return (f"qserver {versions.RELEASE} (storage layout {SCHEMA_VERSION}; protocols: client "
            f"{versions.CLIENT_PROTOCOL.render()}, replication {versions.REPLICATION_PROTOCOL.render()}, membership "
            f"{versions.MEMBERSHIP_PROTOCOL.render()}; cluster feature levels {versions.OLDEST_FEATURE_LEVEL}-"
            f"{versions.FEATURE_LEVEL})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qserver", description="replicated queue server node")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", help="create the cluster secret and the first admin credential")
    p_init.add_argument("--data-dir", required=True, type=Path, help="the node's data directory (made if missing)")
    p_init.add_argument("--node-id", default="n1", help="the node's id in the cluster (default n1)")
    p_init.add_argument("--credentials", type=Path, default=DEFAULT_CREDENTIALS, help="where to write the admin credential")
    p_init.add_argument("--url", default="http://127.0.0.1:7100", help="the URL clients should use")
    p_init.add_argument("--force", action="store_true",
                        help="on an initialised directory: add a new admin credential (the secret stays)")
    p_init.add_argument("--join", type=Path, metavar="DATA_DIR",
                        help="another node's data directory: take its cluster secret and clients")
    p_init.add_argument("--tls", action="store_true",
                        help="make TLS files under DATA_DIR/tls: a local CA (or the joined node's) and this "
                             "node's certificate; the admin credential then names the CA and an https URL")
    p_init.add_argument("--tls-hosts", default=",".join(DEFAULT_HOSTS),
                        help="host names and addresses the node's certificate covers (comma-separated)")
    p_init.add_argument("--tls-ca", type=Path, metavar="DIR",
                        help="sign with the CA under DIR/tls/ (ca.pem, ca-key.pem) instead of making one")
    p_mint = sub.add_parser("admin-credential", help="register a new admin client through a running node, "
                                                     "with the cluster secret in its data directory",
                            description="Register a new admin client through a running node of the cluster, "
                                        "signing as the cluster itself with the secret in the node's data directory "
                                        "(whoever reads a data directory is an admin), and write its credential to "
                                        "--out (a new file). For a lost or overwritten admin credential.")
    p_mint.add_argument("--config", type=Path, help="the node's node.toml (its data directory and URL)")
    p_mint.add_argument("--data-dir", type=Path, help="the node's data directory (instead of, or over, --config)")
    p_mint.add_argument("--url", help="the node's URL (default: from --config, else http://127.0.0.1:7100)")
    p_mint.add_argument("--out", type=Path, required=True, help="where to write the new credential (a new file)")
    p_mint.add_argument("--name", help="the new client's name (default: admin- and 6 random hex digits)")
    p_mint.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p_run = sub.add_parser("run", help="run one node")
    p_run.add_argument("--config", type=Path, help="the node's TOML file (deploy/node.toml explains every setting)")
    p_run.add_argument("--data-dir", type=Path, help="the node's data directory (over the config's)")
    p_run.add_argument("--node-id", help="the node's id (over the config's)")
    p_run.add_argument("--host", help="the address to serve clients on (over the config's)")
    p_run.add_argument("--port", type=int, help="the port to serve clients on (over the config's)")
    p_run.add_argument("--no-journal", action="store_true", help="benchmark only: do not write the journal")
    p_run.add_argument("--log-level", default="INFO", help="DEBUG, INFO (default), WARNING or ERROR")
    migrate_cli.add_parser(sub)
    backup_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command in ("backup", "restore"):
        logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return backup_cli.run(args)
    if args.command == "migrate":        # it prints its own report: the log says only what went wrong
        logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return migrate_cli.run(args)
    if args.command == "init":
        tls_hosts = tuple(h.strip() for h in args.tls_hosts.split(",") if h.strip()) if args.tls else None
        if args.join is not None:
            return join(args.data_dir, args.node_id, args.join, tls_hosts, args.tls_ca)
        return init(args.data_dir, args.node_id, args.credentials, args.url, args.force, tls_hosts, args.tls_ca)
    if args.command == "admin-credential":
        if args.config is None and args.data_dir is None:
            parser.error("admin-credential needs --config or --data-dir")
        try:
            config = load_config(args.config, data_dir=None if args.data_dir is None else str(args.data_dir))
        except (OSError, ValueError) as error:
            print(f"error: E_INVALID_OPTION: {error}", file=sys.stderr)
            return 2
        return admin_credential(config, args.url, args.out, args.name, args.json)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config, node_id=args.node_id, host=args.host, port=args.port,
                         data_dir=None if args.data_dir is None else str(args.data_dir),
                         journal_enabled=False if args.no_journal else None)
    from qserver.node import DataDirInUse, run
    from qserver.storage.lmdb_store import StorageLayoutError
    try:
        run(config)
    except (StorageLayoutError, DataDirInUse) as error:
        print(f"qserver: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
