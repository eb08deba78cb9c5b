"""REST routes of definitions (docs/OPERATIONS.md, "Definitions: export and import";
docs/PROTOCOL.md, "Definitions"): GET /v1/definitions exports what the cluster map defines,
POST /v1/definitions imports such a document.

The document and its checks are pure (replication/definitions.py). An import checks the whole
document against this node's map first and answers 400 E_INVALID_DEFINITIONS, listing every
problem, with nothing changed; then it creates what is missing through the REST routes
themselves: each item is one request to this node, signed in the caller's name with the
cluster secret (`QD2:`, qserver/api/auth.py delegated_signature, as macro queues over REST do:
qserver/features/macro/service.py), so every item is checked, passed on to a queue's master and
proposed exactly as that route does, with exactly the caller's grants (Guarantee 9).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
from aiohttp import web

from qserver.api.auth import DelegatedSigner, validate_grants
from qserver.api.http_common import NODE, coordinator_of, json_body, principal
from replication.definitions import (
    CHANNEL,
    CLIENT,
    CONFLICT,
    CREATE,
    FORWARD,
    MACRO,
    MACRO_MEMBER,
    QUEUE,
    RECIPIENT,
    UNCHANGED,
    Checks,
    Step,
    export_definitions,
    plan_import,
)
from wire import errors as e
from wire import versions
from wire.errors import QueueError
from wire.signing import private_key_from_text, public_key_from_text

# Items of one kind created at once (each is one map command; the membership layer batches them).
CREATES_AT_ONCE = 8
CALL_TIMEOUT_S = 30.0
RETRY_FOR_S = 15.0             # a retriable refusal (a node's lease renewing, a create under way) is asked again
PROBLEMS_IN_MESSAGE_MAX = 100  # the error message lists these; the envelope's `problems` lists them all
CA_CHARS_MAX = 64 * 1024       # as POST /v1/forwards takes (qserver/features/forwards/api.py)
# The order kinds are created in: what an item names exists before it.
PHASES = (QUEUE, CHANNEL, MACRO, MACRO_MEMBER, RECIPIENT, FORWARD, CLIENT)


async def export(request: web.Request) -> web.Response:
    """The definitions of the cluster as this node's map holds them: read in one go, with no
    await between the map and the client registry, so from one version of the map."""
    principal(request).require("admin", "*")
    node = request.app[NODE]
    cluster = coordinator_of(request).membership.cluster_map
    document = export_definitions(cluster, node.engine.clients, release=versions.RELEASE,
                                  now_ms=int(time.time() * 1000))
    return web.json_response(document)


async def import_(request: web.Request) -> web.Response:
    """Check the whole document, then create what is missing (`?dry_run=1`: only say what
    would be created). 200 with a result per item: created, unchanged, conflict (exists
    otherwise: left as it is) or failed (the route refused it after the check passed: a race
    with another change, a node down); nothing the document does not name is touched."""
    who = principal(request)
    who.require("admin", "*")
    dry_run = _flag(request, "dry_run")
    try:
        document = await json_body(request)
    except QueueError as error:
        raise QueueError(e.E_INVALID_DEFINITIONS, f"{error.message}: nothing was changed") from None
    node = request.app[NODE]
    cluster = coordinator_of(request).membership.cluster_map
    steps, problems = plan_import(document, cluster, node.engine.clients, CHECKS)
    if problems:
        return _invalid(problems)
    if dry_run:
        results = [{**step.to_json(), "status": "would_create" if step.action == CREATE else step.action}
                   for step in steps]
    else:
        results = await _run(node, who.client_id, steps)
    statuses = ("would_create", UNCHANGED, CONFLICT) if dry_run else ("created", UNCHANGED, CONFLICT, "failed")
    counts = {status: sum(1 for result in results if result["status"] == status) for status in statuses}
    return web.json_response({"dry_run": dry_run, "results": results, "counts": counts})


def _flag(request: web.Request, name: str) -> bool:
    raw = request.rel_url.query.get(name, "")
    if raw not in ("", "0", "1", "true", "false"):
        raise QueueError(e.E_INVALID_OPTION, f"{name} is 1 or 0")
    return raw in ("1", "true")


def _invalid(problems: list[str]) -> web.Response:
    shown = problems[:PROBLEMS_IN_MESSAGE_MAX]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    error = QueueError(e.E_INVALID_DEFINITIONS, f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in the "
                                                "definitions, nothing was changed:\n  " + "\n  ".join(shown) + more)
    envelope = error.envelope()
    envelope["error"]["problems"] = problems        # an addition to the envelope (docs/PROTOCOL.md, "REST")
    return web.json_response(envelope, status=error.http_status, headers={"X-Error-Code": error.code})


# --- the checks the document needs beyond the map: the routes' own ------------------------------
def _grants_problem(raw: Any) -> str:
    try:
        validate_grants(raw)
    except QueueError as error:
        return error.message
    return ""


def _public_key_problem(text: str) -> str:
    try:
        public_key_from_text(text)
    except ValueError:
        return "public_key must be a base64 raw Ed25519 key"
    return ""


def _private_key_problem(text: str) -> str:
    try:
        private_key_from_text(text)
    except Exception:   # the key parser raises several unrelated types for garbage
        return "private_key is not a private key"
    return ""


def _ca_problem(text: str) -> str:
    if len(text) > CA_CHARS_MAX:
        return f"ca is a PEM certificate of at most {CA_CHARS_MAX} characters"
    try:
        ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=text)
    except (ssl.SSLError, ValueError):
        return "ca is not a PEM certificate"
    return ""


CHECKS = Checks(grants=_grants_problem, public_key=_public_key_problem, private_key=_private_key_problem,
                ca=_ca_problem)


# --- creating: each item through its own REST route, in the caller's name -----------------------
def _route(step: Step) -> tuple[str, str, dict[str, Any]]:
    """The method, the (encoded) path and the body of the route that creates `step`'s item."""
    name = quote(step.name, safe="")
    if step.kind == QUEUE:
        return "PUT", f"/v1/queues/{name}", step.body
    if step.kind == CHANNEL:
        return "PUT", f"/v1/channels/{name}", step.body
    if step.kind == MACRO:
        return "PUT", f"/v1/macros/{name}", step.body
    if step.kind == MACRO_MEMBER:
        return "PUT", f"/v1/macros/{name}/members/{quote(step.member, safe='')}", step.body
    if step.kind == RECIPIENT:
        return "PUT", f"/v1/recipients/{name}/alternatives", step.body
    if step.kind == FORWARD:
        return "POST", "/v1/forwards", step.body
    return "POST", "/v1/clients", step.body


