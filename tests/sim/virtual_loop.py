"""A deterministic asyncio event loop on virtual time, and executors that never use threads.

`VirtualTimeLoop` is an ordinary asyncio loop (callbacks, timers, tasks, futures) whose
clock stands still while there is work to do and jumps straight to the next timer when the
loop would otherwise block: asyncio's own `_run_once` asks its selector to wait `timeout`
seconds, and the selector here advances the clock by that much instead of sleeping. There is
no I/O in a simulation, so nothing is ever selected; `call_soon_threadsafe` needs no wake-up.
Timers due at the same virtual moment run in the order they were set (asyncio's heap alone
would not keep it, and a simulated link that delivers in order relies on it).
Runs are therefore exactly repeatable and take as long as the work they do, not the virtual
time they cover (docs/ARCHITECTURE.md, "Conventions": deterministic simulation from one seed).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class Deadlock(RuntimeError):
    """The loop has nothing ready and no timer: it would wait forever."""


class _VirtualSelector:
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Deadlock("virtual loop has no ready callback and no timer")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        pass


class _OrderedTimerHandle(asyncio.TimerHandle):
    """A timer that sorts after every timer set before it for the same moment."""
    __slots__ = ("_sequence",)

    def __init__(self, sequence: int, when: float, callback: Callable[..., Any], args: tuple[Any, ...],
                 loop: asyncio.AbstractEventLoop, context: Any = None) -> None:
        super().__init__(when, callback, args, loop, context)
        self._sequence = sequence

    def __lt__(self, other: asyncio.TimerHandle) -> bool:
        if isinstance(other, _OrderedTimerHandle):
            return (self.when(), self._sequence) < (other.when(), other._sequence)
        return self.when() < other.when()


class VirtualTimeLoop(asyncio.BaseEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._now = start
        self._selector = _VirtualSelector(self)
        self._clock_resolution = 1e-9
        self._timer_sequence = itertools.count()

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any,  # type: ignore[override]
                context: Any = None) -> asyncio.TimerHandle:
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        timer = _OrderedTimerHandle(next(self._timer_sequence), when, callback, args, self, context)
        heapq.heappush(self._scheduled, timer)      # type: ignore[attr-defined]
        timer._scheduled = True                     # type: ignore[attr-defined]
        return timer

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        # Land exactly on the next timer, never a rounding error short of it.
        target = self._now + seconds
        if self._scheduled and abs(self._scheduled[0].when() - target) < 1e-6:
            target = self._scheduled[0].when()
        self._now = max(self._now, target)

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass        # no other thread ever wakes this loop

    def close(self) -> None:
        if not self.is_closed():
            super().close()
            self._selector.close()


class InlineExecutor(Executor):
    """Runs each submitted call at once, on the caller's thread: a commit that is durable the
    moment the engine hands it over."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to the engine like a thread's exception
            future.set_exception(error)
        return future


class DelayedExecutor(Executor):
    """Runs each submitted call after a virtual delay drawn from `delay_ms` (fsync latency),
    one at a time and in order. `crash()` forgets every call not yet run: what was handed to
    the disk but not synced is lost, as on kill -9. While `pause()`d (the process is stopped)
    calls that come due wait, in order, until `resume()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay_ms: Callable[[], int]) -> None:
        self._loop = loop
        self._delay_ms = delay_ms
        self._pending: list[asyncio.TimerHandle] = []
        self._free_at = 0.0
        self._paused = False
        self._held: list[Callable[[], None]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        at = max(self._free_at, self._loop.time()) + self._delay_ms() / 1000
        self._free_at = at

        def run() -> None:
            if self._paused:
                self._held.append(run)
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:
                    future.set_exception(error)
        self._pending = [handle for handle in self._pending if handle.when() > self._loop.time()]
        self._pending.append(self._loop.call_at(at, run))
        return future

    def crash(self) -> None:
        for handle in self._pending:
            handle.cancel()
        self._pending.clear()
        self._held.clear()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        held, self._held = self._held, []
        for run in held:
            run()
