"""REST routes of the clients a node knows and their grants (docs/PROTOCOL.md, "Grants"): register
one (with a key pair made here unless it brings its public key), list, remove, replace grants.
"""
from __future__ import annotations

import os
import time

from aiohttp import web

from qserver.api.auth import validate_grants
from qserver.api.http_common import NODE, call, json_body, principal
from qserver.core import commands as c
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
    answer = dict(record)
    if private_text is not None:
        answer["private_key"] = private_text
    return web.json_response(answer, status=201)


async def list_clients(request: web.Request) -> web.Response:
    principal(request).require("admin")
    return web.json_response({"clients": sorted(request.app[NODE].engine.clients.values(), key=lambda r: r["name"])})


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
    updated = {**record, "grants": grants}
    await call(engine, lambda r: c.PutClient(client_id, updated, r))
    return web.json_response(updated)
