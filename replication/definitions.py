"""Definitions: what an operator defined in a cluster (queues and their options, macro queues and
their members, channels, recipients' chains of alternatives, forwards, clients' public keys and
grants) as one JSON document, and the plan that imports such a document into a cluster
(docs/OPERATIONS.md, "Definitions: export and import"; docs/PROTOCOL.md, "Definitions").

Pure: the document is read from a cluster map and a client registry, and a document is checked
against them, without a clock or I/O. What needs more than the map (a grant's shape, an Ed25519
key, a PEM certificate) is checked by the `Checks` the caller gives. The plan says, item by item,
what importing would do: create it (with the body its REST route takes), leave it (it exists as
the document says), or report a conflict (it exists otherwise: never changed). An item the
document does not name is never touched.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replication.map_channels import attributes_problem, normalized
from replication.map_commands import ALTERNATIVES_MAX
from replication.map_entries import (
    CHANNEL_PREFIX,
    CHANNEL_RESEND_MAX_S,
    FORWARDS_MAX,
    MACRO_MEMBER_WEIGHT_MAX,
    MACRO_MEMBERS_MAX,
    DeliveryClass,
    FastestBy,
    channel_queue,
    macro_policy_problem,
)
from replication.options import (
    DEAD_LETTER_SUFFIX,
    PLACEMENT_OPTION_NAMES,
    OptionError,
    QueueOptions,
    is_valid_queue_name,
    mismatched_options,
    options_from_json,
    parse_options,
)
from wire import versions
from wire.errors import QueueError

if TYPE_CHECKING:
    from replication.cluster_map import ClusterMap

FORMAT = 1
SECTIONS = ("queues", "channels", "macros", "recipients", "forwards", "clients")
INFORMATIONAL = ("release", "exported_ms", "map_version")     # written by an export, not read by an import
FORWARD_URLS_MAX = 16          # as POST /v1/forwards takes (qserver/features/forwards/api.py URLS_MAX)

# Values a node proposes only at a cluster feature level (wire/versions.py FEATURES): checked here
# too, so that a document naming one is refused before anything is created.
GATED_CONSUMER_POLICIES = {"highest_priority": "macro_highest_priority"}

CREATE, UNCHANGED, CONFLICT = "create", "unchanged", "conflict"
QUEUE, CHANNEL, MACRO, MACRO_MEMBER, RECIPIENT, FORWARD, CLIENT = (
    "queue", "channel", "macro", "macro_member", "recipient", "forward", "client")

ITEM_KEYS: dict[str, frozenset[str]] = {
    "queues": frozenset({"name", "options"}),
    "channels": frozenset({"name", "class", "resend_interval_s", "attributes"}),
    "macros": frozenset({"name", "producer", "consumer", "fastest_by", "members"}),
    "recipients": frozenset({"name", "alternatives"}),
    "forwards": frozenset({"name", "source", "destination", "urls", "client_id", "credentials", "control"}),
    "clients": frozenset({"name", "public_key", "grants"}),
}


@dataclass(frozen=True, slots=True)
class Checks:
    """What the document's checks need beyond the map: each answers "" for a good value, else
    what is wrong (the node's own checks, so an import validates as the REST routes do)."""
    grants: Callable[[Any], str]
    public_key: Callable[[str], str]
    private_key: Callable[[str], str]
    ca: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class Step:
    """One item of an import: what it does (CREATE, UNCHANGED, CONFLICT), why, and for CREATE
    the body of the REST route that creates it."""
    kind: str
    name: str
    action: str
    detail: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    member: str = ""        # a macro member's queue

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"kind": self.kind, "name": self.name, "status": self.action}
        if self.member:
            shown["member"] = self.member
        if self.detail:
            shown["detail"] = self.detail
        return shown


