"""Node configuration: defaults, TOML loading and the checks between limits."""
from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# Keys that were settings once: a config naming one is refused with what to do instead.
RETIRED_KEYS = {
    "commit_inline_operations_max": "removed (commits always run on the writer thread, never on the event "
                                    "loop); delete the line",
}


@dataclass(frozen=True)
class NodeConfig:
    node_id: str = "n1"
    data_dir: str = "./data/n1"
    host: str = "127.0.0.1"
    port: int = 7100
    auth_enabled: bool = True
    journal_enabled: bool = True           # benchmark-only switch; keep on in production
    # Sealed journal segments go to Parquet files here (a directory or any URI pyarrow.fs
    # understands: hdfs://, s3://, ...; empty: <data_dir>/journal-export), by size or age, and
    # on demand (POST /v1/journal/export); exported records are pruned from LMDB after retention.
    journal_export_destination: str = ""
    journal_segment_records_max: int = 200_000
    journal_segment_age_s: float = 300.0
    journal_retention_s: float = 3600.0
    journal_export_check_interval_s: float = 5.0
    body_bytes_max: int = 1 << 20          # largest message or JSON body accepted
    map_size_bytes: int = 1 << 30          # initial LMDB map; grows by doubling
    map_size_max_bytes: int = 1 << 40
    # Free disk kept for what must never be refused for lack of space: acknowledgements and
    # deletes (they give space back), the membership layer's writes. Below it this node
    # refuses new messages (E_STORAGE_FULL) and its replicas stop taking their masters' streams.
    disk_reserve_bytes: int = 64 << 20
    inbox_commands_max: int = 200_000
    batch_operations_max: int = 20_000     # commands stepped per turn of the engine
    commit_early_operations: int = 256     # an idle writer takes a batch this big without waiting
    dedupe_window_s: float = 300.0
    status_retention_s: float = 3600.0
    signature_skew_max_s: float = 300.0
    housekeeping_interval_ms: int = 1000
    receive_wait_max_s: float = 60.0
    websocket_pending_items_max: int = 100_000    # unsent answers per socket before it is cut
    # A client WebSocket session ends after this long (the client library reconnects, signing
    # anew): a session is authorised once, at its upgrade (docs/PROTOCOL.md, "WebSocket frames").
    websocket_session_max_s: float = 3600.0
    # What one client may keep waiting in the engine: receives waiting for a message, push
    # subscriptions and status waits (E_OVERLOADED past either bound; docs/PROTOCOL.md, "Errors").
    listeners_per_connection_max: int = 1_000     # per WebSocket (an HTTP request holds one)
    listeners_per_client_max: int = 10_000        # per client id, over all its connections
    subscription_credit_max: int = 10_000
    url: str = ""                          # how peers and clients reach this node (default http://host:port)
    # Further addresses (URLs or host:port) clients reach this node at, beyond `url`, its
    # [cluster.nodes] entry and host:port: a published port, a load balancer's name. A signed
    # request names the address it was sent to and is refused elsewhere (docs/PROTOCOL.md, "Signing").
    client_addresses: list[str] = field(default_factory=list)
    # The cluster: every node's id -> the URL peers and clients dial for it (a proxy's address
    # in chaos tests), and preferred pairs for named queues at creation.
    cluster_nodes: dict[str, str] = field(default_factory=dict)
    placement: dict[str, list[str]] = field(default_factory=dict)
    # The membership layer (Raft): voter id -> "host:port" this node dials for its Raft
    # link (a proxy's address in chaos tests), and where this node listens for it (voters
    # only: a node not listed follows the cluster map without voting).
    membership_nodes: dict[str, str] = field(default_factory=dict)
    membership_bind: str = ""
    lease_ms: int = 800                     # a node's lease from the membership leader
    lease_margin_ms: int = 400              # extra wait before promoting (clock drift, leader change)
    lease_renew_interval_ms: int = 200
    election_timeout_ms: tuple[int, int] = (300, 600)
    raft_heartbeat_ms: int = 50
    membership_compact_every: int = 1_000    # map commands applied between two snapshots of the map
    replica_replace_after_s: float = 300.0  # a node down this long gets its replicas re-created elsewhere
    accept_replica_handoffs: bool = True    # false: this node's masters refuse handoffs their replicas ask
    shutdown_handoff_timeout_s: float = 10.0
    replica_lag_max: int = 100_000          # operations behind before the replica is out of sync
    replica_lag_max_ms: int = 2_000         # silence before the same
    # An answer held for a commit point that does not come (a master without its lease), and a
    # replica's Forward its master does not answer, end after this with an outcome-unknown
    # E_TIMEOUT (a receive's wait added): past a failover's seconds, inside a client's 30 s.
    commit_wait_max_s: float = 10.0
    # TLS on every link (qserver/transport/tls.py): this node's certificate and key, and the CA its peers'
    # certificates are checked against. Empty: the files `qserver init --tls` made under
    # data_dir/tls/ if there are any, else plaintext (loopback demos).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # A node that listens beyond loopback (host, or its membership address) without TLS refuses
    # to start unless this is set: plaintext exposes every request and peer frame to anyone on the
    # path (docs/PROTOCOL.md, "Peer links"). Set, it starts and logs a warning.
    allow_plaintext: bool = False
    peer_send_queue_bytes_max: int = 8 << 20
    # The bounded op log and snapshots (docs/PROTOCOL.md, "The bounded op log and snapshots"): the log kept for a replica recorded out
    # of sync (past it, the replica gets a snapshot), snapshot chunks, and how long a read view
    # is held by a transfer that makes no progress (it keeps LMDB from reusing freed pages).
    log_retain_max_bytes: int = 64 << 20
    # Op-log records below the floor kept per queue because they hold the only copy of live
    # messages' payloads (a queue consumed as fast as it is filled writes each payload once);
    # past it, the lowest one's payloads move into their message rows.
    payload_hold_bytes: int = 64 << 20
    snapshot_chunk_bytes_max: int = 256 << 10
    snapshot_chunks_in_flight_max: int = 16
    sync_view_max_s: float = 60.0
    # The node's own spans (qserver/tracing.py, docs/TRACING.md), also given as a [tracing] table
    # (exporter, path, endpoint, service_name): "" none, "jsonl" finished spans as JSON lines to
    # tracing_path (relative: under data_dir), "otlp" to tracing_endpoint through OpenTelemetry's SDK.
    tracing_exporter: str = ""
    tracing_path: str = ""
    tracing_endpoint: str = ""
    tracing_service_name: str = "qserver"

    def check(self) -> NodeConfig:
        problems = []
        if not self.node_id or not self.node_id[0].isalpha():
            problems.append("node_id must start with a letter (ids are logical, never addresses)")
        if self.map_size_bytes > self.map_size_max_bytes:
            problems.append("map_size_bytes exceeds map_size_max_bytes")
        if self.disk_reserve_bytes < 0:
            problems.append("disk_reserve_bytes must not be negative")
        if self.membership_compact_every < 2:
            problems.append("membership_compact_every must be at least 2")
        if self.body_bytes_max * 4 > self.map_size_max_bytes:
            problems.append("map_size_max_bytes must hold at least four maximal messages")
        if self.batch_operations_max > self.inbox_commands_max:
            problems.append("batch_operations_max exceeds inbox_commands_max")
        if self.dedupe_window_s <= 0 or self.status_retention_s <= 0:
            problems.append("dedupe_window_s and status_retention_s must be positive")
        if self.cluster_nodes and self.node_id not in self.cluster_nodes:
            problems.append("cluster_nodes must list this node's own id")
        for queue, pair in self.placement.items():
            if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(self.cluster_nodes):
                problems.append(f"placement of {queue} must name two different nodes of cluster_nodes")
        if self.snapshot_chunk_bytes_max * self.snapshot_chunks_in_flight_max * 2 > self.peer_send_queue_bytes_max:
            problems.append("snapshot chunks in flight must fit twice in peer_send_queue_bytes_max (a chunk the "
                            "link drops costs a resend)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file) or (self.tls_cert_file and not self.tls_ca_file):
            problems.append("tls_cert_file and tls_key_file go together, with tls_ca_file (to check peers)")
        if self.websocket_session_max_s <= 0 or self.listeners_per_connection_max < 1 \
                or self.listeners_per_client_max < self.listeners_per_connection_max:
            problems.append("websocket_session_max_s must be positive, listeners_per_connection_max at least 1 and "
                            "listeners_per_client_max at least listeners_per_connection_max")
        if self.commit_wait_max_s <= 0:
            problems.append("commit_wait_max_s must be positive")
        if self.log_retain_max_bytes <= 0 or self.sync_view_max_s <= 0 or self.payload_hold_bytes < 0:
            problems.append("log_retain_max_bytes and sync_view_max_s must be positive, payload_hold_bytes not negative")
        if self.tracing_exporter not in ("", "jsonl", "otlp"):
            problems.append('tracing exporter must be "jsonl" or "otlp" (or "" for none)')
        elif self.tracing_exporter == "jsonl" and not self.tracing_path:
            problems.append('tracing exporter "jsonl" needs a path (the file finished spans are appended to)')
        if self.cluster_nodes:
            if not set(self.membership_nodes) <= set(self.cluster_nodes):
                problems.append("every voter of [cluster.membership] must be a node of [cluster.nodes]")
            if len(self.membership_nodes) not in (2, 3, 4, 5):
                problems.append("the membership layer has 3 or 5 voters (2 or 4 work but tolerate no more failures); "
                                "further nodes follow the map without voting")
            if self.lease_margin_ms < self.election_timeout_ms[0]:
                problems.append("lease_margin_ms must cover election_timeout_ms's minimum (a cut-off membership "
                                "leader may grant leases until check-quorum steps it down)")
            if self.lease_renew_interval_ms * 3 > self.lease_ms:
                problems.append("lease_renew_interval_ms must allow three renewals per lease_ms")
            if self.election_timeout_ms[0] <= 3 * self.raft_heartbeat_ms or \
                    self.election_timeout_ms[1] <= self.election_timeout_ms[0]:
                problems.append("election_timeout_ms must be (min, max) with min > 3 x raft_heartbeat_ms")
        if problems:
            raise ValueError("invalid node configuration: " + "; ".join(problems))
        return self

    def tls_files(self) -> tuple[str, str, str] | None:
        """(certificate, key, CA) when this node serves TLS."""
        if self.tls_cert_file or self.tls_key_file:
            return self.tls_cert_file, self.tls_key_file, self.tls_ca_file
        made = Path(self.data_dir) / "tls"
        if (made / "node.pem").exists():
            return str(made / "node.pem"), str(made / "node-key.pem"), str(made / "ca.pem")
        return None

    def listen_hosts(self) -> list[str]:
        """The addresses this node listens on: its HTTP host, and its membership port's."""
        hosts = [self.host]
        membership = self.membership_bind or self.membership_nodes.get(self.node_id, "")
        if membership:
            hosts.append(membership.rsplit(":", 1)[0].strip("[]"))
        return hosts

    def plaintext_exposure(self) -> list[str]:
        """The addresses beyond loopback this node would serve in plaintext (none with TLS)."""
        if self.tls_files() is not None:
            return []
        return [host for host in self.listen_hosts() if not _is_loopback(host)]

    @property
    def own_url(self) -> str:
        scheme = "https" if self.tls_files() else "http"
        return self.url or self.cluster_nodes.get(self.node_id) or f"{scheme}://{self.host}:{self.port}"

    def with_overrides(self, **overrides: Any) -> NodeConfig:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None}).check()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False     # a host name, or "" / "0.0.0.0"-like wildcards: may be reached from outside


