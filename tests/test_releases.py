"""Releases: releases.toml names every release's commit, and the code knows which it is.

The upgrade tests (tests/test_upgrade.py, tests/test_migration.py) check out the previous release
from releases.toml; these checks keep that file and wire/versions.py honest without git.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from wire import versions

REPOSITORY = Path(__file__).resolve().parents[1]


def releases() -> list[dict[str, object]]:
    with open(REPOSITORY / "releases.toml", "rb") as file:
        return list(tomllib.load(file)["release"])


def test_releases_name_a_commit_each_in_ascending_order_below_the_code() -> None:
    recorded = releases()
    assert recorded and recorded[0]["version"] == "0.1.0"
    keys = [versions.release_key(str(release["version"])) for release in recorded]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for release in recorded:
        assert re.fullmatch(r"[0-9a-f]{40}", str(release["commit"])), release
    # The working tree is the newest release or on its way to the next one.
    assert versions.release_key(versions.RELEASE) >= keys[-1]


def test_every_feature_level_names_its_first_release_and_every_feature_a_level() -> None:
    assert set(versions.FEATURE_LEVEL_RELEASES) == set(range(versions.OLDEST_FEATURE_LEVEL, versions.FEATURE_LEVEL + 1))
    assert all(versions.OLDEST_FEATURE_LEVEL < level <= versions.FEATURE_LEVEL for level in versions.FEATURES.values())


@pytest.mark.parametrize("program", ["qserver", "qctl"])
def test_version_flags_print_the_release(program: str) -> None:
    module = {"qserver": "qserver", "qctl": "client.qctl"}[program]
    call = [sys.executable, "-m", module, "--version"] if program == "qserver" else \
        [sys.executable, "-c", "import sys; from client.qctl import main; sys.exit(main())", "--version"]
    answer = subprocess.run(call, cwd=REPOSITORY, capture_output=True, text=True, timeout=60, check=True)
    assert answer.stdout.startswith(f"{program} {versions.RELEASE} (")


def test_version_ranges_parse_and_meet() -> None:
    assert versions.VersionRange.parse("8-9") == versions.VersionRange(8, 9)
    assert versions.VersionRange.parse("8") == versions.VersionRange(8, 8)
    assert versions.VersionRange(8, 9).common(versions.VersionRange(7, 8)) == 8
    assert versions.VersionRange(9, 9).common(versions.VersionRange(7, 8)) is None
    for bad in ("", "9-8", "0-1", "x", "1-2-3"):
        with pytest.raises(ValueError):
            versions.VersionRange.parse(bad)
    assert versions.release_key("0.2.0.dev0") < versions.release_key("0.2.0") < versions.release_key("0.10.0")
