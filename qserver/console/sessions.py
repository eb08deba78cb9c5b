"""Console sessions: what a sign-in link becomes (docs/CONSOLE.md, "Signing in").

A session is a random id in an HttpOnly, SameSite=Strict cookie, kept in this node's memory only
(it holds at the node that issued it; a restart signs everyone out). It names the client it acts
for, never grants: each call checks the client's grants as they are then, so a grant revoked or a
client removed takes effect at the next page. Bounded per client and in all, idle sessions end,
and every session ends after SESSION_MAX_MS whatever it does.
"""
from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SESSION_IDLE_MS = 30 * 60_000          # a session unused this long ends
SESSION_MAX_MS = 12 * 3_600_000        # and every session ends this long after its sign-in
SESSIONS_PER_CLIENT_MAX = 16           # a client's oldest session ends when it opens one more
SESSIONS_MAX = 10_000                  # in all: the least recently used ends
NOTICES_MAX = 8                        # results of actions waiting to be shown on the next page


@dataclass(eq=False)
class Session:
    session_id: str
    client_id: str
    csrf: str                          # carried by every form that changes something
    opened_ms: int
    seen_ms: int
    notices: list[tuple[str, str]] = field(default_factory=list)    # (kind "ok" | "error", text)

    def notify(self, kind: str, text: str) -> None:
        self.notices.append((kind, text))
        del self.notices[:-NOTICES_MAX]

    def take_notices(self) -> list[tuple[str, str]]:
        notices, self.notices = self.notices, []
        return notices


class Sessions:
    def __init__(self, clock_ms: Callable[[], int] = lambda: int(time.monotonic() * 1000)) -> None:
        self._clock_ms = clock_ms
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()   # least recent first

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, client_id: str) -> Session:
        now = self._clock_ms()
        own = [s for s in self._sessions.values() if s.client_id == client_id]
        for old in own[:max(0, len(own) - SESSIONS_PER_CLIENT_MAX + 1)]:
            self._sessions.pop(old.session_id, None)
        while len(self._sessions) >= SESSIONS_MAX:
            self._sessions.popitem(last=False)
        session = Session(secrets.token_urlsafe(32), client_id, secrets.token_urlsafe(32), now, now)
        self._sessions[session.session_id] = session
        return session

    def find(self, session_id: str | None) -> Session | None:
        """The live session of a cookie's value (None: none, expired or ended)."""
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        now = self._clock_ms()
        if now - session.seen_ms > SESSION_IDLE_MS or now - session.opened_ms > SESSION_MAX_MS:
            del self._sessions[session_id]
            return None
        session.seen_ms = now
        self._sessions.move_to_end(session_id)
        return session

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def per_client(self) -> dict[str, int]:
        counts: dict[str, int] = collections.Counter(s.client_id for s in self._sessions.values())
        return dict(counts)
