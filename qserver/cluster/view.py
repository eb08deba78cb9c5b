"""The node's read of the cluster map: who holds each queue, and where to dial a node.

Separate from the pair driver because everything on the node reads it (the core, the API, the
features, the pairs) while only the pair driver acts on what it says.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from replication.cluster_map import ClusterMap, QueueEntry
from replication.options import base_name

if TYPE_CHECKING:
    from qserver.cluster.membership import Membership



class ClusterView:
    """The local copy of the cluster map, as the node reads it (None outside a cluster)."""

    def __init__(self, node_id: str, urls: dict[str, str], membership: Membership | None) -> None:
        self.node_id = node_id
        self.urls = dict(urls)
        self.membership = membership

    @property
    def clustered(self) -> bool:
        return self.membership is not None

    @property
    def cluster_map(self) -> ClusterMap:
        return self.membership.cluster_map if self.membership is not None else ClusterMap()

    def entry(self, queue: str) -> QueueEntry | None:
        if self.membership is None:
            return None
        return self.membership.cluster_map.queues.get(base_name(queue))

    def url(self, node: str) -> str:
        """Where this node dials `node` (HTTP passing-on): its own [cluster.nodes] entry first,
        as for the peer link, so a proxy on that link carries both (docs/PROTOCOL.md, "Peer links"); the URL
        the map publishes (how clients reach the node) only for nodes the table lacks."""
        if self.urls.get(node):
            return self.urls[node]
        entry = self.cluster_map.nodes.get(node)
        return entry.url if entry is not None and entry.url else ""
