"""Client library instances that call in a client's name: one bounded pool for every part of the
node that acts for a caller (REST on macro queues, the web console, the SQS gateway).

Each instance signs its calls with a secret the cluster's nodes share (qserver/api/auth.py,
`DelegatedSigner`), so a node answers them with exactly the named client's grants
(docs/ARCHITECTURE.md, Guarantee 9) and every call keeps the client library's guarantees
(routing to the master, retries through failovers and handoffs, dedupe ids).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from client.aio import AsyncClient
from client.credentials import Credentials
from qserver.api.auth import DelegatedSigner


@dataclass(frozen=True, slots=True)
class DelegatedCredentials(Credentials):
    secret: bytes = b""

    def signer(self) -> DelegatedSigner:
        return DelegatedSigner(self.client_id, self.secret)


class DelegatedClients:
    """At most `size` instances, least recently used dropped first; one whose client's grants
    changed or that was removed (`AsyncClient.usable` false) is replaced on its next use."""

    def __init__(self, url: str | Callable[[], str], tls_ca_file: Callable[[], str], secret: Callable[[], bytes],
                 size: int) -> None:
        self._own_url = url               # this node's URL (or how to read it once it is known)
        self._tls_ca_file = tls_ca_file
        self._secret = secret             # read at each new instance: a node alone makes its own at start
        self.size = size
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def client_for(self, client_id: str, url: str | None = None) -> AsyncClient:
        """The instance for `client_id` whose home is this node, or the node at `url` (the SQS
        gateway homes a `producer` queue's calls at its master: docs/SQS.md)."""
        home = url or (self._own_url if isinstance(self._own_url, str) else self._own_url())
        key = client_id if url is None else f"{client_id} {home}"
        client = self._clients.get(key)
        if client is not None and not client.usable:
            del self._clients[key]               # its grants changed or it was removed: start afresh
            client = None
        if client is None:
            credentials = DelegatedCredentials(client_id, "", home, self._tls_ca_file(), self._secret())
            client = self._clients[key] = AsyncClient(home, credentials)
            while len(self._clients) > self.size:
                _, oldest = self._clients.popitem(last=False)
                asyncio.get_running_loop().create_task(oldest.close())
        self._clients.move_to_end(key)
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            with contextlib.suppress(Exception):        # closing is best effort at shutdown
                await client.close()
