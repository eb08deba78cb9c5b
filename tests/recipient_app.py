"""A recipient application for the fault surveillance tests (tests/test_surveillance.py), run
as a process of its own so a test can stop it (SIGSTOP) like a hung service: it consumes a
queue as a named recipient and appends "<id> <payload>" to a file for each message whose ack
was answered.

    python -m tests.recipient_app URL CREDENTIALS QUEUE RECIPIENT FILE
"""
from __future__ import annotations

import asyncio
import sys

from client import AsyncClient, QueueError


async def main(url: str, credentials: str, queue: str, recipient: str, path: str) -> None:
    async with AsyncClient(url, credentials) as client, \
            client.consume(queue, prefetch=4, recipient=recipient) as messages:
        with open(path, "a", encoding="utf-8") as taken:
            async for message in messages:
                try:
                    await message.ack()
                except QueueError:
                    continue          # its lease was taken back while it was in fault: it failed over
                taken.write(f"{message.id} {message.payload.decode()}\n")
                taken.flush()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
