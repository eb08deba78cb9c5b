"""The forward root's decisions (seed 003 §3.2, §3.3), as pure functions of its sessions and `now`.

The root (qserver/features/forwards/root.py) keeps the sessions, reads the clock, sends the
rates and drops the sessions these functions name; nothing here reads a clock or touches a
connection, so the rules are tested deterministically (tests/test_forwards_decide.py):
- a session not heard from for its hold time (or whose connection closed) is dropped;
- every `forward_interval_s` (T) each session is sent its rate (`compute_rates`), and in
  static mode at once when a session was dropped (n changed: R/n again);
- the root looks at its sessions again when the next of these is due, at least every TICK_MAX_S.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

KEEPALIVE_MAX_S = 1.0       # a forwarder keeps its session alive at least this often (and every T, if shorter)
HOLD_INTERVALS = 3          # a session silent for this many keepalive intervals (at least HOLD_MIN_S) is dropped
HOLD_MIN_S = 3.0
TICK_MAX_S = 0.25           # the root looks at its sessions at least this often
TICK_MIN_S = 0.01
K = TypeVar("K")


def keepalive_s(forward_interval_s: float) -> float:
    return min(KEEPALIVE_MAX_S, forward_interval_s)


def hold_s(forward_interval_s: float) -> float:
    return max(HOLD_MIN_S, HOLD_INTERVALS * keepalive_s(forward_interval_s))


def compute_rates(total: float, mode: str, weights: dict[K, int], *, opening: K | None = None) -> dict[K, float | None]:
    """Seed 003 §3.3 (figure 6): each session's rate from the weight table. `opening`: a session
    being opened (it gets R/n; in static mode every session is given R/n again, n having
    changed; in adaptive mode the others keep theirs until the next interval)."""
    if not weights:
        return {}
    if not total:
        return dict.fromkeys(weights)
    share = total / len(weights)
    if mode == "static":
        return dict.fromkeys(weights, share)
    if opening is not None:
        return {opening: share}
    weight_sum = sum(weights.values())
    if weight_sum == 0:
        return dict.fromkeys(weights, share)
    return {name: total * weight / weight_sum for name, weight in weights.items()}


class Heard(NamedTuple):
    """What the root knows of a session's liveness: when it last heard from it, and whether its
    connection closed."""
    at: float
    closed: bool


@dataclass(frozen=True, slots=True)
class Review(Generic[K]):
    """What the root does with a queue's sessions at a look."""
    silent: list[K]            # sessions to drop, in the table's order
    emptied: bool              # none is left: the queue leaves the table
    rates_at_once: bool        # static, after a drop: R/n again now (which restarts the interval)
    rates_due: bool            # T passed since the rates were last sent: send them
    next_look_s: float         # how soon to look again


def review(heard: Mapping[K, Heard], now: float, *, computed_at: float, forward_interval_s: float,
           mode: str) -> Review[K]:
    """Drop the silent sessions; send the rates every T (`computed_at`: when they were last
    sent, 0 if never)."""
    hold = hold_s(forward_interval_s)
    silent = [key for key, session in heard.items() if now - session.at > hold or session.closed]
    if len(silent) == len(heard):
        return Review(silent, True, False, False, TICK_MAX_S)
    rates_at_once = bool(silent) and mode == "static"
    if rates_at_once:
        computed_at = now
    due = computed_at + forward_interval_s
    rates_due = now >= due       # static: R/n again (n may have changed), so a forwarder knows it is heard
    if rates_due:
        due = now + forward_interval_s
    return Review(silent, False, rates_at_once, rates_due, max(TICK_MIN_S, min(TICK_MAX_S, due - now)))


# --- a forward's own fill bands and weights (seed 003 figure 6; issue 37 item 12) ---------------
# Each client queue MQᵢ of figure 6 has its own thresholds Tᵢ₁ < Tᵢ₂ < ... and a weight per band
# between them. A forward's `control` (the map's ForwardEntry.control; docs/PROTOCOL.md
# "Forwards", "A forward's own bands and weights") holds them; none given: the root's uniform
# bands, the weight being the band's number (as before).
#   bands:      the thresholds, fractions of the capacity, strictly increasing in (0, 1);
#               k thresholds make k+1 bands (an integer n given: n uniform bands)
#   weights:    one integer per band (none given: the band's number)
#   fill_unit:  "messages" (depth against the source's max_depth) or "bytes" (its payload bytes
#               against `fill_bytes`: a queue has no byte bound of its own)
BANDS_MAX = 64                 # bands of one forward: weights and thresholds stay a short list
WEIGHT_MAX = 1_000_000         # a weight's own ceiling (the root's `forward_bands` caps it further)
FILL_BYTES_MAX = 2**50
FILL_UNITS = ("messages", "bytes")
CONTROL_FIELDS = ("bands", "weights", "fill_unit", "fill_bytes")


