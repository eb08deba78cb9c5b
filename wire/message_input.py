"""What a message may carry, and the one check of each thing a producer or consumer gives.

Every surface that takes a message in (REST in qserver/api/message_routes.py, the WebSocket's
frames in wire/protocol.py and qserver/api/ws_api.py, channels' publish, the engine's enqueue
steps, the client library before it sends) checks it here, so a bad input gets the same words
whichever way it came (docs/PROTOCOL.md, "Messages" and "Headers"). The limits are here too:
the queue options (replication/options.py) and the frame codec take them from this module.

Pure (no I/O, no clock): both the client and the server import it. A check raises QueueError
with the code the surfaces have always answered (E_INVALID_OPTION, E_PAYLOAD_TOO_LARGE,
E_RESERVED_HEADER); where a surface answers a malformed frame with E_BAD_FRAME instead
(wire/protocol.py), it reads the same limits.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from wire import errors as e
from wire.errors import QueueError

PRIORITY_MIN, PRIORITY_MAX = 0, 9
PRIORITY_DEFAULT = 4
TTL_MAX_S = 1_209_600.0       # a message's time to live: at most 14 days (SQS's longest retention)
TTL_MS_MAX = int(TTL_MAX_S * 1000)
TTL_MIN_S = 0.001             # REST `ttl_s`: the smallest time to live (0 or none: the queue's default)
DELAY_MAX_S = 900.0           # a message's delivery delay: at most 15 minutes (as SQS)
DELAY_MS_MAX = int(DELAY_MAX_S * 1000)
VISIBILITY_MAX_S = 43_200.0   # a lease (visibility timeout): at most 12 hours (as SQS)
VISIBILITY_MS_MAX = int(VISIBILITY_MAX_S * 1000)
RECEIVE_MESSAGES_MAX = 10_000  # one receive leases at most this many messages
DEDUPE_ID_CHARS_MAX = 128
HEADERS_MAX = 16             # a message's headers: at most this many names,
HEADER_NAME_CHARS_MAX = 64   # each name 1-64 printable characters,
HEADERS_CHARS_MAX = 4_096    # and all names and values together at most this many characters,
# besides a numbered stream's (replication/queue_core.py SEQUENCE_*_HEADER), each value at most 256.
STREAM_HEADERS = frozenset({"x-sequence-key", "x-sequence", "x-sequence-floor"})
STREAM_HEADER_CHARS_MAX = 256

# Headers the cluster itself sets on a message it moves (fault surveillance: docs/PROTOCOL.md
# "Fault surveillance"); an ordinary enqueue naming one is refused (E_RESERVED_HEADER): a client
# could otherwise pass a message off as failed over, or as another producer's.
FAILED_OVER_FROM = "x-failed-over-from"
RETURNED_FROM = "x-returned-from"
FAULT = "x-fault"
ORIGIN_PRODUCER = "x-origin-producer"      # the client that enqueued a message the cluster moved
FAILED_OVER_TRIED = "x-failed-over-tried"  # the recipients a moved message was at, in order ("a,b")
RESERVED_HEADERS = frozenset({FAILED_OVER_FROM, RETURNED_FROM, FAULT, ORIGIN_PRODUCER, FAILED_OVER_TRIED})
REPLY_TO = "reply-to"                      # the queue a message returns to (its producer must be allowed to post there)

PRIORITY_TEXTS = frozenset(str(p) for p in range(PRIORITY_MIN, PRIORITY_MAX + 1))
PRIORITY_RULE = f"X-Priority must be {PRIORITY_MIN}-{PRIORITY_MAX}"
DEDUPE_ID_RULE = f"dedupe ids are 1-{DEDUPE_ID_CHARS_MAX} printable characters"


def payload_refusal(payload: bytes, bytes_max: int) -> QueueError | None:
    """Why a message's payload is refused (over `bytes_max`, the node's body_bytes_max), or
    None: a batch keeps the refusal in the item's place, a single enqueue raises it."""
    if len(payload) > bytes_max:
        return QueueError(e.E_PAYLOAD_TOO_LARGE, f"message over {bytes_max} bytes")
    return None


