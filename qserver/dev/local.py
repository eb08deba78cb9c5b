"""A local three-node cluster with demo producers and consumers: the README's main job.

    python -m qserver.dev.local [--data-dir data/local] [--base-port 7100] [--credentials PATH]
                            [--duration-s 0] [--rate 1000] [--handoff-every-s 15] [--no-demo]

It initialises three nodes under one directory on first use (n1 makes the cluster secret
and the admin credential, kept with the cluster in DATA_DIR/admin-credentials.json; n2 and n3
join it), starts three real `qserver` processes on loopback (HTTP on base-port+1..3, the
membership layer on base-port+101..103), and waits until they have elected a membership
leader. It copies the cluster's credential to ./.qserver/credentials.json (or --credentials),
where `qctl` and the client look without flags, unless that file belongs to another cluster
that is running, and prints the qctl command line that works for this cluster either way
(qserver/dev/demo_credentials.py). Then, through the client library, a
producer and a consumer run on `orders` (strength `full`: every operation on both members)
and on `events` (strength `producer`), `orders` is handed off between its members every
--handoff-every-s seconds, a node that dies is started again (as a supervisor would), and a
live view shows the nodes, the membership leader, each queue's master, replica, epoch,
in-sync flag and depth, the rates and end-to-end latency, every error the demo traffic saw
by client and code, each client that is stalled (no progress for 5 s with work to do:
qserver/dev/demo_progress.py) and recent events such as each handoff's write pause. With
--no-demo the queues are created and nothing else runs. Ctrl-C (or --duration-s) stops the
demo, prints a summary (per client: its longest stall, how many lasted 5 s or more, its
errors), then stops the nodes one at a time, the membership leader last (SIGTERM: a node hands
its masters off before it stops, so each handoff goes to a node still running, and the leader
is there to commit it; the last node keeps what it masters).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import AsyncClient, QueueError
from client.aio import Message
from client.credentials import ENV_CREDENTIALS, LOCAL_CREDENTIALS
from qserver.dev.demo_credentials import CredentialAccess, credential_access, executable, shown
from qserver.dev.demo_progress import (
    STALL_AFTER_S,
    DemoClient,
    errors_text,
    make_clients,
    observe_depths,
    status_lines,
    summary,
)
from qserver.dev.devcluster import LocalCluster

STATUS_INTERVAL_S = 1.0
STATUS_TIMEOUT_S = 2.0          # the view asks the next node when one does not answer in this time
SUPERVISE_INTERVAL_S = 0.5      # how soon a node that died is started again
RETRY_PAUSE_S = 0.2             # after an error, before the loop's next call
PREFETCH = 500
QUEUES = {"orders": "full", "events": "producer"}
_STAMP = struct.Struct(">d")
DEMO_TEXT = b"demo message"     # after the stamp, in every payload of the demo's producers


def _stamped_at(payload: bytes) -> float | None:
    """When the demo's producer sent a message; None for one someone else put on the demo's
    queues (`qctl put orders hi`): it is consumed and acked like the others, but has no stamp
    to read, and reading one from it ended the consumer."""
    if len(payload) != _STAMP.size + len(DEMO_TEXT) or not payload.endswith(DEMO_TEXT):
        return None
    return float(_STAMP.unpack_from(payload)[0])


def _code(error: BaseException) -> str:
    return error.code if isinstance(error, QueueError) else type(error).__name__


def _stamped(text: str) -> str:
    return f"{time.strftime('%H:%M:%S')} {text}"


class Demo:
    """The demo traffic: a producer and a consumer per queue, each tracked for progress and
    errors (qserver/dev/demo_progress.py) so that the view can say when one is stuck."""

    def __init__(self, client: AsyncClient, rate_per_s: int) -> None:
        self.client = client
        self.rate_per_s = rate_per_s
        self.produced = dict.fromkeys(QUEUES, 0)
        self.consumed = dict.fromkeys(QUEUES, 0)
        self.latencies_ms: list[float] = []
        self.clients = make_clients(QUEUES, time.monotonic)
        self.events: list[str] = []
        self._acks: set[asyncio.Task[None]] = set()

    def event(self, text: str) -> None:
        self.events.append(_stamped(text))

    async def produce(self, queue: str) -> None:
        """Enqueue at the demo's rate, forever: an error is counted and the loop goes on."""
        client = self.clients[f"{queue} producer"]
        batch = max(1, self.rate_per_s // 50)
        interval_s = batch / self.rate_per_s
        next_at = time.monotonic()
        while True:
            payloads = [_STAMP.pack(time.time()) + DEMO_TEXT for _ in range(batch)]
            try:
                await self.client.enqueue_many(queue, payloads, priority=4)
                self.produced[queue] += batch
                client.tracker.progressed()
            except QueueError as error:
                client.count_error(error.code)
                await asyncio.sleep(RETRY_PAUSE_S)
            next_at = max(next_at + interval_s, time.monotonic() - 1.0)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def consume(self, queue: str) -> None:
        """One consumer, iterated for as long as it serves. Making a new one on any error would
        hide a consumer that stopped: it is replaced only after a non-retriable error (or if
        it ends), and the view says so."""
        client = self.clients[f"{queue} consumer"]
        while True:
            async with self.client.consume(queue, prefetch=PREFETCH) as messages:
                reason = await self._iterate(client, messages)
            client.replacements += 1
            self.event(f"{client.name} replaced by a new consumer: {reason}")
            await asyncio.sleep(RETRY_PAUSE_S)

    async def _iterate(self, client: DemoClient, messages: AsyncIterator[Message]) -> str:
        """Take messages until the consumer raises a non-retriable error or ends; returns why.
        A retriable error (the client library raises one after a long outage) is counted, and
        the same consumer is iterated again."""
        while True:
            try:
                async for message in messages:
                    self._take(client, message)
                return "the consumer ended"
            except QueueError as error:
                client.count_error(error.code)
                if not error.retriable:
                    return str(error)
                await asyncio.sleep(RETRY_PAUSE_S)

    def _take(self, client: DemoClient, message: Message) -> None:
        # Acks are pipelined (the client coalesces them into frames); progress is an ack that
        # succeeded, since a message taken but never acked is delivered again.
        stamped_at = _stamped_at(message.payload)
        if stamped_at is not None:
            self.latencies_ms.append((time.time() - stamped_at) * 1000)
        task = asyncio.ensure_future(message.ack())
        self._acks.add(task)
        task.add_done_callback(lambda done: self._acked(client, done))
        task.add_done_callback(self._acks.discard)

    def _acked(self, client: DemoClient, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            client.count_error(_code(error))
        else:
            self.consumed[client.queue] += 1
            client.tracker.progressed()

    def watch(self, name: str, task: asyncio.Task[None]) -> None:
        """A traffic loop ends only on an exception that is not a QueueError (a bug): say so."""
        def ended(done: asyncio.Task[None]) -> None:
            error = None if done.cancelled() else done.exception()
            if error is not None:
                self.clients[name].ended = f"{_code(error)}: {error}"
                self.event(f"{name} ENDED: {self.clients[name].ended}")
        task.add_done_callback(ended)

    async def hand_off(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            started = time.monotonic()
            try:
                answer = await self.client.handoff("orders")
                self.event(f"handoff of orders: master now {answer['master']} (epoch {answer['epoch']}), "
                           f"writes paused {answer.get('pause_ms', '?')} ms, "
                           f"call took {(time.monotonic() - started) * 1000:.0f} ms")
            except QueueError as error:
                self.event(f"handoff of orders refused: {error}")

    async def supervise(self, cluster: LocalCluster) -> None:
        """Start a node that died again, as a supervisor would. Starting one waits for its
        /healthz, so it runs off the event loop: the traffic and the view go on meanwhile."""
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            for event in await asyncio.to_thread(cluster.restart_exited):
                self.event(event)
                write_pid_files(cluster)


@dataclass
class Status:
    """What the view read this second: the map (None: no node answered) and the depths read."""
    cluster_map: dict[str, Any] | None
    depths: dict[str, int]


@dataclass
class StatusReader:
    """The map and the queues' depths for the view, from the first node that answers (the one
    that answered last first), so that the view goes on while a node is down."""
    clients: list[AsyncClient]
    errors: dict[str, int] = field(default_factory=dict)
    last_map: dict[str, Any] = field(default_factory=dict)
    last_map_at: float | None = None
    _preferred: int = 0

    @classmethod
    def for_nodes(cls, urls: Iterable[str], credentials: Path) -> StatusReader:
        return cls([AsyncClient(url, credentials, request_timeout_s=STATUS_TIMEOUT_S) for url in urls])

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def read(self, queues: Iterable[str]) -> Status:
        queues = list(queues)
        answers = await asyncio.gather(self._ask(lambda client: client.cluster()),
                                       *(self._ask(_stats_of(queue)) for queue in queues))
        cluster_map, stats = answers[0], answers[1:]
        if cluster_map is not None:
            self.last_map, self.last_map_at = cluster_map, time.monotonic()
        return Status(cluster_map, {queue: entry["depth"] for queue, entry in zip(queues, stats, strict=True)
                                    if entry is not None})

    async def _ask(self, call: Callable[[AsyncClient], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
        """The first answer, or None when no node gave one (the last error is counted)."""
        failure: QueueError | None = None
        for offset in range(len(self.clients)):
            index = (self._preferred + offset) % len(self.clients)
            try:
                answer = await call(self.clients[index])
            except QueueError as error:
                failure = error
                continue
            self._preferred = index
            return answer
        if failure is not None:
            self.errors[failure.code] = self.errors.get(failure.code, 0) + 1
        return None


def _stats_of(queue: str) -> Callable[[AsyncClient], Awaitable[dict[str, Any]]]:
    # A function of its own, so that each queue's call binds its own name.
    return lambda client: client.queue_stats(queue)


class LiveView:
    """Once a second: read the status, tell each consumer whether its queue holds messages, and
    print the view (the whole screen on a terminal, one line otherwise)."""

    def __init__(self, demo: Demo, status: StatusReader, cluster: LocalCluster, qctl: str) -> None:
        self.demo, self.status, self.cluster, self.qctl = demo, status, cluster, qctl
        self._last = (time.monotonic(), 0, 0)       # when, produced, consumed at the last print

    async def run(self, stop_at: float | None) -> None:
        tty = sys.stdout.isatty()
        while stop_at is None or time.monotonic() < stop_at:
            await asyncio.sleep(STATUS_INTERVAL_S)
            status = await self.status.read(QUEUES)
            observe_depths(self.demo.clients.values(), status.depths)
            if tty:
                print("\x1b[H\x1b[2J" + "\n".join(self.screen(status)), flush=True)
            else:
                print(self.line(status), flush=True)
            self.demo.latencies_ms.clear()          # each print's percentiles are of its second
            self._last = (time.monotonic(), sum(self.demo.produced.values()), sum(self.demo.consumed.values()))

    def screen(self, status: Status) -> list[str]:
        lines = [f"qcluster demo: 3 nodes on loopback, data in {self.cluster.root}  (Ctrl-C stops)",
                 f"try     {self.qctl} status   |   {self._kill_hint()}", ""]
        lines += self._map_lines(status)
        lines += ["", self._rates_line(),
                  f"errors  {errors_text(self.demo.clients.values())}   (counted; the traffic goes on)"]
        unwell = status_lines(self.demo.clients.values(), status.depths)
        lines += [f"clients {line}" for line in unwell[:1]] + [f"        {line}" for line in unwell[1:]]
        if not unwell:
            lines.append(f"clients none stalled (stalled: no progress for {STALL_AFTER_S:g} s with work to do)")
        if self.status.errors:
            lines.append(f"view    no node answered the view's own reads: {self.status.errors}")
        return lines + ["", "recent events:"] + [f"  {event}" for event in self.demo.events[-5:]]

    def line(self, status: Status) -> str:
        masters = [(queue, entry["master"], entry["epoch"])
                   for queue, entry in sorted(self.status.last_map.get("queues", {}).items())]
        unwell = status_lines(self.demo.clients.values(), status.depths)
        return _stamped(f"produced {sum(self.demo.produced.values()):,} consumed {sum(self.demo.consumed.values()):,} "
                        f"masters {masters} events {len(self.demo.events)} "
                        f"errors {errors_text(self.demo.clients.values())}"
                        + "".join(f" | {line}" for line in unwell))

    def _map_lines(self, status: Status) -> list[str]:
        view = self.status.last_map
        leader = view.get("leader")
        nodes = "  ".join(f"{n['id']} {n['state']}{' (membership leader)' if n['id'] == leader else ''}"
                          for n in view.get("nodes", []))
        lines = [f"nodes   {nodes}"]
        if status.cluster_map is None and self.status.last_map_at is not None:
            lines.append(f"        (no node answered: the map as of {time.monotonic() - self.status.last_map_at:.0f} s ago)")
        lines.append(f"{'queue':<8} {'master':<7} {'replica':<8} {'epoch':>5} {'in sync':<8} {'depth':>8}  "
                     "produced  consumed")
        for queue, entry in sorted(view.get("queues", {}).items()):
            depth = f"{status.depths[queue]:,}" if queue in status.depths else "?"
            lines.append(f"{queue:<8} {entry['master']:<7} {entry['replica']:<8} {entry['epoch']:>5} "
                         f"{'yes' if entry['in_sync'] else 'NO':<8} {depth:>8}  "
                         f"{self.demo.produced.get(queue, 0):>8,}  {self.demo.consumed.get(queue, 0):>8,}")
        return lines

    def _rates_line(self) -> str:
        elapsed_s = max(time.monotonic() - self._last[0], 1e-3)
        produced, consumed = sum(self.demo.produced.values()), sum(self.demo.consumed.values())
        latencies = sorted(self.demo.latencies_ms) or [0.0]
        return (f"rates   produced {(produced - self._last[1]) / elapsed_s:>7,.0f}/s  consumed "
                f"{(consumed - self._last[2]) / elapsed_s:>7,.0f}/s   end-to-end p50 "
                f"{latencies[len(latencies) // 2]:.1f} ms  p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms")

    def _kill_hint(self) -> str:
        """kill -9 of the process that masters `orders` now (the README's failover)."""
        master = self.status.last_map.get("queues", {}).get("orders", {}).get("master")
        process = self.cluster.processes.get(master) if master else None
        if process is None or process.poll() is not None:
            return f"kill -9 $(pgrep -f '{self.cluster.root}/nN.toml')   (nN: a master; the demo starts it again)"
        return f"kill -9 {process.pid}   ({master}, the master of orders; the demo starts it again)"


async def create_queues(client: AsyncClient) -> None:
    """The demo's queues, which the README's first commands name (with --no-demo too)."""
    for queue, strength in QUEUES.items():
        await client.create_queue(queue, strength=strength)
    await client.refresh_placement()


async def create_queues_only(cluster: LocalCluster, credentials: Path) -> None:
    async with AsyncClient(cluster.urls["n1"], credentials) as client:
        await create_queues(client)


async def run_demo(cluster: LocalCluster, credentials: Path, rate_per_s: int, duration_s: float,
                   handoff_every_s: float, qctl: str) -> None:
    async with AsyncClient(cluster.urls["n1"], credentials) as client:
        await create_queues(client)
        demo = Demo(client, rate_per_s)
        status = StatusReader.for_nodes(cluster.urls.values(), credentials)
        try:
            await _run_until_stopped(demo, LiveView(demo, status, cluster, qctl), cluster, duration_s,
                                     handoff_every_s)
        finally:
            await status.close()
        _print_summary(demo, status)


async def _run_until_stopped(demo: Demo, view: LiveView, cluster: LocalCluster, duration_s: float,
                             handoff_every_s: float) -> None:
    """The traffic, the handoffs, the supervisor and the view, until Ctrl-C or --duration-s."""
    tasks = []
    for queue in QUEUES:
        for name, coroutine in ((f"{queue} producer", demo.produce(queue)), (f"{queue} consumer", demo.consume(queue))):
            tasks.append(asyncio.create_task(coroutine))
            demo.watch(name, tasks[-1])
    if handoff_every_s > 0:
        tasks.append(asyncio.create_task(demo.hand_off(handoff_every_s)))
    tasks.append(asyncio.create_task(demo.supervise(cluster)))
    viewer = asyncio.create_task(view.run(time.monotonic() + duration_s if duration_s > 0 else None))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([viewer, stopper], return_when=asyncio.FIRST_COMPLETED)
    for task in (*tasks, viewer, stopper):
        task.cancel()
    await asyncio.gather(*tasks, viewer, stopper, return_exceptions=True)


def _print_summary(demo: Demo, status: StatusReader) -> None:
    totals: dict[str, int] = {}
    for client in demo.clients.values():
        for code, count in client.errors.items():
            totals[code] = totals.get(code, 0) + count
    print(f"\ndemo done: {{'produced': {demo.produced}, 'consumed': {demo.consumed}, 'errors': {totals}}}")
    for name, entry in summary(demo.clients.values()).items():
        print(f"  {name}: {entry}")
    if status.errors:
        print(f"  no node answered the live view's own reads: {status.errors}")
    if demo.events:
        print("events:")
    for event in demo.events:
        print(f"  {event}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(args.data_dir.resolve(), 3, base_port=args.base_port)
    cluster.log_level = "INFO"
    logged = {node: _log_size(cluster, node) for node in cluster.ids}
    try:
        cluster.start_all()
        _print_migrations(cluster, logged)
        write_pid_files(cluster)
        access = credential_access(cluster, args.credentials)
        if args.no_demo:
            asyncio.run(create_queues_only(cluster, access.own_path))
    except (RuntimeError, QueueError) as error:
        stop_cluster(cluster)
        raise SystemExit(str(error)) from None
    _print_first_lines(cluster, access, args.no_demo)
    try:
        if args.no_demo:
            _supervise_only(cluster)
        else:
            asyncio.run(run_demo(cluster, access.own_path, args.rate, args.duration_s, args.handoff_every_s,
                                 access.qctl))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # a second Ctrl-C must not cut the stop short
        try:
            stop_cluster(cluster)
        finally:
            cluster.stop_all()      # whatever still runs when the report could not be printed (a closed pipe)
    return 0


def _log_size(cluster: LocalCluster, node: str) -> int:
    path = cluster.root / f"{node}.log"
    return path.stat().st_size if path.exists() else 0


def _print_migrations(cluster: LocalCluster, logged: dict[str, int]) -> None:
    """Say which nodes migrated their data directory to this code's storage layout as they
    started (qserver/storage/migrate.py logs it; docs/OPERATIONS.md, "Storage layouts and migration")."""
    for node, start in logged.items():
        with open(cluster.root / f"{node}.log", "rb") as log:
            log.seek(start)
            for line in log.read().decode(errors="replace").splitlines():
                if "qserver.storage" in line and " migrated layout " in line:
                    print(f"{node}: {line.split('qserver.storage: ', 1)[-1]}", flush=True)


def write_pid_files(cluster: LocalCluster) -> None:
    """DATA_DIR/nX.pid: the pid of node nX's process now, for `python -m qserver.dev.roll`, which
    stops each node in turn (SIGTERM) and lets this supervisor start it again on the code on disk."""
    for node, process in cluster.processes.items():
        (cluster.root / f"{node}.pid").write_text(f"{process.pid}\n")


def stop_cluster(cluster: LocalCluster) -> None:
    """Stop every node one at a time, the membership leader last (LocalCluster.stop_order), and
    say so: each node's handoffs then go to a node still running, and are committed at once."""
    order = cluster.stop_order()
    if not order:
        return
    print(f"stopping the nodes one at a time, the membership leader last ({', '.join(order)}): each hands its "
          "masters off to a node still running before it stops; the last keeps what it masters", flush=True)
    for node in order:
        started = time.monotonic()
        code = cluster.stop(node)
        print(f"  {node} stopped in {time.monotonic() - started:.1f} s" + (f" (exit code {code})" if code else ""),
              flush=True)
    print("cluster stopped")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m qserver.dev.local", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data/local"),
                        help="where the three nodes keep their data and node files (default data/local)")
    parser.add_argument("--base-port", type=int, default=7100,
                        help="node i serves clients on BASE+i and membership on BASE+100+i (default 7100)")
    parser.add_argument("--credentials", type=Path, default=LOCAL_CREDENTIALS,
                        help="where to copy the cluster's admin credential for qctl and the client (default: where "
                             "they look without flags); the cluster's own stays in DATA_DIR/admin-credentials.json")
    parser.add_argument("--rate", type=int, default=1000, help="demo messages per second per queue")
    parser.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--handoff-every-s", type=float, default=15.0, help="hand off `orders` this often (0: never)")
    parser.add_argument("--no-demo", action="store_true",
                        help="only run the three nodes, with the demo's queues created and no traffic")
    return parser.parse_args(argv)


def _print_first_lines(cluster: LocalCluster, access: CredentialAccess, no_demo: bool) -> None:
    for node in cluster.ids:
        print(f"node {node} up at {cluster.urls[node]} (pid {cluster.processes[node].pid}, "
              f"log: {cluster.root / (node + '.log')})")
    first = cluster.ids[0]
    print(f"web console: {cluster.urls[first]}/console/ (every node serves one; docs/CONSOLE.md): sign in with "
          f"`{access.qctl} console`, which prints a one-time link")
    print(f"admin credential of this cluster: {shown(access.own_path)} (kept with it; another: "
          f"{executable('qserver')} admin-credential --config {shown(cluster.root / 'n1.toml')} --out FILE)")
    for note in access.notes:
        print(f"  {note}")
    # The copy is found relative to the working directory only: this line reaches the cluster
    # from any directory (qctl and the client library both read the variable).
    print(f"from any directory: export {ENV_CREDENTIALS}={access.own_path.resolve()}")
    if no_demo:
        print(f"queues {' and '.join(f'{queue} ({strength})' for queue, strength in QUEUES.items())} created, "
              "no traffic (--no-demo)")
    print("try, in another shell:")
    print(f"  {access.qctl} status      # each queue's master (the live view shows it too)")
    print(f"  kill -9 $(pgrep -f '{cluster.root}/n1.toml')      # n1 dies; the demo starts it again at once")
    if not no_demo:
        print("  (the live view names the pid of the node that masters orders now, and any client that stalls)")
    sys.stdout.flush()


def _supervise_only(cluster: LocalCluster) -> None:
    print("cluster running; Ctrl-C stops it")
    with contextlib.suppress(KeyboardInterrupt):
        while len(cluster.left_down) < len(cluster.ids):
            for event in cluster.restart_exited():    # a node that failed stop is started again
                print(_stamped(event), flush=True)
                write_pid_files(cluster)
            time.sleep(SUPERVISE_INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main())
