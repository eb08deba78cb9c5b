"""REST routes of the clients a node knows and their grants (docs/PROTOCOL.md, "Grants"): register
one (with a key pair made here unless it brings its public key), list, remove, replace grants;
and a client's access keys (docs/PROTOCOL.md, "Access keys"): the SQS gateway's credentials.

An access key lives in its client's record, `record["access_keys"] = {key id: {"sealed",
"created_ms"}}`, which the map's PutClient carries to every node as it is (a 0.2.0 node too:
the record is a dict it stores and copies whole). The secret is sealed (qserver/sealing.py) and
shown once, in the answer that creates it; every record a route shows lists key ids only
(`shown`).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import weakref
from typing import Any

from aiohttp import web

from qserver.api.auth import PASSED_ON_BY, validate_grants
from qserver.api.http_common import MAP_CATCH_UP_S, NODE, call, json_body, pass_on_to, principal
from qserver.core import commands as c
from qserver.sealing import new_access_key, seal_access_key
from qserver.services import SERVICES
from replication.options import is_valid_queue_name
from wire import errors as e
from wire.errors import QueueError
from wire.signing import new_private_key, private_key_to_text, public_key_from_text, public_key_text


async def register_client(request: web.Request) -> web.Response:
    principal(request).require("admin")
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not is_valid_queue_name(body["name"]):
        raise QueueError(e.E_INVALID_NAME, "a client needs a name of 1-200 of A-Z a-z 0-9 . _ : -")
    grants = validate_grants(body.get("grants", []))
    engine = request.app[NODE].engine
    if any(record["name"] == body["name"] for record in engine.clients.values()):
        raise QueueError(e.E_CLIENT_EXISTS, f"a client named {body['name']} exists")
    private_text = None
    if body.get("public_key") is not None:
        try:
            public_key_from_text(str(body["public_key"]))
        except ValueError:
            raise QueueError(e.E_INVALID_OPTION, "public_key must be a base64 raw Ed25519 key") from None
        public_text = str(body["public_key"])
    else:
        key = new_private_key()
        private_text, public_text = private_key_to_text(key), public_key_text(key)
    client_id = "c-" + os.urandom(6).hex()
    record = {"id": client_id, "name": body["name"], "public_key": public_text, "grants": grants,
              "created_ms": int(time.time() * 1000)}
    await call(engine, lambda r: c.PutClient(client_id, record, r))
    answer = shown(record)
    if private_text is not None:
        answer["private_key"] = private_text
    return web.json_response(answer, status=201)


async def list_clients(request: web.Request) -> web.Response:
    principal(request).require("admin")
    records = sorted(request.app[NODE].engine.clients.values(), key=lambda r: r["name"])
    return web.json_response({"clients": [shown(record) for record in records]})


async def remove_client(request: web.Request) -> web.Response:
    principal(request).require("admin")
    client_id = request.match_info["id"]
    await call(request.app[NODE].engine, lambda r: c.PutClient(client_id, None, r))
    return web.json_response({"removed": client_id})


async def set_grants(request: web.Request) -> web.Response:
    principal(request).require("admin")
    client_id = request.match_info["id"]
    engine = request.app[NODE].engine
    body = await json_body(request)
    grants = validate_grants(body.get("grants") if isinstance(body, dict) else None)
    record = engine.clients.get(client_id)
    if record is None:
        raise QueueError(e.E_UNKNOWN_CLIENT, f"no client {client_id}")
    updated = {**record, "grants": grants}        # its access keys stay with it
    await call(engine, lambda r: c.PutClient(client_id, updated, r))
    return web.json_response(shown(updated))


# --- access keys ---------------------------------------------------------------------------------
ACCESS_KEYS_MAX = 4              # per client: enough to rotate one while another is in use
# A change of a client's keys reads its record, adds or drops a key and puts the whole record
# back (the map's PutClient). Two changes from records read apart would lose one's key: so every
# change is made at the membership leader, whose map has applied every committed command (a node
# asked passes the request on), one at a time there (per application).
_key_changes: weakref.WeakKeyDictionary[web.Application, asyncio.Lock] = weakref.WeakKeyDictionary()


def shown(record: dict[str, Any]) -> dict[str, Any]:
    """A client record as a route shows it: its access keys' ids and times, never the sealed
    secrets (which open only with the sealing secret, but are none of a reader's business)."""
    keys = record.get("access_keys")
    if keys is None:
        return dict(record)
    return {**record, "access_keys": listed_keys(record)}


def listed_keys(record: dict[str, Any]) -> list[dict[str, Any]]:
    keys = record.get("access_keys")
    if not isinstance(keys, dict):
        return []
    return [{"access_key_id": key_id, "created_ms": entry.get("created_ms") if isinstance(entry, dict) else None}
            for key_id, entry in sorted(keys.items(), key=lambda item: (_created(item[1]), item[0]))]


def _created(entry: Any) -> int:
    created = entry.get("created_ms") if isinstance(entry, dict) else None
    return created if isinstance(created, int) else 0


def _key_lock(request: web.Request) -> asyncio.Lock:
    lock = _key_changes.get(request.app)
    if lock is None:
        lock = _key_changes[request.app] = asyncio.Lock()
    return lock


async def _at_leader(request: web.Request) -> web.Response | None:
    """The leader's answer to a key change asked of another node; None: change it here (this
    node leads, no leader is known, the request was passed on already, or the leader runs a
    release without access keys: 0.2.0 during a rolling upgrade)."""
    node = request.app[NODE]
    membership = node.engine.pairs.view.membership
    leader = membership.leader_id() if membership is not None else None
    if PASSED_ON_BY in request.headers or leader is None or leader == node.config.node_id:
        return None
    answer = await pass_on_to(request, node, leader)
    if answer.status == 404 and b'"E_NOT_FOUND"' in _body(answer):
        return None
    return answer


async def _until_local(request: web.Request, client_id: str, key_id: str, *, present: bool) -> None:
    """Read your writes: the change the leader made is in this node's registry before the
    answer goes back, so the client's next request here sees it (at most MAP_CATCH_UP_S)."""
    engine = request.app[NODE].engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + MAP_CATCH_UP_S
    while loop.time() < deadline:
        keys = (engine.clients.get(client_id) or {}).get("access_keys")
        if (isinstance(keys, dict) and key_id in keys) == present:
            return
        await asyncio.sleep(0.01)


def _record(request: web.Request) -> tuple[str, dict[str, Any]]:
    client_id = request.match_info["id"]
    record = request.app[NODE].engine.clients.get(client_id)
    if record is None:
        raise QueueError(e.E_UNKNOWN_CLIENT, f"no client {client_id}")
    return client_id, record


async def create_access_key(request: web.Request) -> web.Response:
    """A new access key of an existing client; the only answer that shows its secret."""
    principal(request).require("admin")
    passed = await _at_leader(request)
    if passed is not None:
        if passed.status == 201:
            await _until_local(request, request.match_info["id"], _answered(passed, "access_key_id"), present=True)
        return passed
    async with _key_lock(request):
        client_id, record = _record(request)
        keys = record.get("access_keys")
        keys = dict(keys) if isinstance(keys, dict) else {}
        if len(keys) >= ACCESS_KEYS_MAX:
            raise QueueError(e.E_INVALID_OPTION, f"client {client_id} has {len(keys)} access keys, the most it may "
                                                 f"have: revoke one first")
        key_id, secret = new_access_key()
        created_ms = int(time.time() * 1000)
        sealed = seal_access_key(request.app[SERVICES].sealing_secret, client_id, key_id, secret)
        keys[key_id] = {"sealed": sealed, "created_ms": created_ms}
        updated = {**record, "access_keys": keys}
        # Unanswered in time, the key may have been stored: `list` shows it, `revoke` drops it.
        await call(request.app[NODE].engine, lambda r: c.PutClient(client_id, updated, r), may_have_applied=True)
    return web.json_response({"client": client_id, "access_key_id": key_id, "secret_access_key": secret,
                              "created_ms": created_ms}, status=201)


def _body(answer: web.Response) -> bytes:
    body = answer.body
    return bytes(body) if isinstance(body, bytes | bytearray) else b""


def _answered(answer: web.Response, field: str) -> str:
    try:
        return str(json.loads(_body(answer)).get(field, ""))
    except (ValueError, AttributeError):
        return ""


async def list_access_keys(request: web.Request) -> web.Response:
    principal(request).require("admin")
    client_id, record = _record(request)
    return web.json_response({"client": client_id, "access_keys": listed_keys(record)})


async def revoke_access_key(request: web.Request) -> web.Response:
    """Drop an access key: every node stops taking it once the map has applied the change."""
    principal(request).require("admin")
    key_id = request.match_info["key"]
    passed = await _at_leader(request)
    if passed is not None:
        if passed.status == 200:
            await _until_local(request, request.match_info["id"], key_id, present=False)
        return passed
    async with _key_lock(request):
        client_id, record = _record(request)
        keys = record.get("access_keys")
        if not isinstance(keys, dict) or key_id not in keys:
            raise QueueError(e.E_UNKNOWN_ACCESS_KEY, f"client {client_id} has no access key {key_id[:40]}")
        remaining = {other: entry for other, entry in keys.items() if other != key_id}
        updated = {**record, "access_keys": remaining}
        await call(request.app[NODE].engine, lambda r: c.PutClient(client_id, updated, r), may_have_applied=True)
    return web.json_response({"client": client_id, "revoked": key_id})