# --- export ------------------------------------------------------------------------------------
def export_definitions(cluster: ClusterMap, clients: Mapping[str, Mapping[str, Any]], *, release: str,
                       now_ms: int) -> dict[str, Any]:
    """The document of what `cluster` and the client registry `clients` (id -> record) define,
    each section sorted by name. Not exported: placement (master, replica, epochs), channels'
    own queues and dead-letter queues (they come and go with their owner), recipients' states
    and bindings made by subscribing, forwards' sealed credentials, client ids and any private
    key (the registry holds none)."""
    queues = [{"name": name, "options": dict(entry.options)} for name, entry in sorted(cluster.queues.items())
              if not name.startswith(CHANNEL_PREFIX)]
    channels = [{"name": name, "class": entry.delivery_class, "resend_interval_s": entry.resend_interval_s,
                 **({"attributes": dict(entry.attributes)} if entry.attributes else {})}
                for name, entry in sorted(cluster.channels.items())]
    macros = [{"name": name, "producer": entry.producer, "consumer": entry.consumer, "fastest_by": entry.fastest_by,
               "members": [{"queue": m.queue, "priority": m.priority, "weight": m.weight} for m in entry.members]}
              for name, entry in sorted(cluster.macros.items())]
    recipients = [{"name": name, "alternatives": [{"name": other, "queue": queue or None}
                                                  for other, queue in _chain(cluster, name)]}
                  for name in sorted(cluster.alternatives)]
    forwards = [{"name": name, "source": entry.source, "destination": entry.destination, "urls": list(entry.urls),
                 "client_id": entry.client_id, **({"control": dict(entry.control)} if entry.control else {})}
                for name, entry in sorted(cluster.forwards.items())]
    listed = [{"name": str(record.get("name", "")), "public_key": str(record.get("public_key", "")),
               "grants": [dict(grant) for grant in record.get("grants", [])]}
              for record in clients.values()]
    return {"format": FORMAT, "release": release, "exported_ms": now_ms, "map_version": cluster.version,
            "queues": queues, "channels": channels, "macros": macros, "recipients": recipients, "forwards": forwards,
            "clients": sorted(listed, key=lambda client: client["name"])}


def _chain(cluster: ClusterMap, recipient: str) -> list[tuple[str, str]]:
    """A recipient's chain as (alternative, its queue); a chain from an older log names no
    queues: each alternative's binding then, when the map knows one."""
    names = cluster.alternatives.get(recipient, ())
    queues = cluster.alternative_queues.get(recipient, ())
    if len(queues) == len(names):
        return list(zip(names, queues, strict=True))
    return [(name, _bound_queue(cluster, name) or "") for name in names]


def _bound_queue(cluster: ClusterMap, recipient: str) -> str | None:
    entry = cluster.recipients.get(recipient)
    return entry.queue if entry is not None else cluster.chain_binding(recipient)


# --- import: check the whole document, then plan ------------------------------------------------
def plan_import(document: Any, cluster: ClusterMap, clients: Mapping[str, Mapping[str, Any]],
                checks: Checks) -> tuple[list[Step], list[str]]:
    """(the steps, in the order they must run, and every problem found). With any problem the
    steps are not to be run: an import changes nothing unless the whole document holds."""
    planner = _Planner(cluster, clients, checks)
    planner.run(document)
    return (planner.steps if not planner.problems else []), planner.problems


