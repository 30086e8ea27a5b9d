"""Resumable streams: llama-server's ``X-Conversation-Id`` and ``/v1/stream`` routes.

A streaming request that carries an ``X-Conversation-Id`` header tees its SSE bytes
into a :class:`StreamSession` kept under that id. The generation then survives its
client: a page reload or a dropped connection does not cancel it, and
``GET /v1/stream?conv_id=…&from=N`` replays the bytes from offset N and follows the
live ones until the generation ends. ``DELETE /v1/stream?conv_id=…`` is the explicit
Stop: it cancels the generation and forgets the session. ``POST /v1/streams/lookup``
answers only for ids the caller names (no one can list the live sessions).

The rules are llama-server's (tools/server/server-stream.cpp in the pinned sdist): one
live session per id (a new request with the same id cancels the old one), at most
4 MiB kept per session (the oldest bytes go first; an offset below them is "lost"),
a finished session kept 300 s. One thing is ours: at most MAX_SESSIONS sessions are
kept (256 MiB at most); past that the oldest finished one goes first, so ids invented
by a client cannot pile up buffers.

Everything here runs on the server's event loop thread: no locks, futures wake the
readers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

TTL_S = 300.0  # a finished session is kept this long for a replay (llama-server's)
MAX_BYTES = 4 * 1024 * 1024  # SSE bytes kept per session (llama-server's)
MAX_SESSIONS = 64  # x MAX_BYTES: at most 256 MiB of kept streams, whatever clients send
MAX_ID_CHARS = 512
HEADER = "X-Conversation-Id"


class OffsetLost(Exception):
    """The offset asked for fell below the bytes still kept."""


class StreamSession:
    """One generation's SSE bytes: a capped buffer, readable from any kept offset."""

    def __init__(self, conversation_id: str, max_bytes: int, now: float):
        self.conversation_id = conversation_id
        self.started_at = now
        self.completed_at = 0.0  # 0 while the generation runs
        self.cancelled = False
        self._done = False
        self.task: asyncio.Task | None = None  # the producer, cancelled by cancel()
        self._cap = max_bytes
        self._buf = bytearray()
        self._dropped = 0  # bytes let go from the front (the cap)
        self._waiters: list[asyncio.Future] = []

    @property
    def done(self) -> bool:
        return self._done

    @property
    def total_bytes(self) -> int:
        return self._dropped + len(self._buf)

    @property
    def dropped_prefix(self) -> int:
        return self._dropped

    def append(self, data: bytes) -> bool:
        """Keep ``data`` (dropping the oldest bytes past the cap); False once done."""
        if self.done:
            return False
        self._buf += data
        over = len(self._buf) - self._cap
        if over > 0:
            del self._buf[:over]
            self._dropped += over
        self._wake()
        return True

    def read(self, offset: int) -> bytes:
        """The bytes kept from ``offset`` on (empty when there are none yet)."""
        if offset < self._dropped:
            raise OffsetLost(offset)
        return bytes(self._buf[offset - self._dropped :])

    async def changed(self) -> None:
        """Until bytes are appended or the session ends."""
        if self.done:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    def finalize(self, now: float) -> None:
        if not self._done:
            self._done, self.completed_at = True, now
            self._wake()

    def cancel(self, now: float) -> None:
        """The explicit Stop: the producer task is cancelled (its generation with it)."""
        self.cancelled = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.finalize(now)

    def info(self) -> dict:
        return {
            "conversation_id": self.conversation_id,
            "is_done": self.done,
            "total_bytes": self.total_bytes,
            "started_at": int(self.started_at),
            "completed_at": int(self.completed_at),
        }

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class StreamSessions:
    """The sessions by conversation id. Expired ones are swept on every access, so no
    timer thread is needed: memory only grows through create_or_replace, which sweeps."""

    def __init__(
        self,
        ttl_s: float = TTL_S,
        max_bytes: int = MAX_BYTES,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
    ):
        self.ttl_s, self.max_bytes, self.max_sessions = ttl_s, max_bytes, max_sessions
        self._clock = clock
        self._sessions: dict[str, StreamSession] = {}
        self._tasks: set[asyncio.Task] = set()  # producers, held until they end

    def __len__(self) -> int:
        return len(self._sessions)

    def create_or_replace(self, conversation_id: str) -> StreamSession:
        """A fresh session for ``conversation_id``; a live one under the same id is
        cancelled (one id, one live generation, as in llama-server)."""
        now = self._clock()
        self._sweep(now)
        old = self._sessions.pop(conversation_id, None)
        if old is not None:
            old.cancel(now)
        while len(self._sessions) >= self.max_sessions:
            finished = [s for s in self._sessions.values() if s.done]
            pool = finished or list(self._sessions.values())
            oldest = min(pool, key=lambda s: s.completed_at if s.done else s.started_at)
            self._sessions.pop(oldest.conversation_id)
            if not oldest.done:
                oldest.cancel(now)
        s = StreamSession(conversation_id, self.max_bytes, now)
        self._sessions[conversation_id] = s
        return s

    def get(self, conversation_id: str) -> StreamSession | None:
        self._sweep(self._clock())
        return self._sessions.get(conversation_id)

    def lookup(self, ids: list[str]) -> list[dict]:
        """The sessions of the ids named: each id matches itself and ``id::<model>``."""
        self._sweep(self._clock())
        out = []
        for rid in ids:
            for s in self._sessions.values():
                if s.conversation_id == rid or s.conversation_id.startswith(rid + "::"):
                    out.append(s.info())
        return out

    def adopt(self, task: asyncio.Task) -> None:
        """Hold a producer task (the loop keeps only weak references to tasks)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def finish(self, session: StreamSession) -> None:
        session.finalize(self._clock())

    def evict_and_cancel(self, conversation_id: str) -> bool:
        s = self._sessions.pop(conversation_id, None)
        if s is None:
            return False
        s.cancel(self._clock())
        return True

    def close(self) -> None:
        """Server shutdown: every producer cancelled, every reader woken."""
        now = self._clock()
        for s in self._sessions.values():
            s.cancel(now)
        self._sessions.clear()
        for t in list(self._tasks):
            t.cancel()

    def _sweep(self, now: float) -> None:
        cutoff = now - self.ttl_s
        for cid in [c for c, s in self._sessions.items() if s.done and s.completed_at <= cutoff]:
            del self._sessions[cid]


def conversation_id(headers) -> str | None:
    """The request's ``X-Conversation-Id`` (None when absent or empty); ValueError for
    an id too long or with control characters (it is echoed in logs and lookups)."""
    cid = headers.get(HEADER, "")
    if not cid:
        return None
    if len(cid) > MAX_ID_CHARS:
        raise ValueError(f"{HEADER} is too long (at most {MAX_ID_CHARS} characters)")
    if any(ord(c) < 32 or ord(c) == 127 for c in cid):
        raise ValueError(f"{HEADER} must not contain control characters")
    return cid
