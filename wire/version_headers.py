"""The headers that carry versions on every link, and the negotiation rules they follow
(docs/PROTOCOL.md, "Versions and negotiation"). Pure functions, shared by the node and the
client; wire/versions.py holds the versions themselves.

Every link offers its range when it connects and the responder answers with its own:

- Peer links (replication, membership): the dialer's upgrade request carries `X-Peer-Versions`
  (its range for the link's purpose) and `X-Peer-Release`; the responder picks the highest
  version both hold and answers the 101 with its own range, release and `X-Peer-Version` (the
  chosen one), or refuses the upgrade with E_VERSION_MISMATCH naming both sides.
- Client links (REST and the WebSocket upgrade): the client sends
  `X-Qcluster-Client: RELEASE; protocol=LOW-HIGH`; every answer of a node carries
  `X-Qcluster-Node: RELEASE; protocol=LOW-HIGH; feature-level=N`.

A side that sends none of these is release 0.1.0 (or older), from before ranges were offered:
it is taken to speak `versions.SILENT_PEER`'s versions, and its release is None. Release 0.1.0
ignores every header it does not read, on requests and on answers, so it never sees these.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from wire import versions
from wire.errors import (
    E_BAD_REQUEST,
    E_INVALID_OPTION,
    E_METHOD_NOT_ALLOWED,
    E_NOT_FOUND,
    E_VERSION_MISMATCH,
    QueueError,
)
from wire.versions import VersionRange

PEER_VERSIONS = "X-Peer-Versions"      # the sender's range for the link's purpose, "8-9"
PEER_RELEASE = "X-Peer-Release"        # the sender's release, "0.2.0"
PEER_VERSION = "X-Peer-Version"        # the responder's choice, on the 101 answer
CLIENT_HEADER = "X-Qcluster-Client"
NODE_HEADER = "X-Qcluster-Node"
SILENT_RELEASE_TEXT = "0.1.0 (or older)"
HEADER_CHARS_MAX = 200


@dataclass(frozen=True, slots=True)
class Side:
    """What one side of a link named about itself: None release = it named nothing (0.1.0 or older)."""
    release: str | None
    protocol: VersionRange
    feature_level: int | None = None

    def describe(self) -> str:
        return f"release {release_text(self.release)}, versions {self.protocol.render()}"


def release_text(release: str | None) -> str:
    return SILENT_RELEASE_TEXT if release is None else release


def protocol_range(purpose: str) -> VersionRange:
    """This release's range for a link purpose: client, replication or membership."""
    return {"client": versions.CLIENT_PROTOCOL, "replication": versions.REPLICATION_PROTOCOL,
            "membership": versions.MEMBERSHIP_PROTOCOL}[purpose]


def silent_side(purpose: str) -> Side:
    return Side(None, versions.SILENT_PEER[purpose])


def negotiate(purpose: str, mine: Side, theirs: Side) -> int:
    """The highest version both sides speak, or E_VERSION_MISMATCH naming both sides."""
    chosen = mine.protocol.common(theirs.protocol)
    if chosen is None:
        raise QueueError(E_VERSION_MISMATCH,
                         f"no common {purpose} protocol version: this side runs {mine.describe()}; the other "
                         f"runs {theirs.describe()}; upgrade the older side (docs/OPERATIONS.md, \"Upgrades\")")
    return chosen


def _checked_release(text: str) -> str:
    versions.release_key(text)      # ValueError on anything that is not a release
    return text


# --- peer links ------------------------------------------------------------------------------------
def own_side(purpose: str) -> Side:
    """This release's side of a link of `purpose`."""
    return Side(versions.RELEASE, protocol_range(purpose))


def peer_offer(mine: Side) -> dict[str, str]:
    """The headers a dialer adds to its upgrade request (beside the signed X-Peer-* ones)."""
    return {PEER_VERSIONS: mine.protocol.render(), PEER_RELEASE: release_text(mine.release)}


def peer_side(purpose: str, headers: Mapping[str, str]) -> Side:
    """The other side of a peer link as its headers name it (silent: SILENT_PEER). E_BAD_REQUEST
    when the headers are there and malformed."""
    offered, release = headers.get(PEER_VERSIONS), headers.get(PEER_RELEASE)
    if offered is None and release is None:
        return silent_side(purpose)
    try:
        if offered is None or release is None or len(offered) + len(release) > HEADER_CHARS_MAX:
            raise ValueError(f"{PEER_VERSIONS} and {PEER_RELEASE} travel together")
        return Side(_checked_release(release), VersionRange.parse(offered))
    except ValueError as error:
        raise QueueError(E_BAD_REQUEST, f"malformed version headers: {error}") from None


def peer_answer(mine: Side, chosen: int | None) -> dict[str, str]:
    """The headers of the responder's 101 answer (or of its refusal, where `chosen` is None)."""
    headers = peer_offer(mine)
    if chosen is not None:
        headers[PEER_VERSION] = str(chosen)
    return headers