class ControlProblem(ValueError):
    """A forward's control that cannot be used: the API answers it as E_INVALID_OPTION."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_control(raw: object) -> dict[str, Any]:
    """The control as the map keeps it: only the fields given, bands as their thresholds.
    Raises ControlProblem for anything else (it is then stored nowhere)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ControlProblem('control is an object: {"bands", "weights", "fill_unit", "fill_bytes"}')
    unknown = sorted(set(raw) - set(CONTROL_FIELDS))
    if unknown:
        raise ControlProblem(f"control has no field {unknown[0][:40]!r}: {', '.join(CONTROL_FIELDS)}")
    out: dict[str, Any] = {}
    bands: Any = raw.get("bands")
    if bands is not None:
        if _is_int(bands):
            if not 1 <= bands <= BANDS_MAX:
                raise ControlProblem(f"bands is 1..{BANDS_MAX} uniform bands, or a list of thresholds")
            bands = [round(i / bands, 6) for i in range(1, bands)]
        if not isinstance(bands, list) or len(bands) > BANDS_MAX - 1 or not all(
                isinstance(t, int | float) and not isinstance(t, bool) and 0 < t < 1 for t in bands) \
                or any(a >= b for a, b in zip(bands, bands[1:], strict=False)):
            raise ControlProblem(f"bands is a list of at most {BANDS_MAX - 1} thresholds, fractions of the "
                                 "capacity strictly increasing between 0 and 1 (or a number of uniform bands)")
        out["bands"] = [float(t) for t in bands]
    weights: Any = raw.get("weights")
    if weights is not None:
        if not isinstance(weights, list) or not 1 <= len(weights) <= BANDS_MAX or not all(
                _is_int(w) and 0 <= w <= WEIGHT_MAX for w in weights):
            raise ControlProblem(f"weights is a list of 1..{BANDS_MAX} integers 0..{WEIGHT_MAX}, one per band")
        if "bands" in out and len(weights) != len(out["bands"]) + 1:
            raise ControlProblem(f"{len(out['bands']) + 1} bands need as many weights, not {len(weights)}")
        out["weights"] = list(weights)
    unit = raw.get("fill_unit")
    if unit is not None:
        if unit not in FILL_UNITS:
            raise ControlProblem(f"fill_unit is one of {', '.join(FILL_UNITS)}")
        out["fill_unit"] = unit
    fill_bytes: Any = raw.get("fill_bytes")
    if fill_bytes is not None:
        if not _is_int(fill_bytes) or not 1 <= fill_bytes <= FILL_BYTES_MAX:
            raise ControlProblem(f"fill_bytes is the capacity in bytes, 1..{FILL_BYTES_MAX}")
        out["fill_bytes"] = fill_bytes
    if out.get("fill_unit") == "bytes" and "fill_bytes" not in out:
        raise ControlProblem('fill_unit "bytes" needs fill_bytes, the capacity the bytes fill')
    return out


def merged_control(current: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """A change (`PATCH /v1/forwards/{f}`): the fields it names replace the current ones, a
    field given as null is removed (back to the default); new bands drop weights not given
    with them when their counts no longer match. Checked as a whole afterwards."""
    merged = {**current, **{k: v for k, v in change.items() if v is not None}}
    for field_name in [k for k, v in change.items() if v is None]:
        merged.pop(field_name, None)
    if "bands" in change and "weights" not in change:
        merged.pop("weights", None)
    return merged


class Fill(NamedTuple):
    """Where a forward's source stands: what fills it and how much of its capacity that is,
    the band that falls in, and the weight it reports (capped by the root's ceiling)."""
    unit: str
    amount: int
    capacity: int
    band: int
    weight: int
    capped: bool           # its own weight was above the root's ceiling (bands - 1)


def fill_of(control: Mapping[str, Any], depth: int, max_depth: int, queue_bytes: int, root_bands: int) -> Fill:
    """Figure 6: the band the source's fill is in (a fill equal to a threshold is in the band
    above it, as §4.2's "equal to or greater than X·10%"), and that band's weight. Without bands
    or weights of its own: the root's uniform bands (weight_of, in integers)."""
    unit = str(control.get("fill_unit") or "messages")
    amount, capacity = (queue_bytes, int(control.get("fill_bytes") or 1)) if unit == "bytes" else (depth, max_depth)
    capacity = max(1, capacity)
    thresholds: list[float] | None = control.get("bands")
    weights: list[int] | None = control.get("weights")
    ceiling = max(0, root_bands - 1)
    if thresholds is None and weights is None:
        band = min(ceiling, amount * max(1, root_bands) // capacity)
        return Fill(unit, amount, capacity, band, band, False)
    if thresholds is None:
        assert weights is not None
        count = len(weights)
        band = min(count - 1, amount * count // capacity)
    else:
        band = bisect.bisect_right(thresholds, amount / capacity)
    own = int(weights[band]) if weights is not None else band
    return Fill(unit, amount, capacity, band, min(own, ceiling), own > ceiling)
