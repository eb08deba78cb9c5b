"""Every decoder that takes bytes from the network, as fuzz targets (issue 13).

Each target takes raw bytes and may only refuse them with the decoder's own error type (the
one its caller turns into an E_* answer or a dropped frame); any other exception, or a crash
of the interpreter, is a finding. The targets run under atheris (libFuzzer, coverage-guided)
where its wheel installs, else under hypothesis; tests/test_fuzz.py runs each a few seconds in
CI, and by hand for as long as wanted:

    .venv/bin/python tests/fuzz_targets.py TARGET [-max_total_time=600] [libFuzzer options]
    .venv/bin/python tests/fuzz_targets.py --list

A finding is written by libFuzzer as crash-<hash> in the working directory: replay it with
the same command and the file's path as the last argument.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _client_frame(data: bytes) -> None:
    from wire.protocol import FrameError, decode_client_frame
    try:
        decode_client_frame(data)                 # bad items come back as FrameError values
    except FrameError:
        pass


def _server_frame(data: bytes) -> None:
    from wire.protocol import FrameError, decode_server_frame
    try:
        decode_server_frame(data)
    except FrameError:
        pass


def _peer_message(data: bytes) -> None:
    from replication.messages import MessageError, decode_entry, decode_message
    try:
        message = decode_message(data)
    except MessageError:
        return
    for entry in getattr(message, "entries", ()):  # the log entries an Append carries
        try:
            decode_entry(entry)
        except MessageError:
            pass


def _log_entry(data: bytes) -> None:
    from replication.messages import MessageError, decode_entry
    try:
        decode_entry(data)
    except MessageError:
        pass


def _snapshot_rows(data: bytes) -> None:
    from replication.messages import MessageError
    from replication.snapshot import decode_rows
    try:
        decode_rows(data)
    except MessageError:
        pass


def _membership_frame(data: bytes) -> None:
    from replication.messages import MessageError
    from replication.raft_codec import decode_frame
    try:
        decode_frame(data)
    except MessageError:
        pass


def _queue_options(data: bytes) -> None:
    """A REST body for PUT /v1/queues/{q}: JSON the server parses, then checks."""
    from replication.options import OptionError, parse_options
    try:
        raw = json.loads(data)
    except ValueError:                            # E_BAD_JSON before parse_options
        return
    try:
        parse_options(raw)
    except OptionError:
        pass


def _signed_headers(data: bytes) -> None:
    """The signing headers of any request, and its path and body, from an unknown sender."""
    from qserver.api.auth import Authenticator
    from wire.errors import QueueError
    text = data.decode("utf-8", "replace")
    parts = (text.split("\n") + [""] * 7)[:7]
    headers = {"X-Client-Id": parts[0], "X-Timestamp": parts[1], "X-Nonce": parts[2], "X-Signature": parts[3],
               "Host": "127.0.0.1:7101"}      # this node's own address: the input reaches the signature check
    if not _AUTHENTICATOR:
        from wire.signing import new_private_key, public_key_text
        clients = {"c-1": {"public_key": public_key_text(new_private_key()),
                           "grants": [{"pattern": "*", "privileges": ["post"]}]}}
        authenticator = Authenticator(clients, skew_max_s=1e12)
        authenticator.bind("n1", ["127.0.0.1:7101"])
        _AUTHENTICATOR.append(authenticator)
    try:
        _AUTHENTICATOR[0].authenticate(parts[4] or "GET", parts[5] or "/", [("q", parts[6])], headers, data)
    except QueueError:
        pass


_AUTHENTICATOR: list[Any] = []             # one registry for every input (nonces accumulate as on a node)


def seeds(target: str) -> list[bytes]:
    """Well-formed inputs for a target to start from (the fuzzer mutates them)."""
    import msgpack

    from replication.messages import Append, AppendAck, encode_entry, encode_message
    from replication.operations import Enqueued
    from wire.protocol import EnqueueOp, ReceiveOp, encode_frame
    entry = encode_entry([Enqueued(1, 1, 4, 1_700_000_000_000, "d-1", "c-1", b"payload")])
    return {
        "client_frame": [encode_frame([EnqueueOp(1, "q", b"x", 4, "d"), ReceiveOp(2, "q", 5, 100, None)])],
        "server_frame": [msgpack.packb([1, [[1, 7, [3, 1]], [2, 8, "E_UNKNOWN_QUEUE", "no"]]])],
        "peer_message": [encode_message(Append("q", 1, 1, 0, (entry,), 1)), encode_message(AppendAck("q", 1, 1, 0, 5))],
        "log_entry": [entry],
        "snapshot_rows": [msgpack.packb([[1, 1, 4, 1_700_000_000_000, "d", "c", b"x", 0, None]])],
        "membership_frame": [],
        "queue_options": [b'{"strength": "full", "max_depth": 10, "type": "two_way"}'],
        "signed_headers": [b"c-1\n1700000000000\nnonce\nc2lnbmF0dXJl\nPOST\n/v1/queues/q/messages\nx"],
    }[target]


TARGETS: dict[str, Callable[[bytes], None]] = {
    "client_frame": _client_frame, "server_frame": _server_frame, "peer_message": _peer_message,
    "log_entry": _log_entry, "snapshot_rows": _snapshot_rows, "membership_frame": _membership_frame,
    "queue_options": _queue_options, "signed_headers": _signed_headers,
}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        print("targets: " + " ".join(TARGETS))
        sys.exit(0 if len(argv) > 1 and argv[1] == "--list" else 2)
    import atheris
    target = TARGETS[argv[1]]
    with atheris.instrument_imports():
        import qserver.api.auth  # noqa: F401
        import replication.messages  # noqa: F401
        import replication.options  # noqa: F401
        import replication.raft_codec  # noqa: F401
        import replication.snapshot  # noqa: F401
        import wire.protocol  # noqa: F401
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
