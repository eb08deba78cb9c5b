"""bench/bench_forward.py (issue 16, seed 003 §4) end to end in a small configuration: two real
clusters per run, the paper's arrival processes, adaptive against static rate control, the
results line and the four figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_forward


def test_arrivals_follow_the_patterns_and_the_fluid_arithmetic_of_the_paper() -> None:
    mq2 = bench_forward.arrival_times("mq2", 7, 0.0, 6000.0)
    in_burst = [t for t in mq2 if 2400.0 <= t < 4200.0]
    assert len(in_burst) / 1800.0 == pytest.approx(1 / 0.075, rel=0.05)
    assert (len(mq2) - len(in_burst)) / 4200.0 == pytest.approx(1 / 0.24, rel=0.05)
    assert mq2 == bench_forward.arrival_times("mq2", 7, 0.0, 6000.0)       # one seed, one schedule
    assert bench_forward.expected_static_overflows(0.0, 6000.0) == pytest.approx(5.0 * 1800 - 200)
    assert bench_forward.moving_average([0, 30, 60, 90], [0, 2, 4, 6], 60.0) == [0, 1, 3, 5]


def test_all_burst_bursts_every_client_with_mq2s_shape_and_the_plan_says_its_wall_time() -> None:
    gaps = bench_forward.SCENARIOS["all-burst"]
    assert gaps == {"mq1": 0.075, "mq2": 0.075, "mq3": 0.0625}
    for queue, burst_gap in gaps.items():
        times = bench_forward.arrival_times(queue, 3, 0.0, 6000.0, "all-burst")
        in_burst = [t for t in times if 2400.0 <= t < 4200.0]
        assert len(in_burst) / 1800.0 == pytest.approx(1 / burst_gap, rel=0.05), queue
        assert (len(times) - len(in_burst)) / 4200.0 == pytest.approx(1 / bench_forward.MEAN_GAP_S[queue], rel=0.05)
    # The paper's scenario is what it always was: the stored runs' schedules stay valid.
    assert bench_forward.arrival_times("mq1", 3, 0.0, 6000.0) == bench_forward.arrival_times("mq1", 3, 0.0, 6000.0,
                                                                                               "paper")
    assert bench_forward.expected_overflows(0.0, 6000.0, "all-burst") == pytest.approx(
        (1 / 0.075 * 2 + 16 - 25) * 1800 - 3 * 200 - 800)
    assert bench_forward.wall_estimate_s(2700.0, 1.0, 6) == pytest.approx(6 * (2700 + 15))
    assert bench_forward.achieved_rates([0, 2, 4, 6], [None, 10, 30, None]) == [None, None, 10.0, None]


def test_plot_only_draws_each_scenario_with_the_time_scales_side_by_side(tmp_path: Path) -> None:
    """Stored lines (no clusters): k = 1 beside k = 10 in one figure, all-burst in figures of
    its own, Fig. 11 with the achieved rate beside the assigned one."""
    lines = []
    for scenario in ("paper", "all-burst"):
        for k in (1.0, 10.0):
            for mode in ("adaptive", "static"):
                times = [2100.0 + 2 * i for i in range(200)]
                stored = [int(8 * t) for t in times]
                achieved = bench_forward.achieved_rates(times, stored)
                lines.append(json.dumps({
                    "bench": "forward", "scenario": scenario, "mode": mode, "seed": 1, "time_scale": k,
                    "start_s": 2100.0, "end_s": 2500.0, "overflows": 5 if mode == "adaptive" else 50,
                    "series": {"t": times, "mq1": [1] * 200, "mq2": [2] * 200, "mq3": [3] * 200,
                               "root": [4.0] * 200, "root_moving_average": [4.0] * 200, "overflows": list(range(200)),
                               "mq2_rate": [8.0] * 200, "mq2_weight": [1] * 200,
                               "mq2_rate_changes": [[2100.0, 8.0], [2300.0, 12.0]],
                               "mq2_achieved": achieved,
                               "mq2_achieved_average": {"t": times[1:], "rate": [8.0] * 199}}}))
    stored_file = tmp_path / "runs.jsonl"
    stored_file.write_text("\n".join(lines) + "\n")
    bench_forward.main(["--plot-only", str(stored_file), "--out-dir", str(tmp_path)])
    for name in bench_forward.FIGURES:
        assert (tmp_path / name).stat().st_size > 10_000, name
        assert (tmp_path / name.replace("forward-", "forward-all-burst-")).stat().st_size > 10_000, name
    assert "| all-burst | 1 | 1 | 5 | 50 | 0.100 |" in bench_forward.table([json.loads(line) for line in lines])


@pytest.mark.timeout(240)
def test_adaptive_rates_overflow_far_less_than_static_ones_in_a_short_burst(tmp_path: Path) -> None:
    """One seed, both modes, simulated 2380-2540 s (the burst starts at 2400) at k = 10: about
    20 s of wall time per mode, each on two fresh 2-node clusters.

    Why it cannot fail by chance: the arrivals are drawn from a fixed seed, so both modes get
    the same 1,963 arrivals at mq2 (1,881 in the burst), and only the machine's timing varies.
    Static: mq2 is sent R/3 = 8.3 messages/s against 13.3 arriving, fills its 200 within ~40 s
    and refuses the excess: ~500 overflows (514-567 in six runs); the test asks for 250. Adaptive:
    the three forwarders share R = 25 > 22.5 arriving, and mq2, the fullest, gets ~14 (its
    queue peaked at 55-136 of 200; 0 overflows in each of six runs); the test asks for at
    most a fifth of static (the issue's target). k = 10 and not more: at k = 20 on these 2
    cores the adaptive mode loses throughput to the machine (bench/RESULTS.md)."""
    bench_forward.main(["--seeds", "1", "--time-scale", "10", "--start-s", "2380", "--span-s", "160",
                        "--out-dir", str(tmp_path)])
    [results_file] = tmp_path.glob("results-forward-*.jsonl")
    runs = {run["mode"]: run for run in map(json.loads, results_file.read_text().splitlines())}
    adaptive, static = runs["adaptive"], runs["static"]
    assert static["overflows"] >= 250, static
    assert adaptive["overflows"] <= static["overflows"] / 5, (adaptive["overflows"], static["overflows"])
    for run in (adaptive, static):
        # Counted at the producers (E_QUEUE_FULL answers) and by the sources' masters alike.
        assert run["overflows_by_queue"] == run["overflows_source_stats"], run
        assert not run["other_refusals"] and run["consumed"] > 0 and run["samples"] > 50
    assert static["mq2_rate_mean_burst"] == pytest.approx(25 / 3, abs=0.01)
    assert adaptive["mq2_rate_mean_burst"] > 25 / 3 + 2           # Fig. 11: the burst raises mq2's share
    for name in bench_forward.FIGURES:
        assert (tmp_path / name).stat().st_size > 10_000, name
