"""The upgrade test (issue 34, item 5): a 3-node cluster made by the previous release of
`releases.toml` (its `git worktree`, run with this environment) serves queues of both
strengths, a macro queue, a durable channel subscription and a forward, with producers and
consumers of this release and one client of the previous release running; it is rolled node by
node (masters handed off, SIGTERM, started from this checkout on the same data directory and
ports, the membership leader last), finalized, and judged: the chaos checker over the clients'
history and the audit over the journals both releases wrote (tests/upgrade_roll.py says how).

Skipped, with the reason, when git or the release commit is missing (a shallow clone).
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from qserver.dev.devcluster import REPOSITORY
from tests.upgrade_roll import RollPlan, roll_upgrade
from tests.upgrade_support import previous_release, release_tree, skip_reason
from wire import versions

ROLL_TIMEOUT_S = 240.0
KEEP_ENV = "QSERVER_TEST_UPGRADE_DIR"
WRITE_PAUSE_MAX_S = 2.0          # the failover bound (issue 34's measure); a drained roll pauses far less

RELEASE = previous_release()
WHY_NOT = "releases.toml names no release older than this one" if RELEASE is None \
    else skip_reason(RELEASE["commit"])


@pytest.mark.slow
@pytest.mark.timeout(ROLL_TIMEOUT_S + 60)
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_rolling_upgrade_from_the_previous_release(tmp_path: Path) -> None:
    assert RELEASE is not None
    # $QSERVER_TEST_UPGRADE_DIR: leave the run (history, node logs and data, result.json) there.
    run_dir = Path(os.environ.get(KEEP_ENV) or tmp_path)
    with release_tree(RELEASE["commit"], tmp_path / f"release-{RELEASE['version']}") as old_tree:
        result = asyncio.run(asyncio.wait_for(roll_upgrade(run_dir / "run", old_tree, REPOSITORY, RollPlan()),
                                              ROLL_TIMEOUT_S))
    (run_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    shown = json.dumps({k: v for k, v in result.items() if k not in ("queues",)}, indent=1, default=str)[:6000]

    # Every node was rolled to this checkout's release and came back in sync.
    assert [step["release"] for step in result["steps"]] == [versions.RELEASE] * 3, shown
    assert all(step["in_sync"] for step in result["steps"]), shown
    assert all(step["masters_left"] == [] for step in result["steps"]), shown
    assert result["settle"]["settled"], shown
    assert all(outcome["drained"] for outcome in result["drained"].values()), shown
    assert not result["problems"], "\n".join(result["problems"])

    # The clients' history: nothing acknowledged lost, every repeat explained, no stall outside
    # a node's upgrade, every forward delivered, traffic on every queue through the roll.
    assert result["valid"], shown
    assert all(queue["lost"] == 0 for queue in result["queues"].values()), shown
    assert all(pause["acknowledged"] > 0 for pause in result["write_pauses"].values()), shown
    assert all(counts["enqueue_ok"] > 0 for counts in result["forwards"].values()), shown
    # Handing a node's masters off pauses writes for a handoff's time, well under the failover
    # bound. (The stop after it pauses the queues whose replica it holds for up to
    # replica_lag_max_ms, until their masters record it out of sync: not judged here.)
    assert all((pause["longest_during_handoffs_s"] or 0.0) <= WRITE_PAUSE_MAX_S
               for pause in result["write_pauses"].values()), shown

    # The previous release's client worked against the mixed and the upgraded cluster.
    assert result["old_client"]["valid"], shown
    assert result["old_client"]["counts"]["enqueue_ok"] > 0, shown

    # The audit over the journals of both releases is clean.
    assert result["audit"]["verdict"] == "clean", shown
    assert result["audit"]["lost"] == 0, shown

    # The macro, the durable subscription's backlog and the forward work after the roll.
    assert all(check["ok"] for check in result["post_checks"].values()), shown

    # The cluster was finalized at this release's feature level (once finalize exists).
    finalize = result["finalize"]
    if "skipped" not in finalize:
        assert finalize["map_feature_level"] == versions.FEATURE_LEVEL, shown
