"""The report as one self-contained HTML page: inline CSS and SVG, no script, no external files.

Made from the JSON report alone (so the page never says more than the report): the verdict,
Jepsen's total-queue counts, every violation with the records that show it, the flags
(forced promotions, discarded suffixes), and per queue the members, a timeline of epochs
(handoffs, failovers), throughput, depth and redeliveries over time.
"""
from __future__ import annotations

import datetime
import html
from collections.abc import Sequence
from typing import Any

WIDTH, HEIGHT, MARGIN = 640, 150, 40
COLORS = {"enqueued": "#2b6cb0", "consumed": "#2f855a", "depth": "#6b46c1", "release": "#dd6b20",
          "expire": "#c53030", "change_of_master": "#805ad5"}
REASON_COLORS = {"create": "#718096", "handoff": "#2b6cb0", "failover": "#c05621", "unclean": "#9b2c2c",
                 "move": "#2c7a7b", "rejoin": "#4a5568", "change_of_master": "#c05621", "same_master": "#a0aec0"}
CITED_FIELDS = ("node", "sequence", "queue", "epoch", "index", "op", "message_id", "priority", "payload_crc32",
                "role", "at_ms")
STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;color:#1a202c;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #e2e8f0}
h3{font-size:15px;margin:18px 0 6px}
.verdict{display:inline-block;padding:6px 14px;border-radius:6px;color:#fff;font-weight:600;font-size:16px}
.clean{background:#2f855a}.violations{background:#c53030}
table{border-collapse:collapse;margin:6px 0;font-size:13px} td,th{border:1px solid #e2e8f0;padding:3px 8px;text-align:left}
th{background:#f7fafc} td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #e2e8f0;border-radius:6px;padding:8px 14px}
.card b{display:block;font-size:20px}.bad{color:#c53030}.muted{color:#718096}
.charts{display:flex;flex-wrap:wrap;gap:8px} svg{background:#fff;border:1px solid #edf2f7}
details{margin:4px 0} code{background:#f7fafc;padding:0 3px}
"""


def render_html(report: dict[str, Any]) -> str:
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>qaudit report</title>"
             f"<style>{STYLE}</style></head><body>", _header(report), _total_queue(report), _violations(report),
             _flags(report)]
    parts += [_incarnation(incarnation) for incarnation in report["incarnations"]]
    parts += [_journals(report), "</body></html>"]
    return "\n".join(parts)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _header(report: dict[str, Any]) -> str:
    inputs = report.get("inputs", {})
    verdict = report["verdict"]
    label = "CLEAN" if verdict == "clean" else f"{report['totals']['violations']} VIOLATIONS"
    cards = "".join(f"<div class=card><b>{_e(value)}</b>{_e(name)}</div>" for name, value in report["totals"].items())
    made = ", ".join(f"{name}: {_e(inputs[name])}" for name in ("engine", "master", "elapsed_s", "generated_at")
                     if inputs.get(name) is not None)
    sources = "".join(f"<li><code>{_e(path)}</code></li>" for path in inputs.get("journals", []))
    history = f"<li>history <code>{_e(inputs['history'])}</code></li>" if inputs.get("history") else ""
    return (f"<h1>qaudit report</h1><p><span class='verdict {verdict}'>{label}</span> "
            f"<span class=muted>{made}</span></p><div class=cards>{cards}</div>"
            f"<details><summary>inputs</summary><ul>{sources}{history}</ul></details>")


def _total_queue(report: dict[str, Any]) -> str:
    counts = report["total_queue"]
    rows = "".join(f"<tr><th>{_e(name)}</th><td class='n{' bad' if name in ('lost', 'unexpected', 'duplicated') and value else ''}'>"
                   f"{_e(value)}</td></tr>" for name, value in counts.items())
    history = report.get("history", {})
    history_rows = "".join(f"<tr><th>history {_e(name)}</th><td class=n>{_e(value)}</td></tr>"
                           for name, value in history.items() if any(history.values()))
    return ("<h2>Total queue</h2><p class=muted>Jepsen's total-queue terms: every enqueued message ends "
            "acknowledged, dead-lettered or still queued; lost, unexpected and duplicated must be 0; recovered "
            f"counts enqueues of unknown outcome found in the journals.</p><table>{rows}{history_rows}</table>")


def _violations(report: dict[str, Any]) -> str:
    if not report["violation_counts"]:
        return "<h2>Violations</h2><p>None.</p>"
    counts = "".join(f"<tr><th>{_e(kind)}</th><td class='n bad'>{_e(count)}</td></tr>"
                     for kind, count in report["violation_counts"].items())
    items = []
    for item in report["violations"]:
        cited = _records_table(item["records"])
        where = " ".join(f"{name} <b>{_e(item[name])}</b>" for name in ("queue", "node", "index", "message_id")
                         if item.get(name) not in (None, ""))
        items.append(f"<details open><summary><b class=bad>{_e(item['kind'])}</b> {where}: {_e(item['detail'])}"
                     f"</summary>{cited}</details>")
    listed = len(report["violations"])
    total = report["totals"]["violations"]
    note = f"<p class=muted>{listed} of {total} listed (per kind and queue the first ones).</p>" if listed < total else ""
    return f"<h2>Violations</h2><table>{counts}</table>{note}{''.join(items)}"


def _records_table(records: Sequence[dict[str, Any]]) -> str:
    if not records:
        return ""
    head = "".join(f"<th>{_e(name)}</th>" for name in CITED_FIELDS)
    rows = "".join("<tr>" + "".join(f"<td>{_e(record.get(name))}</td>" for name in CITED_FIELDS) + "</tr>"
                   for record in records)
    return f"<table><tr>{head}</tr>{rows}</table>"


def _flags(report: dict[str, Any]) -> str:
    if not report["flags"]:
        return ""
    rows = "".join(f"<tr><td>{_e(flag['kind'])}</td><td>{_e(flag['queue'])}</td><td>{_e(flag['node'])}</td>"
                   f"<td class=n>{_e(flag['epoch'])}</td><td>{_e(flag['detail'])}</td></tr>" for flag in report["flags"])
    return ("<h2>Flags</h2><p class=muted>Not violations by themselves: forced promotions can lose what the old "
            "master alone held; discarded suffixes were never committed.</p>"
            f"<table><tr><th>flag</th><th>queue</th><th>node</th><th>epoch</th><th>detail</th></tr>{rows}</table>")


def _incarnation(incarnation: dict[str, Any]) -> str:
    parts = [f"<h2>Queue {_e(incarnation['queue'])} <span class=muted>({_e(incarnation['id'])})</span></h2>"]
    for queue in incarnation["queues"]:
        parts.append(f"<h3>{_e(queue['queue'])} <span class=muted>strength {_e(queue['strength'])}, final master "
                     f"{_e(queue['final_master'])}</span></h3>")
        parts.append(_members(queue["members"]))
        series = queue["series"]
        charts = [_timeline(incarnation["epochs"], series)] if queue is incarnation["queues"][0] else []
        if series["bucket_ms"]:
            rate = 1000 / series["bucket_ms"]
            charts.append(_line_chart("throughput (messages/s)",
                                      {name: [count * rate for count in series[name]] for name in ("enqueued", "consumed")},
                                      series))
            charts.append(_line_chart("depth", {"depth": series["depth"]}, series))
            charts.append(_bar_chart("redeliveries per bucket", {cause: series[cause] for cause in
                                                                  ("release", "expire", "change_of_master")}, series))
        parts.append(f"<div class=charts>{''.join(charts)}</div>")
    return "\n".join(parts)


def _members(members: Sequence[dict[str, Any]]) -> str:
    names = ("node", "journal_id", "queue_id", "records", "first_index", "last_index", "master_epochs", "enqueued",
             "acked", "dead_lettered", "purged", "expired", "queued", "leased")
    head = "".join(f"<th>{_e(name)}</th>" for name in names)
    rows = "".join("<tr>" + "".join(f"<td>{_e(member[name])}</td>" for name in names) + "</tr>" for member in members)
    return f"<table><tr>{head}</tr>{rows}</table>"


def _axes(title: str, top: float, series: dict[str, Any]) -> str:
    count = len(series["depth"]) or 1
    span_s = count * series["bucket_ms"] / 1000
    start = datetime.datetime.fromtimestamp(series["start_ms"] / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return (f"<text x={MARGIN} y=14 font-size=12 font-weight=600>{_e(title)}</text>"
            f"<line x1={MARGIN} y1={HEIGHT - 20} x2={WIDTH - 10} y2={HEIGHT - 20} stroke=#a0aec0 />"
            f"<line x1={MARGIN} y1=22 x2={MARGIN} y2={HEIGHT - 20} stroke=#a0aec0 />"
            f"<text x=4 y=30 font-size=10>{_e(_short(top))}</text><text x=4 y={HEIGHT - 22} font-size=10>0</text>"
            f"<text x={MARGIN} y={HEIGHT - 6} font-size=10>{_e(start)} UTC</text>"
            f"<text x={WIDTH - 10} y={HEIGHT - 6} font-size=10 text-anchor=end>+{_e(_short(span_s))} s</text>")


def _short(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.2f}"


def _scale(values: Sequence[float], top: float, count: int) -> list[tuple[float, float]]:
    plot_width, plot_height = WIDTH - MARGIN - 10, HEIGHT - 42
    step = plot_width / max(count - 1, 1)
    return [(MARGIN + position * step, HEIGHT - 20 - (value / top) * plot_height if top else HEIGHT - 20)
            for position, value in enumerate(values)]


def _line_chart(title: str, lines: dict[str, list[float]], series: dict[str, Any]) -> str:
    top = max((max(values, default=0) for values in lines.values()), default=0) or 1
    parts = [_axes(title, top, series)]
    for position, (name, values) in enumerate(lines.items()):
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in _scale(values, top, len(values)))
        parts.append(f"<polyline fill=none stroke='{COLORS[name]}' stroke-width=1.5 points='{points}' />")
        parts.append(f"<text x={WIDTH - 120 + 0} y={14 + 12 * position} font-size=10 fill='{COLORS[name]}'>{_e(name)}</text>")
    return f"<svg width={WIDTH} height={HEIGHT} role=img aria-label='{_e(title)}'>{''.join(parts)}</svg>"


def _bar_chart(title: str, stacks: dict[str, list[int]], series: dict[str, Any]) -> str:
    count = len(series["depth"])
    totals = [sum(values[position] for values in stacks.values()) for position in range(count)]
    top = max(totals, default=0) or 1
    plot_width, plot_height = WIDTH - MARGIN - 10, HEIGHT - 42
    bar = plot_width / max(count, 1)
    parts = [_axes(title, top, series)]
    for position in range(count):
        base = float(HEIGHT - 20)
        for name, values in stacks.items():
            height = values[position] / top * plot_height
            if height:
                parts.append(f"<rect x={MARGIN + position * bar:.1f} y={base - height:.1f} width={max(bar - 1, 1):.1f} "
                             f"height={height:.1f} fill='{COLORS[name]}' />")
                base -= height
    for position, name in enumerate(stacks):
        parts.append(f"<text x={WIDTH - 120} y={14 + 12 * position} font-size=10 fill='{COLORS[name]}'>{_e(name)}</text>")
    return f"<svg width={WIDTH} height={HEIGHT} role=img aria-label='{_e(title)}'>{''.join(parts)}</svg>"


def _timeline(epochs: Sequence[dict[str, Any]], series: dict[str, Any]) -> str:
    """One band per epoch from its first record to the next epoch, named by master and reason."""
    if not epochs:
        return ""
    start = min([epoch["first_ms"] for epoch in epochs] + ([series["start_ms"]] if series["bucket_ms"] else []))
    end = max([epoch["first_ms"] for epoch in epochs] +
              ([series["start_ms"] + len(series["depth"]) * series["bucket_ms"]] if series["bucket_ms"] else []))
    span = max(end - start, 1)
    plot_width = WIDTH - MARGIN - 10
    parts = [f"<text x={MARGIN} y=14 font-size=12 font-weight=600>epochs (handoffs, failovers)</text>"]
    for position, epoch in enumerate(epochs):
        left = MARGIN + (epoch["first_ms"] - start) / span * plot_width
        following = epochs[position + 1]["first_ms"] if position + 1 < len(epochs) else end
        right = MARGIN + (following - start) / span * plot_width
        color = REASON_COLORS.get(epoch["reason"], "#4a5568")
        label = f"e{epoch['epoch']} {', '.join(epoch['masters']) or '?'} ({epoch['reason']}{'?' if epoch['inferred'] else ''})"
        row = 30 + (position % 3) * 34
        parts.append(f"<rect x={left:.1f} y={row} width={max(right - left, 2):.1f} height=22 fill='{color}' "
                     f"fill-opacity=0.25 stroke='{color}' />")
        parts.append(f"<line x1={left:.1f} y1=24 x2={left:.1f} y2={HEIGHT - 20} stroke='{color}' stroke-width=2 />")
        if left + 4 + 6.5 * len(label) > WIDTH - 4:      # keep the label inside the chart
            parts.append(f"<text x={WIDTH - 6} y={row + 15} font-size=11 text-anchor=end>{_e(label)}</text>")
        else:
            parts.append(f"<text x={left + 4:.1f} y={row + 15} font-size=11>{_e(label)}</text>")
    parts.append(f"<text x={MARGIN} y={HEIGHT - 6} font-size=10 class=muted>? = reason inferred (no epoch record)</text>")
    return f"<svg width={WIDTH} height={HEIGHT} role=img aria-label='epochs'>{''.join(parts)}</svg>"


def _journals(report: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{_e(j['node'])}</td><td>{_e(j['journal_id'])}</td><td class=n>{_e(j['records'])}</td>"
                   f"<td class=n>{_e(j['first_sequence'])}</td><td class=n>{_e(j['last_sequence'])}</td>"
                   f"<td class=n>{_e(sum(j['violation_counts'].values()))}</td></tr>" for j in report["journals"])
    return ("<h2>Journals</h2><table><tr><th>node</th><th>journal</th><th>records</th><th>first sequence</th>"
            f"<th>last sequence</th><th>violations</th></tr>{rows}</table>")
