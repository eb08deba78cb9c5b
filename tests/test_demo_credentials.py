"""The demo (`python -m qserver.dev.local`) keeps its cluster's credential with the cluster, prints a
qctl command that works for this cluster, never lets ./.qserver/credentials.json silently
name another one, creates its queues with --no-demo, and stops its nodes leader last.

Real processes: the demo runs as a user runs it, in a working directory of the test's own (its
./.qserver/ is there), and qctl is run from the command line it prints.
"""
from __future__ import annotations

import http.server
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.credentials import Credentials, load_credentials, save_credentials
from qserver.dev.devcluster import REPOSITORY, TEST_TLS_ENV, LocalCluster, free_port, port_free
from wire.signing import new_private_key, private_key_to_text

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def node_url(base_port: int, index: int) -> str:
    """Where the demo's node `index` serves (over TLS when the test run asks for it)."""
    return f"{'https' if os.environ.get(TEST_TLS_ENV) == '1' else 'http'}://127.0.0.1:{base_port + index}"


def free_base_port() -> int:
    """A base port whose demo ports (base+1..3, base+101..103) are all free."""
    for _ in range(100):
        base = free_port()
        ports = [base + offset for offset in (1, 2, 3, 101, 102, 103)]
        if all(port_free(port) for port in ports):
            return base
    raise RuntimeError("no free block of demo ports")




class DemoRun:
    """One `python -m qserver.dev.local --no-demo` process: its first lines, then Ctrl-C."""

    def __init__(self, workdir: Path, data_dir: Path, base_port: int) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qserver.dev.local", "--data-dir", str(data_dir), "--base-port", str(base_port),
             "--no-demo"], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.first_lines = self._until("cluster running; Ctrl-C stops it")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def _until(self, last: str) -> list[str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            self.output.append(line)
            if line == last:
                return list(self.output)
        raise AssertionError(f"the demo did not print {last!r}:\n" + "\n".join(self.output))

    def qctl_command(self) -> list[str]:
        """The qctl command line the demo printed under "try, in another shell:", without `status`."""
        line = self.first_lines[self.first_lines.index("try, in another shell:") + 1]
        argv = shlex.split(line.split("#")[0])
        assert argv[-1] == "status", line
        return argv[:-1]

    def qctl(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.qctl_command(), *argv], cwd=self.workdir, capture_output=True, text=True,
                              timeout=60)

    def stop(self) -> list[str]:
        """Ctrl-C, as at the terminal; the lines printed after it."""
        before = len(self.output)
        self.process.send_signal(signal.SIGINT)
        lines = self._until("cluster stopped")
        assert self.process.wait(STOP_TIMEOUT_S) == 0
        self._close_output()
        return lines[before:]

    def _close_output(self) -> None:
        self._reader.join(timeout=10)     # the process ended: its output reaches its end
        assert self.process.stdout is not None
        self.process.stdout.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self.process.stdout.closed:  # type: ignore[union-attr]
            self._close_output()
        for pid in re.findall(r"^node n\d up at \S+ \(pid (\d+),", "\n".join(self.output), re.MULTILINE):
            try:
                os.kill(int(pid), signal.SIGKILL)     # a node left behind by a demo that failed
            except ProcessLookupError:
                pass


@pytest.fixture
def demos(tmp_path: Path) -> Iterator[list[DemoRun]]:
    started: list[DemoRun] = []
    yield started
    for demo in started:
        demo.close()


def another_clusters_credential(url: str) -> Credentials:
    return Credentials("admin", private_key_to_text(new_private_key()), url, cluster="/elsewhere/n1")