class _Planner:
    def __init__(self, cluster: ClusterMap, clients: Mapping[str, Mapping[str, Any]], checks: Checks) -> None:
        self.cluster = cluster
        self.clients_by_name = {str(record.get("name")): record for record in clients.values()}
        self.checks = checks
        self.problems: list[str] = []
        self.steps: list[Step] = []
        # What the cluster will hold once the document is in, where later checks look: a queue
        # that exists keeps its own options (a conflict is never changed).
        self.queue_options: dict[str, QueueOptions] = {}
        for name, entry in cluster.queues.items():
            try:
                self.queue_options[name] = options_from_json(entry.options)
            except (TypeError, ValueError, KeyError):     # written by a newer release: take it as it is
                self.queue_options[name] = QueueOptions()
        self.macro_names: set[str] = set(cluster.macros)
        self.forwarded: dict[str, str] = {entry.source: name for name, entry in cluster.forwards.items()}

    def problem(self, where: str, text: str) -> None:
        self.problems.append(f"{where}: {text}")

    def run(self, document: Any) -> None:
        if not isinstance(document, dict):
            self.problem("document", 'a definitions document is a JSON object {"format": 1, "queues": [...], ...}')
            return
        if document.get("format") != FORMAT:
            self.problem("format", f"this release reads definitions format {FORMAT}, not {document.get('format')!r}")
            return
        unknown = set(document) - {"format", *INFORMATIONAL, *SECTIONS}
        if unknown:
            self.problem("document", f"unknown keys {', '.join(sorted(map(str, unknown)))} (sections are "
                                     f"{', '.join(SECTIONS)})")
        sections: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for section in SECTIONS:
            sections[section] = self._items(section, document.get(section, []))
        # Names first, across sections: a macro queue may name a queue defined later in the file.
        for _, item in sections["macros"]:
            if isinstance(item.get("name"), str):
                self.macro_names.add(item["name"])
        for where, item in sections["queues"]:
            self._queue(where, item)
        for where, item in sections["channels"]:
            self._channel(where, item)
        for where, item in sections["macros"]:
            self._macro(where, item)
        for where, item in sections["recipients"]:
            self._recipient(where, item)
        for where, item in sections["forwards"]:
            self._forward(where, item)
        for where, item in sections["clients"]:
            self._client(where, item)

    def _items(self, section: str, raw: Any) -> list[tuple[str, dict[str, Any]]]:
        """The section's items as (where, item): each an object of known keys with a unique name."""
        if not isinstance(raw, list):
            self.problem(section, "a section is a list of objects")
            return []
        items, seen = [], set()
        for position, item in enumerate(raw):
            where = f"{section}[{position}]"
            if not isinstance(item, dict):
                self.problem(where, "an item is a JSON object")
                continue
            name = item.get("name")
            if isinstance(name, str):
                where = f"{where} {name}"
            unknown = set(item) - ITEM_KEYS[section]
            if unknown:
                self.problem(where, f"unknown keys {', '.join(sorted(map(str, unknown)))}" + (
                    " (private keys are never part of definitions)" if "private_key" in unknown else ""))
                continue
            if not isinstance(name, str) or not is_valid_queue_name(name):
                self.problem(where, "a name is 1-200 of A-Z a-z 0-9 . _ : - starting alphanumeric")
                continue
            if name in seen:
                self.problem(where, f"{name} is named twice in {section}")
                continue
            seen.add(name)
            items.append((where, item))
        return items

    # --- queues --------------------------------------------------------------------------------
    def _queue(self, where: str, item: dict[str, Any]) -> None:
        name = item["name"]
        if name.endswith(DEAD_LETTER_SUFFIX):
            self.problem(where, f"names ending {DEAD_LETTER_SUFFIX} belong to dead-letter queues, which come with "
                                "their queue (E_RESERVED_NAME)")
            return
        if name.startswith(CHANNEL_PREFIX):
            self.problem(where, "a channel's queue comes with its channel: define the channel under channels "
                                "(E_RESERVED_NAME)")
            return
        if name in self.macro_names:
            self.problem(where, f"{name} is a macro queue")
            return
        raw = item.get("options", {})
        if isinstance(raw, dict) and raw.keys() & PLACEMENT_OPTION_NAMES:
            self.problem(where, f"placement ({', '.join(sorted(raw.keys() & PLACEMENT_OPTION_NAMES))}) is not "
                                "part of definitions: the cluster places what it creates")
            return
        try:
            given, _ = parse_options(raw)
        except OptionError as error:
            self.problem(where, str(error))
            return
        entry = self.cluster.queues.get(name)
        if entry is None:
            self.queue_options[name] = QueueOptions(**given)
            self.steps.append(Step(QUEUE, name, CREATE, body=_json_options(given)))
            return
        different = mismatched_options(self.queue_options[name], given)
        if different:
            self.steps.append(Step(QUEUE, name, CONFLICT, f"exists with other {', '.join(different)}: left as it is"))
        else:
            self.steps.append(Step(QUEUE, name, UNCHANGED))

    # --- channels ------------------------------------------------------------------------------
    def _channel(self, where: str, item: dict[str, Any]) -> None:
        name = item["name"]
        delivery_class = item.get("class", DeliveryClass.LATEST.value)
        resend = item.get("resend_interval_s", 0.0)
        attributes = item.get("attributes", {})
        problem = attributes_problem(attributes)
        if problem is not None:
            self.problem(where, problem)
            return
        attributes = normalized(attributes)
        if name.endswith(DEAD_LETTER_SUFFIX):
            self.problem(where, f"channel names may not end {DEAD_LETTER_SUFFIX}")
            return
        if delivery_class not in {kind.value for kind in DeliveryClass} or type(resend) not in (int, float) \
                or not 0 <= resend <= CHANNEL_RESEND_MAX_S:
            self.problem(where, f"class is {', '.join(kind.value for kind in DeliveryClass)}, resend_interval_s "
                                f"0-{CHANNEL_RESEND_MAX_S}")
            return
        existing = self.cluster.channels.get(name)
        if existing is None:
            if channel_queue(name) in self.cluster.queues:
                self.problem(where, f"{channel_queue(name)} exists as a queue (E_RESERVED_NAME)")
                return
            self.steps.append(Step(CHANNEL, name, CREATE, body={"class": delivery_class, "resend_interval_s": float(resend),
                                                                **attributes}))
        elif (existing.delivery_class, existing.resend_interval_s, existing.attributes) == \
                (delivery_class, float(resend), attributes):
            self.steps.append(Step(CHANNEL, name, UNCHANGED))
        else:
            self.steps.append(Step(CHANNEL, name, CONFLICT, f"exists as {existing.delivery_class}, resend every "
                                                            f"{existing.resend_interval_s} s: left as it is"))

    # --- macro queues --------------------------------------------------------------------------
    def _macro(self, where: str, item: dict[str, Any]) -> None:
        name = item["name"]
        producer = item.get("producer", "round_robin")
        consumer = item.get("consumer", "prioritized")
        fastest_by = item.get("fastest_by", FastestBy.RESPONSE_TIME.value)
        members = item.get("members", [])
        if name.endswith(DEAD_LETTER_SUFFIX) or name in self.queue_options:
            self.problem(where, f"{name} is a queue" if name in self.queue_options else
                         f"macro queue names may not end {DEAD_LETTER_SUFFIX}")
            return
        if not all(isinstance(value, str) for value in (producer, consumer, fastest_by)):
            self.problem(where, "producer, consumer and fastest_by are strings")
            return
        policy_problem = macro_policy_problem(producer, consumer, fastest_by)
        if policy_problem:
            self.problem(where, policy_problem)
            return
        existing = self.cluster.macros.get(name)
        gate = GATED_CONSUMER_POLICIES.get(consumer)
        if existing is None and gate in versions.FEATURES:
            try:
                versions.require_feature(getattr(self.cluster, "feature_level", versions.OLDEST_FEATURE_LEVEL), gate)
            except QueueError as error:
                self.problem(where, f"{error.code}: {error.message}")
                return
        wanted = self._members(where, name, members)
        if wanted is None:
            return
        if existing is None:
            self.steps.append(Step(MACRO, name, CREATE, body={"producer": producer, "consumer": consumer,
                                                              "fastest_by": fastest_by}))
        elif (existing.producer, existing.consumer, existing.fastest_by) != (producer, consumer, fastest_by):
            self.steps.append(Step(MACRO, name, CONFLICT, f"exists with policies {existing.producer}/"
                                                          f"{existing.consumer}/{existing.fastest_by}: left as it is, "
                                                          "members too"))
            return
        else:
            self.steps.append(Step(MACRO, name, UNCHANGED))
        for queue, priority, weight in wanted:
            member = existing.member(queue) if existing is not None else None
            if member is None:
                self.steps.append(Step(MACRO_MEMBER, name, CREATE, body={"priority": priority, "weight": weight},
                                       member=queue))
            elif (member.priority, member.weight) == (priority, weight):
                self.steps.append(Step(MACRO_MEMBER, name, UNCHANGED, member=queue))
            else:
                self.steps.append(Step(MACRO_MEMBER, name, CONFLICT, f"a member with priority {member.priority}, "
                                                                     f"weight {member.weight}: left as it is",
                                       member=queue))

    def _members(self, where: str, name: str, members: Any) -> list[tuple[str, int, int]] | None:
        if not isinstance(members, list):
            self.problem(where, "members is a list")
            return None
        existing = self.cluster.macros.get(name)
        known = {member.queue for member in existing.members} if existing is not None else set()
        wanted: list[tuple[str, int, int]] = []
        ok = True
        for position, member in enumerate(members):
            at = f"{where} members[{position}]"
            if not isinstance(member, dict) or set(member) - {"queue", "priority", "weight"}:
                self.problem(at, 'a member is {"queue", "priority": 0-9, "weight": 1-100}')
                ok = False
                continue
            queue, priority, weight = member.get("queue"), member.get("priority", 0), member.get("weight", 1)
            if not isinstance(queue, str) or queue not in self.queue_options or queue.startswith(CHANNEL_PREFIX):
                self.problem(at, f"no queue {queue!r} in the document or the cluster")
                ok = False
            elif type(priority) is not int or type(weight) is not int or not 0 <= priority <= 9 \
                    or not 1 <= weight <= MACRO_MEMBER_WEIGHT_MAX:
                self.problem(at, f"priority is 0-9 and weight 1-{MACRO_MEMBER_WEIGHT_MAX} (integers)")
                ok = False
            elif any(queue == other for other, _, _ in wanted):
                self.problem(at, f"{queue} is named twice")
                ok = False
            else:
                wanted.append((queue, priority, weight))
        if len(known | {queue for queue, _, _ in wanted}) > MACRO_MEMBERS_MAX:
            self.problem(where, f"at most {MACRO_MEMBERS_MAX} members")
            ok = False
        every = sorted(known | {queue for queue, _, _ in wanted})
        kinds = {self.queue_options[queue].type.value for queue in every if queue in self.queue_options}
        if len(kinds) > 1:
            self.problem(where, f"its members are of types {', '.join(sorted(kinds))}: a macro queue's members "
                                "answer the same way (one type)")
            ok = False
        return wanted if ok else None

    # --- recipients' chains of alternatives ----------------------------------------------------
    def _recipient(self, where: str, item: dict[str, Any]) -> None:
        name = item["name"]
        chain = item.get("alternatives")
        if not isinstance(chain, list) or not 0 < len(chain) <= ALTERNATIVES_MAX:
            self.problem(where, f"alternatives is a list of 1-{ALTERNATIVES_MAX} {{\"name\", \"queue\"}}")
            return
        pairs: list[tuple[str, str]] = []
        for position, alternative in enumerate(chain):
            at = f"{where} alternatives[{position}]"
            if not isinstance(alternative, dict) or set(alternative) - {"name", "queue"} \
                    or not isinstance(alternative.get("name"), str) or not is_valid_queue_name(alternative["name"]):
                self.problem(at, 'an alternative is {"name": recipient, "queue": its queue}')
                return
            other, queue = alternative["name"], alternative.get("queue")
            if queue is None:       # one bound already (it subscribed, or another chain names it)
                queue = _bound_queue(self.cluster, other)
                if queue is None:
                    self.problem(at, f"name the queue of {other}, which the cluster has not bound to one")
                    return
            if not isinstance(queue, str) or queue not in self.queue_options or queue.startswith(CHANNEL_PREFIX):
                self.problem(at, f"no queue {queue!r} in the document or the cluster")
                return
            pairs.append((other, queue))
        names = [other for other, _ in pairs]
        if name in names or len(set(names)) != len(names):
            self.problem(where, "a chain names each alternative once, and not the recipient itself")
            return
        existing = _chain(self.cluster, name) if name in self.cluster.alternatives else None
        if existing is None:
            # The chain binds each alternative to its queue, and an administrator's binding wins
            # over a subscriber's (replication/cluster_map.py, SetAlternatives): say so.
            rebound = [f"{other} (bound to {self.cluster.recipients[other].queue} by subscribing)"
                       for other, queue in pairs
                       if other in self.cluster.recipients and self.cluster.recipients[other].queue != queue]
            self.steps.append(Step(RECIPIENT, name, CREATE, f"rebinds {', '.join(rebound)}" if rebound else "",
                                   body={"alternatives": [f"{other}={queue}" for other, queue in pairs]}))
        elif existing == pairs:
            self.steps.append(Step(RECIPIENT, name, UNCHANGED))
        else:
            shown = ", ".join(f"{other}={queue}" for other, queue in existing)
            self.steps.append(Step(RECIPIENT, name, CONFLICT, f"has the chain {shown}: left as it is"))

    # --- forwards ------------------------------------------------------------------------------
    def _forward(self, where: str, item: dict[str, Any]) -> None:
        name = item["name"]
        source, destination = item.get("source"), item.get("destination")
        urls, client_id, control = item.get("urls", []), item.get("client_id", ""), item.get("control", {})
        if not isinstance(control, dict):      # its fields are checked where the forward is created
            self.problem(where, 'control is {"bands", "weights", "fill_unit", "fill_bytes"} (PROTOCOL.md "Forwards")')
            return
        for value, what in ((source, "source"), (destination, "destination")):
            if not isinstance(value, str) or not is_valid_queue_name(value):
                self.problem(where, f"{what} must be a valid queue name")
                return
        assert isinstance(source, str) and isinstance(destination, str)
        if not isinstance(urls, list) or len(urls) > FORWARD_URLS_MAX or not all(
                isinstance(url, str) and url.startswith(("http://", "https://")) for url in urls):
            self.problem(where, f"urls is a list of at most {FORWARD_URLS_MAX} http(s) URLs of the destination's "
                                "cluster")
            return
        if not isinstance(client_id, str):
            self.problem(where, "client_id is a string")
            return
        urls = [url.rstrip("/") for url in urls]
        existing = self.cluster.forwards.get(name)
        if existing is not None:
            if (existing.source, existing.destination, list(existing.urls), existing.client_id, existing.control) == \
                    (source, destination, urls, client_id or existing.client_id, control):
                self.steps.append(Step(FORWARD, name, UNCHANGED))
            else:
                self.steps.append(Step(FORWARD, name, CONFLICT, f"exists as {existing.source} -> "
                                                                f"{existing.destination}"
                                                                f"{' at ' + ', '.join(existing.urls) if existing.urls else ''}"
                                                                f" as {existing.client_id or 'this cluster'}: left as "
                                                                "it is"))
            return
        options = self.queue_options.get(source)
        if options is None or source.startswith(CHANNEL_PREFIX):
            self.problem(where, f"no queue {source} in the document or the cluster")
            return
        if options.strength.value != "full":
            self.problem(where, f"its source {source} is not a `full` queue (under `producer` a replica's copy of a "
                                "message would never be forwarded)")
            return
        if source in self.forwarded:
            self.problem(where, f"queue {source} is forwarded already, by {self.forwarded[source]}")
            return
        body: dict[str, Any] = {"name": name, "source": source, "destination": destination, "urls": urls,
                                **({"control": control} if control else {})}
        if not urls:
            if destination == source:
                self.problem(where, "a forward into its own source")
                return
            if destination not in self.queue_options:
                self.problem(where, f"no queue {destination} in the document or the cluster")
                return
        else:
            credentials = self._credentials(where, name, item.get("credentials"), client_id)
            if credentials is None:
                return
            body["credentials"] = credentials
        if len(self.cluster.forwards) + sum(1 for step in self.steps if step.kind == FORWARD
                                            and step.action == CREATE) >= FORWARDS_MAX:
            self.problem(where, f"the cluster holds at most {FORWARDS_MAX} forwards")
            return
        self.forwarded[source] = name
        self.steps.append(Step(FORWARD, name, CREATE, body=body))

    def _credentials(self, where: str, name: str, raw: Any, client_id: str) -> dict[str, str] | None:
        """A new forward to another cluster signs there as a client of that cluster, whose
        private key no export holds: the import must bring it (qctl definitions import
        --forward-credentials NAME=FILE)."""
        if raw is None:
            self.problem(where, "a forward to another cluster needs the private key of its client there, which "
                                "no export holds: give it at import (qctl definitions import --forward-credentials "
                                f"{name}=FILE, or \"credentials\": {{\"client_id\", \"private_key\", "
                                "\"ca\"}} in the item)")
            return None
        if not isinstance(raw, dict) or set(raw) - {"client_id", "private_key", "ca"} \
                or not isinstance(raw.get("client_id"), str) or not isinstance(raw.get("private_key"), str) \
                or not isinstance(raw.get("ca", ""), str):
            self.problem(where, 'credentials is {"client_id", "private_key", "ca"?} (strings)')
            return None
        if client_id and raw["client_id"] != client_id:
            self.problem(where, f"the credentials are of client {raw['client_id']}, the forward names {client_id}")
            return None
        wrong = self.checks.private_key(raw["private_key"]) or (self.checks.ca(raw["ca"]) if raw.get("ca") else "")
        if wrong:
            self.problem(where, f"credentials: {wrong}")
            return None
        return dict(raw)

    # --- clients -------------------------------------------------------------------------------
    def _client(self, where: str, item: dict[str, Any]) -> None:
        name, public_key, grants = item["name"], item.get("public_key"), item.get("grants", [])
        if not isinstance(public_key, str):
            self.problem(where, "a client is defined by its public key (the private key stays with the client)")
            return
        wrong = self.checks.public_key(public_key) or self.checks.grants(grants)
        if wrong:
            self.problem(where, wrong)
            return
        existing = self.clients_by_name.get(name)
        if existing is None:
            self.steps.append(Step(CLIENT, name, CREATE, body={"name": name, "public_key": public_key,
                                                               "grants": grants}))
        elif existing.get("public_key") == public_key and _grant_set(existing.get("grants", [])) == _grant_set(grants):
            self.steps.append(Step(CLIENT, name, UNCHANGED))
        else:
            what = "another public key" if existing.get("public_key") != public_key else "other grants"
            self.steps.append(Step(CLIENT, name, CONFLICT, f"exists ({existing.get('id')}) with {what}: left as it is"))


def _grant_set(grants: Any) -> set[tuple[str, tuple[str, ...]]]:
    return {(str(grant.get("pattern")), tuple(sorted(set(grant.get("privileges", [])))))
            for grant in grants if isinstance(grant, dict)}


def _json_options(given: dict[str, Any]) -> dict[str, Any]:
    """parse_options' values as the REST route's JSON body takes them (enums as their values)."""
    return {name: getattr(value, "value", value) for name, value in given.items()}
