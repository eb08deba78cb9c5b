"""Store-and-forward rate control, seed 003 §4 reproduced on two local clusters (issue 16; run by
hand, not in CI; loopback only; every run bounded in time).

    .venv/bin/python bench/bench_forward.py [--seeds 1,2,3] [--modes adaptive,static]
        [--scenario paper|all-burst] [--time-scale 10] [--start-s 2100] [--span-s 2700]
        [--out-dir bench/] [--quick] [--estimate]
    .venv/bin/python bench/bench_forward.py --plot-only bench/results-forward-DATE.jsonl [more.jsonl ...]

The paper's case (§4.2-4.4): three client queues mq1..mq3 (here `full` queues of a 2-node
source cluster, max_depth 200 = 1 MB / 5 KB) forward into one root queue (a `full` queue of a
2-node root cluster, max_depth 800 = 4 MB / 5 KB) from which a consumer removes a block of 25
messages every second (R = 25 messages/s = 1 Mbps / 5 KB); every T = 2 s the root hands out
the rates, Rᵢ = R·wᵢ/Σw from the fill levels the forwarders report (adaptive), or R/3 each
(static). Messages of 5 KB arrive at mqᵢ by pattern i: exponential gaps of mean 0.24 s (mq1),
0.2 s (mq3), and 0.24 s at mq2 but 0.075 s during the bursty period 2400-4200 s. An enqueue
refused E_QUEUE_FULL is the paper's overflow.

Scenarios (`--scenario`, issue 37 item 13): `paper` is §4.3 as above; `all-burst` is the
paper's stated limitation, all three clients bursting at once: mq1 and mq3 burst with mq2's
shape (their mean gap × 0.075/0.24) over the same period 2400-4200 s. Arrival means then:
mq1 and mq2 0.24 s → 0.075 s (4.17 → 13.3 messages/s), mq3 0.2 s → 0.0625 s (5 → 16
messages/s); 42.7 messages/s offered against R = 25 during the burst, so both modes must
overflow ~17.7 messages/s in all (the fluid bound, `expected_overflows`); what is compared is
how the overflows spread and whether adaptive loses anything to static there.

Time is compressed by `--time-scale` k: every rate ×k, every duration (the gaps, T, the
consumer's period) /k, so the queues' sizes in messages follow the paper's dynamics in
simulated seconds (what the plots and the JSON show; wall seconds = simulated / k). k is at
most 40 (the root's forward_interval_s is at least 0.05 s), and k = 1 is the paper's own time
scale (no compression: R = 25 messages/s, T = 2 s, one wall second per simulated second; a run
of the default window takes span + ~15 s of wall time, 2,715 s ≈ 45 min; `--estimate` prints
the plan's wall time without running it); the default 10 is what this
2-core machine sustains: at k = 20 the nodes' commits slow to where a forwarder (one data
message in flight, a token bucket of 0.1 s) falls short of its rate, and one told rate 0
looks again only every 0.1 s wall, a whole T; both cost the adaptive mode overflows the
paper's model does not have (bench/RESULTS.md). Only the window [start, start+span] of the
paper's time line runs (default 2100-4800 s: 300 s before the burst, 600 s after); the queues
start empty at its start (before the burst the queues reach their steady state within a few
tens of simulated seconds).

The generators are open loop: each arrival is sent at its own time whether or not the
enqueues before it were answered; how late the machine sent them (lag) and how long their
answers took are recorded. Each run (mode, seed) gets two fresh clusters, killed at its end
(also on Ctrl-C or an error). One JSON line per run goes to results-forward-DATE.jsonl in
--out-dir as soon as the run ends (with the series the plots are drawn from, the scenario and
k), and the four figures of the paper (9-12) to forward-fig*.png there. Fig. 11 draws the rate
mq2 achieved (what its forwarder stored at the root per simulated second, 60 s average) beside
the rate it was assigned. `--plot-only FILE...` draws from stored lines: one figure per
scenario (the all-burst ones as forward-all-burst-fig*.png), with one panel per time scale side
by side when the lines hold more than one (k = 1 beside k = 10, say).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from client import AsyncClient, QueueError  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402

# --- the paper's case (seed 003 §4.2, §4.3), in simulated seconds and messages ----------------------
MESSAGE_BYTES = 5_000           # "fixed at 5k bytes"
CLIENT_DEPTH_MAX = 200          # 1 Mbyte / 5 KB
ROOT_DEPTH_MAX = 800            # 4 Mbytes / 5 KB
ROOT_RATE = 25.0                # R = 1 Mbps = 25 messages of 5 KB per second
BLOCK_MESSAGES = 25             # the root's consumer removes a block of 25 messages ...
BLOCK_EVERY_S = 1.0             # ... every second
INTERVAL_S = 2.0                # T: how often the root computes the rates
BURST_S = (2400.0, 4200.0)      # pattern 2's bursty period
MEAN_GAP_S = {"mq1": 0.24, "mq2": 0.24, "mq3": 0.2}      # patterns 1, 2, 3 (exponential gaps)
BURST_GAP_S = {"mq2": 0.075}
SCENARIOS = {
    "paper": BURST_GAP_S,
    # The paper's limitation: every client bursts at once, each with mq2's shape (its gap × 0.075/0.24).
    "all-burst": {q: round(gap * BURST_GAP_S["mq2"] / MEAN_GAP_S["mq2"], 6) for q, gap in MEAN_GAP_S.items()},
}
SETUP_WALL_S = 15.0             # wall: two clusters started, the sessions open, all stopped (13-14 s measured)
MOVING_WINDOW_S = 60.0          # Fig. 12's moving average
QUEUES = ("mq1", "mq2", "mq3")
ROOT = "root"
MODES = ("adaptive", "static")
INTERVAL_MIN_S = 0.05           # replication/options.py: forward_interval_s >= 0.05 s, so k <= 40
SESSION_TIMEOUT_S = 30.0        # wall: every forwarder's session open before a run starts
DRAIN_TIMEOUT_S = 30.0          # wall: the generators' last answers after the window


@dataclass(frozen=True, slots=True)
class RunConfig:
    seed: int
    mode: str
    time_scale: float           # k: wall seconds = simulated seconds / k
    start_s: float              # the window of the paper's time line that runs (simulated)
    end_s: float
    sample_s: float = INTERVAL_S          # simulated: how often the queues and rates are read
    payload_bytes: int = MESSAGE_BYTES
    scenario: str = "paper"


@dataclass(frozen=True, slots=True)
class Plan:
    """What the options default to: the full benchmark, or the smoke run (--quick)."""
    time_scale: float
    start_s: float
    span_s: float
    seeds: str


FULL = Plan(time_scale=10.0, start_s=2100.0, span_s=2700.0, seeds="1,2,3")
QUICK = Plan(time_scale=10.0, start_s=2340.0, span_s=300.0, seeds="1")


# --- the arrival processes (pure) -------------------------------------------------------------------
def arrival_times(queue: str, seed: int, start_s: float, end_s: float, scenario: str = "paper") -> list[float]:
    """Pattern i at mqi (§4.3) within [start_s, end_s): a Poisson process whose rate changes at
    the bursty period's edges (memoryless: a gap that crosses an edge is drawn again from it).
    `scenario` names which queues burst (SCENARIOS); the paper's schedule is unchanged by it."""
    bursts = SCENARIOS[scenario]
    rng = random.Random(f"seed003:{seed}:{queue}")
    edges = sorted(BURST_S) if queue in bursts else []
    times: list[float] = []
    at = start_s
    while True:
        bursty = queue in bursts and BURST_S[0] <= at < BURST_S[1]
        mean_gap = bursts[queue] if bursty else MEAN_GAP_S[queue]
        following = at + rng.expovariate(1.0 / mean_gap)
        edge = next((e for e in edges if at < e), math.inf)
        if following >= edge:
            at = edge
            continue
        if following >= end_s:
            return times
        times.append(following)
        at = following