def load_config(path: str | Path | None = None, **overrides: Any) -> NodeConfig:
    """Defaults, then the TOML file's `[node]` table (or top level), then flags."""
    values: dict[str, Any] = {}
    if path is not None:
        raw = tomllib.loads(Path(path).read_text())
        values = dict(raw.get("node", raw))
        cluster = raw.get("cluster", {})
        if "nodes" in cluster:
            values["cluster_nodes"] = dict(cluster["nodes"])
        if "membership" in cluster:
            values["membership_nodes"] = dict(cluster["membership"])
        if "election_timeout_ms" in values:
            values["election_timeout_ms"] = tuple(values["election_timeout_ms"])
        if "placement" in cluster:
            values["placement"] = {name: list(pair) for name, pair in cluster["placement"].items()}
        values.pop("tracing", None)         # a file without a [node] table: its tables are here too
        for key, value in raw.get("tracing", {}).items():       # [tracing] exporter = "jsonl", ...
            if key not in ("exporter", "path", "endpoint", "service_name"):
                raise ValueError(f"unknown [tracing] key: {key} (exporter, path, endpoint, service_name)")
            values[f"tracing_{key}"] = value
        known = {f.name for f in fields(NodeConfig)}
        unknown = set(values) - known
        retired = sorted(unknown & RETIRED_KEYS.keys())
        if retired:
            raise ValueError("; ".join(f"{key}: {RETIRED_KEYS[key]}" for key in retired))
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
    return NodeConfig(**values).with_overrides(**overrides)
