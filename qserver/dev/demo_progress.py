"""What the demo's producers and consumers achieved: progress, stalls and errors, kept apart
from the demo's sockets and terminal so that the rules are plain and tested (tests/test_demo_progress.py).

The demo must not claim all is well while a client is stuck: a consumer that takes nothing
while its queue holds messages, or a producer whose enqueues stop succeeding, raises no error
by itself. So each client has a `ProgressTracker` fed with its progress and with whether it
has work; a period with work and no progress that lasts STALL_AFTER_S is a stall, shown while
it lasts and counted in the summary. Time comes from an injected clock (no `time` import).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

STALL_AFTER_S = 5.0


class ProgressTracker:
    """Periods in which a client had work and made no progress.

    A period starts when the client is known to have work (a producer always has; a consumer
    has while its queue's depth is above 0) and ends at its next progress or when the work is
    gone. Work that arrives while the client idles counts from when it was seen, not from the
    client's last progress: an idle consumer is not a stalled one.
    """

    def __init__(self, clock: Callable[[], float], *, has_work: bool = False,
                 stall_after_s: float = STALL_AFTER_S) -> None:
        self._clock = clock
        self.stall_after_s = stall_after_s
        self._has_work = has_work
        self._waiting_since: float | None = clock() if has_work else None
        self._longest_ended_s = 0.0
        self._stalls_ended = 0

    def progressed(self) -> None:
        now = self._clock()
        self._end_period(now)
        self._waiting_since = now if self._has_work else None

    def observe_work(self, has_work: bool) -> None:
        """What the client has to do as last seen (a consumer's queue depth above 0)."""
        self._has_work = has_work
        if has_work and self._waiting_since is None:
            self._waiting_since = self._clock()
        elif not has_work:
            self._end_period(self._clock())
            self._waiting_since = None

    def waiting_s(self) -> float:
        """How long the current period without progress has lasted (0 outside one)."""
        return 0.0 if self._waiting_since is None else self._clock() - self._waiting_since

    def stalled_s(self) -> float | None:
        """The current stall's length, or None while the client is not stalled."""
        waiting_s = self.waiting_s()
        return waiting_s if waiting_s >= self.stall_after_s else None

    @property
    def longest_stall_s(self) -> float:
        """The longest period with work and without progress, the current one included."""
        return max(self._longest_ended_s, self.waiting_s())

    @property
    def stalls(self) -> int:
        """Periods that reached stall_after_s, the current one included."""
        return self._stalls_ended + (self.stalled_s() is not None)

    def _end_period(self, now: float) -> None:
        if self._waiting_since is None:
            return
        length_s = now - self._waiting_since
        self._longest_ended_s = max(self._longest_ended_s, length_s)
        self._stalls_ended += length_s >= self.stall_after_s


@dataclass
class DemoClient:
    """One demo producer or consumer, named as the view shows it ("orders consumer")."""
    name: str
    queue: str
    tracker: ProgressTracker
    is_consumer: bool
    errors: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    replacements: int = 0        # consumers made anew after a non-retriable error
    ended: str | None = None     # why its loop ended, when it did (it should not)

    def count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self.last_error = code


def make_clients(queues: Iterable[str], clock: Callable[[], float]) -> dict[str, DemoClient]:
    """A producer and a consumer per queue, keyed by name. A producer has work from the start."""
    clients = {}
    for queue in queues:
        for is_consumer, role in ((False, "producer"), (True, "consumer")):
            tracker = ProgressTracker(clock, has_work=not is_consumer)
            clients[f"{queue} {role}"] = DemoClient(f"{queue} {role}", queue, tracker, is_consumer)
    return clients


def observe_depths(clients: Iterable[DemoClient], depths: Mapping[str, int]) -> None:
    """Tell each consumer whether its queue has messages; a depth not read now changes nothing."""
    for client in clients:
        if client.is_consumer and client.queue in depths:
            client.tracker.observe_work(depths[client.queue] > 0)


def status_lines(clients: Iterable[DemoClient], depths: Mapping[str, int]) -> list[str]:
    """The live view's lines on clients that are not well: stalled, ended or replaced."""
    lines = []
    for client in clients:
        if client.ended is not None:
            lines.append(f"{client.name}: ENDED ({client.ended})")
            continue
        stalled_s = client.tracker.stalled_s()
        if stalled_s is not None:
            lines.append(f"{client.name}: stalled {stalled_s:.1f} s ({_stall_context(client, depths)})")
        if client.replacements:
            lines.append(f"{client.name}: replaced {client.replacements} time(s) after a non-retriable error "
                         f"(last {client.last_error})")
    return lines


def _stall_context(client: DemoClient, depths: Mapping[str, int]) -> str:
    if client.is_consumer:
        depth = depths.get(client.queue)
        return f"depth {depth:,}" if depth is not None else "depth unknown now"
    return f"last error {client.last_error}" if client.last_error else "an enqueue has not returned"


def errors_text(clients: Iterable[DemoClient]) -> str:
    """Every error the demo traffic saw, by client and code: "orders consumer E_NOT_MASTER 1"."""
    parts = [f"{client.name} {code} {count:,}" for client in clients
             for code, count in sorted(client.errors.items())]
    return ", ".join(parts) or "none"


def summary(clients: Iterable[DemoClient]) -> dict[str, dict[str, object]]:
    """Per client: its longest stall, how many stalls reached STALL_AFTER_S, its errors by code."""
    result: dict[str, dict[str, object]] = {}
    for client in clients:
        entry: dict[str, object] = {"longest_stall_s": round(client.tracker.longest_stall_s, 1),
                                    f"stalls_over_{client.tracker.stall_after_s:g}_s": client.tracker.stalls,
                                    "errors": dict(client.errors)}
        if client.is_consumer:
            entry["replaced"] = client.replacements
        if client.ended is not None:
            entry["ended"] = client.ended
        result[client.name] = entry
    return result
