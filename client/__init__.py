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
"""
from client.aio import AsyncClient, Consumer, Message
from client.credentials import Credentials, load_credentials, save_credentials
from client.errors import QueueError
from client.sync import Client, SyncConsumer, SyncMessage

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
