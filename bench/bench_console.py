"""The console's pages at many queues (issue 35, "Measures": each page within 100 ms at 1,000
queues, and paging at 10,000).

On a local cluster of 3 real `qserver` processes on loopback (run by hand, not in CI; the
cluster lives in a temporary directory, removed at the end unless --keep):

    .venv/bin/python bench/bench_console.py [--queues 1000] [--large 10000] [--repeat 20] [--out FILE]

Queues are created as bench/bench_scale.py creates them (signed REST `PUT /v1/queues/{q}` at
n1, `full`, 16 in flight). Signed in as the admin (a sign-in link, as `qctl console` prints),
each page is asked --repeat times, one at a time, at n1: the queues page (the first page, a
filtered page, the 10th page reached through the `next` links), a queue's page (with 50
messages to browse) and the cluster page; then, with --large queues, the first and the last
queues pages. The time is the whole request on loopback (the client's share is well under a
millisecond): an upper bound of the node's time. Before measuring, the bench waits until every
pair is in sync, and asks each page 3 times unmeasured. One JSON line per page with the median and
p95, printed and appended to --out (default bench/results-console-<date>.jsonl).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_scale import bounded_gather, git_commit  # noqa: E402
from client.aio import AsyncClient  # noqa: E402
from client.credentials import load_credentials  # noqa: E402
from client.http import HttpClient  # noqa: E402
from qserver.dev.devcluster import LocalCluster  # noqa: E402
from wire.console_link import signin_link  # noqa: E402
from wire.errors import QueueError  # noqa: E402

TARGET_MS = 100.0
CREATE_CONCURRENCY = 16


def queue_name(index: int) -> str:
    return f"cq-{index:05d}"


async def create_queues(http: HttpClient, names: list[str]) -> tuple[float, list[str]]:
    """Create `names`; the time it took and the names whose create failed five times (reported:
    the pages are measured all the same)."""
    started = time.perf_counter()
    failed: list[str] = []

    def creator(name: str) -> Any:
        async def create() -> None:
            for attempt in range(5):        # creating is idempotent: a create that timed out is asked again
                try:
                    async with asyncio.timeout(60):
                        await http.create_queue(name, strength="full")
                    return
                except QueueError as error:
                    if error.code != "E_TIMEOUT":
                        raise
                    print(f"create {name}: {error} (attempt {attempt + 1})", file=sys.stderr, flush=True)
            failed.append(name)
        return create
    await bounded_gather((creator(name) for name in names), CREATE_CONCURRENCY)
    return time.perf_counter() - started, failed


async def settled(http: HttpClient, timeout_s: float = 120.0) -> float:
    """Wait until every pair is in sync (the creates' state transfers are over): pages measured
    meanwhile would measure the cluster's catching up. The seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if (await http.cluster_summary())["counts"]["out_of_sync"] == 0:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)
    return time.perf_counter() - started


async def timed(browser: aiohttp.ClientSession, url: str, repeat: int) -> tuple[dict[str, Any], str]:
    times: list[float] = []
    text = ""
    for _ in range(3):        # warm up (the first asks open the node's connections to the others)
        async with browser.get(url, allow_redirects=False) as answer:
            await answer.read()
    for _ in range(repeat):
        started = time.perf_counter()
        async with browser.get(url, allow_redirects=False) as answer:
            text = await answer.text()
            if answer.status != 200:
                raise RuntimeError(f"{url}: {answer.status} {text[:500]}")
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
    return {"count": len(times), "median_ms": round(statistics.median(times), 2), "p95_ms": round(p95, 2),
            "max_ms": round(times[-1], 2)}, text


def next_link(text: str) -> str:
    found = re.search(r'<a id="next" href="([^"]*)"', text)
    if found is None:
        raise RuntimeError("no next link")
    return found.group(1).replace("&amp;", "&")


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.commit, self.dirty = git_commit()

    def line(self, **fields: Any) -> None:
        record = {"bench": "console", **fields, "commit": self.commit, "dirty": self.dirty,
                  "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        print(json.dumps(record), flush=True)
        with self.out.open("a") as sink:
            sink.write(json.dumps(record) + "\n")


async def measure(args: argparse.Namespace, cluster: LocalCluster, report: Report) -> None:
    credentials = load_credentials(cluster.credentials_path)
    url = cluster.urls["n1"]
    async with HttpClient(url, credentials.signer()) as http, \
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        seconds, failed = await create_queues(http, [queue_name(i) for i in range(args.queues)])
        report.line(measure="create", queues=args.queues, seconds=round(seconds, 2), failed=failed)
        async with AsyncClient(url, cluster.credentials_path) as client:
            await client.enqueue_many(queue_name(7), [json.dumps({"n": i}).encode() for i in range(60)])
        async with browser.get(signin_link(url, credentials.signer()), allow_redirects=False) as answer:
            assert answer.status == 303, answer.status
        report.line(measure="settle", queues=args.queues, seconds=round(await settled(http), 2))

        async def one(page: str, path: str, queues: int, target: float | None = TARGET_MS) -> str:
            figures, text = await timed(browser, url + path, args.repeat)
            met = None if target is None else figures["p95_ms"] <= target
            report.line(measure="page", page=page, path=path, queues=queues, **figures, target_ms=target, met=met)
            return text

        first = await one("queues, first page", "/console/queues", args.queues)
        await one("queues, filtered", "/console/queues?q=cq-004", args.queues)
        path, text = "/console/queues", first
        for _ in range(9):
            path = next_link(text)
            async with browser.get(url + path) as answer:
                text = await answer.text()
        await one("queues, page 10", path, args.queues)
        queue_text = await one("queue (50 messages browsed)", "/console/queues/" + queue_name(7), args.queues)
        await one("message (JSON view)", f"/console/queues/{queue_name(7)}/messages/{first_message(queue_text)}"
                  "?view=json", args.queues)
        await one("cluster", "/console/cluster", args.queues)
        if args.large > args.queues:
            seconds, failed = await create_queues(http, [queue_name(i) for i in range(args.queues, args.large)])
            report.line(measure="create", queues=args.large - args.queues, seconds=round(seconds, 2), failed=failed)
            report.line(measure="settle", queues=args.large, seconds=round(await settled(http), 2))
            await one("queues, first page", "/console/queues", args.large, None)
            await one("queues, last page", "/console/queues?before=cr", args.large, None)
            await one("queues, filtered", "/console/queues?q=cq-0999", args.large, None)
            await one("cluster", "/console/cluster", args.large, None)


def first_message(text: str) -> str:
    found = re.search(r'<tr data-message="(\d+)"', text)
    return found.group(1) if found else "1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--large", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / f"results-console-{datetime.date.today().isoformat()}.jsonl")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    report = Report(args.out)
    root = Path(tempfile.mkdtemp(prefix="bench-console-"))
    cluster = LocalCluster(root, 3)
    try:
        cluster.start_all()
        asyncio.run(measure(args, cluster, report))
    finally:
        cluster.kill_all()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
