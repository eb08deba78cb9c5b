"""The console's one-time sign-in link (docs/CONSOLE.md, "Signing in"), minted by the client
(`qctl console`) with its own private key and checked by the node, so that no private key is ever
pasted into a browser.

A link is `<node URL>/console/signin?client=ID&t=MS&n=NONCE&s=SIGNATURE` where SIGNATURE is the
client's Ed25519 signature (the request scheme's "QS2:" + base64, wire/signing.py) over

    "QC1\\n" CLIENT_ID "\\n" AUDIENCE "\\n" TIMESTAMP "\\n" NONCE

The audience is the node the link names (host:port, as for signed requests): a link minted for
one node holds at no other. The node takes a link once, within LINK_VALID_MS of its timestamp,
and turns it into a session cookie carrying that client's grants.
"""
from __future__ import annotations

import os
import time
from urllib.parse import urlencode

from wire.signing import Signer, audience_of

SIGNIN_VERSION = "QC1"
SIGNIN_PATH = "/console/signin"
LINK_VALID_MS = 60_000          # a link is taken within a minute of its minting, once


def signin_message(client_id: str, audience: str, timestamp_ms: int, nonce: str) -> bytes:
    text = "\n".join((SIGNIN_VERSION, client_id, audience_of(audience), str(timestamp_ms), nonce))
    return text.encode("utf-8", "surrogateescape")


def signin_link(node_url: str, signer: Signer, *, timestamp_ms: int | None = None) -> str:
    """A sign-in link to the console of the node at `node_url`, for `signer`'s client."""
    stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce = os.urandom(16).hex()
    signature = signer.signature(signin_message(signer.client_id, node_url, stamp, nonce))
    query = urlencode({"client": signer.client_id, "t": str(stamp), "n": nonce, "s": signature})
    return f"{node_url.rstrip('/')}{SIGNIN_PATH}?{query}"
