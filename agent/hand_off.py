"""Who serves the other tenants while one request waits?

The agent's socket is served by one thread at a time (:mod:`agent.server`): it polls
every connection, reads a ready request, answers it and polls again, so a request
passes no GIL between threads. One thread per connection spent twice the CPU per
lease+release at 8 tenants as at one, most of it handing the GIL over at every
syscall. A request about to wait (a central grant from poold, room for its memory, a
frame that has not all arrived, a peer that does not take its reply) calls
:func:`ahead` first: the loop goes on in another thread at once, and this one finishes
its request and retires. Something slow nobody marked is caught by a watchdog instead,
later. :class:`Turns` keeps whose turn at the loop it is; the loop itself (what a turn
polls and serves) is the server's.

Outside a request the loop serves (the heartbeat thread, a test calling the service
directly, a tenant's own client) :func:`ahead` does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger("agent.server")  # it logs as the server it serves

_local = threading.local()


class _Serving:
    # A class, not @contextmanager: entered on every request, where a generator's
    # set-up costs more than the rest of it.
    __slots__ = ("_hand_off",)

    def __init__(self, hand_off: Callable[[], None]) -> None:
        self._hand_off = hand_off

    def __enter__(self) -> None:
        _local.hand_off = self._hand_off

    def __exit__(self, *exc: object) -> None:
        _local.hand_off = None


def serving(hand_off: Callable[[], None]) -> _Serving:
    """Around one request the loop serves: ``hand_off`` passes the loop on (once)."""
    return _Serving(hand_off)


def ahead() -> None:
    """The calling thread is about to wait or to run long: let the loop go on without it."""
    hand_off: Callable[[], None] | None = getattr(_local, "hand_off", None)
    if hand_off is not None:
        _local.hand_off = None
        hand_off()


# A request the loop has served this long without passing the loop on (an unmarked
# wait) loses it to a new thread; the watchdog looks this often.
WATCH_INTERVAL_S: Final = 0.05


class Turn:
    """One thread's turn at the loop; ``since`` is when the request it is serving began
    (0: none)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = 0.0


class Turns:
    """Which thread runs the loop now: one at a time, each in a thread of its own; a new
    one takes over when the holder's request waits (:meth:`hand_off`) or has held the loop
    a whole ``WATCH_INTERVAL_S`` (the watchdog). ``run(turn)`` is the loop: it returns
    once ``turn`` is no longer :attr:`current` (or the stop)."""

    def __init__(self, run: Callable[[Turn], None], stopping: threading.Event) -> None:
        self._run = run
        self._stopping = stopping
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.current: Turn | None = None

    def begin(self) -> None:
        """The first turn, and the watchdog."""
        with self._lock:
            self.current = first = Turn()
        threading.Thread(target=self._watch, name="agent-loop-watch", daemon=True).start()
        self._start(first)

    def hand_off(self, turn: Turn) -> None:
        """``turn`` is over: a new thread runs the loop from now. Its holder finishes the
        request it is serving and retires."""
        with self._lock:
            if self.current is not turn or self._closed or self._stopping.is_set():
                return
            self.current = following = Turn()
        self._start(following)

    def close(self) -> list[threading.Thread]:
        """No new turns; the loop threads still running, this one left out (to join)."""
        with self._lock:
            self._closed = True
            return [t for t in self._threads if t is not threading.current_thread()]

    def _start(self, turn: Turn) -> None:
        thread = threading.Thread(target=self._take, args=(turn,), name="agent-loop", daemon=True)
        with self._lock:  # started under it: close() lists only started threads
            self._threads.add(thread)
            thread.start()

    def _take(self, turn: Turn) -> None:
        try:
            self._run(turn)
        except Exception:  # the loop must not die with one thread: pass it on
            log.exception("the agent's socket loop failed; going on in a new thread")
            self.hand_off(turn)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            turn = self.current
            since = 0.0 if turn is None else turn.since
            if turn is not None and since and time.monotonic() - since >= WATCH_INTERVAL_S:
                log.debug("a request held the socket loop for %.3f s", time.monotonic() - since)
                self.hand_off(turn)
