"""`qctl client access-key create|list|revoke CLIENT`: a client's access keys, the credentials
an AWS SDK signs its SQS requests with (docs/PROTOCOL.md, "Access keys"; docs/SQS.md).

One of the command groups client/qctl.py's parser dispatches to (a coroutine of the HttpClient
and the parsed arguments that returns an Outcome: qctl_render.py). CLIENT is a client's id or
its name. The secret is shown once, by `create`: the node keeps it sealed and never shows it again.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome, format_table
from wire import errors as e
from wire.errors import QueueError

SQS_PATH = "/sqs"        # where a node serves the SQS-compatible API (docs/SQS.md)
REGION = "us-east-1"     # any region signs; SDKs want one


async def resolve_client(http: HttpClient, given: str) -> dict[str, Any]:
    """The record of the client named by id or, failing that, by name (E_UNKNOWN_CLIENT)."""
    clients = await http.list_clients()
    for field in ("id", "name"):
        for record in clients:
            if record.get(field) == given:
                return record
    raise QueueError(e.E_UNKNOWN_CLIENT, f"no client with the id or name {given!r} (qctl clients list)")


def _when(ms: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + " UTC" if isinstance(ms, int) else "-"


def environment(key_id: str, secret: str, endpoint_url: str) -> list[str]:
    """The lines an AWS SDK or the AWS CLI takes the key from (AWS_ENDPOINT_URL_SQS: botocore
    1.31+, AWS CLI 2.13+, the JavaScript SDK v3)."""
    return [f"AWS_ACCESS_KEY_ID={key_id}", f"AWS_SECRET_ACCESS_KEY={secret}", f"AWS_DEFAULT_REGION={REGION}",
            f"AWS_ENDPOINT_URL_SQS={endpoint_url}"]


async def cmd_access_key_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    record = await resolve_client(http, args.client)
    answer = await http.create_access_key(str(record["id"]))
    key_id, secret = str(answer["access_key_id"]), str(answer.pop("secret_access_key"))
    endpoint_url = http.url.rstrip("/") + SQS_PATH
    document: dict[str, Any] = {**answer, "name": record.get("name"), "endpoint_url": endpoint_url}
    lines = environment(key_id, secret, endpoint_url)
    if args.out is not None:
        _write_private(args.out, [f"# qcluster access key {key_id} of client {record.get('name')} ({record['id']})",
                                  *(f"export {line}" for line in lines)])
        document["file"] = str(args.out)
        human = (f"access key {key_id} of client {record.get('name')} ({record['id']}), made {_when(answer.get('created_ms'))}\n"
                 f"written to {args.out} (owner only): `. {args.out}` sets AWS_ACCESS_KEY_ID, "
                 f"AWS_SECRET_ACCESS_KEY and the endpoint for an AWS SDK or the AWS CLI")
        return Outcome(document, human)
    document["secret_access_key"] = secret      # shown once: nowhere else keeps it
    human = "\n".join([
        f"access key {key_id} of client {record.get('name')} ({record['id']}), made {_when(answer.get('created_ms'))}",
        "the secret is shown this once; keep it where you keep passwords:", "",
        *lines[:2], "",
        f"with the AWS CLI or an SDK: --endpoint-url {endpoint_url} (or AWS_ENDPOINT_URL_SQS={endpoint_url}), "
        f"any region, e.g. {REGION}"])
    return Outcome(document, human)


def _write_private(path: Path, lines: list[str]) -> None:
    """The file is made owner-only before the secret is written into it."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)          # an existing file keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as file:
        file.write("\n".join(lines) + "\n")


async def cmd_access_key_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    record = await resolve_client(http, args.client)
    keys = await http.list_access_keys(str(record["id"]))
    rows = [[key.get("access_key_id"), _when(key.get("created_ms"))] for key in keys]
    human = format_table(["ACCESS_KEY_ID", "CREATED"], rows) if rows else \
        f"client {record.get('name')} ({record['id']}) has no access key"
    return Outcome({"client": record["id"], "name": record.get("name"), "access_keys": keys}, human)


async def cmd_access_key_revoke(http: HttpClient, args: argparse.Namespace) -> Outcome:
    record = await resolve_client(http, args.client)
    answer = await http.revoke_access_key(str(record["id"]), args.key)
    return Outcome(answer, f"revoked {args.key} of client {record.get('name')} ({record['id']})")


def add_parser(client_commands: Any, command: Any) -> None:
    """`qctl clients access-key ...` (also `qctl client access-key ...`); client/qctl.py's
    `command` adds the global options (--json among them)."""
    help_text = "access keys of a client: the credentials of the SQS-compatible API (AWS SDKs, the AWS CLI)"
    group = client_commands.add_parser("access-key", aliases=["access-keys"], help=help_text, description=help_text)
    actions = group.add_subparsers(dest="access_key_command", required=True, metavar="ACTION")
    create = command(actions, "create", cmd_access_key_create,
                     "make an access key id and secret for the client (shown once; at most 4 per client)")
    create.add_argument("client", metavar="CLIENT", help="the client's id or name")
    create.add_argument("--out", type=Path, metavar="FILE",
                        help="write the key as shell `export` lines here (owner only) instead of printing the secret")
    listing = command(actions, "list", cmd_access_key_list, "the client's access keys (ids and when made)")
    listing.add_argument("client", metavar="CLIENT", help="the client's id or name")
    revoke = command(actions, "revoke", cmd_access_key_revoke, "revoke an access key: refused at once on every node")
    revoke.add_argument("client", metavar="CLIENT", help="the client's id or name")
    revoke.add_argument("key", metavar="KEY", help="the access key id")
