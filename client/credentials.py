"""Where a client's identity comes from: the credentials file and how it is found.

A credentials file is a small JSON document holding a registered client's id, its Ed25519
private key (base64 of the raw 32 bytes) and the URL of a node to talk to:

    {"client_id": "c-1a2b", "private_key": "base64...", "url": "http://127.0.0.1:7100"}

and, for a cluster that serves TLS (`https://` URLs), `"ca_file"`: the CA certificate the
client checks the nodes' certificates against (qserver/transport/tls.py).

and, when a node wrote it (`qserver init`, `qserver admin-credential`), `"cluster"`: the data
directory of that node, so that a refusal can say which cluster the file belongs to.

`qserver init` writes the first admin's file with `save_credentials`, `qctl clients add --out`
writes one for each new client, and `load_credentials` finds it without flags: an explicit
path first, then `$QSERVER_CREDENTIALS`, then `./.qserver/credentials.json` (the demo's copy of
its cluster's credential), then `~/.config/qserver/credentials.json`. The file holds a secret,
so it is written with mode 0600.

A file of one cluster used against another fails with an answer that does not say so
(`E_UNAUTHENTICATED: unknown client`, or `E_UNAVAILABLE` when that cluster is not running):
`explain_refusal` adds which file was used, whose it is, and how to get the right one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wire.errors import E_UNAUTHENTICATED, E_UNAVAILABLE, QueueError
from wire.signing import Signer, private_key_from_text

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
    # The data directory of the node that issued it ("": unknown, e.g. `qctl clients add`).
    # Keyword-only, so that subclasses may add positional fields after ca_file.
    cluster: str = field(default="", kw_only=True)

    def signer(self) -> Signer:
        return Signer(self.client_id, private_key_from_text(self.private_key_text))

    def to_json(self) -> dict[str, str]:
        document = {"client_id": self.client_id, "private_key": self.private_key_text, "url": self.url}
        if self.ca_file:
            document["ca_file"] = self.ca_file
        if self.cluster:
            document["cluster"] = self.cluster
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
        ca_file, cluster = document.get("ca_file", ""), document.get("cluster", "")
        if not isinstance(key_text, str) or not isinstance(url, str) or not isinstance(ca_file, str) \
                or not isinstance(cluster, str):
            raise _bad(source, "private_key, url, ca_file and cluster must be strings")
        try:
            private_key_from_text(key_text)
        except ValueError as exc:  # bad base64 and wrong key length both land here
            raise _bad(source, f"private_key is not a base64 raw Ed25519 key ({exc})") from None
        return cls(client_id, key_text, url.rstrip("/"), ca_file, cluster=cluster)


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


def find_credentials(path: str | Path | None = None) -> Path:
    """The credentials file `load_credentials` reads (see the module docstring for the order).

    An explicit path or `$QSERVER_CREDENTIALS` that does not exist is an error rather than
    a reason to fall through: silently using another identity would be a surprise.
    """
    candidates = credentials_search_path(path)
    explicit = path is not None or bool(os.environ.get(ENV_CREDENTIALS))
    for index, candidate in enumerate(candidates):
        if candidate.is_file():
            return candidate
        if index == 0 and explicit:
            raise QueueError(E_UNAUTHENTICATED, f"no credentials file at {candidate}")
    looked = ", ".join(str(c) for c in candidates)
    raise QueueError(E_UNAUTHENTICATED, f"no credentials found (looked in {looked})")


def load_credentials(path: str | Path | None = None) -> Credentials:
    """Read the first credentials file found (`find_credentials`)."""
    return _read(find_credentials(path))


def describe(creds: Credentials) -> str:
    """Whose a credential is, for people: its client, the cluster that issued it, its URL."""
    issued = f"issued by the cluster of {creds.cluster}, " if creds.cluster else ""
    return f"client {creds.client_id!r}, {issued}for {creds.url}"


# How to get the credential of the cluster one meant: README.md, "Credentials".
RIGHT_CREDENTIAL_HINT = (
    "use the credential of the cluster you mean: the demo keeps its cluster's in DATA_DIR/admin-credentials.json "
    "and prints the qctl command for it (qctl --credentials FILE, or $QSERVER_CREDENTIALS); or mint a new admin "
    "credential from a node's data directory: qserver admin-credential --config NODE.toml --out FILE")


def explain_refusal(error: QueueError, source: Path, creds: Credentials, url: str) -> QueueError:
    """`error` with what a refused or unanswered call cannot say by itself: which credentials
    file was used, which cluster it belongs to, and how to get the right one. Only an unknown
    client (the file belongs to another cluster) and an unreachable URL (the cluster it names
    is not running, or it is not the one meant) are explained; other errors pass unchanged."""
    if error.code == E_UNAUTHENTICATED.code and "unknown client" in error.message:
        where = "at its own URL" if url == creds.url else f"at {url}"
        detail = (f"the cluster {where} does not know the credentials file {source} ({describe(creds)}): no such "
                  "client there, or another key under its id; the file belongs to another cluster (one initialised "
                  "again, or another on the same ports)")
        fix = RIGHT_CREDENTIAL_HINT
    elif error.code == E_UNAVAILABLE.code and error.message.startswith("cannot reach "):   # no node answered
        where = "there" if url == creds.url else f"at {url} (--url)"
        detail = (f"qctl used the credentials file {source} ({describe(creds)}), and no node answers {where}: "
                  "that cluster is not running, or it is not the cluster you mean")
        fix = f"start it, or {RIGHT_CREDENTIAL_HINT}"
    else:
        return error
    return QueueError(error.kind, f"{error.message}\n  {detail}\n  fix: {fix}", outcome_unknown=error.outcome_unknown)


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
