"""Running an older release's code beside this checkout's, for upgrade tests
(tests/test_migration.py; the rolling upgrade, tests/upgrade_roll.py, has the same steps).

`releases.toml` names each release's commit; `previous_release` picks the newest one older than
this checkout (wire/versions.py RELEASE), `release_tree` checks its commit out in a detached
`git worktree` (removed afterwards), and `qserver_command` gives the argv, environment and
working directory that run that tree's `python -m qserver` with this interpreter (the tree
first on the path: qserver/dev/devcluster.py code_environment). `skip_reason` says why a test
cannot do any of this here (no git, a clone without the release's commit)."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qserver.dev.devcluster import REPOSITORY, code_environment
from wire import versions

RELEASES_FILE = REPOSITORY / "releases.toml"


def releases(releases_file: Path = RELEASES_FILE) -> list[dict[str, Any]]:
    """Every release of releases.toml, oldest first."""
    found = tomllib.loads(releases_file.read_text()).get("release", [])
    return sorted(found, key=lambda r: versions.release_key(r["version"]))


def previous_release(releases_file: Path = RELEASES_FILE) -> dict[str, Any] | None:
    """The newest release older than this checkout's, None when there is none."""
    older = [r for r in releases(releases_file)
             if versions.release_key(r["version"]) < versions.release_key(versions.RELEASE)]
    return older[-1] if older else None


def skip_reason(commit: str) -> str | None:
    """Why `commit` cannot be checked out here (None: it can)."""
    if shutil.which("git") is None:
        return "git is not installed"
    if subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--git-dir"], capture_output=True).returncode:
        return f"{REPOSITORY} is not a git checkout"
    if subprocess.run(["git", "-C", str(REPOSITORY), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode:
        return f"this clone lacks the release commit {commit[:12]} (a shallow clone? `git fetch --unshallow`)"
    return None


@contextlib.contextmanager
def release_tree(commit: str, where: Path | None = None) -> Iterator[Path]:
    """The commit's code in a detached `git worktree` (at `where`, else a new temporary
    directory), removed afterwards however the block ends."""
    parent = None
    if where is None:
        parent = Path(tempfile.mkdtemp(prefix="qserver-release-"))
        where = parent / "tree"
    subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", "--force", str(where), commit],
                   check=True, capture_output=True, timeout=120)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(where)],
                       capture_output=True, timeout=120)
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "prune"], capture_output=True, timeout=120)
        if parent is not None:
            shutil.rmtree(parent, ignore_errors=True)


def qserver_command(code: Path, *args: str, extra_env: dict[str, str] | None = None
                    ) -> tuple[list[str], dict[str, str], Path]:
    """(argv, environment, working directory) of `python -m qserver ARGS...` from the code tree
    `code` (this checkout: REPOSITORY) with this interpreter."""
    environment = code_environment(code)
    environment.update(extra_env or {})
    return [sys.executable, "-m", "qserver", *args], environment, code


def run_qserver(code: Path, *args: str, timeout_s: float = 60.0, extra_env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """Run a `qserver` command of the tree `code` to its end (its output captured)."""
    argv, environment, cwd = qserver_command(code, *args, extra_env=extra_env)
    return subprocess.run(argv, env=environment, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