def expected_static_overflows(start_s: float, end_s: float) -> float:
    """The fluid arithmetic of §4.4 for static mode: during the burst mq2 gets 1/0.075 = 13.3
    messages/s and is sent R/3 = 8.3, so it fills its 200 and then refuses 5 messages/s (mq1
    and mq3, at loads 0.5 and 0.6, and mq2 outside the burst, overflow as good as never)."""
    burst_s = max(0.0, min(end_s, BURST_S[1]) - max(start_s, BURST_S[0]))
    excess = 1.0 / BURST_GAP_S["mq2"] - ROOT_RATE / len(QUEUES)
    return max(0.0, excess * burst_s - CLIENT_DEPTH_MAX)


def expected_overflows(start_s: float, end_s: float, scenario: str) -> float:
    """The fluid lower bound for any rate control: what arrives during the burst beyond R and
    beyond the room the client queues have (3 × 200; the root's own 800 fill too, at most)."""
    if scenario == "paper":
        return expected_static_overflows(start_s, end_s)
    burst_s = max(0.0, min(end_s, BURST_S[1]) - max(start_s, BURST_S[0]))
    offered = sum(1.0 / gap for gap in SCENARIOS[scenario].values())
    return max(0.0, (offered - ROOT_RATE) * burst_s - len(QUEUES) * CLIENT_DEPTH_MAX - ROOT_DEPTH_MAX)


