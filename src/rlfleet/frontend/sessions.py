"""Session affinity for the KV router (`--router-mode kv`): the requests of one session (an
agent episode: the `X-Session-ID` header SkyRL, vLLM and Dynamo-style clients send, or a
body's `session_id`) stay on the worker that holds its conversation, until the client says
the session is over (`POST /finish_session?session_id=`, as SkyRL 0.4's client sends it) or
it has been idle for `ttl` seconds.

The table only remembers; the KV router decides (rlfleet.frontend.kv.KvRouter.choose): a
bound session goes back to its worker unless that worker is gone or closed to it, or
another costs less (counting the sessions bound to each worker as its load; a request
without token IDs: unless its worker is overloaded), and then is bound to wherever it went
(the old worker sheds it). A worker whose prefix cache is cleared (a refresh) or that
leaves loses its sessions."""

from __future__ import annotations

import time
from collections import OrderedDict

DEFAULT_TTL = 600.0  # seconds a session stays bound after its last request
MAX_SESSIONS = 65_536  # bindings kept at most (the least recently used go first)
MAX_SESSION_ID = 256  # characters
TURNS_DECAY = 0.97  # per finished session: about the last 30 count


class SessionTable:
    """session ID -> (worker instance ID, when last used), least recently used first."""

    def __init__(self, ttl: float = DEFAULT_TTL, limit: int = MAX_SESSIONS) -> None:
        if not ttl > 0:
            raise ValueError(f"--kv-session-ttl must be positive, got {ttl}")
        self.ttl, self.limit = ttl, limit
        # session -> (worker, when last used, its requests so far)
        self._bound: OrderedDict[str, tuple[int, float, int]] = OrderedDict()
        self._per_worker: dict[int, int] = {}  # sessions bound to each worker
        self.shed = 0  # sessions moved to another worker (for /health)
        self._turns = [0.0, 0.0]  # decayed requests of the finished sessions, sessions

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session: str) -> int | None:
        """The worker `session` is bound to (None: none, or idle past the TTL)."""
        got = self._bound.get(session)
        if got is None:
            return None
        if got[1] < time.monotonic() - self.ttl:
            self._drop(session)
            return None
        return got[0]

    def bind(self, session: str, iid: int) -> None:
        """A request of `session` goes to worker `iid`: the session is bound there."""
        old = self._bound.get(session)
        if old is None or old[0] != iid:
            if old is not None:
                self._per_worker[old[0]] -= 1
            self._per_worker[iid] = self._per_worker.get(iid, 0) + 1
        self._bound[session] = (iid, time.monotonic(), 1 + (old[2] if old else 0))
        self._bound.move_to_end(session)
        while len(self._bound) > self.limit:
            self._drop(next(iter(self._bound)))
        oldest = time.monotonic() - self.ttl
        while self._bound and next(iter(self._bound.values()))[1] < oldest:
            self._drop(next(iter(self._bound)))

    def _drop(self, session: str) -> bool:
        got = self._bound.pop(session, None)
        if got is None:
            return False
        self._per_worker[got[0]] -= 1
        return True

    def finish(self, session: str) -> bool:
        """The session is over: forget it (whether it was bound), and learn its length."""
        got = self._bound.get(session)
        if got is not None:
            self._turns[0] = self._turns[0] * TURNS_DECAY + got[2]
            self._turns[1] = self._turns[1] * TURNS_DECAY + 1
        return self._drop(session)

    def turns_to_come(self, session: str) -> float:
        """How many more requests `session` is expected to send: the mean length of the
        sessions finished lately (`finish`) less its requests so far, at least one; before
        any session has finished, as many as it has sent (a session that has lasted t turns
        is as likely to last t more as not)."""
        got = self._bound.get(session)
        done = got[2] if got else 0
        if self._turns[1] > 0:
            return max(1.0, self._turns[0] / self._turns[1] - done)
        return float(max(1, done))

    def drop_worker(self, iid: int) -> int:
        """Forget every session bound to worker `iid`; how many."""
        gone = [s for s, (w, _, _) in self._bound.items() if w == iid]
        for s in gone:
            self._drop(s)
        return len(gone)

    def count(self, iid: int) -> int:
        """Sessions bound to worker `iid` (some may be idle past the TTL, not yet seen)."""
        return self._per_worker.get(iid, 0)
