"""Python client library for the replicated queue server (`qserver`).

    from client import AsyncClient
    async with AsyncClient() as queue_client:          # credentials found without flags
        await queue_client.create_queue("orders", strength="full")
        message_id = await queue_client.enqueue("orders", b"hello", priority=6)
        [message] = await queue_client.receive("orders", wait_s=1.0); await message.ack()

`AsyncClient` batches concurrent calls into WebSocket frames and reconnects on its own;
`Client` is the same API for synchronous code; `load_credentials` finds the credentials
file (explicit path, `$QSERVER_CREDENTIALS`, `./.qserver/`, `~/.config/qserver/`).
Every failure is a `QueueError` with a stable `.code`, `.retriable` and `.outcome_unknown`.

The names are imported on first use (PEP 562), so code that needs only the error catalog
or the frame codec (`wire.errors`, `wire.protocol`, e.g. the server's pure cores) does
not load asyncio, aiohttp or threads by importing this package.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wire.errors import QueueError

if TYPE_CHECKING:
    from client.aio import AsyncClient
    from client.consumer import Consumer, Message
    from client.credentials import Credentials, load_credentials, save_credentials
    from client.sync import Client, SyncConsumer, SyncMessage

_HOMES = {
    "AsyncClient": "client.aio", "Consumer": "client.consumer", "Message": "client.consumer",
    "Credentials": "client.credentials", "load_credentials": "client.credentials",
    "save_credentials": "client.credentials",
    "Client": "client.sync", "SyncConsumer": "client.sync", "SyncMessage": "client.sync",
}

__all__ = [
    "AsyncClient",
    "Client",
    "Consumer",
    "Credentials",
    "Message",
    "QueueError",
    "SyncConsumer",
    "SyncMessage",
    "load_credentials",
    "save_credentials",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
