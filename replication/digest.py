"""The rolling digest of a queue's replicated history (STYLE.md: checksums across every
boundary). Each member folds every replicated operation into it in ordering-index order, so
master and replica compare one value at index N instead of their whole histories: equal
digests at equal indices mean equal histories (up to a 128-bit hash collision)."""
from __future__ import annotations

import hashlib

from replication.messages import encode_operation
from replication.operations import Operation

DIGEST_BYTES = 16
EMPTY_DIGEST = bytes(DIGEST_BYTES)


def fold(digest: bytes, op: Operation) -> bytes:
    """The digest after `op`, from the digest before it."""
    return fold_encoded(digest, encode_operation(op))


def fold_encoded(digest: bytes, encoded: bytes) -> bytes:
    """The same, from the operation's encoding (which both members stream and log as is)."""
    return hashlib.blake2b(digest + encoded, digest_size=DIGEST_BYTES).digest()

