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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

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
