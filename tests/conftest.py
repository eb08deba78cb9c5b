"""Shared fixtures: real `qserver` processes on loopback.

`qnode` starts one node in a fresh data directory, initialised with `qserver init`, and
gives its URL and the admin credentials file. It can be killed with SIGKILL and started
again on the same data and port, which is how the restart tests crash it.

Every fixture's teardown fails the test when one of its nodes exited by itself (a crash, or a
fail-stop with code 70) or logged a traceback or a fail-stop, unless the test ended that
process through these classes (kill, stop, wipe, stop_all) or said it expected the exit
(`expect_exit`): the test's clients only talk to the nodes still up and would pass without
noticing. These methods block (they wait for the process and poll /healthz): an async test
calls them through `asyncio.to_thread`, so its clients see the node go down while it happens.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from qserver.dev.devcluster import REPOSITORY, TEST_TLS_CA_ENV, TEST_TLS_ENV, LocalCluster, NodeRuns, free_port
from qserver.transport.tls import make_tls_files

TLS = os.environ.get(TEST_TLS_ENV) == "1"
if TLS and TEST_TLS_CA_ENV not in os.environ:
    # QSERVER_TEST_TLS=1: every node of the run gets a certificate from one CA, which every
    # client in this process trusts through SSL_CERT_FILE. Made here, at import, because aiohttp
    # builds its default SSL context when it is first imported (by the test modules, later).
    _ca_dir = Path(tempfile.mkdtemp(prefix="qserver-test-ca-"))
    os.environ["SSL_CERT_FILE"] = make_tls_files(_ca_dir, "test-ca")["tls_ca_file"]
    os.environ[TEST_TLS_CA_ENV] = str(_ca_dir)


class QNode:
    """One real qserver process (loopback only); with QSERVER_TEST_TLS=1, over TLS."""

    def __init__(self, data_dir: Path, port: int, extra_args: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = port
        self.url = f"{'https' if TLS else 'http'}://127.0.0.1:{port}"
        self.credentials_path = data_dir / "admin-credentials.json"
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "qserver.log"
        self.runs = NodeRuns(f"node {data_dir.name} at {self.url}", self.log_path)
        tls = ["--tls", "--tls-ca", os.environ[TEST_TLS_CA_ENV]] if TLS else []
        subprocess.run([sys.executable, "-m", "qserver", "init", "--data-dir", str(data_dir),
                        "--credentials", str(self.credentials_path), "--url", self.url, *tls],
                       check=True, capture_output=True, cwd=REPOSITORY)

    def start(self) -> None:
        self.process = self.runs.start(
            ["--data-dir", str(self.data_dir), "--port", str(self.port), "--log-level", "WARNING", *self.extra_args],
            self.url)

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything that was not already committed."""
        if self.process is not None:
            self.runs.end(self.process, signal.SIGKILL, timeout_s=10)
        self.process = None

    def stop(self) -> int:
        """SIGTERM: orderly shutdown; returns the exit code."""
        code = 0
        if self.process is not None:
            code = self.runs.end(self.process, signal.SIGTERM, timeout_s=30)
        self.process = None
        return code

    def restart(self) -> None:
        self.kill()
        self.start()

    def expect_exit(self) -> None:
        """The running process will exit by itself (a fail-stop the test provokes): teardown
        does not report that exit or its fail-stop record (see NodeRuns.expect_exit)."""
        self.runs.expect_exit()

    def problems(self) -> list[str]:
        return self.runs.problems()


def fail_on_unexpected_ends(problems: Iterable[str]) -> None:
    """Teardown's verdict: a node that died on its own or logged a traceback fails the test."""
    found = list(problems)
    if found:
        pytest.fail("a node of this test exited by itself or logged an error:\n\n" + "\n\n".join(found),
                    pytrace=False)


@pytest.fixture
def qnode(tmp_path: Path) -> Iterator[QNode]:
    node = QNode(tmp_path / "n1", free_port())
    node.start()
    try:
        yield node
    finally:
        node.kill()
    fail_on_unexpected_ends(node.problems())


@pytest.fixture
def qnode_factory(tmp_path: Path) -> Iterator[object]:
    """Build nodes with extra `qserver run` arguments (e.g. a config file)."""
    nodes: list[QNode] = []

    def make(name: str = "n1", extra_args: list[str] | None = None) -> QNode:
        node = QNode(tmp_path / name, free_port(), extra_args)
        nodes.append(node)
        return node
    try:
        yield make
    finally:
        for node in nodes:
            node.kill()
    fail_on_unexpected_ends(problem for node in nodes for problem in node.problems())


@pytest.fixture(autouse=True)
def _no_user_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never read or write the developer's own ~/.config/qserver credentials."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QSERVER_CREDENTIALS", raising=False)
    os.makedirs(tmp_path / "home", exist_ok=True)


@pytest.fixture
def qcluster_factory(tmp_path: Path) -> Iterator[object]:
    clusters: list[LocalCluster] = []

    def make(size: int = 3, placement: dict[str, list[str]] | None = None,
             extra: dict[str, object] | None = None, voters: int | None = None) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster{len(clusters)}", size, placement, extra, voters=voters)
        clusters.append(cluster)
        cluster.start_all()
        return cluster
    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.kill_all()
    fail_on_unexpected_ends(problem for cluster in clusters for problem in cluster.problems())
