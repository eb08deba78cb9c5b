"""The deploy/ material stays valid: every node configuration loads and passes the checks
between limits, and the Dockerfile copies paths that exist (no Docker engine runs here)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from qserver.config import load_config
from tests.conftest import REPOSITORY

DEPLOY = REPOSITORY / "deploy"


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.toml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_example_configuration_loads_and_passes_its_checks(path: Path) -> None:
    config = load_config(path)
    assert config.node_id in config.cluster_nodes and set(config.membership_nodes) <= set(config.cluster_nodes)


def test_the_compose_file_names_one_configuration_per_node_and_the_dockerfile_copies_what_exists() -> None:
    compose = (DEPLOY / "compose.yaml").read_text()
    for node in ("n1", "n2", "n3"):
        assert f"./compose/{node}.toml:/etc/qserver/node.toml" in compose
    copied: set[str] = set()
    for line in re.findall(r"^COPY (.+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            assert (REPOSITORY / source).exists(), source
            copied.add(source)
    # What `pip install .` builds from: every package and module pyproject.toml names, and the
    # build's own files (wire/ was missing, and the image could not import a node).
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {pattern.rstrip("*") for pattern in project["packages"]["find"]["include"]}
    wanted |= {f"{module}.py" for module in project.get("py-modules", [])} | {"pyproject.toml", "setup.py"}
    assert wanted <= copied, f"the Dockerfile does not copy {sorted(wanted - copied)}"


def test_every_supervisor_starts_a_node_again_after_it_fails_stop() -> None:
    """A broken invariant ends the process with code 70 (qserver/core/failstop.py): each way of
    running a node starts it again."""
    assert "restart: on-failure" in (DEPLOY / "compose.yaml").read_text()
    assert "Restart=on-failure" in (DEPLOY / "qserver.service").read_text()


def test_a_retired_setting_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('[node]\nnode_id = "n1"\ncommit_inline_operations_max = 4\n')
    with pytest.raises(ValueError, match="commit_inline_operations_max: removed .* delete the line"):
        load_config(path)