async def _run(node: Any, client_id: str, steps: list[Step]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [step.to_json() for step in steps]
    gate = asyncio.Semaphore(CREATES_AT_ONCE)

    async def create(positions: list[int]) -> None:
        async with gate:
            for position in positions:
                results[position] = await _create(node, client_id, steps[position])
    for kind in PHASES:
        # One at a time per macro queue: its members keep the document's order, which the
        # first_available and round_robin policies follow (replication/map_entries.py).
        batches: dict[str, list[int]] = {}
        for position, step in enumerate(steps):
            if step.kind == kind and step.action == CREATE:
                batches.setdefault(step.name if kind == MACRO_MEMBER else str(position), []).append(position)
        await asyncio.gather(*(create(positions) for positions in batches.values()))
    return results


async def _create(node: Any, client_id: str, step: Step) -> dict[str, Any]:
    shown = step.to_json()
    method, path, body = _route(step)
    loop = asyncio.get_running_loop()
    deadline, pause_s = loop.time() + RETRY_FOR_S, 0.1
    while True:
        status, answer = await _call(node, client_id, method, path, body)
        error = answer.get("error") if isinstance(answer, dict) else None
        if 200 <= status < 300:
            # 200 rather than 201: it came into being between the check and now (a queue or a
            # macro queue as the document says, else the route refuses; a channel takes the
            # document's class and interval, as its route does).
            existed = status == 200 and step.kind in (QUEUE, CHANNEL, MACRO) and not (
                step.kind == QUEUE and answer.get("created"))
            detail = "created meanwhile" + ("; set to the document's class and interval" if step.kind == CHANNEL else "")
            return {**shown, "status": UNCHANGED if existed else "created", **({"detail": detail} if existed else {})}
        if not isinstance(error, dict):
            return {**shown, "status": "failed", "code": e.E_INTERNAL.code, "detail": f"HTTP {status}"}
        code, message = str(error.get("code")), str(error.get("message", ""))
        if code == e.E_CLIENT_EXISTS.code and _same_client(node, step.body):     # registered meanwhile, as asked
            return {**shown, "status": UNCHANGED, "detail": "created meanwhile"}
        if code in (e.E_OPTIONS_MISMATCH.code, e.E_CLIENT_EXISTS.code):      # created otherwise meanwhile
            return {**shown, "status": CONFLICT, "detail": f"{message}: left as it is"}
        if error.get("retriable") and not error.get("outcome_unknown") and loop.time() + pause_s < deadline:
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, 1.0)
            continue
        return {**shown, "status": "failed", "code": code, "detail": message}


def _same_client(node: Any, body: dict[str, Any]) -> bool:
    """Whether this node's registry holds a client of the body's name with its key and grants
    (the route refused the name: the engine found it in this node's registry)."""
    for record in node.engine.clients.values():
        if record.get("name") == body["name"]:
            def grants(raw: Any) -> list[str]:
                return sorted(json.dumps(grant, sort_keys=True) for grant in validate_grants(raw))
            return bool(record.get("public_key") == body["public_key"] and grants(record.get("grants")) ==
                        grants(body["grants"]))
    return False


async def _call(node: Any, client_id: str, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    base = node.url.rstrip("/")
    headers.update(DelegatedSigner(client_id, node.auth.cluster_secret).headers(method, path, [], data, audience=base))
    try:
        async with node.http_session().request(method, yarl.URL(base + path, encoded=True), data=data,
                                               headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as answer:
            raw = await answer.read()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome_unknown = method == "POST"
        return 503, QueueError(e.E_UNAVAILABLE, f"{method} {path}: {exc or type(exc).__name__}",
                               outcome_unknown=outcome_unknown).envelope()
    try:
        return status, json.loads(raw) if raw else {}
    except ValueError:
        return status, {}
