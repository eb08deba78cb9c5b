"""What the console's rates and small graphs are computed from (docs/CONSOLE.md, "Cluster" and
"Queues"): a rate needs two readings of a total, so the console keeps small bounded rings of
readings.

- Per node: every NODE_SAMPLE_EVERY_S one task reads each node's unsigned `/metrics` (all at
  once, each within FETCH_TIMEOUT_S) and keeps the node's enqueued and acknowledged totals, its
  loop lag and its room on disk. The task starts with the first page that wants it and ends by
  itself once no such page was served for IDLE_STOP_S (and when the node stops): a node nobody
  looks at pays nothing. `/metrics` is read in the background, never while a page waits: at
  10,000 queues it is megabytes and takes a node ~120 ms to render (bench/RESULTS.md, scale).
- Per queue: the totals of the queues a page shows, read with that page (never all queues):
  at most QUEUES_TRACKED_MAX queues (the least recently shown are forgotten), each with at most
  QUEUE_POINTS_MAX readings at least QUEUE_SAMPLE_MIN_S apart.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

log = logging.getLogger("qserver.console")

NODE_SAMPLE_EVERY_S = 5.0
NODE_POINTS_MAX = 120                 # ten minutes of readings per node
FETCH_TIMEOUT_S = 2.0                 # for a node's /metrics, or its page of queues (pages_queues.py)
# A node whose /metrics is over LARGE_METRICS_BYTES (some thousands of queues) is read every
# LARGE_SAMPLE_EVERY_S instead, as often as Prometheus usually scrapes it: rendering it holds
# that node's loop (~120 ms at 10,000 queues).
LARGE_METRICS_BYTES = 1 << 20
LARGE_SAMPLE_EVERY_S = 15.0
IDLE_STOP_S = 120.0
QUEUES_TRACKED_MAX = 1_000          # 20 pages of queues: at most ~5 MB of readings in all
QUEUE_POINTS_MAX = 30
QUEUE_SAMPLE_MIN_S = 2.0
NODE_URLS_TTL_S = 60.0               # how long the queues page asks the nodes it knows without reading the map
# The /metrics lines the console reads (everything else is skipped unparsed).
WANTED = ("qserver_queue_enqueued_total", "qserver_queue_acked_total", "qserver_loop_lag_max_seconds",
          "qserver_storage_free_bytes", "qserver_storage_used_bytes")


@dataclass
class NodeReading:
    at: float                          # time.monotonic()
    enqueued: float
    acked: float
    loop_lag_s: float | None
    disk_free_bytes: float | None
    used_bytes: float | None
    map_free_bytes: float | None


def parse_metrics(text: str) -> NodeReading:
    """The node-wide figures of one `/metrics` text. Per-queue totals are summed over the queues
    this node masters when the series carry a `role` label (issue 35: a queue is not counted
    twice), else over every queue core of the node."""
    sums = {"qserver_queue_enqueued_total": [0.0, 0.0], "qserver_queue_acked_total": [0.0, 0.0]}
    roles_seen = False
    single: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(WANTED):
            continue
        series, _, value_text = line.rpartition(" ")
        try:
            value = float(value_text)
        except ValueError:
            continue
        name = series.split("{", 1)[0]
        if name in sums:
            has_role = 'role="' in series
            roles_seen = roles_seen or has_role
            sums[name][0] += value
            if not has_role or 'role="master"' in series:
                sums[name][1] += value
        elif name == "qserver_storage_free_bytes":
            single["disk_free" if 'where="disk"' in series else "map_free"] = value
        else:
            single[name] = value
    pick = 1 if roles_seen else 0
    return NodeReading(time.monotonic(), sums["qserver_queue_enqueued_total"][pick],
                       sums["qserver_queue_acked_total"][pick], single.get("qserver_loop_lag_max_seconds"),
                       single.get("disk_free"), single.get("qserver_storage_used_bytes"), single.get("map_free"))


def rate(points: Iterable[tuple[float, float]]) -> float | None:
    """Per second between the last two readings (None: fewer than two; a total that went down,
    after a restart, counts from zero)."""
    last = list(points)[-2:]
    if len(last) < 2 or last[1][0] <= last[0][0]:
        return None
    return max(0.0, last[1][1] - last[0][1]) / (last[1][0] - last[0][0])


def rates_of(points: list[tuple[float, float]]) -> list[float]:
    """The rate between each pair of consecutive readings (what a sparkline draws)."""
    return [max(0.0, b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(points, points[1:], strict=False) if b[0] > a[0]]


@dataclass
class Sampler:
    session: aiohttp.ClientSession | None = None
    nodes: dict[str, collections.deque[NodeReading]] = field(default_factory=dict)
    node_urls: dict[str, str] = field(default_factory=dict)
    queues: collections.OrderedDict[str, collections.deque[tuple[float, float, float]]] = \
        field(default_factory=collections.OrderedDict)
    last_wanted: float = 0.0
    task: asyncio.Task[None] | None = None
    _member_urls: tuple[float, dict[str, str]] = (0.0, {})

    def member_urls(self) -> dict[str, str]:
        """The nodes' URLs as a page last read them (none once NODE_URLS_TTL_S old)."""
        at, urls = self._member_urls
        return urls if time.monotonic() - at < NODE_URLS_TTL_S else {}

    def remember_member_urls(self, urls: dict[str, str]) -> None:
        self._member_urls = (time.monotonic(), dict(urls))

    # --- nodes --------------------------------------------------------------------------------
    def want_nodes(self, session: aiohttp.ClientSession, urls: dict[str, str]) -> None:
        """A page shows the nodes: keep (or start) reading their /metrics in the background."""
        self.session, self.node_urls, self.last_wanted = session, dict(urls), time.monotonic()
        for gone in set(self.nodes) - set(urls):
            del self.nodes[gone]
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="console-sampler")

    def node_points(self, node: str) -> list[NodeReading]:
        return list(self.nodes.get(node, ()))

    async def _run(self) -> None:
        while time.monotonic() - self.last_wanted < IDLE_STOP_S:
            largest = await self.sample_nodes()
            await asyncio.sleep(LARGE_SAMPLE_EVERY_S if largest > LARGE_METRICS_BYTES else NODE_SAMPLE_EVERY_S)

    async def sample_nodes(self) -> int:
        """Read every node's /metrics once; the length of the largest."""
        urls = dict(self.node_urls)
        texts = await asyncio.gather(*(self._metrics(url) for url in urls.values()))
        for node, text in zip(urls, texts, strict=True):
            if text is None:
                continue
            self.nodes.setdefault(node, collections.deque(maxlen=NODE_POINTS_MAX)).append(parse_metrics(text))
        return max((len(text) for text in texts if text is not None), default=0)

    async def _metrics(self, url: str) -> str | None:
        if self.session is None or self.session.closed:
            return None
        try:
            async with asyncio.timeout(FETCH_TIMEOUT_S), self.session.get(url.rstrip("/") + "/metrics") as answer:
                return await answer.text() if answer.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # --- queues -------------------------------------------------------------------------------
    def record_queue(self, name: str, enqueued: float, acked: float) -> None:
        now = time.monotonic()
        points = self.queues.get(name)
        if points is None:
            points = self.queues[name] = collections.deque(maxlen=QUEUE_POINTS_MAX)
            while len(self.queues) > QUEUES_TRACKED_MAX:
                self.queues.popitem(last=False)
        self.queues.move_to_end(name)
        if points and (now - points[-1][0] < QUEUE_SAMPLE_MIN_S or enqueued < points[-1][1]):
            if enqueued < points[-1][1]:       # a new incarnation, or stats from another member: afresh
                points.clear()
            else:
                return
        points.append((now, enqueued, acked))

    def queue_series(self, name: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        points = list(self.queues.get(name, ()))
        return [(t, e) for t, e, _ in points], [(t, a) for t, _, a in points]


_SAMPLERS: weakref.WeakKeyDictionary[Any, Sampler] = weakref.WeakKeyDictionary()


def sampler_of(console: Any) -> Sampler:
    """The console's sampler (one per console, that is per node)."""
    sampler = _SAMPLERS.get(console)
    if sampler is None:
        sampler = _SAMPLERS[console] = Sampler()
    return sampler


async def stop_sampler(console: Any) -> None:
    sampler = _SAMPLERS.pop(console, None)
    if sampler is not None:
        await sampler.stop()


def sparkline(values: list[float], width: int = 80, height: int = 18) -> dict[str, Any] | None:
    """The points of an inline SVG polyline for `values` (None: fewer than two values); drawn
    by the template, so every number is the server's and nothing runs in the browser."""
    if len(values) < 2:
        return None
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 1 - (v / top) * (height - 2):.1f}" for i, v in enumerate(values))
    return {"points": points, "width": width, "height": height, "top": top}
