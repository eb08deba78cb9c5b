"""`qctl node stats`: one node's statistics in one call (GET /v1/node, docs/PROTOCOL.md)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from client.http import HttpClient
from client.qctl_render import Handler, Outcome, duration_text, format_table
from wire.errors import E_FEATURE_DISABLED, E_NOT_FOUND, QueueError


async def node_stats(http: HttpClient) -> dict[str, Any]:
    """GET /v1/node; a node of 0.2.0 or older has no such route (E_FEATURE_DISABLED)."""
    try:
        return dict(await http._json("GET", "/v1/node"))
    except QueueError as error:
        if error.code == E_NOT_FOUND.code:
            raise QueueError(E_FEATURE_DISABLED, "this node has no GET /v1/node (release 0.3.0 or later has it)") \
                from error
        raise


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / (1 << 20):.1f} MiB"


def render_node_stats(stats: dict[str, Any]) -> str:
    queues, clients, rates = stats["queues"], stats["clients"], stats["rates"]
    storage, lease, lag = stats["storage"], stats["lease"], stats["loop_lag"]
    membership, cluster_map = stats.get("membership") or {}, stats.get("map") or {}
    failed = queues["failed"]
    lines = [
        f"node {stats['node']} ({stats['url']}), release {stats['release']}, up {duration_text(stats['uptime_s'])}",
        f"queues: {queues['mastered']['count']} mastered, {queues['replicated']['count']} replicated, "
        f"{failed['count']} FAILED" + (f" ({', '.join(failed['names'])})" if failed["names"] else ""),
        f"clients: {clients['connections']} connections, {clients['distinct_clients']} distinct clients "
        f"({clients['producing']} producing, {clients['consuming']} consuming)",
        f"rates: {rates['enqueued_per_s']:g} enqueued/s, {rates['acked_per_s']:g} acked/s "
        f"(over {rates['window_s']:g} s)",
        f"storage: file {_mib(storage['file_bytes'])}, map {_mib(storage['map_bytes'])} of at most "
        f"{_mib(storage['map_size_max_bytes'])}, used {_mib(storage['used_bytes'])}, "
        f"disk free {_mib(storage['disk_free_bytes'])}" + (f", FULL: {storage['full']}" if storage["full"] else ""),
        f"loop lag: {lag['recent_max_s'] * 1000:.1f} ms max in {lag['window_s']:g} s, {lag['max_s'] * 1000:.1f} ms ever",
        "lease: " + ("held" if lease["held"] else "NOT HELD") + (
            f" ({lease['remaining_ms']} ms left)" if lease.get("remaining_ms") is not None else " (a node alone)"),
    ]
    if membership:
        lines.append(f"membership: {membership.get('role')}, term {membership.get('term')}, "
                     f"leader {membership.get('leader') or 'none'}")
    if cluster_map:
        lines.append(f"map: version {cluster_map['version']}, {cluster_map['queues']} queues, {cluster_map['nodes']} "
                     f"nodes, {cluster_map['raft_log_entries']} Raft log entries, feature level "
                     f"{cluster_map['feature_level']}")
    return "\n".join(lines)


async def cmd_node_stats(http: HttpClient, args: argparse.Namespace) -> Outcome:
    stats = await node_stats(http)
    return Outcome(stats, render_node_stats(stats))


def add_node_stats_parser(one_node: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """`qctl node stats` under `qctl node` (the node asked is --url's, or the credentials')."""
    command(one_node, "stats", cmd_node_stats,
            "the statistics of the node asked (--url): queues mastered, replicated and FAILED, clients, rates, "
            "storage, map, loop lag, lease, membership (GET /v1/node)")


def failed_queues(document: Any) -> list[tuple[str, dict[str, Any]]]:
    """The queues a `qctl status` document shows FAILED: the map's entries in a cluster (GET
    /v1/cluster), the statistics of a node alone."""
    queues = document.get("queues") if isinstance(document, dict) else None
    if isinstance(queues, dict):
        found = list(queues.items())
    elif isinstance(queues, list):
        found = [(str(stats.get("name")), stats) for stats in queues if isinstance(stats, dict)]
    else:
        return []
    return sorted((name, entry) for name, entry in found if isinstance(entry, dict) and entry.get("failed_reason"))


def with_failed_queues(handler: Handler) -> Handler:
    """`qctl status` with the queues that cannot serve listed last: reason, since when, detail."""
    async def status(http: HttpClient, args: argparse.Namespace) -> Outcome:
        outcome = await handler(http, args)
        failed = failed_queues(outcome.document)
        if not failed:
            return outcome
        now_s = time.time()
        table = format_table(["FAILED QUEUE", "REASON", "SINCE", "DETAIL"], [
            [name, entry["failed_reason"], f"{duration_text(now_s - entry.get('failed_since_ms', 0) / 1000)} ago",
             entry.get("failed_detail") or ""] for name, entry in failed])
        return Outcome(outcome.document, f"{outcome.human}\n\n{table}", outcome.shortfall)
    return status