def dialer_outcome(purpose: str, headers: Mapping[str, str], mine: Side | None = None) -> tuple[int, Side]:
    """The version a dialer uses after the 101, and the responder's side. A silent responder
    (0.1.0) speaks SILENT_PEER's versions, of which the dialer picks the highest it shares;
    a responder that chose a version outside this side's range is E_VERSION_MISMATCH."""
    theirs = peer_side(purpose, headers)
    mine = own_side(purpose) if mine is None else mine
    chosen_text = headers.get(PEER_VERSION)
    if chosen_text is None:
        return negotiate(purpose, mine, theirs), theirs
    if not (chosen_text.isascii() and chosen_text.isdigit()) or len(chosen_text) > 6:
        raise QueueError(E_BAD_REQUEST, f"malformed {PEER_VERSION} {chosen_text[:20]!r}")
    chosen = int(chosen_text)
    if not mine.protocol.low <= chosen <= mine.protocol.high:
        raise QueueError(E_VERSION_MISMATCH, f"the responder chose {purpose} version {chosen}, outside this "
                                             f"side's {mine.protocol.render()} ({theirs.describe()})")
    return chosen, theirs


# --- client links ----------------------------------------------------------------------------------
def client_header() -> str:
    return f"{versions.RELEASE}; protocol={versions.CLIENT_PROTOCOL.render()}"


def node_header(feature_level: int) -> str:
    return f"{versions.RELEASE}; protocol={versions.CLIENT_PROTOCOL.render()}; feature-level={feature_level}"


def parse_side(text: str | None) -> Side:
    """`RELEASE; protocol=LOW-HIGH[; feature-level=N][; other=...]` (unknown keys are ignored:
    a later release may add some); None = a silent side. ValueError when malformed."""
    if text is None:
        return silent_side("client")
    if len(text) > HEADER_CHARS_MAX:
        raise ValueError("the version header is too long")
    release, *pairs = (part.strip() for part in text.split(";"))
    fields: dict[str, str] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"{pair[:40]!r} is not key=value")
        fields[key.strip().lower()] = value.strip()
    if "protocol" not in fields:
        raise ValueError("the version header names no protocol=LOW-HIGH")
    level_text = fields.get("feature-level")
    if level_text is not None and not (level_text.isascii() and level_text.isdigit() and len(level_text) <= 6):
        raise ValueError(f"feature-level {level_text[:20]!r} is not a number")
    return Side(_checked_release(release), VersionRange.parse(fields["protocol"]),
                None if level_text is None else int(level_text))


def check_client(text: str | None) -> Side:
    """The node's check of a client's header: E_BAD_REQUEST when malformed, E_VERSION_MISMATCH
    when the client speaks no version of this node's range. A client without the header
    (release 0.1.0) is served as before."""
    try:
        client = parse_side(text)
    except ValueError as error:
        raise QueueError(E_BAD_REQUEST, f"malformed {CLIENT_HEADER}: {error}") from None
    negotiate("client", Side(versions.RELEASE, versions.CLIENT_PROTOCOL), client)
    return client


def node_is_older(release: str | None) -> bool:
    """Whether a node that named `release` (None: named none) runs a release before this client's."""
    if release is None:
        return True
    try:
        return versions.release_key(release) < versions.release_key(versions.RELEASE)
    except ValueError:
        return False


def older_node_message(release: str | None, what: str, original: str) -> str:
    """The message of an error from a node older than this client, about something it lacks."""
    return (f"the node runs qserver {release_text(release)}, which does not support {what}; upgrade the cluster "
            f"(the node said: {original})")


# What a node answers when it lacks a route, a method on a route, or an option's name or value
# (an E_INVALID_OPTION whose message says the name is unknown or the value is not one it knows:
# replication/options.py, replication/map_entries.py).
LACK_MARKS = ("unknown", "one of")
LACKS = {E_NOT_FOUND.code: "{request}", E_METHOD_NOT_ALLOWED.code: "{request}",
         E_INVALID_OPTION.code: "an option or value of {request}"}


def explain_older_node(error: QueueError, release: str | None, request: str) -> QueueError:
    """`error` as is, or, when it says the node lacks something and the node runs an older
    release than this client (or named none), the same code with a message that says so."""
    what = LACKS.get(error.code)
    if what is None or not node_is_older(release) or error.message.startswith("the node runs qserver"):
        return error
    if error.code == E_INVALID_OPTION.code and not any(mark in error.message for mark in LACK_MARKS):
        return error        # a value out of range is the caller's mistake, not a lack of the node
    return QueueError(error.kind, older_node_message(release, what.format(request=request), error.message),
                      outcome_unknown=error.outcome_unknown)