def wall_estimate_s(span_s: float, time_scale: float, runs: int) -> float:
    """Wall seconds a plan takes: each run's window at k, and its clusters' start and stop."""
    return runs * (span_s / time_scale + SETUP_WALL_S)


def achieved_rates(times: Sequence[float], stored: Sequence[int | None]) -> list[float | None]:
    """Messages/s (simulated) a forwarder stored at the root between each sample and the one
    before (None at the first and where a sample lacks the count): Fig. 11's achieved rate."""
    rates: list[float | None] = [None]
    for i in range(1, len(times)):
        before, now = stored[i - 1], stored[i]
        span = times[i] - times[i - 1]
        rates.append(None if before is None or now is None or span <= 0 else (now - before) / span)
    return rates


def moving_average(times: Sequence[float], values: Sequence[float], window_s: float) -> list[float]:
    """The trailing mean over `window_s` of values sampled at `times` (Fig. 12's "continuous
    average of the ordinate value over intervals of a specified width")."""
    averages, total, first = [], 0.0, 0
    for i, (at, value) in enumerate(zip(times, values, strict=True)):
        total += value
        while times[first] <= at - window_s:
            total -= values[first]
            first += 1
        averages.append(total / (i - first + 1))
    return averages


def step_mean(changes: Sequence[tuple[float, float]], start_s: float, end_s: float) -> float | None:
    """The time-weighted mean over [start_s, end_s) of a step function given by its changes
    (time, value), sorted; None where it is not defined over the interval."""
    if end_s <= start_s:
        return None
    total, covered = 0.0, 0.0
    for i, (at, value) in enumerate(changes):
        until = changes[i + 1][0] if i + 1 < len(changes) else end_s
        low, high = max(at, start_s), min(until, end_s)
        if high > low:
            total += value * (high - low)
            covered += high - low
    return total / covered if covered else None


def percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# --- one run ------------------------------------------------------------------------------------------
class SimClock:
    """Simulated seconds against the event loop's clock (and the nodes' wall clock, which
    stamps the forwarders' rate traces)."""

    def __init__(self, config: RunConfig, lead_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.k, self.start_s = config.time_scale, config.start_s
        self.loop_at_start = loop.time() + lead_s
        self.epoch_at_start = time.time() + lead_s

    def loop_time(self, simulated_s: float) -> float:
        return self.loop_at_start + (simulated_s - self.start_s) / self.k

    def now(self) -> float:
        return self.start_s + (asyncio.get_running_loop().time() - self.loop_at_start) * self.k

    def from_epoch(self, epoch_s: float) -> float:
        return self.start_s + (epoch_s - self.epoch_at_start) * self.k


@dataclass
class Producer:
    """What one generator saw: its overflows (simulated arrival times), other refusals, and
    how late (wall seconds) each arrival was sent and answered."""
    queue: str
    sent: int = 0
    stored: int = 0
    overflows: list[float] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    send_lag_s: list[float] = field(default_factory=list)
    answer_s: list[float] = field(default_factory=list)


@dataclass
class Observed:
    samples: list[dict[str, Any]] = field(default_factory=list)
    mq2_rate_changes: dict[float, float] = field(default_factory=dict)    # simulated time -> messages/s (simulated)
    consumed: int = 0
    consumer_lag_s: list[float] = field(default_factory=list)
    sample_misses: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)   # the consumer's and sampler's


