"""Secrets at rest in the cluster map: sealed with a secret every node holds and the map does not.

The map (its Raft log, its snapshots, every node's copy in LMDB) is no place for a secret in the
clear: a forward's private key in another cluster, a client's access key secret
(docs/PROTOCOL.md "Forwards", "Access keys"). What the map keeps instead is the secret encrypted
with AES-256-GCM under a key derived (HKDF-SHA256) from the sealing secret: the cluster secret
in a cluster, which every member has and the map never holds, or a lone node's own
`sealing.secret` (qserver/node.py). Each use names its `purpose`, which gives it a key of its own,
and a `binding` (the names the secret belongs to) sealed in as associated data, so a sealed text
copied to another entry of the map does not open there.

A stored text is "sealed1:" followed by base64 of the 12-byte nonce and the ciphertext with its
tag. Purpose "forward credentials" is the format forwards have always stored
(qserver/features/forwards/forwarder.py seal_secret): maps written before this module existed open.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["ACCESS_KEY_PURPOSE", "SEALED_PREFIX", "SEALING_SECRET_FILE", "SealingError", "is_access_key_id",
           "is_sealed", "load_or_make_secret", "lone_node_secret", "new_access_key", "open_access_key", "open_sealed", "seal",
           "seal_access_key"]

SEALED_PREFIX = "sealed1:"       # the version of the stored format
NONCE_BYTES = 12
_KEYS_CACHED_MAX = 16            # (secret, purpose) -> derived key; a node has a handful of both
SEALING_SECRET_FILE = "sealing.secret"     # a lone node's without a cluster secret (lone_node_secret)
CLUSTER_SECRET_FILE = "cluster.secret"     # written by `qserver init` (qserver/cli.py)
SECRET_BYTES = 32


class SealingError(ValueError):
    """A stored text that does not open: not sealed, damaged, sealed under another secret or
    purpose, or bound to other names. Its message never holds the secret or the text."""


_keys: dict[tuple[bytes, str], AESGCM] = {}


def _key(secret: bytes, purpose: str) -> AESGCM:
    cached = _keys.get((secret, purpose))
    if cached is None:
        if not secret:
            raise SealingError("no sealing secret")
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                       info=f"qcluster {purpose} v1".encode()).derive(secret)
        cached = AESGCM(derived)
        if len(_keys) >= _KEYS_CACHED_MAX:
            _keys.pop(next(iter(_keys)))
        _keys[(secret, purpose)] = cached
    return cached


def is_sealed(stored: str) -> bool:
    return stored.startswith(SEALED_PREFIX)


def seal(secret: bytes, purpose: str, binding: str, plaintext: bytes) -> str:
    """The text the map keeps of `plaintext`: encrypted under `secret` for `purpose`, bound to
    `binding` (it opens only with the same three)."""
    nonce = os.urandom(NONCE_BYTES)
    sealed = _key(secret, purpose).encrypt(nonce, plaintext, binding.encode())
    return SEALED_PREFIX + base64.b64encode(nonce + sealed).decode()


def open_sealed(secret: bytes, purpose: str, binding: str, stored: str) -> bytes:
    """The plaintext `seal(secret, purpose, binding, ...)` sealed into `stored`; SealingError
    for anything else."""
    if not is_sealed(stored):
        raise SealingError("not a sealed text")
    try:
        raw = base64.b64decode(stored[len(SEALED_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise SealingError("a sealed text that is not base64") from None
    if len(raw) <= NONCE_BYTES:
        raise SealingError("a sealed text too short")
    try:
        return _key(secret, purpose).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], binding.encode())
    except InvalidTag:
        raise SealingError(f"a sealed {purpose} that does not open here (another secret or binding)") from None


def lone_node_secret(data_dir: Path) -> bytes:
    """The sealing secret of a node outside a cluster: the cluster secret `qserver init` wrote
    into its data directory (so what it sealed still opens should nodes join it), else its own
    `sealing.secret`, made on first start. A secret of the process would not do: what it sealed
    would not open after a restart."""
    cluster_secret = data_dir / CLUSTER_SECRET_FILE
    if cluster_secret.is_file():
        text = cluster_secret.read_text().strip()
        if text:
            return text.encode()
    return load_or_make_secret(data_dir / SEALING_SECRET_FILE)


def load_or_make_secret(path: Path) -> bytes:
    """A secret kept in a file: its text, made on first use (32 random bytes as hex, owner only)."""
    try:
        return path.read_text().strip().encode()
    except FileNotFoundError:
        pass
    text = os.urandom(SECRET_BYTES).hex()
    # Written whole under a name of this process, then linked into place: a second process on
    # the directory either links first or reads the whole file the first one linked.
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text + "\n")
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(temporary, path)
    except FileExistsError:
        return path.read_text().strip().encode()
    finally:
        temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)           # the name too survives a crash: else a restart makes another
    finally:
        os.close(directory)
    return text.encode()


# --- access keys (docs/PROTOCOL.md "Access keys"): the SQS gateway's credentials ------------------
# A client's record in the map holds {"access_keys": {key id: {"sealed": ..., "created_ms": ...}}};
# the secret is sealed for this purpose, bound to the client and the key id.
ACCESS_KEY_PURPOSE = "access key"
ACCESS_KEY_PREFIX = "AKQC"
_ACCESS_KEY_ID = re.compile(r"AKQC[A-Z2-7]{16}")


def new_access_key() -> tuple[str, str]:
    """(key id, secret access key): 20 characters "AKQC" + 16 of base32 (80 random bits), and
    40 of base64 (240 random bits), shaped as AWS's so that every SDK takes them."""
    key_id = ACCESS_KEY_PREFIX + base64.b32encode(os.urandom(10)).decode()
    return key_id, base64.b64encode(os.urandom(30)).decode()


def is_access_key_id(text: str) -> bool:
    return _ACCESS_KEY_ID.fullmatch(text) is not None


def seal_access_key(secret: bytes, client_id: str, key_id: str, secret_access_key: str) -> str:
    return seal(secret, ACCESS_KEY_PURPOSE, f"{client_id}\x1f{key_id}", secret_access_key.encode("ascii"))


def open_access_key(secret: bytes, client_id: str, key_id: str, sealed: str) -> bytes:
    """The secret access key (its text, ASCII, as a SigV4 signer uses it); SealingError when the
    sealed text does not open for that client and key."""
    return open_sealed(secret, ACCESS_KEY_PURPOSE, f"{client_id}\x1f{key_id}", sealed)
