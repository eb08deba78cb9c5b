"""The aiohttp session every signed request goes out on, the client library's and the node's
(a node dials its peers with signed upgrades, docs/PROTOCOL.md "Peer links")."""
from __future__ import annotations

import aiohttp


def signed_session(connector: aiohttp.BaseConnector | None = None) -> aiohttp.ClientSession:
    """An aiohttp session for signed requests. aiohttp sends a GET, PUT or DELETE once more,
    with the same headers, when the pooled connection it went out on turns out broken; the
    node may have taken the first, and then refuses the copy as a replay (its nonce was
    used): a WebSocket upgrade refused E_REPLAYED_REQUEST ended a client for good after a
    link was cut and healed (bench/bench_failover.py --blackholes). Every send here is signed
    anew by our own retries, so aiohttp's resend is switched off."""
    session = aiohttp.ClientSession(connector=connector)
    if not hasattr(session, "_retry_connection"):
        raise RuntimeError("this aiohttp has no _retry_connection switch: check how it resends requests")
    session._retry_connection = False
    return session