async def generate(client: AsyncClient, producer: Producer, times: list[float], clock: SimClock,
                   payload: bytes) -> None:
    """Open loop: each arrival is sent at its time, without waiting for the answers before it."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    async def one(arrival_s: float, due: float) -> None:
        try:
            await client.enqueue(producer.queue, payload)
            producer.stored += 1
        except QueueError as error:
            if error.code == "E_QUEUE_FULL":
                producer.overflows.append(arrival_s)
            else:
                producer.errors[error.code] += 1
        producer.answer_s.append(loop.time() - due)

    for arrival_s in times:
        due = clock.loop_time(arrival_s)
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        producer.send_lag_s.append(max(0.0, loop.time() - due))
        producer.sent += 1
        task = loop.create_task(one(arrival_s, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_TIMEOUT_S)


async def consume(client: AsyncClient, clock: SimClock, stop: asyncio.Event, observed: Observed) -> None:
    """The root's application server: a block of up to 25 messages every (simulated) second,
    on a fixed schedule (a late block is taken at once, not pushed back)."""
    loop = asyncio.get_running_loop()
    block = 0
    while not stop.is_set():
        due = clock.loop_time(clock.start_s + block * BLOCK_EVERY_S)
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        observed.consumer_lag_s.append(max(0.0, loop.time() - due))
        try:
            messages = await client.receive(ROOT, BLOCK_MESSAGES, wait_s=0)
            if messages:
                await asyncio.gather(*(message.ack() for message in messages))
            observed.consumed += len(messages)
        except QueueError as error:
            observed.errors[f"consumer {error.code}"] += 1
        block += 1


async def sample(source: AsyncClient, root: AsyncClient, clock: SimClock, config: RunConfig, stop: asyncio.Event,
                 observed: Observed) -> None:
    """Every sample_s (simulated): each forwarder's rate, weight and source depth, the root's
    depth, and mq2's rate changes from its trace (the root sends rates every T, more often
    than a poll could see them)."""
    loop = asyncio.get_running_loop()
    period_s = config.sample_s / config.time_scale
    tick = 0
    while not stop.is_set():
        due = clock.loop_at_start + tick * period_s
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        at = clock.now()
        try:
            *forwards, root_stats = await asyncio.gather(*(source.forward_stats(f"fwd-{q}") for q in QUEUES),
                                                         root.queue_stats(ROOT))
        except QueueError as error:
            observed.errors[f"sampler {error.code}"] += 1
            forwards = []
        if forwards:
            observed.samples.append(sample_row(at, forwards, root_stats, config.time_scale))
            for epoch_s, rate, _weight in forwards[1].get("rate_trace", []):
                if rate is not None:
                    observed.mq2_rate_changes[round(clock.from_epoch(epoch_s), 3)] = rate / config.time_scale
        following = tick + 1
        tick = max(following, math.ceil((loop.time() - clock.loop_at_start) / period_s))
        observed.sample_misses += tick - following


def sample_row(at: float, forwards: Sequence[dict[str, Any]], root_stats: dict[str, Any],
               time_scale: float) -> dict[str, Any]:
    row: dict[str, Any] = {"t": round(at, 2), "root": root_stats["depth"]}
    for queue, stats in zip(QUEUES, forwards, strict=True):
        rate = stats.get("rate")
        row[queue] = stats.get("source_depth")
        row[f"{queue}_rate"] = None if rate is None else round(rate / time_scale, 3)
        row[f"{queue}_weight"] = stats.get("weight")
        row[f"{queue}_overflows"] = stats.get("overflows")
        row[f"{queue}_stored"] = stats.get("stored")
    return row


async def open_sessions(source: AsyncClient) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    while time.monotonic() < deadline:
        stats = {q: await source.forward_stats(f"fwd-{q}") for q in QUEUES}
        if all(s.get("state") == "open" and s.get("rate") is not None for s in stats.values()):
            return stats
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the forwarders' sessions did not open within {SESSION_TIMEOUT_S:g} s")


async def set_up(source: AsyncClient, root: AsyncClient, root_cluster: LocalCluster, config: RunConfig) -> None:
    k = config.time_scale
    await root.create_queue(ROOT, strength="full", max_depth=ROOT_DEPTH_MAX, forward_rate=ROOT_RATE * k,
                            forward_interval_s=INTERVAL_S / k, forward_mode=config.mode)
    document = json.loads(root_cluster.credentials_path.read_text())
    credentials = {"client_id": document["client_id"], "private_key": document["private_key"]}
    for queue in QUEUES:
        await source.create_queue(queue, strength="full", max_depth=CLIENT_DEPTH_MAX)
        await source.create_forward(f"fwd-{queue}", queue, ROOT, urls=list(root_cluster.urls.values()),
                                    credentials=credentials)
    with contextlib.suppress(QueueError):
        await source.refresh_placement()
        await root.refresh_placement()
    await open_sessions(source)


async def measure(config: RunConfig, source_cluster: LocalCluster, root_cluster: LocalCluster) -> dict[str, Any]:
    async with AsyncClient(source_cluster.urls["n1"], source_cluster.credentials_path) as source, \
            AsyncClient(root_cluster.urls["n1"], root_cluster.credentials_path) as root:
        await set_up(source, root, root_cluster, config)
        schedules = {q: arrival_times(q, config.seed, config.start_s, config.end_s, config.scenario) for q in QUEUES}
        producers = {q: Producer(q) for q in QUEUES}
        observed = Observed()
        payload = b"m" * config.payload_bytes
        clock = SimClock(config, lead_s=0.2)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        watchers = [loop.create_task(consume(root, clock, stop, observed)),
                    loop.create_task(sample(source, root, clock, config, stop, observed))]
        started = time.monotonic()
        try:
            await asyncio.gather(*(generate(source, producers[q], schedules[q], clock, payload) for q in QUEUES))
            delay = clock.loop_time(config.end_s) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            stop.set()
            await asyncio.wait(watchers, timeout=DRAIN_TIMEOUT_S)
            for task in watchers:
                task.cancel()
        for task in watchers:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        wall_s = time.monotonic() - started
        final = {q: await source.forward_stats(f"fwd-{q}") for q in QUEUES}
        return summarize(config, producers, observed, final, wall_s)


# --- what a run yields ----------------------------------------------------------------------------------
def summarize(config: RunConfig, producers: dict[str, Producer], observed: Observed,
              final: dict[str, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    samples = observed.samples
    times = [row["t"] for row in samples]
    overflow_times = sorted(t for p in producers.values() for t in p.overflows)
    root_depths = [float(row["root"]) for row in samples]
    root_average = moving_average(times, root_depths, MOVING_WINDOW_S)
    changes = sorted(observed.mq2_rate_changes.items())
    in_burst = [row for row in samples if BURST_S[0] <= row["t"] < BURST_S[1]]
    lags = [lag for p in producers.values() for lag in p.send_lag_s]
    answers = [a for p in producers.values() for a in p.answer_s]
    k = config.time_scale
    achieved = achieved_rates(times, [row.get("mq2_stored") for row in samples])
    known = [(t, r) for t, r in zip(times, achieved, strict=True) if r is not None]
    achieved_average = moving_average([t for t, _ in known], [r for _, r in known], MOVING_WINDOW_S)
    return {
        "bench": "forward", "scenario": config.scenario, "mode": config.mode, "seed": config.seed, "time_scale": k,
        "arrival_mean_gap_s": {q: MEAN_GAP_S[q] for q in QUEUES},
        "burst_mean_gap_s": dict(SCENARIOS[config.scenario]), "burst_s": list(BURST_S),
        "expected_overflows": round(expected_overflows(config.start_s, config.end_s, config.scenario)),
        "start_s": config.start_s, "end_s": config.end_s, "payload_bytes": config.payload_bytes,
        "overflows": len(overflow_times),
        "overflows_by_queue": {q: len(p.overflows) for q, p in producers.items()},
        "overflows_in_burst": sum(BURST_S[0] <= t < BURST_S[1] for t in overflow_times),
        "overflows_source_stats": {q: final[q].get("overflows") for q in QUEUES},
        "expected_static_overflows": round(expected_static_overflows(config.start_s, config.end_s)),
        "arrivals": {q: p.sent for q, p in producers.items()},
        "stored": sum(p.stored for p in producers.values()),
        "other_refusals": dict(sum((p.errors for p in producers.values()), collections.Counter())),
        "observer_errors": dict(observed.errors),
        "forwarded": {q: final[q].get("stored") for q in QUEUES},
        "consumed": observed.consumed,
        "mq2_depth_max": max((row["mq2"] or 0 for row in samples), default=0),
        "mq2_depth_mean_burst": _mean(row["mq2"] for row in in_burst),
        "root_depth_mean": _mean(root_depths), "root_depth_max": max(root_depths, default=0.0),
        "root_moving_average_max": round(max(root_average, default=0.0), 1),
        "mq2_rate_mean_before_burst": _round(step_mean(changes, config.start_s, min(config.end_s, BURST_S[0]))),
        "mq2_rate_mean_burst": _round(step_mean(changes, max(config.start_s, BURST_S[0]),
                                                min(config.end_s, BURST_S[1]))),
        "mq2_rate_mean_after_burst": _round(step_mean(changes, max(config.start_s, BURST_S[1]), config.end_s)),
        "mq2_forwarded_rate_burst": _round(forwarded_rate(in_burst, "mq2")),
        "forwarded_rate_burst": {q: _round(forwarded_rate(in_burst, q)) for q in QUEUES},
        "send_lag_ms": _spread_ms(lags), "answer_ms": _spread_ms(answers),
        "consumer_lag_ms": _spread_ms(observed.consumer_lag_s),
        "samples": len(samples), "sample_misses": observed.sample_misses, "wall_s": round(wall_s, 1),
        "series": {
            "t": times, "mq1": [row["mq1"] for row in samples], "mq2": [row["mq2"] for row in samples],
            "mq3": [row["mq3"] for row in samples], "root": root_depths,
            "root_moving_average": [round(v, 2) for v in root_average],
            "overflows": [bisect.bisect_right(overflow_times, t) for t in times],
            "mq2_rate": [row["mq2_rate"] for row in samples], "mq2_weight": [row["mq2_weight"] for row in samples],
            "mq2_achieved": [None if r is None else round(r, 3) for r in achieved],
            "mq2_achieved_average": {"t": [t for t, _ in known], "rate": [round(v, 3) for v in achieved_average]},
            "mq2_rate_changes": [[at, round(rate, 3)] for at, rate in changes
                                 if config.start_s - 10 * INTERVAL_S <= at <= config.end_s],
        },
    }


def forwarded_rate(rows: Sequence[dict[str, Any]], queue: str) -> float | None:
    """Messages/s (simulated) the queue's forwarder stored at the root between the first and
    the last of `rows` (what it achieved, against the rate it was given)."""
    if len(rows) < 2 or rows[0].get(f"{queue}_stored") is None or rows[-1].get(f"{queue}_stored") is None:
        return None
    return (rows[-1][f"{queue}_stored"] - rows[0][f"{queue}_stored"]) / (rows[-1]["t"] - rows[0]["t"])


def _mean(values: Any) -> float:
    listed = [float(v) for v in values if v is not None]
    return round(statistics.fmean(listed), 1) if listed else 0.0


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _spread_ms(values: Sequence[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.5) * 1000, 1), "p99": round(percentile(values, 0.99) * 1000, 1),
            "max": round(max(values, default=0.0) * 1000, 1)}


# --- clusters -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def two_clusters(work_dir: Path) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """A source and a root cluster of 2 nodes each (a pair needs two), killed on the way out,
    whatever ends the run (the nodes run in their own sessions: a Ctrl-C does not reach them)."""
    clusters = [LocalCluster(work_dir / "source", 2), LocalCluster(work_dir / "root", 2)]
    try:
        for cluster in clusters:
            cluster.start_all()
        yield clusters[0], clusters[1]
    finally:
        for cluster in clusters:
            for node in list(cluster.processes):
                cluster.kill(node)


def run_one(config: RunConfig) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qbench-forward-") as work:
        with two_clusters(Path(work)) as (source, root):
            result = asyncio.run(measure(config, source, root))
        result["run_wall_s"] = round(time.monotonic() - started, 1)     # with the clusters' start and stop
        result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)  # others' work on the machine shows here
        return result


def run_all(seeds: Sequence[int], modes: Sequence[str], time_scale: float, start_s: float, span_s: float,
            results_path: Path | None, scenario: str = "paper") -> list[dict[str, Any]]:
    """Each run's line is appended to the results file as soon as it ends (a long plan
    interrupted keeps the runs it finished)."""
    results = []
    for seed in seeds:
        for mode in modes:
            config = RunConfig(seed, mode, time_scale, start_s, start_s + span_s, scenario=scenario)
            result = run_one(config)
            line = json.dumps(result)
            if results_path is not None:
                with results_path.open("a") as out:
                    out.write(line + "\n")
            print(json.dumps({key: value for key, value in result.items() if key != "series"}), flush=True)
            results.append(result)
    return results


# --- the table and the figures -----------------------------------------------------------------------------
def table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: overflows per scenario, time scale, seed and mode, and adaptive / static (a
    line stored before scenarios existed is the paper's)."""
    by_seed: dict[tuple[str, float, int], dict[str, int]] = collections.defaultdict(dict)
    for result in results:
        key = (result.get("scenario", "paper"), result["time_scale"], result["seed"])
        by_seed[key][result["mode"]] = result["overflows"]
    lines = ["| scenario | k | seed | adaptive | static | adaptive / static |", "|---|---|---|---|---|---|"]
    for (scenario, k, seed), counts in sorted(by_seed.items()):
        adaptive, static = counts.get("adaptive"), counts.get("static")
        ratio = f"{adaptive / static:.3f}" if adaptive is not None and static else "-"
        lines.append(f"| {scenario} | {k:g} | {seed} | {adaptive} | {static} | {ratio} |")
    for scenario, k in sorted({(s, k) for s, k, _ in by_seed}):
        group = [c for (s, kk, _), c in by_seed.items() if (s, kk) == (scenario, k)]
        total = {mode: sum(c.get(mode, 0) for c in group) for mode in MODES}
        if total["static"] and len(group) > 1:
            lines.append(f"| {scenario} | {k:g} | all | {total['adaptive']} | {total['static']} | "
                         f"{total['adaptive'] / total['static']:.3f} |")
    return "\n".join(lines)


