"""Which admin credential the demo uses, and which one `qctl` finds without flags.

A cluster's admin credential is kept with the cluster: `DATA_DIR/admin-credentials.json`
(n1 writes it when the cluster is initialised). It used to live only in
`./.qserver/credentials.json`, which every new cluster overwrote, so a demo started again on its
old data directory pointed qctl at another cluster and the admin key was lost.

`./.qserver/credentials.json` (or the demo's --credentials) is now a convenience copy, where
qctl and the client look without flags. At each start the demo makes it a copy of its own
cluster's credential, unless it holds the credential of another cluster that is running (a
node answers at its URL, which is none of this cluster's): that one is left as it is, and the
demo prints its commands with `--credentials`. Whatever it does, it says so: the copy never
changes owner, or keeps one, silently.

A data directory from before (no admin-credentials.json) keeps the credential of the copy if
the cluster accepts it (an older demo wrote it only there), and otherwise gets a fresh admin
credential, minted through the running cluster with its cluster secret (`qserver admin-credential`).
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

from client.credentials import LOCAL_CREDENTIALS, Credentials, describe, load_credentials, save_credentials
from client.http import HttpClient
from qserver.cli import mint_admin_credential
from qserver.config import load_config
from qserver.dev.devcluster import LocalCluster
from wire.errors import QueueError

PROBE_TIMEOUT_S = 1.0       # how long a node of another cluster has to answer /healthz


@dataclass(frozen=True)
class CopyPlan:
    """Whether the demo makes the convenience copy its own cluster's credential, and why (for
    its output; empty when there is nothing to say)."""
    take: bool
    note: str = ""


def plan_copy(own: Credentials, held: Credentials | None, held_readable: bool, our_urls: Collection[str],
              held_cluster_answers: Callable[[], bool]) -> CopyPlan:
    """The rule of the module docstring. `held`: what the copy holds now (None: no file, or
    one that is not a credentials file, then `held_readable` is False); `held_cluster_answers`
    is asked only when it matters (it probes the network)."""
    if held is None:
        return CopyPlan(True, "" if held_readable else "it was not a credentials file")
    if (held.client_id, held.private_key_text) == (own.client_id, own.private_key_text):
        return CopyPlan(True)
    if held.url in our_urls:
        return CopyPlan(True, f"it held {describe(held)}: another credential for these ports")
    if held_cluster_answers():
        return CopyPlan(False, f"it holds {describe(held)}, and a cluster answers there")
    return CopyPlan(True, f"it held {describe(held)}, which is not running")


@dataclass
class CredentialAccess:
    """How the demo and the user reach this cluster: its own credential file, the qctl command
    line that works for it, and what the demo did to the credential files (to be printed)."""
    own_path: Path
    qctl: str
    notes: list[str] = field(default_factory=list)


def credential_access(cluster: LocalCluster, copy_path: Path) -> CredentialAccess:
    """Make sure the running cluster has its own credential, and set the convenience copy by
    `plan_copy`; returns the qctl command line to print."""
    held, readable = _held(copy_path)
    own, notes = own_credential(cluster, held)
    qctl = executable("qctl")
    if copy_path.resolve() == cluster.credentials_path.resolve():      # --credentials named the cluster's own
        return CredentialAccess(cluster.credentials_path, f"{qctl} --credentials {shown(copy_path)}", notes)
    plan = plan_copy(own, held, readable, set(cluster.urls.values()), lambda: _answers(held))
    if plan.take:
        if held != own:
            save_credentials(copy_path, own)
        # Only the default copy is found without flags; another (--credentials PATH) is named.
        default_copy = copy_path.resolve() == LOCAL_CREDENTIALS.resolve()
        where = "where qctl and the client look without flags" if default_copy else "name it with --credentials"
        notes.append(f"copied to {shown(copy_path)}, {where}" + (f" ({plan.note})" if plan.note else ""))
        flags = "" if default_copy else f" --credentials {shown(copy_path)}"
    else:
        notes.append(f"{shown(copy_path)} is left as it is ({plan.note}): qctl without --credentials talks to that "
                     f"cluster; for this one name the file, or `export QSERVER_CREDENTIALS="
                     f"{shown(cluster.credentials_path)}` and use the README's commands as written")
        flags = f" --credentials {shown(cluster.credentials_path)}"
    return CredentialAccess(cluster.credentials_path, qctl + flags, notes)


def own_credential(cluster: LocalCluster, held: Credentials | None) -> tuple[Credentials, list[str]]:
    """The cluster's own admin credential, with its URL brought up to date when the demo now
    runs on other ports. A data directory an older demo made has none: the credential the copy
    `held` is kept if this cluster accepts it (the older demo wrote it there), else one is minted."""
    path = cluster.credentials_path
    url = cluster.urls[cluster.ids[0]]
    if not path.is_file():
        if held is not None and _accepted(replace(held, url=url)):
            save_credentials(path, replace(held, url=url))
            return replace(held, url=url), [f"kept with the cluster now: the credential the copy held "
                                            f"({describe(held)}), which an older demo wrote only there"]
        creds = mint_admin_credential(load_config(cluster.root / f"{cluster.ids[0]}.toml"), url)
        save_credentials(path, creds)
        return creds, [f"this cluster had no admin credential of its own (an older demo initialised it): minted "
                       f"admin client {creds.client_id} with {cluster.ids[0]}'s cluster secret"]
    creds = load_credentials(path)
    if creds.url == url:
        return creds, []
    save_credentials(path, replace(creds, url=url))
    return replace(creds, url=url), [f"its URL is now {url} (it was {creds.url}: --base-port changed)"]


def _held(path: Path) -> tuple[Credentials | None, bool]:
    """What a credentials file holds: (credential or None, whether it was readable as one)."""
    if not path.exists():
        return None, True
    try:
        return load_credentials(path), True
    except QueueError:
        return None, False


def _accepted(creds: Credentials) -> bool:
    """Whether the node at the credential's URL takes a call signed with it."""
    async def ask() -> None:
        async with HttpClient(creds.url, creds.signer(), ca_file=creds.ca_file) as http:
            await http.cluster()
    try:
        asyncio.run(ask())
    except QueueError:
        return False
    return True


def _answers(creds: Credentials | None) -> bool:
    """Whether a node answers /healthz at the credential's URL (any status: it runs)."""
    if creds is None:
        return False
    context = None
    if creds.url.startswith("https://"):
        context = ssl.create_default_context(cafile=creds.ca_file or None)
    try:
        with urllib.request.urlopen(creds.url + "/healthz", timeout=PROBE_TIMEOUT_S, context=context):
            return True
    except urllib.error.HTTPError:
        return True                   # a 503 is a node that runs, starting or stopping
    except (OSError, ValueError):     # refused, unreachable, timed out, TLS failed, bad URL
        return False


def executable(name: str) -> str:
    """A command of this environment (qctl, qserver) as the user can type it here: relative to
    the current directory when it is below it."""
    command = Path(sys.executable).parent / name
    with contextlib.suppress(ValueError):
        command = command.relative_to(Path.cwd())
    return str(command)


def shown(path: Path) -> str:
    """A path as the user can type it here: relative to the current directory when it is below."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    return str(path)
