"""A local cluster of real `qserver` processes on loopback, for tests, benchmarks and demos.

Every node gets its own data directory under one root (the first is initialised with
`qserver init`, the others `--join` it: same cluster secret and clients), a TOML file with the
shared `[cluster]` tables, and a free port. Nothing here is used by a node itself.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0
RESTARTS_PER_MINUTE_MAX = 3
# QSERVER_TEST_TLS=1: test clusters use TLS; tests/conftest.py then makes one CA for the whole
# run, names it here, and points SSL_CERT_FILE at it so every client of the test process trusts it.
TEST_TLS_ENV, TEST_TLS_CA_ENV = "QSERVER_TEST_TLS", "QSERVER_TEST_TLS_CA_DIR"


FREE_PORT_FIRST, FREE_PORT_LAST = 5_000, 9_999   # below chaos/cluster.py's port blocks and the
                                                 # ephemeral range (32768-60999 on Linux)
_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range and not handed out
    before by this process: a port the system picks for bind(0) is one an outgoing
    connection may take before the node binds it (a node of a full test run failed to start
    so)."""
    if len(_PORTS_GIVEN) > (FREE_PORT_LAST - FREE_PORT_FIRST) // 2:
        _PORTS_GIVEN.clear()              # long runs: the earliest are long released
    for _ in range(1000):
        port = random.randint(FREE_PORT_FIRST, FREE_PORT_LAST)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORT_FIRST}-{FREE_PORT_LAST} on 127.0.0.1")


