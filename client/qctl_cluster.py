"""`qctl` commands of the cluster as a whole: status, handoff, promote, queue move, rebalance,
journal export, nodes (add, drain, undrain, remove), node (the maintenance drain and undrain)
and clients (add, list, remove).

One of the command groups client/qctl.py's parser dispatches to (each a coroutine of the
HttpClient and the parsed arguments that returns an Outcome: qctl_render.py).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from client.credentials import Credentials, save_credentials
from client.http import HttpClient
from client.qctl_render import Outcome, format_fields, format_grants, format_table, queue_table
from client.qctl_upgrade import add_releases, node_releases, status_level_lines, with_release
from wire.errors import QueueError
from wire.signing import new_private_key, private_key_to_text, public_key_text

STATUS_QUEUES_LISTED_MAX = 200     # beyond this many queues `qctl status` shows the map's counts


async def cmd_status(http: HttpClient, args: argparse.Namespace) -> Outcome:
    if not args.all:
        # The map's counts first: they cost the nodes, not the map. A small map is then listed
        # whole as before; a large one is summarized (GET /v1/cluster?summary=1).
        summary = await http.cluster_summary()
        counts = summary.get("counts")
        if isinstance(counts, dict) and counts.get("queues", 0) > STATUS_QUEUES_LISTED_MAX:
            return status_summary(summary)
    cluster = await http.cluster()
    nodes = cluster.get("nodes", [])
    if not nodes or "version" not in cluster:          # a single node outside a cluster
        queues = await http.list_queues()
        node_table = format_table(["NODE", "URL", "STATE"], [[n.get("id"), n.get("url"), n.get("state")] for n in nodes])
        human = node_table + "\n\n" + (queue_table(queues, cluster.get("queues", {})) if queues else "no queues")
        return Outcome({"cluster": cluster, "queues": queues}, human)
    # Each master's node knows its replica's lag: ask every node that is up.
    lag: dict[str, Any] = {}
    for node in nodes:
        if node.get("state") != "up":
            continue
        try:
            async with HttpClient(node["url"], http._signer, ca_file=http.ca_file) as other:
                for name, entry in (await other.cluster()).get("queues", {}).items():
                    if "lag" in entry and entry.get("master") == node["id"]:
                        lag[name] = entry["lag"]
        except QueueError:
            continue
    leader = cluster.get("leader")
    raft = cluster.get("membership", {})
    voters, learners = set(raft.get("voters", [])), set(raft.get("learners", []))

    def membership_role(node_id: str | None) -> str:
        role = "voter" if node_id in voters else "learner" if node_id in learners else "-"
        return f"{role}, leader" if node_id == leader else role
    found = await node_releases(http)      # one call: every node's release (client/qctl_upgrade.py)
    add_releases(nodes, found)
    node_table = format_table(*with_release(["NODE", "URL", "STATE", "MEMBERSHIP"],
                                            [[n.get("id"), n.get("url"), n.get("state"), membership_role(n.get("id"))]
                                             for n in nodes], nodes))
    node_table = "\n".join([node_table, *status_level_lines(cluster, found)])
    queues = cluster.get("queues", {})
    for name, entry in queues.items():
        entry["lag"] = lag.get(name)
    queue_rows = [[name, e.get("options", {}).get("strength"), e.get("master"), e.get("replica"), e.get("epoch"),
                   "yes" if e.get("in_sync") else "NO", e.get("lag"), e.get("last_reason"),
                   e.get("unclean_promotions") or ""] for name, e in sorted(queues.items())]
    queue_text = format_table(["QUEUE", "STRENGTH", "MASTER", "REPLICA", "EPOCH", "IN_SYNC", "LAG", "LAST_CHANGE",
                               "UNCLEAN"], queue_rows) if queue_rows else "no queues"
    human = f"membership leader: {leader or 'none'} (term {cluster.get('term')})\n\n{node_table}\n\n{queue_text}"
    macros = cluster.get("macros", {})
    if macros:
        human += "\n\n" + format_table(["MACRO", "PRODUCER", "CONSUMER", "MEMBERS"], [
            [name, m["producer"] + (f" ({m['fastest_by']})" if m["producer"] == "fastest" else ""), m["consumer"],
             ", ".join(member["queue"] for member in m["members"]) or "-"] for name, m in sorted(macros.items())])
    channels = cluster.get("channels", {})
    if channels:
        human += "\n\n" + format_table(["CHANNEL", "CLASS", "RESEND_S", "MASTER"], [
            [name, c["class"], c.get("resend_interval_s") or "", queues.get(c["queue"], {}).get("master")]
            for name, c in sorted(channels.items())])
    recipients = cluster.get("recipients", {})
    if recipients:
        human += "\n\n" + format_table(["RECIPIENT", "QUEUE", "STATE", "SINCE", "REASON"], [
            [name, r["queue"], r["state"].upper() if r["state"] != "ok" else "ok",
             time.strftime("%H:%M:%S", time.localtime(r["since_ms"] / 1000)), r.get("reason") or ""]
            for name, r in sorted(recipients.items())])
    return Outcome(cluster, human)


def status_summary(summary: dict[str, Any]) -> Outcome:
    """`qctl status` on a large map: its nodes with how many queues each masters and
    replicates, and the map's counts; the JSON document is the server's summary."""
    counts = summary["counts"]
    leader = summary.get("leader")
    raft = summary.get("membership", {})
    voters, learners = set(raft.get("voters", [])), set(raft.get("learners", []))
    nodes = summary.get("nodes", [])
    if "version" not in summary:          # a single node outside a cluster
        return Outcome(summary, format_table(["NODE", "URL", "STATE"], [[n.get("id"), n.get("url"), n.get("state")]
                                                                        for n in nodes])
                       + f"\n\n{counts['queues']} queues: `qctl queue list` lists them")

    def membership_role(node_id: str | None) -> str:
        role = "voter" if node_id in voters else "learner" if node_id in learners else "-"
        return f"{role}, leader" if node_id == leader else role
    node_table = format_table(*with_release(["NODE", "URL", "STATE", "MEMBERSHIP", "MASTERS", "REPLICAS"],
                                            [[n.get("id"), n.get("url"), n.get("state"), membership_role(n.get("id")),
                                              n.get("masters"), n.get("replicas")] for n in nodes], nodes))
    # The feature level below the nodes (a large map's status makes no call for releases:
    # `qctl cluster versions` lists them).
    node_table = "\n".join([node_table, *status_level_lines(summary)])
    lines = [f"membership leader: {leader or 'none'} (term {summary.get('term')})", "", node_table, "",
             f"{counts['queues']} queues, {counts['out_of_sync']} with a replica out of sync; "
             f"{counts['macros']} macro queues, {counts['channels']} channels, {counts['forwards']} forwards, "
             f"{counts['recipients']} recipients ({counts['recipients_not_ok']} not ok)",
             "`qctl queue list` lists every queue, `qctl status --all` the whole map"]
    out_of_sync = summary.get("out_of_sync") or []
    if out_of_sync:
        more = counts["out_of_sync"] - len(out_of_sync)
        lines.append("out of sync: " + ", ".join(out_of_sync) + (f" (and {more} more)" if more > 0 else ""))
    not_ok = summary.get("recipients_not_ok") or []
    if not_ok:
        more = counts["recipients_not_ok"] - len(not_ok)
        lines.append("recipients not ok: " + ", ".join(not_ok) + (f" (and {more} more)" if more > 0 else ""))
    return Outcome(summary, "\n".join(lines))


async def cmd_handoff(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.handoff(args.queue, args.initiator)
    return Outcome(answer, f"{args.queue}: master {answer.get('master')}, replica {answer.get('replica')}, "
                           f"epoch {answer.get('epoch')}" + (f", writes paused {answer['pause_ms']} ms"
                                                             if "pause_ms" in answer else ""))


async def cmd_promote(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.promote(args.queue, unclean=args.unclean)
    return Outcome(answer, f"{args.queue}: {answer.get('master')} promoted (epoch {answer.get('epoch')}, unclean)")


MOVE_DONE = {
    "already_there": "{to} holds the {member} already: nothing moved",
    "moved": "the new replica on {to} catches up by state transfer",
    "handed_off": "{to} held the other member: a handoff swapped them",
    "moved_and_handed_off": "a member on {to} took the queue by state transfer, then a handoff made it master",
}


async def cmd_queue_move(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.move_queue(args.name, args.member, args.to)
    done = MOVE_DONE.get(answer.get("how", "moved"), "").format(to=args.to, member=args.member)
    return Outcome(answer, f"{args.name}: master {answer.get('master')}, replica {answer.get('replica')} "
                           f"(epoch {answer.get('epoch')}); {done}")


async def cmd_rebalance(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.rebalance()
    moves, chosen = answer.get("moves", []), answer.get("handoffs", [])
    catching_up = answer.get("catching_up", [])
    lines = [f"moved the replica of {m['queue']} from {m['from']} to {m['to']}" for m in moves]
    if chosen:
        lines.append(f"handing off {len(chosen)} queue(s) to their replicas: {', '.join(chosen)} (see qctl status)")
    if catching_up:
        lines.append(f"still catching up (no handoff for them yet): {', '.join(catching_up)}; "
                     "run qctl rebalance again once qctl status shows them in sync")
    return Outcome(answer, "\n".join(lines) or "already balanced: no replica move or handoff would "
                                               "spread members or masters more evenly")


async def cmd_journal_export(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.export_journal()
    written = answer.get("segments_written", [])
    return Outcome(answer, f"{answer.get('node')}: {len(written)} segment(s) written to {answer.get('destination')}, "
                           f"exported through sequence {answer.get('exported_through')}, "
                           f"{answer.get('pruned', 0)} record(s) pruned")


KNOWN_NODE_HINTS = {
    "up": "nothing to do",
    "draining": "to make it serve again: qctl nodes undrain {node}",
    "down": "it is set up again by itself once it runs and renews its lease",
}


async def cmd_nodes_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.add_node(args.node_id, args.url)
    if not answer.get("known"):
        return Outcome(answer, f"node {args.node_id} added")
    state = answer.get("state", "?")
    hint = KNOWN_NODE_HINTS.get(state, "").format(node=args.node_id)
    url = f"its url is now {answer.get('url')}" if answer.get("url_changed") else f"url {answer.get('url')}"
    return Outcome(answer, f"node {args.node_id} is already in the cluster (state {state}, {url})"
                           + (f"; {hint}" if hint else ""))


async def cmd_nodes_drain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.drain_node(args.node_id),
                   f"node {args.node_id} draining: its masters hand off, its replicas move (see qctl status); "
                   f"qctl nodes undrain {args.node_id} makes it serve again")


async def cmd_nodes_undrain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.undrain_node(args.node_id),
                   f"node {args.node_id} is up again: it takes new queues, and qctl rebalance moves members "
                   "and masters onto it")


async def cmd_node_drain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """`qctl node drain`: the maintenance drain (masters only, waits), or with --move-replicas
    the decommissioning drain of `qctl nodes drain`."""
    if args.move_replicas:
        return await cmd_nodes_drain(http, args)
    answer = await http.drain_node_for_maintenance(args.node_id, args.timeout_s)
    lines = [f"{h['queue']}: master {h['from']} -> {h['to']} (epoch {h['epoch']}), writes paused "
             f"{h['pause_ms'] if h.get('pause_ms') is not None else '?'} ms" for h in answer.get("handoffs", [])]
    unmarked = sorted(n for n, held in answer.get("marked", {}).items() if held is None)
    lines.append(f"node {args.node_id} masters no queue (took {answer.get('took_ms')} ms"
                 + (f", longest write pause {answer['longest_pause_ms']} ms" if answer.get("longest_pause_ms")
                    is not None else "") + "); its replicas stay. Stop it, upgrade it, start it, then "
                 f"qctl node undrain {args.node_id}")
    if unmarked:
        lines.append(f"not told of the maintenance (an older release, or not reached): {', '.join(unmarked)}; "
                     "a master they hand to it is handed back once it runs this release")
    return Outcome(answer, "\n".join(lines))


async def cmd_node_undrain(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.undrain_node_from_maintenance(args.node_id)
    human = f"node {args.node_id} is out of maintenance (state {answer.get('state')}): it may take masters again"
    if args.rebalance:
        balance = await cmd_rebalance(http, args)
        answer = {**answer, "rebalance": balance.document}
        human += "\n" + balance.human
    else:
        human += "; qctl rebalance hands some back to it"
    return Outcome(answer, human)


async def cmd_nodes_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.remove_node(args.node_id), f"node {args.node_id} removed")


async def cmd_clients_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """The key pair is made here, so the server only ever sees the public key."""
    key = new_private_key()
    answer = await http.register_client(args.name, args.grants, public_key_text(key))
    private_text = answer.pop("private_key", None) or private_key_to_text(key)
    document = dict(answer)
    if args.out is not None:
        save_credentials(args.out, Credentials(str(answer["id"]), private_text, http.url, http.ca_file))
        document["credentials_file"] = str(args.out)
    else:
        document["private_key"] = private_text  # shown once: nowhere else keeps it
    document["grants"] = answer.get("grants", args.grants)
    human = format_fields({**document, "grants": format_grants(document["grants"])})
    return Outcome(document, human)


async def cmd_clients_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    clients = await http.list_clients()
    rows = [[c.get("id"), c.get("name"), format_grants(c.get("grants"))] for c in clients]
    return Outcome({"clients": clients}, format_table(["ID", "NAME", "GRANTS"], rows))


async def cmd_clients_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_client(args.client_id)
    return Outcome(answer or {"removed": args.client_id}, f"removed {args.client_id}")
