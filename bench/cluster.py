"""Start and stop a local static cluster of real qserver processes (benchmarks; loopback only)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    def __init__(self, root: Path, size: int, placement: dict[str, list[str]], *, journal: bool = True) -> None:
        self.root = root
        self.ids = [f"n{i}" for i in range(1, size + 1)]
        self.urls = {node: f"http://127.0.0.1:{free_port()}" for node in self.ids}
        self.credentials = root / "credentials.json"
        self.placement = placement
        self.journal = journal
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._init(self.ids[0], ["--credentials", str(self.credentials), "--url", self.urls[self.ids[0]]])
        for node in self.ids[1:]:
            self._init(node, ["--join", str(root / self.ids[0])])
        for node in self.ids:
            self._write_config(node)

    def _init(self, node: str, extra: list[str]) -> None:
        subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(self.root / node), "--node-id", node,
                        *extra], check=True, capture_output=True, cwd=REPOSITORY)

    def _write_config(self, node: str) -> None:
        port = self.urls[node].rsplit(":", 1)[1]
        lines = ["[node]", f'node_id = "{node}"', f'data_dir = "{self.root / node}"', f"port = {port}",
                 f"journal_enabled = {'true' if self.journal else 'false'}", "[cluster.nodes]"]
        lines += [f'{n} = "{url}"' for n, url in self.urls.items()]
        lines += ["[cluster.placement]"] + [f'"{q}" = ["{a}", "{b}"]' for q, (a, b) in self.placement.items()]
        (self.root / f"{node}.toml").write_text("\n".join(lines) + "\n")

    def start(self, node: str) -> None:
        log = open(self.root / f"{node}.log", "ab")
        self.processes[node] = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", str(self.root / f"{node}.toml"), "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPOSITORY)
        log.close()
        for _ in range(400):
            try:
                urllib.request.urlopen(self.urls[node] + "/healthz", timeout=1)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{node} did not start")

    def start_all(self) -> None:
        for node in self.ids:
            self.start(node)

    def kill(self, node: str) -> None:
        process = self.processes.pop(node, None)
        if process is not None:
            process.kill()
            process.wait(10)

    def wipe(self, node: str) -> None:
        """Forget a node's queues (keep its secret and clients): it returns as a new replica."""
        self.kill(node)
        shutil.rmtree(self.root / node)
        self._init(node, ["--join", str(self.root / self.ids[0])])

    def stop_all(self) -> None:
        for node in list(self.processes):
            process = self.processes.pop(node)
            process.terminate()
            process.wait(30)
