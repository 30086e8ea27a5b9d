"""Engine events to an asyncio loop with one wake-up of the loop per scheduler step (#22).

The scheduler calls each request's ``on_event`` on the engine thread, once per event.
A consumer on an asyncio loop must hand every event over with
``loop.call_soon_threadsafe``, and each such call writes to the loop's self-pipe and
wakes the loop thread, which then takes the GIL from the engine thread: 8 requests
in a batch meant 8 wake-ups and 8 GIL hand-overs per step, in the middle of the step.

A :class:`LoopRelay` buffers what a step emits and hands the whole batch to its loop
with ONE ``call_soon_threadsafe`` when the step ends. ``Scheduler.run`` brackets each
step with :func:`step_events`; an event emitted outside a bracketed step (a test
driving ``Scheduler.step`` itself, a request failed by ``_survive``) goes out at once,
so nothing ever waits for a step that does not come. The per-request ``on_event(ev)``
contract is unchanged: a relay's :meth:`~LoopRelay.sender` is such a callback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

_step = threading.local()  # .relays: the relays the running step pushed to (engine thread)


@contextmanager
def step_events() -> Iterator[None]:
    """Bracket one scheduler step: every relay it pushed events to flushes once, at
    the end (also when the step raises: what was emitted before still goes out)."""
    relays: list[LoopRelay] = []
    _step.relays = relays
    try:
        yield
    finally:
        _step.relays = None
        for relay in relays:
            relay.flush()


class LoopRelay:
    """Delivers engine events on one event loop's thread, batched per scheduler step.

    ``loop`` is anything with ``call_soon_threadsafe`` (an asyncio loop); it may be
    bound later with :meth:`bind`, as an aiohttp app is built before its loop runs.
    """

    def __init__(self, loop: Any = None):
        self.loop = loop
        self._lock = threading.Lock()
        # (deliver, event, lost) in emission order; deliver(event) runs on the loop
        self._items: list[tuple[Callable[[Any], None], Any, Callable[[], None] | None]] = []
        self.wakeups = 0  # call_soon_threadsafe calls made: one per step with events
        self.delivered = 0  # events handed over

    def bind(self, loop: Any) -> None:
        self.loop = loop

    def sender(
        self, deliver: Callable[[Any], None], lost: Callable[[], None] | None = None
    ) -> Callable[[Any], None]:
        """An ``on_event`` callback for Engine.submit: each event reaches
        ``deliver(ev)`` on the loop's thread; ``lost()`` runs (on the engine thread) if
        the loop is gone, so the request can be cancelled instead of running on."""
        return lambda ev: self.push(deliver, ev, lost)

    def push(self, deliver: Callable[[Any], None], ev: Any, lost=None) -> None:
        with self._lock:
            self._items.append((deliver, ev, lost))
        relays = getattr(_step, "relays", None)
        if relays is None:
            self.flush()  # not inside a bracketed step: nobody would flush it later
        elif self not in relays:  # a handful of relays at most (one per loop)
            relays.append(self)

    def flush(self) -> None:
        """Hand everything buffered to the loop with one wake-up. Under the lock, so
        two flushes (from two threads) cannot reorder one request's events."""
        with self._lock:
            items, self._items = self._items, []
            if not items:
                return
            # counted first: once handed over, a reader may see the events delivered
            # (and a test read the counters) before this thread runs another line
            self.wakeups += 1
            self.delivered += len(items)
            try:
                self.loop.call_soon_threadsafe(_dispatch, items)
                return
            except (RuntimeError, AttributeError):  # the loop is closed (or never bound)
                self.wakeups -= 1
                self.delivered -= len(items)
                lost = [f for _, _, f in items if f is not None]
        for f in lost:  # outside the lock: a cancel may emit nothing, but be safe
            try:
                f()
            except Exception:
                log.exception("relay: cancelling a request whose loop is gone failed")


def _dispatch(items: list) -> None:
    """On the loop's thread: each event to its request, in emission order."""
    for deliver, ev, _ in items:
        try:
            deliver(ev)
        except Exception:  # one consumer's bug must not starve the others
            log.exception("relay: delivering an engine event failed")
