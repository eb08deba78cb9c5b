"""The code stays ruff- and mypy-clean (docs/ARCHITECTURE.md, "Conventions"): checked here so CI holds us to it."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPOSITORY


def test_ruff_finds_nothing() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPOSITORY,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing_in_the_packages() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "client", "qserver", "replication"], cwd=REPOSITORY,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
