"""The network decoders under a fuzzer, a few seconds each (issue 13; under 60 s in all): atheris
(coverage-guided, libFuzzer) where its wheel installs, else hypothesis. A decoder may only
refuse with its own error type; anything else, or a crash, fails the test with the input that
did it. Longer runs by hand: `.venv/bin/python tests/fuzz_targets.py TARGET -max_total_time=600`."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_targets import TARGETS, seeds

HERE = Path(__file__).resolve().parent
SECONDS_PER_TARGET = 4
# QSERVER_FUZZ=hypothesis runs the fallback where atheris is installed too.
HAS_ATHERIS = importlib.util.find_spec("atheris") is not None and os.environ.get("QSERVER_FUZZ") != "hypothesis"


@pytest.mark.skipif(not HAS_ATHERIS, reason="no atheris wheel here: test_..._under_hypothesis runs instead")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_decoder_under_coverage_guided_fuzzing_only_refuses_with_its_own_error(target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, seed in enumerate(seeds(target)):
        (corpus / f"seed-{number}").write_bytes(seed)
    run = subprocess.run([sys.executable, str(HERE / "fuzz_targets.py"), target,
                          f"-max_total_time={SECONDS_PER_TARGET}", "-rss_limit_mb=2048", "-max_len=4096",
                          f"-artifact_prefix={tmp_path}/", str(corpus)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=SECONDS_PER_TARGET + 60)
    findings = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "oom-", "timeout-")))
    assert run.returncode == 0 and not findings, \
        f"{target}: {findings} (replay: tests/fuzz_targets.py {target} {tmp_path}/<file>)\n{run.stderr[-3000:]}"


@pytest.mark.skipif(HAS_ATHERIS, reason="atheris runs these targets coverage-guided")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_decoder_under_hypothesis_only_refuses_with_its_own_error(target: str) -> None:
    @settings(max_examples=2000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=4096), st.sampled_from(seeds(target) or [b""]).flatmap(
        lambda seed: st.binary(min_size=len(seed), max_size=len(seed) + 8).map(
            lambda noise: bytes(a ^ b for a, b in zip(seed, noise, strict=False)) + noise[len(seed):]))))
    def check(data: bytes) -> None:
        TARGETS[target](data)
    check()
