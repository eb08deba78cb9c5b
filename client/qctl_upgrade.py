"""`qctl` commands of upgrades: `cluster versions` (what every node runs) and `cluster finalize`
(raise the cluster feature level once every node supports it): docs/OPERATIONS.md, "The
cluster feature level". Also what `qctl status` shows of them: each node's release and the
cluster's level.

One of the command groups client/qctl.py's parser dispatches to (each a coroutine of the
HttpClient and the parsed arguments that returns an Outcome: qctl_render.py).
"""
from __future__ import annotations

import argparse
from typing import Any

from client.http import HttpClient
from client.qctl_render import Outcome, format_table
from wire import versions
from wire.errors import QueueError


def _levels(found: dict[str, Any]) -> str:
    levels = found.get("feature_levels")
    return f"{levels[0]}-{levels[1]}" if isinstance(levels, list) and len(levels) == 2 else "-"


def _protocols(found: dict[str, Any]) -> str:
    protocols = found.get("protocols")
    if not isinstance(protocols, dict):
        return "-"
    return " ".join(f"{link}:{speaks}" for link, speaks in sorted(protocols.items()))


def level_line(level: Any, finalizable_to: Any = None) -> str:
    """The status line of the cluster's feature level, with what finalize would do."""
    line = f"cluster feature level: {level}"
    if isinstance(level, int) and isinstance(finalizable_to, int) and finalizable_to > level:
        line += f" (every node supports {finalizable_to}: `qctl cluster finalize` raises it)"
    return line


async def cmd_cluster_versions(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.cluster_versions()
    nodes = answer.get("nodes", [])
    rows = [[found.get("id"), found.get("state"), found.get("release") if found.get("reachable") else "unreachable",
             found.get("storage_layout"), _levels(found), _protocols(found)] for found in nodes]
    table = format_table(["NODE", "STATE", "RELEASE", "LAYOUT", "FEATURE_LEVELS", "PROTOCOLS"], rows)
    lines = [level_line(answer.get("feature_level"), answer.get("finalizable_to")), "", table]
    unreachable = [f"{found.get('id')}: {found.get('error', 'no answer')}" for found in nodes
                   if not found.get("reachable")]
    if unreachable:
        lines += ["", "not answering (a finalize waits for them): " + "; ".join(unreachable)]
    return Outcome(answer, "\n".join(lines))


async def cmd_cluster_finalize(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.finalize_cluster(args.level)
    releases = answer.get("releases", {})
    running = ", ".join(f"{node} {release}" for node, release in sorted(releases.items()))
    if answer.get("changed"):
        human = f"cluster feature level raised from {answer.get('previous')} to {answer.get('level')} ({running})"
    else:
        human = f"the cluster runs at feature level {answer.get('level')} already: nothing to do ({running})"
    return Outcome(answer, human)


async def node_releases(http: HttpClient) -> dict[str, Any]:
    """`qctl status`'s one call for versions: {"feature_level", "finalizable_to", "releases":
    node -> release}; empty when the node asked predates the call (release 0.1.0) or refuses it."""
    try:
        answer = await http.cluster_versions()
    except QueueError:
        return {}
    releases = {str(found.get("id")): (found.get("release") if found.get("reachable") else "unreachable")
                for found in answer.get("nodes", []) if isinstance(found, dict)}
    return {"feature_level": answer.get("feature_level"), "finalizable_to": answer.get("finalizable_to"),
            "releases": releases}


def add_releases(nodes: list[dict[str, Any]], found: dict[str, Any]) -> None:
    """Each node of a status document gets its `release` (None: not known)."""
    releases = found.get("releases", {})
    for node in nodes:
        node["release"] = releases.get(node.get("id"))


def add_parser(commands: Any, command: Any) -> None:
    """`qctl cluster versions` and `qctl cluster finalize [--level N]` (client/qctl.py's
    `command` makes each subcommand with the global options)."""
    cluster = commands.add_parser("cluster", help="versions of every node and the cluster feature level")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    command(cluster_commands, "versions", cmd_cluster_versions,
            "every node's release, storage layout, protocols and feature levels, and the cluster feature level")
    finalize = command(cluster_commands, "finalize", cmd_cluster_finalize,
                       "raise the cluster feature level once every node runs a release that supports it (refused "
                       "with the nodes that lag before that; it never goes down)")
    finalize.add_argument("--level", type=int, default=None,
                          help=f"the level to raise it to (default: the highest the node's release runs at, "
                               f"{versions.FEATURE_LEVEL} for {versions.RELEASE})")


def with_release(headers: list[str], rows: list[list[Any]], nodes: list[dict[str, Any]]
                 ) -> tuple[list[str], list[list[Any]]]:
    """A status node table with a RELEASE column, when any node's release is known (a node
    of release 0.1.0 answering status knows none)."""
    if not any(node.get("release") for node in nodes):
        return headers, rows
    return [*headers, "RELEASE"], [[*row, node.get("release")] for row, node in zip(rows, nodes, strict=True)]


def status_level_lines(document: dict[str, Any], found: dict[str, Any] | None = None) -> list[str]:
    """`qctl status`'s line of the cluster feature level (none when the node answering does
    not name it: release 0.1.0)."""
    level = document.get("feature_level", (found or {}).get("feature_level"))
    return [] if level is None else [level_line(level, (found or {}).get("finalizable_to"))]
