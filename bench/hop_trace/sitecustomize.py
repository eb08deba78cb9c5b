"""Hop timestamps inside a `qserver` process, for bench/trace_hops.py only (never imported by
the product). Loaded by Python at start-up because trace_hops.py puts this folder first on the
PYTHONPATH of the nodes it starts; does nothing unless QSERVER_HOP_TRACE names a file prefix (the pid is added).

Each wrapped function appends `wall-clock ns, event` to an in-memory list, written out at exit
(the node stops in order on SIGTERM): the wrappers cost ~1 µs, which is the resolution this trace claims."""
from __future__ import annotations

import atexit
import os
import time

TRACE_PREFIX = os.environ.get("QSERVER_HOP_TRACE")


def _install() -> None:
    events: list[tuple[int, str]] = []
    now = time.time_ns

    def note(event: str) -> None:
        events.append((now(), event))

    def wrap(owner: object, name: str, event: str, *, end_event: str | None = None) -> None:
        original = getattr(owner, name)

        def traced(*args: object, **kwargs: object) -> object:
            note(event)
            try:
                return original(*args, **kwargs)
            finally:
                if end_event:
                    note(end_event)
        setattr(owner, name, traced)

    from qserver.api import ws_api
    from qserver.cluster import pairs, peer_inbox
    from qserver.core import engine, pipeline
    from qserver.storage import commit
    from qserver.storage import lmdb_store as storage
    from qserver.transport import peers

    wrap(ws_api.ClientConnection, "_handle_frame", "client frame in")
    wrap(ws_api, "encode_frame", "client answer encoded")
    wrap(engine.Engine, "_step_inbox", "engine steps inbox")
    wrap(pipeline.CommitPipeline, "start_commit", "batch sealed", end_event="commit started")
    wrap(pipeline.CommitPipeline, "_commit_done", "commit done (loop)")
    wrap(storage.Storage, "commit", "lmdb commit begins", end_event="lmdb commit ends (fsync'd)")
    wrap(commit.BatchWriter, "write", "txn write begins", end_event="txn write ends")
    wrap(peers, "encode_frame", "peer frame encoded")
    wrap(peers.PeerTransport, "_deliver", "peer frame in")

    original_decode = peer_inbox.decode_message

    def decode_message(data: bytes) -> object:
        message = original_decode(data)
        note(f"peer message in: {type(message).__name__}")
        return message
    peer_inbox.decode_message = decode_message
    original_encode = pairs.encode_message

    def encode_message(message: object) -> bytes:
        note(f"peer message out: {type(message).__name__}")
        return original_encode(message)
    pairs.encode_message = encode_message

    def dump() -> None:
        with open(f"{TRACE_PREFIX}.{os.getpid()}", "w") as out:
            for stamp, event in events:
                out.write(f"{stamp}\t{event}\n")
    atexit.register(dump)   # the node stops in order on SIGTERM, so atexit runs


if TRACE_PREFIX:
    _install()