def start_qserver(run_args: list[str], url: str, log_path: Path, timeout_s: float = START_TIMEOUT_S,
                  ssl_context: ssl.SSLContext | None = None) -> subprocess.Popen[bytes]:
    """Start `qserver run ARGS...` (output to log_path) and wait for its /healthz; a node that
    exits or stays silent raises RuntimeError with the end of its log."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "qserver", "run", *run_args],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=REPOSITORY,
                                   start_new_session=True)   # a Ctrl-C at the terminal is for the caller
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"qserver exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1, context=ssl_context) as answer:
                if answer.status == 200:
                    return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"qserver did not start within {timeout_s}s (log: {log_path})")


class LocalCluster:
    def __init__(self, root: Path, size: int, placement: dict[str, list[str]] | None = None,
                 settings: dict[str, object] | None = None, *, base_port: int | None = None,
                 credentials_path: Path | None = None, voters: int | None = None, tls: bool | None = None) -> None:
        """`settings`: extra [node] keys for every node (TOML literals, e.g. {"journal_enabled": "false"}).
        `base_port`: node i serves HTTP on base_port+i and Raft on base_port+100+i (else free
        ports). Data already under `root` is reused (the nodes were initialised before).
        `voters`: how many of the nodes (the first ones) vote in the membership layer (default all).
        `tls`: every link over TLS with a local CA (`qserver init --tls`); default from
        $QSERVER_TEST_TLS ("1": on), so the whole suite can run with TLS on."""
        self.root = root
        self.tls = tls if tls is not None else os.environ.get(TEST_TLS_ENV) == "1"
        scheme = "https" if self.tls else "http"
        self.ids = [f"n{i}" for i in range(1, size + 1)]
        def port(i: int, offset: int) -> int:
            return base_port + offset + i if base_port else free_port()
        self.urls = {node: f"{scheme}://127.0.0.1:{port(i, 0)}" for i, node in enumerate(self.ids, 1)}
        self.raft_addresses = {node: f"127.0.0.1:{port(i, 100)}" for i, node in enumerate(self.ids, 1)
                               if voters is None or i <= voters}
        self.credentials_path = credentials_path or root / "admin-credentials.json"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._restarts: dict[str, list[float]] = {}     # node -> when restart_exited started it
        self.left_down: set[str] = set()
        self.log_level = os.environ.get("QSERVER_TEST_LOG_LEVEL", "WARNING")
        self._init(self.ids[0], ["--credentials", str(self.credentials_path), "--url", self.urls[self.ids[0]]])
        for node in self.ids[1:]:
            self._init(node, ["--join", str(root / self.ids[0])])
        for node in self.ids:
            self._write_config(node, placement or {}, settings or {})

    def _init(self, node: str, extra: list[str]) -> None:
        if (self.root / node / "cluster.secret").exists():
            return
        shared_ca = os.environ.get(TEST_TLS_CA_ENV)     # tests: one CA for every cluster of the run
        tls = ["--tls", *(["--tls-ca", shared_ca] if shared_ca else [])] if self.tls else []
        subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(self.root / node), "--node-id", node,
                        *extra, *tls], check=True, capture_output=True, cwd=REPOSITORY)

    def _write_config(self, node: str, placement: dict[str, list[str]], settings: dict[str, object]) -> None:
        port = self.urls[node].rsplit(":", 1)[1]
        lines = ["[node]", f'node_id = "{node}"', f'data_dir = "{self.root / node}"', f"port = {port}"]
        lines += [f"{key} = {value}" for key, value in settings.items()]
        lines += ["[cluster.nodes]"] + [f'{n} = "{url}"' for n, url in self.urls.items()]
        lines += ["[cluster.membership]"] + [f'{n} = "{address}"' for n, address in self.raft_addresses.items()]
        lines += ["[cluster.placement]"] + [f'"{q}" = ["{a}", "{b}"]' for q, (a, b) in placement.items()]
        (self.root / f"{node}.toml").write_text("\n".join(lines) + "\n")

    def start(self, node: str, *, wait: bool = True) -> None:
        """Start one node and wait for its /healthz (a node that exits raises with its log) and,
        unless `wait` is false, until it takes part in the cluster (see wait_ready)."""
        self.processes[node] = start_qserver(
            ["--config", str(self.root / f"{node}.toml"), "--log-level", self.log_level], self.urls[node],
            self.root / f"{node}.log", ssl_context=self.ssl_context)
        if wait and len(self.processes) > len(self.ids) // 2:
            self.wait_ready([node])

    def start_all(self) -> None:
        for node in self.ids:
            self.start(node, wait=False)
        self.wait_ready()

    def wait_ready(self, nodes: list[str] | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every running node sees a membership leader, every running node up in the map,
        every running voter a voter of the membership layer's configuration, and holds a valid
        lease (a test that kills a node at once needs the voters it counts on)."""
        deadline = time.monotonic() + timeout_s
        for node in nodes or list(self.processes):
            while True:
                health = self.health(node)
                membership: dict[str, Any] = health.get("membership", {})  # type: ignore[assignment]
                states = membership.get("nodes", {})
                voters = membership.get("raft", {}).get("voters", [])
                if membership.get("leader") and membership.get("lease_valid") \
                        and all(states.get(running) == "up" for running in self.processes) \
                        and all(running in voters for running in self.processes if running in self.raft_addresses):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node} did not join the cluster in {timeout_s}s: {health}")
                time.sleep(0.05)

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        """For this process's own requests to the nodes (health checks) when they serve TLS."""
        if not self.tls:
            return None
        return ssl.create_default_context(cafile=str(self.root / self.ids[0] / "tls" / "ca.pem"))

    def restart_exited(self) -> list[str]:
        """The supervisor's part: a node that exited by itself (a fail-stop, exit code 70, or a
        crash) is started again, as systemd's Restart=on-failure would, at most
        RESTARTS_PER_MINUTE_MAX times a minute per node; then it is left down. Returns what
        happened, one line per node."""
        events = []
        now = time.monotonic()
        for node, process in list(self.processes.items()):
            code = process.poll()
            if code is None or node in self.left_down:
                continue
            recent = [at for at in self._restarts.get(node, []) if now - at < 60]
            if len(recent) >= RESTARTS_PER_MINUTE_MAX:
                self.left_down.add(node)
                events.append(f"{node} exited with code {code} again: left down (see {self.root / (node + '.log')})")
                continue
            self._restarts[node] = recent + [now]
            self.start(node, wait=False)
            events.append(f"{node} exited with code {code}: started again")
        return events

    def health(self, node: str) -> dict[str, object]:
        try:
            with urllib.request.urlopen(self.urls[node] + "/healthz", timeout=2, context=self.ssl_context) as answer:
                return dict(json.loads(answer.read()))
        except OSError:
            return {}

    def kill(self, node: str) -> None:
        """kill -9: nothing that was not committed survives."""
        process = self.processes.pop(node, None)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    def wipe(self, node: str) -> None:
        """The node loses its disk: a fresh data directory that joins the same cluster."""
        self.kill(node)
        shutil.rmtree(self.root / node)
        self._init(node, ["--join", str(self.root / self.ids[0])])

    def stop_all(self) -> None:
        """SIGTERM every node (an orderly stop), then wait for each."""
        for node in list(self.processes):
            process = self.processes.pop(node)
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