FIGURES = {
    "forward-fig9-overflows.png": ("Fig. 9: cumulative overflowed messages (all client queues)", "overflows",
                                   "messages refused (E_QUEUE_FULL)"),
    "forward-fig10-mq2-size.png": ("Fig. 10: size of client queue mq2", "mq2", "messages (×5 KB)"),
    "forward-fig11-mq2-rate.png": ("Fig. 11: mq2's sending rate", "mq2_rate", "messages/s (×40 kbit/s)"),
    "forward-fig12-root-average.png": ("Fig. 12: root queue size, 60 s moving average", "root_moving_average",
                                       "messages (×5 KB)"),
}
COLORS = {"adaptive": "tab:blue", "static": "tab:red"}
LABELS = {"adaptive": "with control (adaptive)", "static": "without control (static R/3)"}


def plot(results: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """The paper's four figures per scenario, adaptive against static; the first seed drawn
    solid, the others faint; x in the paper's simulated seconds. Runs at several time scales
    are drawn side by side, one panel per k (the uncompressed k = 1 beside the compressed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for scenario in sorted({r.get("scenario", "paper") for r in results}):
        runs = [r for r in results if r.get("scenario", "paper") == scenario]
        scales = sorted({r["time_scale"] for r in runs})
        prefix = "forward-" if scenario == "paper" else f"forward-{scenario}-"
        who = "mq2" if scenario == "paper" else "all clients"
        for name, (title, key, ylabel) in FIGURES.items():
            figure, panels = plt.subplots(1, len(scales), figsize=(8 * len(scales), 4.5), squeeze=False,
                                          sharey=True)
            for axes, k in zip(panels[0], scales, strict=True):
                here = [r for r in runs if r["time_scale"] == k]
                first_seed = min(r["seed"] for r in here)
                axes.axvspan(*BURST_S, color="0.92", label=f"bursty period ({who})")
                for result in sorted(here, key=lambda r: (r["mode"], r["seed"])):
                    draw(axes, result, key, first=result["seed"] == first_seed)
                if key == "mq2":
                    axes.axhline(CLIENT_DEPTH_MAX, color="0.4", linestyle=":", linewidth=1, label="max_depth 200")
                if key == "mq2_rate":
                    axes.axhline(ROOT_RATE, color="0.4", linestyle=":", linewidth=1, label="R = 25")
                scale = "paper's time scale (k = 1)" if k == 1 else f"time compressed k = {k:g}"
                seeds = ",".join(str(s) for s in sorted({r["seed"] for r in here}))
                axes.set_title(f"{title}\n{scenario}, {scale}, seeds {seeds}", fontsize=10)
                axes.set_xlabel("simulated time (s)")
                axes.set_ylabel(ylabel)
                axes.set_xlim(min(r["start_s"] for r in here), max(r["end_s"] for r in here))
                axes.legend(loc="upper left", fontsize=7)
            figure.tight_layout()
            path = out_dir / (prefix + name.removeprefix("forward-"))
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)
    return written


def draw(axes: Any, result: dict[str, Any], key: str, *, first: bool) -> None:
    """One run's curve. The rate (Fig. 11) changes every T, between 0 and R in adaptive mode:
    the first seed's steps are drawn faint under each run's 60 s moving average."""
    mode, series = result["mode"], result["series"]
    label = f"{LABELS.get(mode, mode)}, seed {result['seed']}" if first else None
    style: dict[str, Any] = {"color": COLORS.get(mode, "k"), "linewidth": 1.6 if first else 0.8,
                             "alpha": 1.0 if first else 0.35}
    changes = series.get("mq2_rate_changes")
    if key != "mq2_rate" or not changes:
        axes.plot(series["t"], [math.nan if v is None else v for v in series[key]], label=label, **style)
        return
    times, rates = rate_grid(changes, result["start_s"], result["end_s"])
    if first:
        axes.step(times, rates, where="post", color=style["color"], linewidth=0.5, alpha=0.3)
    axes.plot(times, moving_average(times, rates, MOVING_WINDOW_S),
              label=None if label is None else f"{label}: assigned (60 s average)", **style)
    achieved = series.get("mq2_achieved_average")
    if achieved and achieved["t"]:
        # What mq2's forwarder stored at the root: below the assigned rate when the machine
        # (or an empty mq2) held it back.
        axes.plot(achieved["t"], achieved["rate"], linestyle="--",
                  label=None if label is None else f"{label}: achieved (60 s average)", **style)


def rate_grid(changes: Sequence[Sequence[float]], start_s: float, end_s: float,
              step_s: float = 1.0) -> tuple[list[float], list[float]]:
    """The rate's step function read every step_s (simulated) over [start_s, end_s)."""
    at = [change[0] for change in changes]
    times = [start_s + i * step_s for i in range(int((end_s - start_s) / step_s))]
    rates = [changes[max(0, bisect.bisect_right(at, t) - 1)][1] for t in times]
    return times, rates


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=None, help=f"comma-separated (default {FULL.seeds})")
    parser.add_argument("--modes", default="adaptive,static")
    parser.add_argument("--time-scale", type=float, default=None,
                        help=f"k, at most {INTERVAL_S / INTERVAL_MIN_S:g} (default {FULL.time_scale:g})")
    parser.add_argument("--start-s", type=float, default=None,
                        help=f"simulated start of the window (default {FULL.start_s:g})")
    parser.add_argument("--span-s", type=float, default=None,
                        help=f"simulated length of the window (default {FULL.span_s:g})")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: k={QUICK.time_scale:g}, {QUICK.start_s:g}-"
                             f"{QUICK.start_s + QUICK.span_s:g} s, seed {QUICK.seeds}")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="paper",
                        help="paper: mq2 bursts (§4.3); all-burst: all three burst at once (the paper's limitation)")
    parser.add_argument("--no-results", action="store_true", help="append no JSON line to the results file")
    parser.add_argument("--estimate", action="store_true", help="print the plan's wall time and stop")
    parser.add_argument("--plot-only", type=Path, nargs="+", default=None,
                        help="draw the figures from results files (runs of several k: side by side)")
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        results = [json.loads(line) for path in args.plot_only for line in path.read_text().splitlines()
                   if line.strip()]
        results = [r for r in results if r.get("bench") == "forward"]
        if not results:
            parser.error("no results lines of this bench in " + ", ".join(map(str, args.plot_only)))
        args.out_dir.mkdir(parents=True, exist_ok=True)
    else:
        plan = QUICK if args.quick else FULL
        time_scale = plan.time_scale if args.time_scale is None else args.time_scale
        if not 1 <= time_scale <= INTERVAL_S / INTERVAL_MIN_S:
            parser.error(f"--time-scale is in [1, {INTERVAL_S / INTERVAL_MIN_S:g}] (1: the paper's own time)")
        modes = [m for m in args.modes.split(",") if m]
        if not modes or any(m not in MODES for m in modes):
            parser.error(f"--modes are among {', '.join(MODES)}")
        seeds = [int(s) for s in (args.seeds or plan.seeds).split(",") if s]
        span_s = plan.span_s if args.span_s is None else args.span_s
        estimate = wall_estimate_s(span_s, time_scale, len(seeds) * len(modes))
        print(f"plan: {len(seeds) * len(modes)} runs ({args.scenario}, k = {time_scale:g}, {span_s:g} simulated s "
              f"each): about {estimate / 60:.0f} min of wall time", flush=True)
        if args.estimate:
            return
        args.out_dir.mkdir(parents=True, exist_ok=True)
        results_path = None if args.no_results else \
            args.out_dir / f"results-forward-{datetime.date.today().isoformat()}.jsonl"
        results = run_all(seeds, modes, time_scale, plan.start_s if args.start_s is None else args.start_s,
                          span_s, results_path, args.scenario)
    print(table(results))
    for path in plot(results, args.out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
