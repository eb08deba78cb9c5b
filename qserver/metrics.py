"""Prometheus text exposition without a dependency: counters and fixed-bucket histograms."""
from __future__ import annotations

import asyncio
import bisect
import collections
import gc
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger("qserver.metrics")


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.samples = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.samples += 1

    def render(self, label: str = "", header: bool = True) -> list[str]:
        """`label`: one `key="value"` every sample carries (several histograms of one family,
        each rendered with its own label and only the first with the header)."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"] if header else []
        prefix, only = (label + ",", "{" + label + "}") if label else ("", "")
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{self.name}_bucket{{{prefix}le="{bound:g}"}} {running}')
        lines.append(f'{self.name}_bucket{{{prefix}le="+Inf"}} {self.samples}')
        lines.append(f"{self.name}_sum{only} {self.total:.6f}")
        lines.append(f"{self.name}_count{only} {self.samples}")
        return lines


def label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_family(name: str, kind: str, help_text: str, samples: Sequence[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        rendered = ",".join(f'{key}="{label_value(val)}"' for key, val in labels.items())
        lines.append(f"{name}{{{rendered}}} {value:g}" if rendered else f"{name} {value:g}")
    return lines


class LoopLag:
    """How late the event loop runs a timer: a task asks to wake every INTERVAL_S and records
    how much later it did (whatever held the loop meanwhile: a long callback, a collection, a
    step of the engine). A node's lease is 800 ms: lag near it lapses the node's own lease."""
    INTERVAL_S = 0.05
    WINDOW_S = 10.0

    def __init__(self) -> None:
        self.histogram = Histogram("qserver_loop_lag_seconds", "how late the event loop ran a timer",
                                   (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
        self._recent: collections.deque[tuple[float, float]] = collections.deque()   # (when, lag)
        self.max_ever_s = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.INTERVAL_S)
            now = loop.time()
            lag = max(0.0, now - asked - self.INTERVAL_S)
            self.histogram.observe(lag)
            self.max_ever_s = max(self.max_ever_s, lag)
            self._recent.append((now, lag))
            while self._recent[0][0] < now - self.WINDOW_S:
                self._recent.popleft()

    def recent_max_s(self) -> float:
        return max((lag for _, lag in self._recent), default=0.0)

    def render(self) -> list[str]:
        return self.histogram.render() + render_family(
            "qserver_loop_lag_max_seconds", "gauge", f"the longest loop lag of the last {self.WINDOW_S:g} s",
            [({}, self.recent_max_s())])


class CollectorPauses:
    """How long Python's cyclic collector held the process, per generation (gc.callbacks): a
    collection of the oldest generation walks every object a node keeps (every queue's core
    and role), and shows as loop lag nothing else explains. One that takes longer than
    LOG_OVER_S is logged. The collector is the process's: one instance (COLLECTOR_PAUSES)
    counts for every node the process runs (tests run several), installed while any runs."""
    LOG_OVER_S = 0.1

    def __init__(self) -> None:
        self.histograms = [Histogram("qserver_gc_pause_seconds", "how long the cyclic collector held the process, "
                                     "by generation", (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)) for _ in range(3)]
        self._started = 0.0
        self._users = 0

    def install(self) -> None:
        self._users += 1
        if self._users == 1:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0 and self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = int(info.get("generation", 0))
        self.histograms[min(generation, 2)].observe(took)
        if took > self.LOG_OVER_S and not sys.is_finalizing():
            log.warning("a collection of generation %d took %.3f s (%d objects collected)", generation, took,
                        int(info.get("collected", 0)))

    def render(self) -> list[str]:
        lines: list[str] = []
        for generation, histogram in enumerate(self.histograms):
            lines += histogram.render(f'generation="{generation}"', header=generation == 0)
        return lines


COLLECTOR_PAUSES = CollectorPauses()
