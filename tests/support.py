"""Raw signed HTTP and WebSocket access for tests that must send what a client library never
would (bad signatures, garbage frames, replays), and small waits the integration tests share."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from client.credentials import load_credentials
from client.http import TLS_CLOSE_GRACE_S
from qserver.dev.devcluster import TEST_TLS_ENV
from wire.signing import Signer


@contextlib.asynccontextmanager
async def raw_session() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session for raw requests, closed as the client library closes its own
    (client/http.py, HttpClient.close): with TLS, a connection's shutdown ends on a later turn
    of the loop, and a loop closed first leaves the socket to the collector, whose
    ResourceWarning then fails whichever test is running."""
    async with aiohttp.ClientSession() as session:
        yield session
    if os.environ.get(TEST_TLS_ENV) == "1":
        await asyncio.sleep(TLS_CLOSE_GRACE_S)


class RawApi:
    def __init__(self, session: aiohttp.ClientSession, url: str, signer: Signer | None) -> None:
        self.session = session
        self.url = url
        self.signer = signer

    @classmethod
    def for_credentials(cls, session: aiohttp.ClientSession, path: Any) -> RawApi:
        creds = load_credentials(path)
        return cls(session, creds.url, creds.signer())

    async def request(self, method: str, path: str, body: bytes | dict[str, Any] | None = None, *,
                      query: dict[str, str] | None = None, headers: dict[str, str] | None = None,
                      sign: bool = True, signed_headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        all_headers: dict[str, str] = {}
        if sign and self.signer is not None:
            all_headers.update(signed_headers or self.signer.headers(method, path, query or {}, raw, audience=self.url,
                                                                     headers=headers))
        all_headers.update(headers or {})
        data: Any = io.BytesIO(raw) if len(raw) > 512 * 1024 else raw
        async with self.session.request(method, self.url + path, data=data, params=query, headers=all_headers) as answer:
            data = await answer.read()
            parsed: Any = data
            if answer.headers.get("Content-Type", "").startswith("application/json"):
                parsed = json.loads(data)
            return answer.status, parsed, answer.headers

    async def ws(self) -> aiohttp.ClientWebSocketResponse:
        assert self.signer is not None
        return await self.session.ws_connect(self.url + "/v1/ws", headers=self.signer.headers(
            "GET", "/v1/ws", {}, b"", audience=self.url))


def error_code(body: Any) -> str:
    return str(body["error"]["code"])


async def code_of(call: Awaitable[Any]) -> str:
    """The E_* code the call raises (it must raise a QueueError)."""
    from wire.errors import QueueError
    with pytest.raises(QueueError) as raised:
        await call
    return raised.value.code


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    """Wait for a condition the test cannot be told of, asking it every 50 ms."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.05)


async def replica_in_sync(client: Any, queue: str, timeout_s: float = 20.0) -> None:
    """Wait until the map records `queue`'s replica in sync: an operator's handoff is refused
    (E_HANDOFF_REFUSED) while it is not, and a node stalled > 2 s on a loaded machine (CI's
    2 cores) is recorded out of sync for a moment."""
    async def in_sync() -> bool:
        return bool((await client.cluster())["queues"][queue].get("in_sync"))
    await until(in_sync, timeout_s)


async def next_channel_message(client: Any, timeout_s: float = 15.0) -> Any:
    return await asyncio.wait_for(client.next_channel_message(), timeout_s)
