"""A local cluster of real `qserver` processes on loopback, for tests, benchmarks and demos.

Every node gets its own data directory under one root (the first is initialised with
`qserver init`, the others `--join` it: same cluster secret and clients), a TOML file with the
shared `[cluster]` tables, and a free port. Nothing here is used by a node itself.

Every process a node had is remembered (`NodeRuns`) with whether the caller ended it, so a
test's teardown can fail on a node that crashed or failed stop behind its clients' back.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
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
        if port in _PORTS_GIVEN or not port_free(port):
            continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORT_FIRST}-{FREE_PORT_LAST} on 127.0.0.1")


def port_free(port: int) -> bool:
    """Whether nothing listens on (or holds) this loopback port now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def code_environment(code: Path) -> dict[str, str]:
    """The environment of a `python -m qserver` that runs the code tree `code` (this checkout,
    or an older release's `git worktree`, tests/test_upgrade.py) with this interpreter: the tree
    first on the path, ahead of the editable install of this checkout (its finder comes after
    the path's entries)."""
    environment = dict(os.environ)
    if code.resolve() != REPOSITORY:
        environment["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [environment.get("PYTHONPATH")])])
    return environment


def start_qserver(run_args: list[str], url: str, log_path: Path, timeout_s: float = START_TIMEOUT_S,
                  ssl_context: ssl.SSLContext | None = None, code: Path = REPOSITORY) -> subprocess.Popen[bytes]:
    """Start `qserver run ARGS...` (output to log_path) from the code tree `code` and wait for
    its /healthz; a node that exits or stays silent raises RuntimeError with the end of its log."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "qserver", "run", *run_args],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=code, env=code_environment(code),
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


# What a node's log holds when something went wrong that its clients may never see: a Python
# traceback (an error logged with its stack, or a crash), or a CRITICAL record, which only the
# fail path writes (Engine.fail's "the engine failed", then qserver.core.failstop.stop_process's
# "stopping the node:" before exit code 70).
TRACEBACK_MARK = b"Traceback (most recent call last)"
FAIL_STOP_MARK = b"stopping the node:"
QUIET_LEVELS = (b"DEBUG", b"INFO")    # a stack logged on purpose (QSERVER_TEST_LOG_LEVEL=DEBUG) is no error
LOG_RECORD_START = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) ", re.MULTILINE)
LOG_EXCERPT_BYTES_MAX = 3000
BAD_RECORDS_SHOWN_MAX = 3


@dataclass(eq=False)
class NodeRun:
    """One process of a node: where its output begins in the node's log, whether the test
    ended it on purpose and whether the test said it would end by itself."""
    process: subprocess.Popen[bytes]
    log_offset: int
    ended_on_purpose: bool = False
    exit_expected: bool = False


class NodeRuns:
    """Every process started for one node, so that teardown can tell a node the test killed or
    stopped from one that died on its own (a crash or a fail-stop) and read each process's part
    of the log: a test's clients talk to the nodes still up and would pass without noticing."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self.runs: list[NodeRun] = []

    def start(self, run_args: list[str], url: str, ssl_context: ssl.SSLContext | None = None,
              code: Path = REPOSITORY) -> subprocess.Popen[bytes]:
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        process = start_qserver(run_args, url, self.log_path, ssl_context=ssl_context, code=code)
        self.runs.append(NodeRun(process, log_offset))
        return process

    def end(self, process: subprocess.Popen[bytes], signal_number: int, timeout_s: float) -> int:
        """Signal a process still running and wait for it; one that had already exited is
        left as it was, exited by itself, and its code returned."""
        if process.poll() is None:
            for run in self.runs:
                if run.process is process:
                    run.ended_on_purpose = True
            process.send_signal(signal_number)
        return process.wait(timeout=timeout_s)

    def expect_exit(self) -> None:
        """The current process will exit by itself (a fail-stop the test provokes): its exit and
        its fail path's records are not reported; the node's later processes still are."""
        if not self.runs:
            raise RuntimeError(f"{self.name} has no process to expect an exit of")
        self.runs[-1].exit_expected = True

    def problems(self) -> list[str]:
        """One description per process that exited by itself and per log record holding a
        traceback or a fail-stop (see _bad_records), except those the test expected."""
        log = self.log_path.read_bytes() if self.log_path.exists() else b""
        ends = [run.log_offset for run in self.runs[1:]] + [len(log)]
        return [problem for run, end in zip(self.runs, ends, strict=True)
                for problem in self._problems_of(run, log[run.log_offset:end])]

    def _problems_of(self, run: NodeRun, log: bytes) -> list[str]:
        """What went wrong in one process, given its part of the log; a burst of the same
        error is summed up after the first few records (its first lines, once each)."""
        name = f"{self.name} (pid {run.process.pid})"
        found = []
        code = run.process.poll()
        if code is not None and not run.ended_on_purpose and not run.exit_expected:
            found.append(f"{name} exited by itself with code {code}; the end of its log ({self.log_path}):\n"
                         + _text(log[-LOG_EXCERPT_BYTES_MAX:]))
        bad = _bad_records(log, fail_stop_expected=run.exit_expected)
        found += [f"{name} logged {what} ({self.log_path}):\n{_text(record)}"
                  for what, record in bad[:BAD_RECORDS_SHOWN_MAX]]
        if len(bad) > BAD_RECORDS_SHOWN_MAX:
            first_lines = dict.fromkeys(_text(LOG_RECORD_START.sub(rb"\1 ", record.split(b"\n", 1)[0]))
                                        for _, record in bad)
            found.append(f"{name} logged {len(bad) - BAD_RECORDS_SHOWN_MAX} more such records, among them:\n"
                         + "\n".join(first_lines))
        return found


def _bad_records(log: bytes, *, fail_stop_expected: bool) -> list[tuple[str, bytes]]:
    """The log records (a record runs to the start of the next) that are CRITICAL, or hold a
    traceback and are not DEBUG or INFO (output outside logging, a crash's, has no level); the
    fail path's CRITICAL records (their tracebacks included) pass when the test expected the
    process to fail-stop."""
    starts = [(match.start(), match.group(1)) for match in LOG_RECORD_START.finditer(log)]
    if not starts or starts[0][0] != 0:
        starts.insert(0, (0, b""))    # output before the first record (a crash before logging began)
    found = []
    for (start, level), end in zip(starts, [start for start, _ in starts[1:]] + [len(log)], strict=True):
        record = log[start:end]
        if level == b"CRITICAL":
            if not fail_stop_expected:
                what = "a fail-stop" if FAIL_STOP_MARK in record.split(b"\n", 1)[0] else "a critical error"
                found.append((what, record[:LOG_EXCERPT_BYTES_MAX]))
        elif TRACEBACK_MARK in record and level not in QUIET_LEVELS:
            found.append(("a traceback", record[:LOG_EXCERPT_BYTES_MAX]))
    return found


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


class LocalCluster:
    def __init__(self, root: Path, size: int, placement: dict[str, list[str]] | None = None,
                 settings: dict[str, object] | None = None, *, base_port: int | None = None,
                 credentials_path: Path | None = None, voters: int | None = None, tls: bool | None = None,
                 code: Path = REPOSITORY) -> None:
        """`settings`: extra [node] keys for every node (TOML literals, e.g. {"journal_enabled": "false"}).
        `base_port`: node i serves HTTP on base_port+i and Raft on base_port+100+i (else free
        ports). Data already under `root` is reused (the nodes were initialised before).
        `voters`: how many of the nodes (the first ones) vote in the membership layer (default all).
        `tls`: every link over TLS with a local CA (`qserver init --tls`); default from
        $QSERVER_TEST_TLS ("1": on), so the whole suite can run with TLS on.
        `code`: the code tree every node is initialised and started from (default this
        checkout; an older release's `git worktree` for an upgrade, see `start`'s `code`)."""
        self.root = root
        self.code = {f"n{i}": code for i in range(1, size + 1)}    # node -> the tree it runs
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
        self.runs = {node: NodeRuns(f"node {node}", root / f"{node}.log") for node in self.ids}
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
                        *extra, *tls], check=True, capture_output=True, cwd=self.code[node],
                       env=code_environment(self.code[node]))

    def _write_config(self, node: str, placement: dict[str, list[str]], settings: dict[str, object]) -> None:
        port = self.urls[node].rsplit(":", 1)[1]
        lines = ["[node]", f'node_id = "{node}"', f'data_dir = "{self.root / node}"', f"port = {port}"]
        lines += [f"{key} = {value}" for key, value in settings.items()]
        lines += ["[cluster.nodes]"] + [f'{n} = "{url}"' for n, url in self.urls.items()]
        lines += ["[cluster.membership]"] + [f'{n} = "{address}"' for n, address in self.raft_addresses.items()]
        lines += ["[cluster.placement]"] + [f'"{q}" = ["{a}", "{b}"]' for q, (a, b) in placement.items()]
        (self.root / f"{node}.toml").write_text("\n".join(lines) + "\n")

    def start(self, node: str, *, wait: bool = True, code: Path | None = None) -> None:
        """Start one node and wait for its /healthz (a node that exits raises with its log) and,
        unless `wait` is false, until it takes part in the cluster (see wait_ready). `code`: run
        it from this code tree from now on (a rolling upgrade starts a stopped node of the old
        release with the new one on the same data directory and ports)."""
        if code is not None:
            self.code[node] = code
        self.processes[node] = self.runs[node].start(
            ["--config", str(self.root / f"{node}.toml"), "--log-level", self.log_level], self.urls[node],
            ssl_context=self.ssl_context, code=self.code[node])
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
        if process is not None:
            self.runs[node].end(process, signal.SIGKILL, timeout_s=10)

    def stop(self, node: str) -> int:
        """SIGTERM one node (an orderly stop: it hands its masters off first); its exit code."""
        return self.runs[node].end(self.processes.pop(node), signal.SIGTERM, timeout_s=30)

    def wipe(self, node: str) -> None:
        """The node loses its disk: a fresh data directory that joins the same cluster."""
        self.kill(node)
        shutil.rmtree(self.root / node)
        self._init(node, ["--join", str(self.root / self.ids[0])])

    def stop_order(self) -> list[str]:
        """The running nodes in the order a whole-cluster stop takes them: the membership leader
        last. SIGTERM hands a node's masters off first; stopped one at a time, leader last, each
        handoff goes to a node still running, and the leader is there to commit it (stopping the
        leader early made the next node's handoffs wait 5 s for a swap no one committed)."""
        leader = self.membership_leader()
        return sorted(self.processes, key=lambda node: node == leader)     # stable: the others keep their order

    def membership_leader(self) -> str | None:
        """The running node the first node that answers names membership leader (None: no answer)."""
        for node in self.processes:
            membership = self.health(node).get("membership")
            leader = membership.get("leader") if isinstance(membership, dict) else None
            if leader in self.processes:
                return str(leader)
        return None

    def stop_all(self) -> None:
        """SIGTERM every node (an orderly stop), one at a time in `stop_order`, waiting for each."""
        for node in self.stop_order():
            self.stop(node)

    def kill_all(self) -> None:
        for node in list(self.processes):
            self.kill(node)

    def expect_exit(self, node: str) -> None:
        """The node's current process will exit by itself: see NodeRuns.expect_exit."""
        self.runs[node].expect_exit()

    def problems(self) -> list[str]:
        """Every node process that exited by itself, and every traceback or fail-stop in the
        logs, that the test did not expect (see NodeRuns.problems)."""
        return [problem for node in self.ids for problem in self.runs[node].problems()]
