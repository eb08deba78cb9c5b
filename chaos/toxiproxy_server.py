"""A server that speaks Toxiproxy's HTTP API (Shopify/toxiproxy v2), for chaos tests.

No Toxiproxy server binary is packaged for pip or Debian, so this module proxies TCP on
loopback and lets the real `toxiproxy-python` client add toxics to the links (chaos/README.md).
A real `toxiproxy-server` found on PATH is preferred by `start()`.

    client --> [listen] Proxy --upstream Link--> [upstream address]
    client <-- [listen] Proxy <-downstream Link-- [upstream address]

Each accepted connection has two Links, one per direction. A Link reads its source into a
bounded queue (stamping each chunk with its arrival time) and one pump task passes every
chunk through the toxics of its stream, in the order they were added, before writing it.
Toxics are re-read at every step and any change wakes the pump, so adding, updating or
removing a toxic acts on live connections as it does in Toxiproxy.

Everything runs on one asyncio event loop: the HTTP API (aiohttp), the listeners and the
links. `toxiproxy-python` is synchronous (it uses `requests`) and keeps the server address in
a class attribute (`toxiproxy.api.APIConsumer.host/port`), so drive it from a plain thread or a
synchronous test, never from inside an event loop: the blocking call would stall that loop.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client
import ipaddress
import json
import logging
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from chaos.toxics import (
    STREAMS,
    ApiError,
    Toxic,
    bad_request_body,
    missing_field,
    parse_new_toxic,
    proxy_already_exists,
    proxy_not_found,
    toxic_already_exists,
    toxic_not_found,
    updated_toxic,
)

LOG = logging.getLogger(__name__)

VERSION = "2.12.0-qcluster"
API_PORT_DEFAULT = 8474
LISTEN_DEFAULT = "127.0.0.1:0"

# Limits (docs/ARCHITECTURE.md, "Conventions": a limit on everything).
PROXIES_MAX = 256
TOXICS_PER_PROXY_MAX = 32
CONNECTIONS_PER_PROXY_MAX = 256
READ_BYTES_MAX = 64 * 1024
LINK_QUEUE_CHUNKS_MAX = 64  # per direction: at most 4 MiB held by a link
STREAM_BUFFER_BYTES_MAX = 64 * 1024
REQUEST_BODY_BYTES_MAX = 1024 * 1024
DIAL_TIMEOUT_S = 5.0
BANDWIDTH_SLICE_MS = 100  # as Toxiproxy: a slow link sends what 100 ms of its rate allows

SERVER_START_TIMEOUT_S = 15.0
SERVER_STOP_TIMEOUT_S = 10.0
REPOSITORY = Path(__file__).resolve().parent.parent


# --- Addresses: loopback only -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_loopback_address(text: object, field: str, *, port_zero_allowed: bool) -> Address:
    """`host:port` where host is a loopback IP or `localhost` (taken as 127.0.0.1): all the
    traffic of the project stays on the loopback interface."""
    if not isinstance(text, str):
        raise bad_request_body(f"{field} must be a string")
    host, separator, port_text = text.rpartition(":")
    if not separator or not port_text.isdigit():
        raise ApiError(f"{field} must be host:port, got {text!r}", 400)
    host = "127.0.0.1" if host == "localhost" else host.strip("[]")
    if not is_loopback_host(host):
        raise ApiError(f"{field} must be a loopback address (127.0.0.0/8 or ::1), got {text!r}", 400)
    port = int(port_text)
    if not (0 if port_zero_allowed else 1) <= port <= 65535:
        raise ApiError(f"{field} has an invalid port: {text!r}", 400)
    return Address(str(ipaddress.ip_address(host)), port)


# --- Links: one direction of a proxied connection ------------------------------------------


@dataclasses.dataclass(slots=True)
class Chunk:
    data: bytes  # b"" marks the end of the stream
    arrived: float  # loop time when it was read


class ToxicRun:
    """One toxic running on one link: its toxicity roll and its per-connection state."""

    def __init__(self, toxic: Toxic, active: bool) -> None:
        self.toxic = toxic
        self.active = active
        self.bytes_transmitted = 0  # limit_data
        self.timer: asyncio.TimerHandle | None = None  # timeout

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _of_type(runs: Iterable[ToxicRun], toxic_type: str) -> list[ToxicRun]:
    return [run for run in runs if run.toxic.type == toxic_type]


class Link:
    """Reads `source`, passes the data through the toxics of its stream, writes `destination`.

    Ends as Toxiproxy's links end: the end of the source, a timeout, limit_data or an error
    closes the destination; reset_peer resets both sockets of the connection.
    """

    def __init__(self, connection: Connection, stream: str, source: asyncio.StreamReader,
                 destination: asyncio.StreamWriter) -> None:
        self.stream = stream
        self.finished = False
        self._connection = connection
        self._source = source
        self._destination = destination
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=LINK_QUEUE_CHUNKS_MAX)
        self._runs: dict[str, ToxicRun] = {}
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, toxics: list[Toxic]) -> None:
        self.set_toxics(toxics)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._pump())]

    def set_toxics(self, toxics: list[Toxic]) -> None:
        """Bring the running toxics in line with the proxy's, as Toxiproxy does on live links:
        a new toxic starts, an updated one re-runs (new toxicity roll, timers restarted,
        limit_data's count kept), a removed one stops; removing a timeout closes the link."""
        if self.finished:
            return
        runs: dict[str, ToxicRun] = {}
        for toxic in toxics:
            run = self._runs.pop(toxic.name, None)
            runs[toxic.name] = run if run is not None and run.toxic is toxic else self._new_run(toxic, run)
        closes = False
        for removed in self._runs.values():
            removed.stop_timer()
            closes = closes or (removed.active and removed.toxic.type == "timeout")
        self._runs = runs
        self._changed.set()
        self._changed = asyncio.Event()
        if closes:
            self.finish()

    def _new_run(self, toxic: Toxic, previous: ToxicRun | None) -> ToxicRun:
        run = ToxicRun(toxic, self._connection.rng.random() < toxic.toxicity)
        if previous is not None:
            previous.stop_timer()
            run.bytes_transmitted = previous.bytes_transmitted
        timeout_ms = toxic.attribute("timeout") if toxic.type == "timeout" else 0
        if run.active and timeout_ms > 0:
            run.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self.finish)
        return run

    def stop(self) -> None:
        """Stop reading and writing without touching the sockets (the connection does that)."""
        if self.finished:
            return
        self.finished = True
        for run in self._runs.values():
            run.stop_timer()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def finish(self, reset: bool = False) -> None:
        if self.finished:
            return
        self.stop()
        if reset:
            self._connection.reset()
        else:
            self._destination.close()
        self._connection.link_finished()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self._source.read(READ_BYTES_MAX)
                await self._queue.put(Chunk(data, loop.time()))
                if not data:
                    return
        except OSError:
            await self._queue.put(Chunk(b"", loop.time()))

    async def _pump(self) -> None:
        try:
            while True:
                chunk = await self._queue.get()
                if not chunk.data:
                    await self._deliver_end()
                    return
                if await self._deliver(chunk):
                    return
        except OSError:
            self.finish()  # the destination broke

    def _active_runs(self) -> list[ToxicRun]:
        return [run for run in self._runs.values() if run.active]

    async def _deliver(self, chunk: Chunk) -> bool:
        """Pass one chunk through the toxics and write what comes out; True once the link is
        finished. A change of toxics while waiting re-evaluates the rest of the chunk."""
        loop = asyncio.get_running_loop()
        data = chunk.data
        latency_s, latency_drawn_for = 0.0, None  # jitter is drawn once per chunk and toxic set
        while data:
            changed = self._changed
            runs = self._active_runs()
            if _of_type(runs, "timeout"):
                return False  # a timeout toxic drops the data on the floor
            resets = _of_type(runs, "reset_peer")
            if resets:
                await self._reset_after(resets[0])
                return True
            if latency_drawn_for is not changed:
                latency_s, latency_drawn_for = self._latency_s(runs), changed
            if await self._wait_until(chunk.arrived + latency_s, changed):
                continue
            rates = [run.toxic.attribute("rate") for run in _of_type(runs, "bandwidth")]
            piece = data
            if rates:
                rate = min(rates)  # KB/s; 0 lets nothing through, as in Toxiproxy
                piece = data[: max(1, rate * BANDWIDTH_SLICE_MS)]
                deadline = loop.time() + len(piece) / (rate * 1000) if rate else None
                if await self._wait_until(deadline, changed):
                    continue
            data = data[len(piece):]
            if await self._write_limited(piece, runs):
                return True
        return False

    def _latency_s(self, runs: list[ToxicRun]) -> float:
        total_ms = 0.0
        for run in _of_type(runs, "latency"):
            jitter_ms = run.toxic.attribute("jitter")
            total_ms += run.toxic.attribute("latency")
            if jitter_ms:
                total_ms += self._connection.rng.uniform(-jitter_ms, jitter_ms)
        return total_ms / 1000

    async def _write_limited(self, piece: bytes, runs: list[ToxicRun]) -> bool:
        """Write what limit_data still allows; True (link finished) once a limit is reached."""
        limits = _of_type(runs, "limit_data")
        for run in limits:
            piece = piece[: max(0, run.toxic.attribute("bytes") - run.bytes_transmitted)]
        if piece:
            self._destination.write(piece)
            await self._destination.drain()
            for run in limits:
                run.bytes_transmitted += len(piece)
        if any(run.bytes_transmitted >= run.toxic.attribute("bytes") for run in limits):
            self.finish()
            return True
        return False

    async def _deliver_end(self) -> None:
        """The source ended: slow_close holds the close back, reset_peer turns it into a reset."""
        loop = asyncio.get_running_loop()
        ended_at = loop.time()
        while True:
            changed = self._changed
            runs = self._active_runs()
            if _of_type(runs, "timeout"):
                break
            resets = _of_type(runs, "reset_peer")
            if resets:
                await self._reset_after(resets[0])
                return
            delay_ms = sum(run.toxic.attribute("delay") for run in _of_type(runs, "slow_close"))
            if not await self._wait_until(ended_at + delay_ms / 1000, changed):
                break
        self.finish()

    async def _reset_after(self, run: ToxicRun) -> None:
        # As in Toxiproxy, the wait is not cut short by a change of toxics.
        await asyncio.sleep(run.toxic.attribute("timeout") / 1000)
        self.finish(reset=True)

    async def _wait_until(self, deadline: float | None, changed: asyncio.Event) -> bool:
        """Sleep until `deadline` (loop time; None: until a change); True if the toxics
        changed first."""
        if changed.is_set():
            return True
        delay_s = None if deadline is None else deadline - asyncio.get_running_loop().time()
        if delay_s is not None and delay_s <= 0:
            return False
        try:
            async with asyncio.timeout(delay_s):
                await changed.wait()
            return True
        except TimeoutError:
            return False


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    """Closing a socket with SO_LINGER 0 sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Connection:
    """A client connection and its upstream connection, joined by two links."""

    def __init__(self, proxy: Proxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.rng = proxy.rng
        self._proxy = proxy
        self._writers = (client[1], upstream[1])
        self._links = {
            "upstream": Link(self, "upstream", client[0], upstream[1]),
            "downstream": Link(self, "downstream", upstream[0], client[1]),
        }

    def start(self, toxics: list[Toxic]) -> None:
        for stream, link in self._links.items():
            link.start([toxic for toxic in toxics if toxic.stream == stream])

    def set_toxics(self, toxics: list[Toxic]) -> None:
        for stream, link in self._links.items():
            link.set_toxics([toxic for toxic in toxics if toxic.stream == stream])

    def reset(self) -> None:
        for link in self._links.values():
            link.stop()
        for writer in self._writers:
            _set_linger_zero(writer)
            writer.transport.abort()
        self.link_finished()

    def drop(self) -> None:
        """The proxy is going down: stop both links and close both sockets at once."""
        for link in self._links.values():
            link.stop()
        for writer in self._writers:
            writer.transport.abort()
        self.link_finished()

    def link_finished(self) -> None:
        if all(link.finished for link in self._links.values()):
            self._proxy.forget(self)


# --- Proxies ----------------------------------------------------------------------------------


class Proxy:
    """A named listener that forwards each connection to `upstream` through its toxics."""

    def __init__(self, name: str, listen: Address, upstream: Address, rng: random.Random) -> None:
        self.name = name
        self.listen = listen
        self.upstream = upstream
        self.enabled = False
        self.rng = rng
        self.toxics: list[Toxic] = []  # in the order they were added
        self._server: asyncio.Server | None = None
        self._connections: set[Connection] = set()
        self._dialing: set[asyncio.Task[Any]] = set()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "listen": str(self.listen), "upstream": str(self.upstream),
                "enabled": self.enabled, "toxics": self.toxics_json()}

    def toxics_json(self) -> list[dict[str, Any]]:
        """Upstream toxics first, then downstream, as Toxiproxy lists its two chains."""
        return [toxic.to_json() for stream in STREAMS for toxic in self.toxics if toxic.stream == stream]

    async def start(self) -> None:
        """Listen (again) on `listen`; after the first start it names the port actually bound."""
        if self.enabled:
            return
        try:
            self._server = await asyncio.start_server(self._accept, self.listen.host, self.listen.port,
                                                      limit=STREAM_BUFFER_BYTES_MAX)
        except OSError as error:
            raise ApiError(f"listen tcp {self.listen}: {error.strerror or error}", 500) from error
        self.listen = Address(self.listen.host, int(self._server.sockets[0].getsockname()[1]))
        self.enabled = True

    async def stop(self) -> None:
        """Stop listening and drop every connection, as disabling a Toxiproxy proxy does."""
        if not self.enabled:
            return
        self.enabled = False
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._dialing):
            task.cancel()
        for connection in list(self._connections):
            connection.drop()
        if server is not None:
            await server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports close their sockets

    async def update(self, listen: Address, upstream: Address, enabled: bool) -> None:
        if listen != self.listen or upstream != self.upstream:
            await self.stop()
            self.listen, self.upstream = listen, upstream
        if enabled:
            await self.start()
        else:
            await self.stop()

    def forget(self, connection: Connection) -> None:
        self._connections.discard(connection)

    def find_toxic(self, name: str) -> Toxic:
        for toxic in self.toxics:
            if toxic.name == name:
                return toxic
        raise toxic_not_found()

    def add_toxic(self, toxic: Toxic) -> None:
        if any(existing.name == toxic.name for existing in self.toxics):
            raise toxic_already_exists()
        if len(self.toxics) >= TOXICS_PER_PROXY_MAX:
            raise ApiError(f"a proxy holds at most {TOXICS_PER_PROXY_MAX} toxics", 400)
        self.toxics.append(toxic)
        self._push_toxics()

    def replace_toxic(self, toxic: Toxic) -> None:
        self.toxics = [toxic if existing.name == toxic.name else existing for existing in self.toxics]
        self._push_toxics()

    def remove_toxic(self, name: str) -> None:
        self.find_toxic(name)
        self.toxics = [toxic for toxic in self.toxics if toxic.name != name]
        self._push_toxics()

    def remove_all_toxics(self) -> None:
        self.toxics = []
        self._push_toxics()

    def _push_toxics(self) -> None:
        for connection in list(self._connections):
            connection.set_toxics(self.toxics)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if not self.enabled or len(self._connections) + len(self._dialing) >= CONNECTIONS_PER_PROXY_MAX:
            client_writer.transport.abort()
            return
        upstream = await self._dial(client_writer)
        if upstream is None:
            return
        connection = Connection(self, (client_reader, client_writer), upstream)
        self._connections.add(connection)
        connection.start(self.toxics)


    async def _dial(self, client_writer: asyncio.StreamWriter) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Connect to the upstream; None (client closed) when it cannot be reached, as in
        Toxiproxy. A cancel (the proxy goes down meanwhile) ends here too: the stream
        protocol's callback that owns this task expects it to finish, not to be cancelled."""
        task = asyncio.current_task()
        if task is None:
            return None
        self._dialing.add(task)
        try:
            async with asyncio.timeout(DIAL_TIMEOUT_S):
                return await asyncio.open_connection(self.upstream.host, self.upstream.port,
                                                     limit=STREAM_BUFFER_BYTES_MAX)
        except (OSError, TimeoutError, asyncio.CancelledError):
            client_writer.transport.abort()
            return None
        finally:
            self._dialing.discard(task)


