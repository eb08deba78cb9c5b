"""A chaos cluster: real `qserver` processes whose every link passes through its own proxy.

Each node dials each peer through a proxy of its own, for both kinds of peer traffic, and
clients reach each node through one more (chaos/README.md):

    peer-a-b     a's replication link (WebSocket) and HTTP passing-on to b   -> b's HTTP port
    raft-a-b     a's membership (Raft) link to b                             -> b's Raft port
    client-a     every client of a (the URL a publishes in the cluster map)  -> a's HTTP port

Only one of peer-a-b / peer-b-a carries the pair's replication link (the lower id dials) and
only one of raft-a-b / raft-b-a its Raft link (the lower id dials too), so cutting a pair cuts
all four. Every node's TOML holds its own tables: `[cluster.nodes]` and `[cluster.membership]`
name the proxies it dials, `url` its client proxy, `membership_bind` where its Raft link
listens.

All ports of a cluster come from one block below the kernel's ephemeral range, so a restarted
node never finds its port taken by somebody's outgoing connection.

`toxiproxy-python` is synchronous and keeps the server address in a class attribute: every
method here blocks, so asyncio callers use `asyncio.to_thread` (chaos.nemesis does).
"""
from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from chaos.toxiproxy_server import ToxiproxyHandle
from qserver.dev.devcluster import LocalCluster, port_free

PORT_BLOCK_SIZE = 300          # nodes' HTTP at +1.., Raft at +101.., proxies at +200..
PORT_BLOCK_FIRST = 10_000
PORT_BLOCK_LAST = 32_000       # below Linux's default ephemeral range (32768-60999)
PORT_BLOCK_ATTEMPTS_MAX = 200
NODES_MAX = 5                  # the membership layer has 3 or 5 voters
PROXY_SLOTS = PORT_BLOCK_SIZE - 200
TOXICITY_ALWAYS = 1.0
STREAMS = ("upstream", "downstream")




def free_port_block(rng: random.Random | None = None) -> int:
    """A base port whose whole block (base+1 .. base+PORT_BLOCK_SIZE-1) can be bound now."""
    rng = rng or random.Random(os.getpid() ^ time.monotonic_ns())
    blocks = list(range(PORT_BLOCK_FIRST, PORT_BLOCK_LAST - PORT_BLOCK_SIZE, PORT_BLOCK_SIZE))
    for base in rng.sample(blocks, min(len(blocks), PORT_BLOCK_ATTEMPTS_MAX)):
        if all(port_free(port) for port in range(base + 1, base + PORT_BLOCK_SIZE)):
            return base
    raise RuntimeError("no free block of ports below the ephemeral range")


def peer_proxy(source: str, target: str) -> str:
    return f"peer-{source}-{target}"


def raft_proxy(source: str, target: str) -> str:
    return f"raft-{source}-{target}"


def client_proxy(node: str) -> str:
    return f"client-{node}"


