"""Macro queues for callers that do not run their policies: REST (and so `curl`).

The client library runs a macro queue's policies itself and calls the members' masters
directly (client/macro.py). A plain REST call on a macro queue's name is served here, by the
same code: the node keeps a client library instance per calling client and makes the member
calls in that client's name, signed with the cluster secret (qserver/api/auth.py,
`delegated_signature`), so they carry exactly the caller's grants and every member call keeps
its own guarantees (dedupe ids, acknowledgement after commit, failover handling). The answer
names the member: acks, releases and extensions go to the member's own path.
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

from client.aio import AsyncClient, Message
from client.macro import MacroEnqueued
from qserver.features.delegated import DelegatedClients
from qserver.metrics import render_family
from wire.errors import QueueError

if TYPE_CHECKING:
    from qserver.services import NodeServices

log = logging.getLogger("qserver.macro")
CLIENTS_MAX = 32                # callers with a client library instance kept here (least recently used go)


class MacroService:
    def __init__(self, services: NodeServices) -> None:
        self._services = services
        self._clients = DelegatedClients(services.url, services.tls_ca_file, lambda: services.cluster_secret,
                                         CLIENTS_MAX)
        self.calls: collections.Counter[str] = collections.Counter()    # REST calls served, by outcome

    def is_macro(self, name: str) -> bool:
        cluster = self._services.cluster_map
        return cluster is not None and name in cluster.macros

    def client_for(self, client_id: str) -> AsyncClient:
        """A client library instance that calls in `client_id`'s name (delegated; qserver/api/auth.py)."""
        return self._clients.client_for(client_id)

    async def enqueue(self, client_id: str, name: str, payload: bytes, priority: int, dedupe_id: str, **extra: Any
                      ) -> MacroEnqueued:
        try:
            answer = await self.client_for(client_id).enqueue(name, payload, priority, dedupe_id, **extra)
        except QueueError as error:
            self.calls[f"enqueue {error.code}"] += 1
            raise
        self.calls["enqueue ok"] += 1
        return answer if isinstance(answer, MacroEnqueued) else MacroEnqueued(answer, name)

    async def receive(self, client_id: str, name: str, wait_s: float, visibility_timeout_s: float | None
                      ) -> list[Message]:
        try:
            messages = await self.client_for(client_id).receive(name, 1, wait_s, visibility_timeout_s)
        except QueueError as error:
            self.calls[f"receive {error.code}"] += 1
            raise
        self.calls["receive ok"] += 1
        return messages

    def render_metrics(self) -> list[str]:
        cluster = self._services.cluster_map
        macros = cluster.macros if cluster is not None else {}
        calls = [({"op": key.split()[0], "outcome": key.split()[1]}, count) for key, count in sorted(self.calls.items())]
        return (render_family("qserver_macro_queues", "gauge", "macro queues in the cluster map", [({}, len(macros))])
                + render_family("qserver_macro_members", "gauge", "member queues per macro queue",
                                [({"macro": name}, len(macro.members)) for name, macro in sorted(macros.items())])
                + render_family("qserver_macro_rest_calls_total", "counter",
                                "REST calls on macro queues this node served, by outcome", calls)
                + render_family("qserver_macro_delegating_clients", "gauge",
                                "callers with a client library instance here (REST on macro queues)",
                                [({}, len(self._clients))]))

    async def close(self) -> None:
        await self._clients.close()