# --- The HTTP API -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyInput:
    name: str
    listen: Address
    upstream: Address
    enabled: bool


def _parse_proxy_input(body: object, position: str = "") -> ProxyInput:
    """A proxy as `POST /proxies` and `/populate` describe it; `listen` defaults to
    127.0.0.1:0 (Toxiproxy's default, all interfaces, is not allowed here)."""
    if not isinstance(body, dict):
        raise bad_request_body("expected a JSON object")
    name, upstream = body.get("name"), body.get("upstream")
    if not isinstance(name, str) or not name:
        raise missing_field("name" + position)
    if not isinstance(upstream, str) or not upstream:
        raise missing_field("upstream" + position)
    enabled = body.get("enabled", True)
    if not isinstance(enabled, bool):
        raise bad_request_body("enabled must be a boolean")
    return ProxyInput(name=name,
                      listen=parse_loopback_address(body.get("listen") or LISTEN_DEFAULT, "listen",
                                                    port_zero_allowed=True),
                      upstream=parse_loopback_address(upstream, "upstream", port_zero_allowed=False),
                      enabled=enabled)


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as error:
        raise bad_request_body(str(error) if raw else "EOF") from error


@web.middleware
async def _api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Toxiproxy refuses browsers, so that a web page cannot drive a local proxy.
    if request.headers.get("User-Agent", "").startswith("Mozilla/"):
        return web.Response(status=403, text="User agent not allowed\n")
    try:
        return await handler(request)
    except ApiError as error:
        return web.json_response(error.to_json(), status=error.status)