def test_the_demo_keeps_its_credential_with_its_cluster_and_takes_back_the_copy_from_a_cluster_not_running(
        tmp_path: Path, demos: list[DemoRun]) -> None:
    workdir, root, base = tmp_path / "work", tmp_path / "local", free_base_port()
    copy = workdir / ".qserver" / "credentials.json"
    other = another_clusters_credential(f"http://127.0.0.1:{free_port()}")    # no node answers there
    save_credentials(copy, other)
    save_credentials(tmp_path / "other.json", other)
    demos.append(demo := DemoRun(workdir, root, base))
    lines = "\n".join(demo.first_lines)
    qserver = Path(sys.executable).parent / "qserver"          # the test's directory is not above it
    assert f"admin credential of this cluster: {root / 'admin-credentials.json'} (kept with it; another: " \
           f"{qserver} admin-credential --config {root / 'n1.toml'} --out FILE)" in lines
    assert (f"  copied to .qserver/credentials.json, where qctl and the client look without flags (it held client "
            f"'admin', issued by the cluster of /elsewhere/n1, for {other.url}, which is not running)") in lines
    assert "queues orders (full) and events (producer) created, no traffic (--no-demo)" in lines
    assert load_credentials(copy) == load_credentials(root / "admin-credentials.json")
    assert demo.qctl_command()[1:] == []          # qctl finds the copy without flags
    assert demo.qctl("status").returncode == 0
    # The console's address and how to sign in, among the first lines; the link qctl prints signs in.
    n1 = node_url(base, 1)
    assert any(line.startswith(f"web console: {n1}/console/ ") and line.endswith(
        f"sign in with `{shlex.join(demo.qctl_command())} console`, which prints a one-time link")
        for line in demo.first_lines[:5]), demo.first_lines[:5]
    console = demo.qctl("--json", "console", "--no-open")
    assert console.returncode == 0, console.stderr
    link = json.loads(console.stdout)["url"]
    assert link.startswith(n1 + "/console/signin?")
    handoff = demo.qctl("handoff", "orders")      # the README's first command, with --no-demo too
    assert handoff.returncode == 0, handoff.stderr
    refused = subprocess.run([*demo.qctl_command(), "--credentials", str(tmp_path / "other.json"), "--url", n1,
                              "status"], cwd=workdir, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.startswith("error: E_UNAUTHENTICATED: unknown client")
    assert f"the cluster at {n1} does not know the credentials file {tmp_path / 'other.json'}" in refused.stderr
    assert "/elsewhere/n1" in refused.stderr and "qserver admin-credential" in refused.stderr
    signed_in = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    with signed_in.open(link, timeout=10) as answer:      # follows the redirect with the session cookie
        assert "signed in as <b>admin</b>" in answer.read().decode(), answer.url
    with urllib.request.urlopen(n1 + "/healthz", timeout=5) as answer:
        leader = json.loads(answer.read())["membership"]["leader"]
    stopped = demo.stop()
    order = re.fullmatch(r"stopping the nodes one at a time, the membership leader last \((n\d), (n\d), (n\d)\): "
                         r"each hands its masters off to a node still running before it stops; the last keeps what "
                         r"it masters", stopped[0])
    assert order is not None, stopped
    assert order.group(3) == leader and sorted(order.groups()) == ["n1", "n2", "n3"]
    assert [line.split()[:2] for line in stopped[1:4]] == [[node, "stopped"] for node in order.groups()]
    assert stopped[4:] == ["cluster stopped"]
    # Stopped: qctl says which file it used and whose it is.
    unreachable = demo.qctl("status")
    assert unreachable.returncode == 1 and unreachable.stderr.startswith(f"error: E_UNAVAILABLE: cannot reach {n1}")
    assert f"qctl used the credentials file .qserver/credentials.json (client 'admin', issued by the cluster of " \
           f"{root / 'n1'}, for {n1})" in unreachable.stderr


def test_a_data_directory_an_older_demo_made_keeps_the_credential_of_the_copy_or_gets_one_minted(
        tmp_path: Path, demos: list[DemoRun]) -> None:
    workdir, root, first_base, base = tmp_path / "work", tmp_path / "local", free_base_port(), free_base_port()
    # As an older demo left it: the admin credential only in ./.qserver/credentials.json (and on
    # other ports than this start's).
    LocalCluster(root, 3, base_port=first_base)
    copy = workdir / ".qserver" / "credentials.json"
    copy.parent.mkdir(parents=True)
    (root / "admin-credentials.json").rename(copy)
    first = load_credentials(copy)
    n1 = node_url(base, 1)
    demos.append(upgraded := DemoRun(workdir, root, base))
    assert (f"  kept with the cluster now: the credential the copy held (client 'admin', issued by the cluster of "
            f"{root / 'n1'}, for {node_url(first_base, 1)}), which an older demo wrote only there") in upgraded.first_lines
    own = load_credentials(root / "admin-credentials.json")
    assert (own.client_id, own.private_key_text, own.url) == (first.client_id, first.private_key_text, n1)
    assert load_credentials(copy) == own
    assert upgraded.qctl("status").returncode == 0
    upgraded.stop()
    # Its credential lost, and the copy overwritten by another cluster's: one is minted.
    (root / "admin-credentials.json").unlink()
    save_credentials(copy, another_clusters_credential(n1))
    demos.append(again := DemoRun(workdir, root, base))
    lines = "\n".join(again.first_lines)
    minted = load_credentials(root / "admin-credentials.json")
    assert (f"  this cluster had no admin credential of its own (an older demo initialised it): minted admin client "
            f"{minted.client_id} with n1's cluster secret") in lines
    assert "another credential for these ports" in lines
    assert load_credentials(copy) == minted
    status = again.qctl("status")
    assert status.returncode == 0, status.stderr
    again.stop()


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def test_the_demo_leaves_the_copy_of_another_running_cluster_alone_and_names_its_own_file_in_its_commands(
        tmp_path: Path, demos: list[DemoRun]) -> None:
    server = http.server.HTTPServer(("127.0.0.1", free_port()), _Healthy)     # a node of another cluster
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        workdir, root = tmp_path / "work", tmp_path / "local"
        copy = workdir / ".qserver" / "credentials.json"
        other = another_clusters_credential(f"http://127.0.0.1:{server.server_address[1]}")
        save_credentials(copy, other)
        demos.append(demo := DemoRun(workdir, root, free_base_port()))
    finally:
        server.shutdown()
        server.server_close()
    lines = "\n".join(demo.first_lines)
    assert (f"  .qserver/credentials.json is left as it is (it holds client 'admin', issued by the cluster of "
            f"/elsewhere/n1, for {other.url}, and a cluster answers there)") in lines
    assert f"export QSERVER_CREDENTIALS={root / 'admin-credentials.json'}" in lines
    assert demo.qctl_command()[1:] == ["--credentials", str(root / "admin-credentials.json")]
    assert load_credentials(copy) == other
    handoff = demo.qctl("handoff", "orders")
    assert handoff.returncode == 0, handoff.stderr
    demo.stop()
