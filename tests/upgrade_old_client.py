"""A client of the previous release during a rolling upgrade (tests/upgrade_roll.py).

Run as a script with the previous release's tree first on PYTHONPATH, so `client` and `chaos`
are that release's: "clients of release N-1 keep working against nodes of N" (issue 34). It
creates its queue, runs one producer and one polling consumer of that release's chaos workload
(chaos/workload.py) recording a history in that release's format, until its stdin closes; then
it drains the queue and exits 0. Imports only what release 0.1.0 has.

    python tests/upgrade_old_client.py '{"ids": [...], "urls": {...}, "credentials": PATH,
                                         "history": PATH, "queue": NAME}'
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from chaos.history import History
from chaos.workload import Observer, QueueSpec, Workload

DRAIN_TIMEOUT_S = 45.0


class Nodes:
    """What the workload asks of a cluster: the nodes and how to reach them."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.ids: list[str] = list(document["ids"])
        self.urls: dict[str, str] = dict(document["urls"])
        self.client_urls = dict(self.urls)
        self.credentials_path = Path(document["credentials"])
        self.processes = dict.fromkeys(self.ids, True)    # every node counts as running for the observer
        self.paused: set[str] = set()


async def main(document: dict[str, Any]) -> int:
    nodes = Nodes(document)
    history = History(Path(document["history"]))
    spec = QueueSpec(document["queue"], "full", producers=1, consumers=1, rate=20)
    workload = Workload(nodes, history, [spec], 7, 8.0)  # type: ignore[arg-type]
    observer = Observer(nodes, history)  # type: ignore[arg-type]
    try:
        await workload.create_queues()
        stop = asyncio.Event()
        tasks = workload.start(stop)
        await asyncio.to_thread(sys.stdin.read)         # until the runner closes our stdin
        history.phase = "recovery"
        stop.set()
        await workload.stop_workers(tasks)
        current: dict[str, Any] = {}
        for node in nodes.ids:
            current = await observer.sample(node) or {}
            if current:
                break
        drained = await workload.drain(current, DRAIN_TIMEOUT_S)
        print(json.dumps({"drained": drained, "errors": workload.errors[:10]}), flush=True)
        return 0 if all(result["drained"] for result in drained.values()) else 1
    finally:
        await workload.close()
        await observer.close()
        history.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]))))