class ChaosCluster(LocalCluster):
    """`LocalCluster` with a proxy on every link (see the module docstring). `toxiproxy` is a
    running Toxiproxy API (chaos.toxiproxy_server.start); the cluster creates its proxies
    there and removes them on `close`."""

    def __init__(self, root: Path, size: int, toxiproxy: ToxiproxyHandle,
                 placement: dict[str, list[str]] | None = None, settings: dict[str, object] | None = None,
                 *, base_port: int | None = None) -> None:
        if not 3 <= size <= NODES_MAX:
            raise ValueError(f"a chaos cluster has 3 to {NODES_MAX} nodes")
        self.toxiproxy = toxiproxy.client()
        self.base_port = base_port or free_port_block()
        self.proxies: dict[str, Any] = {}          # name -> toxiproxy.proxy.Proxy
        self.client_urls: dict[str, str] = {}      # node -> its client proxy's URL
        self.paused: set[str] = set()
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, size, placement, settings, base_port=self.base_port)

    # --- wiring -----------------------------------------------------------------------------
    def _create_proxies(self) -> None:
        """Every proxy of the cluster, each listening on its own port of the block."""
        ports = itertools.count(self.base_port + 200)
        wanted: list[tuple[str, str]] = []
        for node in self.ids:
            wanted.append((client_proxy(node), self.urls[node].split("://", 1)[1]))
        for source, target in itertools.permutations(self.ids, 2):
            wanted.append((peer_proxy(source, target), self.urls[target].split("://", 1)[1]))
            wanted.append((raft_proxy(source, target), self.raft_addresses[target]))
        if len(wanted) > PROXY_SLOTS:
            raise ValueError("more proxies than the port block holds")
        for name, upstream in wanted:
            self.proxies[name] = self.toxiproxy.create(upstream=upstream, name=name,
                                                       listen=f"127.0.0.1:{next(ports)}")
        # TLS passes through the proxies untouched (the certificates name 127.0.0.1).
        scheme = "https" if self.tls else "http"
        self.client_urls = {node: f"{scheme}://{self.proxies[client_proxy(node)].listen}" for node in self.ids}

    def _write_config(self, node: str, placement: dict[str, list[str]], settings: dict[str, object]) -> None:
        if not self.proxies:
            self._create_proxies()
        port = self.urls[node].rsplit(":", 1)[1]
        own_client_url = self.client_urls[node]

        def dialled(target: str) -> str:
            return f"{'https' if self.tls else 'http'}://{self.proxies[peer_proxy(node, target)].listen}"

        def raft_dialled(target: str) -> str:
            return str(self.proxies[raft_proxy(node, target)].listen)
        lines = ["[node]", f'node_id = "{node}"', f'data_dir = "{self.root / node}"', 'host = "127.0.0.1"',
                 f"port = {port}", f'url = "{own_client_url}"', f'membership_bind = "{self.raft_addresses[node]}"']
        lines += [f"{key} = {value}" for key, value in settings.items()]
        lines += ["[cluster.nodes]"] + [f'{n} = "{own_client_url if n == node else dialled(n)}"' for n in self.ids]
        lines += ["[cluster.membership]"] + [
            f'{n} = "{self.raft_addresses[n] if n == node else raft_dialled(n)}"' for n in self.ids]
        lines += ["[cluster.placement]"] + [f'"{q}" = ["{a}", "{b}"]' for q, (a, b) in placement.items()]
        (self.root / f"{node}.toml").write_text("\n".join(lines) + "\n")

    def links_between(self, first: str, second: str) -> list[str]:
        """The proxies of every link between two nodes, in both directions."""
        return [peer_proxy(first, second), peer_proxy(second, first),
                raft_proxy(first, second), raft_proxy(second, first)]

    def links_of(self, node: str) -> list[str]:
        """Every peer and membership proxy that touches `node` (not its client proxy)."""
        return [name for other in self.ids if other != node for name in self.links_between(node, other)]

    # --- faults on links (blocking: call from a thread) ---------------------------------------
    def add_toxic(self, proxy: str, toxic_type: str, attributes: dict[str, int], *, name: str,
                  streams: tuple[str, ...] = STREAMS) -> None:
        for stream in streams:
            self.proxies[proxy].add_toxic(name=f"{name}-{stream}", type=toxic_type, stream=stream,
                                          toxicity=TOXICITY_ALWAYS, attributes=attributes)

    def remove_toxic(self, proxy: str, *, name: str, streams: tuple[str, ...] = STREAMS) -> None:
        for stream in streams:
            self.proxies[proxy].destroy_toxic(f"{name}-{stream}")

    def set_enabled(self, proxy: str, enabled: bool) -> None:
        if enabled:
            self.proxies[proxy].enable()
        else:
            self.proxies[proxy].disable()

    def heal_links(self) -> None:
        """Every proxy enabled and every toxic gone (Toxiproxy's /reset)."""
        self.toxiproxy.reset()

    # --- faults on processes -----------------------------------------------------------------
    def pid(self, node: str) -> int | None:
        process = self.processes.get(node)
        return process.pid if process is not None and process.poll() is None else None

    def pause(self, node: str) -> bool:
        """SIGSTOP: the process keeps its sockets and its memory but does nothing."""
        process = self.processes.get(node)
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signal.SIGSTOP)
        self.paused.add(node)
        return True

    def resume(self, node: str) -> None:
        process = self.processes.get(node)
        self.paused.discard(node)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)

    def kill(self, node: str) -> None:
        if node in self.paused:          # a stopped process dies of SIGKILL as well; forget it
            self.paused.discard(node)
        super().kill(node)

    def running(self) -> list[str]:
        return [node for node, process in self.processes.items() if process.poll() is None]

    def exited(self) -> dict[str, int]:
        """Nodes that ended by themselves (a crash), with their exit codes."""
        return {node: code for node, process in dict(self.processes).items() if (code := process.poll()) is not None}

    def close(self) -> None:
        """Resume, then kill -9 every node and remove the proxies. Safe to call twice."""
        for node in list(self.paused):
            self.resume(node)
        for node in list(self.processes):
            try:
                self.kill(node)
            except subprocess.TimeoutExpired:
                pass
        for proxy in list(self.proxies.values()):
            try:
                proxy.destroy()
            except Exception:   # the server may already be gone; nothing else holds them
                pass
        self.proxies.clear()
