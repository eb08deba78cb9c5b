"""Prometheus text exposition without a dependency: counters and fixed-bucket histograms."""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.samples = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.samples += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.samples}')
        lines.append(f"{self.name}_sum {self.total:.6f}")
        lines.append(f"{self.name}_count {self.samples}")
        return lines


def label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_family(name: str, kind: str, help_text: str, samples: Sequence[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        rendered = ",".join(f'{key}="{label_value(val)}"' for key, val in labels.items())
        lines.append(f"{name}{{{rendered}}} {value:g}" if rendered else f"{name} {value:g}")
    return lines
