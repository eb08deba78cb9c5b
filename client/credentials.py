"""Where a client's identity comes from: the credentials file and how it is found.

A credentials file is a small JSON document holding a registered client's id, its Ed25519
private key (base64 of the raw 32 bytes) and the URL of a node to talk to:

    {"client_id": "c-1a2b", "private_key": "base64...", "url": "http://127.0.0.1:7100"}

and, for a cluster that serves TLS (`https://` URLs), `"ca_file"`: the CA certificate the
client checks the nodes' certificates against (qserver/tls.py).

`qserver init` writes the first admin's file with `save_credentials`, `qctl clients add --out`
writes one for each new client, and `load_credentials` finds it without flags: an explicit
path first, then `$QSERVER_CREDENTIALS`, then `./.qserver/credentials.json`, then
`~/.config/qserver/credentials.json`. The file holds a secret, so it is written with mode 0600.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.errors import E_UNAUTHENTICATED, QueueError
from client.signing import Signer, private_key_from_text

ENV_CREDENTIALS = "QSERVER_CREDENTIALS"
DEFAULT_URL = "http://127.0.0.1:7100"
LOCAL_CREDENTIALS = Path(".qserver") / "credentials.json"
USER_CREDENTIALS = Path("~") / ".config" / "qserver" / "credentials.json"
CREDENTIALS_FILE_BYTES_MAX = 64 * 1024


@dataclass(frozen=True, slots=True)
class Credentials:
    """A registered client's id and private key, and the node URL it talks to by default."""

    client_id: str
    private_key_text: str
    url: str = DEFAULT_URL
    ca_file: str = ""          # the CA that signs the nodes' TLS certificates ("" : the system's)

    def signer(self) -> Signer:
        return Signer(self.client_id, private_key_from_text(self.private_key_text))

    def to_json(self) -> dict[str, str]:
        document = {"client_id": self.client_id, "private_key": self.private_key_text, "url": self.url}
        if self.ca_file:
            document["ca_file"] = self.ca_file
        return document

    @classmethod
    def from_json(cls, document: Any, source: str = "credentials") -> Credentials:
        """Validate a parsed credentials document; a bad one raises E_UNAUTHENTICATED."""
        if not isinstance(document, dict):
            raise _bad(source, "expected a JSON object")
        client_id, key_text = document.get("client_id"), document.get("private_key")
        url = document.get("url", DEFAULT_URL)
        if not isinstance(client_id, str) or not client_id:
            raise _bad(source, "client_id must be a non-empty string")
        ca_file = document.get("ca_file", "")
        if not isinstance(key_text, str) or not isinstance(url, str) or not isinstance(ca_file, str):
            raise _bad(source, "private_key, url and ca_file must be strings")
        try:
            private_key_from_text(key_text)
        except ValueError as exc:  # bad base64 and wrong key length both land here
            raise _bad(source, f"private_key is not a base64 raw Ed25519 key ({exc})") from None
        return cls(client_id, key_text, url.rstrip("/"), ca_file)


def _bad(source: str, reason: str) -> QueueError:
    return QueueError(E_UNAUTHENTICATED, f"{source}: {reason}")


def credentials_search_path(path: str | Path | None = None) -> list[Path]:
    """The files `load_credentials` tries, in order."""
    if path is not None:
        return [Path(path).expanduser()]
    candidates = []
    from_env = os.environ.get(ENV_CREDENTIALS)
    if from_env:
        candidates.append(Path(from_env).expanduser())
    candidates.append(LOCAL_CREDENTIALS)
    candidates.append(USER_CREDENTIALS.expanduser())
    return candidates


def load_credentials(path: str | Path | None = None) -> Credentials:
    """Read the first credentials file found (see the module docstring for the order).

    An explicit path or `$QSERVER_CREDENTIALS` that does not exist is an error rather than
    a reason to fall through: silently using another identity would be a surprise.
    """
    candidates = credentials_search_path(path)
    explicit = path is not None or bool(os.environ.get(ENV_CREDENTIALS))
    for index, candidate in enumerate(candidates):
        if candidate.is_file():
            return _read(candidate)
        if index == 0 and explicit:
            raise QueueError(E_UNAUTHENTICATED, f"no credentials file at {candidate}")
    looked = ", ".join(str(c) for c in candidates)
    raise QueueError(E_UNAUTHENTICATED, f"no credentials found (looked in {looked})")


def _read(path: Path) -> Credentials:
    try:
        with path.open("rb") as handle:
            raw = handle.read(CREDENTIALS_FILE_BYTES_MAX + 1)
    except OSError as exc:
        raise _bad(str(path), f"cannot read ({exc.strerror})") from None
    if len(raw) > CREDENTIALS_FILE_BYTES_MAX:
        raise _bad(str(path), "file is too large to be a credentials file")
    try:
        document = json.loads(raw)
    except ValueError:
        raise _bad(str(path), "not valid JSON") from None
    return Credentials.from_json(document, str(path))


def save_credentials(path: str | Path, creds: Credentials) -> None:
    """Write `creds` to `path` with mode 0600, atomically (a reader never sees half a file).

    The temporary file is created 0600 before any byte of the key is written, so the secret
    is never readable by others, not even for a moment; missing parent directories are
    created 0700.
    """
    target = Path(path).expanduser()
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    data = (json.dumps(creds.to_json(), indent=2) + "\n").encode()
    temporary.unlink(missing_ok=True)  # O_EXCL below: never reuse a file with a looser mode
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)  # O_CREAT's mode is filtered by the umask; make it exact
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