class ToxiproxyServer:
    """The proxies and the HTTP API over them, all on the running event loop."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.proxies: dict[str, Proxy] = {}
        self._lock = asyncio.Lock()  # one change of the proxy set at a time
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = API_PORT_DEFAULT) -> int:
        """Serve the API on host:port (loopback only); returns the port bound."""
        if not is_loopback_host(host):
            raise ValueError(f"the API listens on loopback only, not {host!r}")
        self._runner = web.AppRunner(self.application(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        for proxy in list(self.proxies.values()):
            await proxy.stop()
        self.proxies.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def application(self) -> web.Application:
        app = web.Application(middlewares=[_api_middleware], client_max_size=REQUEST_BODY_BYTES_MAX)
        proxy, toxic = "/proxies/{proxy}", "/proxies/{proxy}/toxics/{toxic}"
        app.add_routes([
            web.get("/version", self._version),
            web.post("/reset", self._reset),
            web.post("/populate", self._populate),
            web.get("/proxies", self._proxy_index),
            web.post("/proxies", self._proxy_create),
            web.get(proxy, self._proxy_show),
            web.post(proxy, self._proxy_update),
            web.patch(proxy, self._proxy_update),
            web.delete(proxy, self._proxy_delete),
            web.get(proxy + "/toxics", self._toxic_index),
            web.post(proxy + "/toxics", self._toxic_create),
            web.get(toxic, self._toxic_show),
            web.post(toxic, self._toxic_update),
            web.patch(toxic, self._toxic_update),
            web.delete(toxic, self._toxic_delete),
        ])
        return app

    def _proxy(self, request: web.Request) -> Proxy:
        proxy = self.proxies.get(request.match_info["proxy"])
        if proxy is None:
            raise proxy_not_found()
        return proxy

    async def _add_proxy(self, given: ProxyInput) -> Proxy:
        if given.name in self.proxies:
            raise proxy_already_exists()
        if len(self.proxies) >= PROXIES_MAX:
            raise ApiError(f"at most {PROXIES_MAX} proxies", 400)
        proxy = Proxy(given.name, given.listen, given.upstream, self.rng)
        if given.enabled:
            await proxy.start()
        self.proxies[given.name] = proxy
        return proxy

    async def _version(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps({"version": VERSION}) + "\n",
                            content_type="application/json", charset="utf-8")

    async def _reset(self, request: web.Request) -> web.Response:
        """Enable every proxy and remove every toxic."""
        async with self._lock:
            for proxy in list(self.proxies.values()):
                await proxy.start()
                proxy.remove_all_toxics()
        return web.Response(status=204)

    async def _proxy_index(self, request: web.Request) -> web.Response:
        return web.json_response({name: proxy.to_json() for name, proxy in self.proxies.items()})

    async def _proxy_create(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        async with self._lock:
            if isinstance(body, dict) and body.get("name") in self.proxies:
                raise proxy_already_exists()
            proxy = await self._add_proxy(_parse_proxy_input(body))
        return web.json_response(proxy.to_json(), status=201)

    async def _populate(self, request: web.Request) -> web.Response:
        """Create or replace many proxies; one whose listen and upstream are unchanged stays
        as it is. Every entry is checked before anything changes."""
        body = await _json_body(request)
        if not isinstance(body, list):
            raise bad_request_body("expected a JSON array of proxies")
        wanted = [_parse_proxy_input(entry, f" at proxy {index}") for index, entry in enumerate(body, 1)]
        names = [given.name for given in wanted]
        if len(set(names)) != len(names):
            raise ApiError("duplicate proxy name in populate request", 400)
        done: list[Proxy] = []
        async with self._lock:
            try:
                for given in wanted:
                    done.append(await self._replace_proxy(given))
            except ApiError as error:
                return web.json_response({**error.to_json(), "proxies": [p.to_json() for p in done]},
                                         status=error.status)
        return web.json_response({"proxies": [proxy.to_json() for proxy in done]}, status=201)

    async def _replace_proxy(self, given: ProxyInput) -> Proxy:
        existing = self.proxies.get(given.name)
        if existing is not None:
            if existing.listen == given.listen and existing.upstream == given.upstream:
                return existing
            await existing.stop()
            del self.proxies[given.name]
        return await self._add_proxy(given)

    async def _proxy_show(self, request: web.Request) -> web.Response:
        return web.json_response(self._proxy(request).to_json())

    async def _proxy_update(self, request: web.Request) -> web.Response:
        """Change listen, upstream or enabled; fields left out keep their values."""
        async with self._lock:
            proxy = self._proxy(request)
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise bad_request_body("expected a JSON object")
            listen = parse_loopback_address(body.get("listen", str(proxy.listen)), "listen", port_zero_allowed=True)
            upstream = parse_loopback_address(body.get("upstream", str(proxy.upstream)), "upstream",
                                              port_zero_allowed=False)
            enabled = body.get("enabled", proxy.enabled)
            if not isinstance(enabled, bool):
                raise bad_request_body("enabled must be a boolean")
            await proxy.update(listen, upstream, enabled)
        return web.json_response(proxy.to_json())

    async def _proxy_delete(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._proxy(request)
            del self.proxies[proxy.name]
            await proxy.stop()
        return web.Response(status=204)

    async def _toxic_index(self, request: web.Request) -> web.Response:
        return web.json_response(self._proxy(request).toxics_json())

    async def _toxic_create(self, request: web.Request) -> web.Response:
        proxy = self._proxy(request)
        toxic = parse_new_toxic(await _json_body(request))
        proxy.add_toxic(toxic)
        return web.json_response(toxic.to_json())

    async def _toxic_show(self, request: web.Request) -> web.Response:
        return web.json_response(self._proxy(request).find_toxic(request.match_info["toxic"]).to_json())

    async def _toxic_update(self, request: web.Request) -> web.Response:
        proxy = self._proxy(request)
        body = await _json_body(request)
        toxic = updated_toxic(proxy.find_toxic(request.match_info["toxic"]), body)
        proxy.replace_toxic(toxic)
        return web.json_response(toxic.to_json())

    async def _toxic_delete(self, request: web.Request) -> web.Response:
        self._proxy(request).remove_toxic(request.match_info["toxic"])
        return web.Response(status=204)


# --- Running a server: the real binary, a subprocess or a thread ------------------------------


class ToxiproxyHandle:
    """A running Toxiproxy API server on loopback. `stop()` ends it (safe to call twice)."""

    def __init__(self, host: str, port: int, kind: str, stopper: Callable[[], None]) -> None:
        self.host = host
        self.port = port
        self.kind = kind  # "binary", "subprocess" or "thread"
        self._stopper: Callable[[], None] | None = stopper

    @property
    def url(self) -> str:
        return f"http://{Address(self.host, self.port)}"

    def client(self) -> Any:
        """A `toxiproxy.Toxiproxy` pointed at this server. The address is a class attribute
        of toxiproxy-python, shared by every client in the process; use it from a thread,
        never from inside an event loop. It speaks IPv4 only: start the server on 127.0.0.1."""
        import toxiproxy  # a dev dependency, imported only by those who drive the server

        client = toxiproxy.Toxiproxy()
        client.update_api_consumer(self.host, self.port)
        return client

    def stop(self) -> None:
        stopper, self._stopper = self._stopper, None
        if stopper is not None:
            stopper()

    def __enter__(self) -> ToxiproxyHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start(host: str = "127.0.0.1", port: int = 0, *, backend: str = "auto", seed: int | None = None,
          log_path: Path | None = None) -> ToxiproxyHandle:
    """Start a Toxiproxy API server on host:port (loopback only; port 0 picks a free one).

    backend "auto" runs a real `toxiproxy-server` when one is on PATH, else this module in a
    background thread; "binary", "subprocess" (`python -m chaos.toxiproxy_server`) and
    "thread" force one. Returns once the API answers; the handle's `stop()` ends the server.
    """
    if not is_loopback_host(host):
        raise ValueError(f"the Toxiproxy API listens on loopback only, not {host!r}")
    if backend == "auto":
        backend = "binary" if shutil.which("toxiproxy-server") else "thread"
    if backend == "thread":
        thread = _ServerThread(host, port, seed)
        return ToxiproxyHandle(host, thread.start(), "thread", thread.stop)
    if backend not in ("binary", "subprocess"):
        raise ValueError(f"unknown backend {backend!r}")
    port = port or _free_port(host)
    if backend == "binary":
        binary = shutil.which("toxiproxy-server")
        if binary is None:
            raise RuntimeError("no toxiproxy-server on PATH")
        command = [binary, "-host", host, "-port", str(port)]
        if seed is not None:
            command += ["-seed", str(seed)]
    else:
        command = [sys.executable, "-m", "chaos.toxiproxy_server", "--host", host, "--port", str(port)]
        if seed is not None:
            command += ["--seed", str(seed)]
    process = _start_process(command, f"http://{Address(host, port)}", log_path)
    return ToxiproxyHandle(host, port, backend, lambda: _stop_process(process))


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# Bypass any HTTP proxy from the environment: the API is on loopback.
_URL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(url: str) -> bool:
    try:
        with _URL_OPENER.open(url + "/version", timeout=1) as answer:
            return bool(answer.status == 200)
    except (OSError, http.client.HTTPException):
        return False


def _start_process(command: list[str], url: str, log_path: Path | None) -> subprocess.Popen[bytes]:
    if log_path is None:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPOSITORY)
    else:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPOSITORY)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode} (log: {log_path})")
        if _answers(url):
            return process
        time.sleep(0.05)
    _stop_process(process)
    raise RuntimeError(f"{command[0]} did not answer on {url} within {SERVER_START_TIMEOUT_S}s")


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=SERVER_STOP_TIMEOUT_S)


class _ServerThread:
    """A ToxiproxyServer on its own event loop in a daemon thread."""

    def __init__(self, host: str, port: int, seed: int | None) -> None:
        self._host, self._port, self._seed = host, port, seed
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="toxiproxy-server", daemon=True)

    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(SERVER_START_TIMEOUT_S):
            raise RuntimeError(f"the Toxiproxy server thread did not start within {SERVER_START_TIMEOUT_S}s")
        if self._error is not None:
            self._thread.join(SERVER_STOP_TIMEOUT_S)
            raise RuntimeError(f"the Toxiproxy server did not start: {self._error}") from self._error
        return self._port

    def stop(self) -> None:
        loop, stop_requested = self._loop, self._stop_requested
        if loop is not None and stop_requested is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(stop_requested.set)
        self._thread.join(SERVER_STOP_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except Exception as error:  # reported to start(), or logged once serving
            if self._ready.is_set():
                LOG.exception("the Toxiproxy server thread failed")
            self._error = error
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        server = ToxiproxyServer(self._seed)
        try:
            self._port = await server.start(self._host, self._port)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await self._stop_requested.wait()
        finally:
            await server.close()


# --- Command line -----------------------------------------------------------------------------


async def _serve_until_signalled(host: str, port: int, seed: int | None) -> None:
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop_requested.set)
    server = ToxiproxyServer(seed)
    try:
        bound = await server.start(host, port)
        LOG.info("Toxiproxy API on http://%s:%d", host, bound)
        await stop_requested.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.toxiproxy_server",
                                     description="A Toxiproxy-compatible server (HTTP API v2), loopback only.")
    parser.add_argument("--host", default="127.0.0.1", help="API address (loopback only)")
    parser.add_argument("--port", type=int, default=API_PORT_DEFAULT, help="API port (default 8474)")
    parser.add_argument("--seed", type=int, default=None, help="seed for toxicity and jitter draws")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if not is_loopback_host(args.host):
        parser.error(f"--host must be a loopback address, not {args.host!r}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve_until_signalled(args.host, args.port, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