def check_payload(payload: bytes, bytes_max: int) -> None:
    refusal = payload_refusal(payload, bytes_max)
    if refusal is not None:
        raise refusal


def valid_dedupe_id(dedupe_id: str) -> bool:
    """1-128 printable characters. Lone surrogates, which is how aiohttp hands over header
    bytes that are not UTF-8 and which storage could not encode, are not printable."""
    return 0 < len(dedupe_id) <= DEDUPE_ID_CHARS_MAX and dedupe_id.isprintable()


def dedupe_id_refusal(dedupe_id: str | None) -> QueueError | None:
    """Why a dedupe id is refused, or None (no id is fine: the message is not deduplicated)."""
    if dedupe_id is not None and not valid_dedupe_id(dedupe_id):
        return QueueError(e.E_INVALID_OPTION, DEDUPE_ID_RULE)
    return None


def check_dedupe_id(dedupe_id: str | None) -> None:
    refusal = dedupe_id_refusal(dedupe_id)
    if refusal is not None:
        raise refusal


def priority_from_text(raw: str | None) -> int:
    """A priority as REST carries it (the X-Priority header; none: PRIORITY_DEFAULT). The
    WebSocket carries an integer, which the frame codec bounds by PRIORITY_MIN..PRIORITY_MAX."""
    if raw is None:
        return PRIORITY_DEFAULT
    if raw not in PRIORITY_TEXTS:
        raise QueueError(e.E_INVALID_OPTION, PRIORITY_RULE)
    return int(raw)


def checked_headers(headers: Any) -> dict[str, str] | None:
    """A message's headers as given (a small map of printable names to strings, within the
    limits above; empty: None), or QueueError E_INVALID_OPTION naming what is wrong."""
    if headers is None or headers == {}:
        return None
    # The stream headers a forward sets (docs/PROTOCOL.md "Forwards") count apart, so that a
    # message accepted at its source, at the limits, can be forwarded (issue 32, Low).
    if not isinstance(headers, dict) or len(headers) > HEADERS_MAX + len(STREAM_HEADERS) \
            or sum(1 for name in headers if name not in STREAM_HEADERS) > HEADERS_MAX:
        raise _bad_headers(f"headers are a map of at most {HEADERS_MAX} names to strings")
    total = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not 0 < len(name) <= HEADER_NAME_CHARS_MAX or not name.isprintable():
            raise _bad_headers(f"a header name is 1-{HEADER_NAME_CHARS_MAX} printable characters")
        if not isinstance(value, str) or not value.isprintable():
            raise _bad_headers(f"header {name!r} must be a string of printable characters")
        if name not in STREAM_HEADERS:
            total += len(name) + len(value)
        elif len(value) > STREAM_HEADER_CHARS_MAX:
            raise _bad_headers(f"header {name!r} holds at most {STREAM_HEADER_CHARS_MAX} characters")
    if total > HEADERS_CHARS_MAX:
        raise _bad_headers(f"headers hold at most {HEADERS_CHARS_MAX} characters")
    return dict(headers)


def headers_from_json(raw: str | None) -> dict[str, str] | None:
    """A message's headers as REST carries them: `X-Headers`, a JSON object of names to strings."""
    if raw is None:
        return None
    try:
        return checked_headers(json.loads(raw))
    except ValueError as error:
        raise _bad_headers(f"X-Headers must be a JSON object of names to strings: {error}") from None
    except QueueError as error:
        raise _bad_headers(f"X-Headers must be a JSON object of names to strings: {error.message}") from None


def check_not_reserved(headers: Mapping[str, str]) -> None:
    """Refuse the headers only the cluster sets (RESERVED_HEADERS) on a producer's message."""
    reserved = RESERVED_HEADERS.intersection(headers)
    if reserved:
        raise QueueError(e.E_RESERVED_HEADER, f"the cluster sets {', '.join(sorted(reserved))} itself")


def reply_to_refusal(client: str, reply_to: str) -> QueueError:
    """A producer's `reply-to` names a queue it may not post to (the grant check is the node's)."""
    return QueueError(e.E_FORBIDDEN, f"client {client} may not post to {reply_to}, which its {REPLY_TO} names")


def _bad_headers(text: str) -> QueueError:
    return QueueError(e.E_INVALID_OPTION, text)
