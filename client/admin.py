"""`AdminCalls`: the client's admin and REST-only calls, signed REST through `client/http.py`.

Each is one request to the node the client was given (`self.http`); those that change the
cluster map (macro queues, channels) read it again after, so the client's own next call sees
the change. Kept apart from `AsyncClient` (client/aio.py), which mixes it in, because none of
it touches the WebSocket, the batching or the router: it is the REST API's surface, one method
per route.
"""
from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

from client.http import Grant, HttpClient
from client.views import ViewCalls
from wire.errors import E_FEATURE_DISABLED, E_NOT_FOUND, QueueError


class _MapReader(Protocol):
    """What the class mixing this in has: reading the cluster map again (AsyncClient)."""

    async def refresh_placement(self, queue: str | None = None) -> None: ...


class AdminCalls(ViewCalls):
    """Admin and REST-only calls, mixed into `AsyncClient`; `http` is its REST client (and the
    virtual queues' calls: client/views.py)."""

    http: HttpClient

    # --- queues, macro queues, clients and the cluster ------------------------------------------
    async def create_queue(self, name: str, **options: Any) -> dict[str, Any]:
        return await self.http.create_queue(name, **options)

    async def delete_queue(self, name: str) -> dict[str, Any]:
        return await self.http.delete_queue(name)

    async def set_queue_options(self, name: str, **options: Any) -> dict[str, Any]:
        """Change options of an existing queue (admin grant): visibility_timeout_s (new
        leases), max_deliveries, message_ttl_s (messages enqueued from now), max_depth,
        dead_letter, delay_s, receive_wait_s and the surveillance and forward-rate options;
        answers the queue's options after the change (`{"name", "options", "changed"}`). Others
        are refused with E_INVALID_OPTION; below cluster feature level 3, or against a node of
        release 0.2.0 or older, E_FEATURE_DISABLED (docs/PROTOCOL.md, "Changing a queue's options")."""
        return await self.http.set_queue_options(name, **options)

    async def purge(self, name: str) -> dict[str, Any]:
        """Take every message the queue holds now, ready or leased, out of it for good (admin
        grant): `{"queue", "purged"}`, and under `producer` `"members"`, each member's count."""
        return await self.http.purge(name)

    async def redrive(self, name: str, limit: int | None = None) -> dict[str, Any]:
        """Move up to `limit` (all there are now when None) of the queue's dead letters back
        into it, each at its priority as a new message (admin grant): `{"queue", "redriven"}`,
        `"stopped"` with the error code that ended it early, and under `producer` `"members"`."""
        return await self.http.redrive(name, limit)

    async def list_queues(self) -> list[dict[str, Any]]:
        """Every queue this client may see, by name (the client walks the server's pages)."""
        return await self.http.list_queues()

    async def queue_page(self, limit: int = 1000, after: str | None = None) -> dict[str, Any]:
        """One page of the queues: `{"queues": [...], "next": name or None}` (1 <= limit <= 1000;
        `after`: the previous page's `next`)."""
        return await self.http.queue_page(limit, after)

    async def queue_page_around(self, limit: int = 1000, after: str | None = None, *, before: str | None = None,
                                match: str = "") -> dict[str, Any]:
        """One page of the queues whose name contains `match`: the first `limit` after `after`,
        or the last before `before`; `{"queues", "next", "previous"}` (docs/PROTOCOL.md,
        "Listings"). E_VERSION_MISMATCH from a node of 0.2.0 or older."""
        return await self.http.queue_page_around(limit, after, before=before, match=match)

    async def create_macro(self, name: str, producer: str = "round_robin", consumer: str = "prioritized",
                           fastest_by: str = "response_time") -> dict[str, Any]:
        """Define a macro queue (admin; client/macro.py says what the policies do); add its
        members with `add_macro_member`. Enqueue, receive and consume on it as on a queue."""
        return await self._changed_map(self.http.create_macro(name, producer, consumer, fastest_by))

    async def delete_macro(self, name: str) -> dict[str, Any]:
        """Forget a macro queue; its members and their messages stay."""
        return await self._changed_map(self.http.delete_macro(name))

    async def add_macro_member(self, name: str, queue: str, priority: int = 0, weight: int = 1) -> dict[str, Any]:
        """Add a queue to a macro queue (or set its `priority`, 0-9, for the `prioritized`
        consumer policy, and its `weight`, 1-100, for the `round_robin` producer policy)."""
        return await self._changed_map(self.http.add_macro_member(name, queue, priority, weight))

    async def remove_macro_member(self, name: str, queue: str) -> dict[str, Any]:
        return await self._changed_map(self.http.remove_macro_member(name, queue))

    async def list_macros(self) -> list[dict[str, Any]]:
        return await self.http.list_macros()

    async def describe_macro(self, name: str) -> dict[str, Any]:
        """A macro queue's definition, each member with its pair (master, replica, epoch)."""
        return await self.http.macro(name)

    async def queue_stats(self, name: str) -> dict[str, Any]:
        return await self.http.queue_stats(name)

    async def reply(self, queue: str, message_id: int, receipt: str, body: bytes) -> None:
        await self.http.reply(queue, message_id, receipt, body)

    async def message_status(self, queue: str, message_id: int, wait_s: float = 0.0,
                             until: str | None = None) -> dict[str, Any]:
        return await self.http.message_status(queue, message_id, wait_s, until)

    async def register_client(self, name: str, grants: Iterable[Grant],
                              public_key: str | None = None) -> dict[str, Any]:
        return await self.http.register_client(name, grants, public_key)

    async def list_clients(self) -> list[dict[str, Any]]:
        return await self.http.list_clients()

    async def remove_client(self, client_id: str) -> dict[str, Any]:
        return await self.http.remove_client(client_id)

    async def set_grants(self, client_id: str, grants: Iterable[Grant]) -> dict[str, Any]:
        return await self.http.set_grants(client_id, grants)

    async def create_access_key(self, client_id: str) -> dict[str, Any]:
        """A new access key of the client for the SQS gateway (admin grant; docs/PROTOCOL.md,
        "Access keys"): `{"client", "access_key_id", "secret_access_key", "created_ms"}`, the
        only time the secret is shown. At most 4 per client (E_INVALID_OPTION beyond);
        E_UNKNOWN_CLIENT; E_FEATURE_DISABLED from a node of release 0.2.0 or older."""
        return await self.http.create_access_key(client_id)

    async def list_access_keys(self, client_id: str) -> list[dict[str, Any]]:
        """The client's access keys, `[{"access_key_id", "created_ms"}]`, oldest first."""
        return await self.http.list_access_keys(client_id)

    async def revoke_access_key(self, client_id: str, key_id: str) -> dict[str, Any]:
        """Revoke an access key (every node refuses it once the map applied the change):
        `{"client", "revoked"}`; E_UNKNOWN_ACCESS_KEY when the client has no such key."""
        return await self.http.revoke_access_key(client_id, key_id)

    async def cluster(self) -> dict[str, Any]:
        return await self.http.cluster()

    async def node_stats(self) -> dict[str, Any]:
        """GET /v1/node: the statistics of the node this client was given, in one call: queues
        mastered, replicated and FAILED (counts, names capped), connections and distinct
        clients, enqueue/ack rates, storage and map use, loop lag, lease, membership, release.
        A node of 0.2.0 or older has no such route: E_FEATURE_DISABLED says so."""
        try:
            return dict(await self.http._json("GET", "/v1/node"))
        except QueueError as error:
            if error.code == E_NOT_FOUND.code:
                raise QueueError(E_FEATURE_DISABLED, "this node has no GET /v1/node (release 0.3.0 or later "
                                                     "has it)") from error
            raise

    async def events(self, after: int = 0, limit: int = 100, wait_s: float = 0.0) -> dict[str, Any]:
        """The cluster events of the node this client was given (handoffs, failovers, recipients'
        states, nodes down and up, the membership leader, queues created and deleted) after
        sequence number `after`, those this client's grants let it see, at most `limit` (<=
        1000), waiting up to `wait_s` (<= 20) for one: `{"events": [{"seq", "at_ms", "kind",
        "text", "queue"?, "node"?, ...}], "next_after", "node", "started_ms", "first_seq"}`.
        Pass `next_after` as the next call's `after`. A node of a release without the feed
        answers E_NOT_FOUND saying so."""
        return await self.http.events(after, limit, wait_s)

    async def handoff(self, queue: str, initiator: str = "master") -> dict[str, Any]:
        return await self.http.handoff(queue, initiator)

    async def promote(self, queue: str, *, unclean: bool = False) -> dict[str, Any]:
        return await self.http.promote(queue, unclean=unclean)

    async def move_queue(self, queue: str, member: str, to: str) -> dict[str, Any]:
        return await self.http.move_queue(queue, member, to)

    async def rebalance(self) -> dict[str, Any]:
        return await self.http.rebalance()

    async def add_node(self, node_id: str, url: str) -> dict[str, Any]:
        return await self.http.add_node(node_id, url)

    async def drain_node(self, node_id: str) -> dict[str, Any]:
        return await self.http.drain_node(node_id)

    async def remove_node(self, node_id: str) -> dict[str, Any]:
        return await self.http.remove_node(node_id)

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        """A draining node serves again (draining -> up); `rebalance` then brings it members."""
        return await self.http.undrain_node(node_id)

    async def drain_node_for_maintenance(self, node_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Hand the node's masters off to their in-sync replicas and wait until it masters none
        (its replicas stay: it comes back after a restart and catches up by log). Refused with
        E_DRAIN_REFUSED when a queue would be left without an in-sync copy."""
        return await self.http.drain_node_for_maintenance(node_id, timeout_s)

    async def undrain_node_from_maintenance(self, node_id: str) -> dict[str, Any]:
        """The node may take masters again (`rebalance` hands some back to it)."""
        return await self.http.undrain_node_from_maintenance(node_id)

    async def cluster_versions(self) -> dict[str, Any]:
        """Every node's release, storage layout, protocols and feature levels, and the
        cluster's feature level (docs/OPERATIONS.md, "The cluster feature level")."""
        return await self.http.cluster_versions()

    async def finalize_cluster(self, level: int | None = None) -> dict[str, Any]:
        """Raise the cluster feature level (admin; default: the highest the node's release runs
        at) once every node runs a release that supports it, and E_NODES_BEHIND naming the
        nodes that lag before that: `{"level", "previous", "changed", "releases"}`. Idempotent;
        the level never goes down."""
        return await self.http.finalize_cluster(level)

    async def _changed_map(self, change: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        result = await change
        with contextlib.suppress(QueueError):     # this client's own calls see the change at once
            await cast(_MapReader, self).refresh_placement()
        return result

    # --- channels, recipients and forwards (seeds 001-003) ----------------------------------------
    async def create_channel(self, name: str, delivery_class: str = "latest", resend_interval_s: float = 0.0,
                             **attributes: Any) -> dict[str, Any]:
        """Define a channel (admin): `latest`, `acked` or `durable`; `resend_interval_s` > 0 sends
        the last value again after that long without a publish; `attributes` as `characterize`'s."""
        return await self._changed_map(self.http.put_channel(name, delivery_class, resend_interval_s, **attributes))

    async def characterize(self, name: str, delivery_class: str | None = None, *, size_bytes: int | None = None,
                           per_second: float | None = None, loss_tolerant: bool | None = None,
                           skip_last_value: bool | None = None) -> dict[str, Any]:
        """Change a channel's delivery class, and say what its data is like: the typical
        payload's `size_bytes`, how many publishes `per_second`, whether it is `loss_tolerant`;
        the channel's master chooses how each message travels from them (typeof's
        `mechanism`; docs/PROTOCOL.md "How a channel's messages travel"). `skip_last_value`:
        subscribing does not send the last value. What is not given keeps its value; all apply
        from the next publish (attributes need cluster feature level 3)."""
        return await self._changed_map(self.http.put_channel(
            name, delivery_class, size_bytes=size_bytes, per_second=per_second, loss_tolerant=loss_tolerant,
            skip_last_value=skip_last_value))

    async def set_resend_interval(self, name: str, seconds: float) -> dict[str, Any]:
        return await self._changed_map(self.http.put_channel(name, resend_interval_s=seconds))

    async def typeof(self, name: str) -> dict[str, Any]:
        """A channel's delivery class, resend interval and where it is served."""
        return await self.http.channel(name)

    async def delete_channel(self, name: str) -> dict[str, Any]:
        return await self._changed_map(self.http.delete_channel(name))

    async def list_channels(self) -> list[dict[str, Any]]:
        return await self.http.list_channels()

    async def subscriptions(self, channel: str) -> list[dict[str, Any]]:
        """A durable channel's subscriptions: each one's `floor`, the messages `waiting` for it,
        whether a reader is `attached` and how many it holds `unacknowledged`."""
        return await self.http.subscriptions(channel)

    async def drop_subscription(self, channel: str, name: str) -> dict[str, Any]:
        """End a durable subscription for good (admin): its backlog is no longer kept."""
        return await self.http.drop_subscription(channel, name)

    async def set_alternatives(self, recipient: str, alternatives: Sequence[str]) -> dict[str, Any]:
        """A push recipient's ordered chain of alternative recipients (seed 001; admin)."""
        return await self.http.set_alternatives(recipient, alternatives)

    async def create_forward(self, name: str, source: str, destination: str, *, urls: Sequence[str] = (),
                             credentials: Mapping[str, str] | None = None,
                             control: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Store-and-forward (seed 003; admin): the master of `source` (a `full` queue here)
        moves its messages into `destination` of the cluster at `urls`, signed there with
        `credentials` ({"client_id", "private_key"}); no urls: a queue of this cluster.
        `control`: its own {"bands", "weights", "fill_unit", "fill_bytes"} (seed 003 figure 6)."""
        return await self.http.create_forward(name, source, destination, urls=urls, credentials=credentials,
                                              control=control)

    async def change_forward(self, name: str, control: Mapping[str, Any]) -> dict[str, Any]:
        """Change a forward's own bands, weights, fill unit (None: back to the default)."""
        return await self.http.change_forward(name, control)

    async def forwards(self) -> list[dict[str, Any]]:
        return await self.http.forwards()

    async def forward_stats(self, name: str) -> dict[str, Any]:
        return await self.http.forward_stats(name)

    async def delete_forward(self, name: str) -> dict[str, Any]:
        return await self.http.delete_forward(name)

    async def recipients(self) -> list[dict[str, Any]]:
        """Every recipient with its queue, state (ok, fault, defunct) and alternatives."""
        return await self.http.recipients()

    async def alternatives(self, recipient: str) -> list[str]:
        return await self.http.alternatives(recipient)

    async def remove_recipient(self, recipient: str) -> dict[str, Any]:
        """Forget a recipient (admin): its state and alternatives; what fault surveillance holds
        for it goes back to its queue. E_UNKNOWN_RECIPIENT when the cluster does not know it."""
        return await self.http.remove_recipient(recipient)

    # --- definitions (docs/OPERATIONS.md, "Definitions: export and import") ----------------------
    async def export_definitions(self) -> dict[str, Any]:
        """Everything the cluster defines (queues and their options, channels, macro queues and
        members, recipients' chains, forwards without secrets, clients' public keys and grants)
        as one JSON document (admin on `*`)."""
        return await self.http.export_definitions()

    async def import_definitions(self, document: Mapping[str, Any], dry_run: bool = False, *,
                                 forward_credentials: Mapping[str, Mapping[str, str]] | None = None
                                 ) -> dict[str, Any]:
        """Create what `document` defines and the cluster lacks (admin on `*`): each item
        `created`, `unchanged`, `conflict` (exists otherwise: left as it is) or `failed`; an
        invalid document raises E_INVALID_DEFINITIONS and changes nothing. `dry_run`: only
        check and say what would be created. `forward_credentials`: see HttpClient."""
        answer = await self.http.import_definitions(document, dry_run=dry_run, forward_credentials=forward_credentials)
        if not dry_run:
            with contextlib.suppress(QueueError):     # this client's own calls see the new queues at once
                await cast(_MapReader, self).refresh_placement()
        return answer
