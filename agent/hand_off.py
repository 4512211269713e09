"""Who serves the other tenants while one request waits?

The agent's socket is served by one thread at a time (:mod:`agent.server`): it polls
every connection, reads a ready request, answers it and polls again, so a request
passes no GIL between threads. One thread per connection spent twice the CPU per
lease+release at 8 tenants as at one, most of it handing the GIL over at every
syscall. A request about to wait (a central grant from poold, room for its memory, a
frame that has not all arrived, a peer that does not take its reply) calls
:func:`ahead` first: the loop goes on in another thread at once, and this one finishes
its request and retires. Something slow nobody marked is caught by the server's
watchdog instead, later.

Outside a request the loop serves (the heartbeat thread, a test calling the service
directly, a tenant's own client) :func:`ahead` does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def serving(hand_off: Callable[[], None]) -> Iterator[None]:
    """Around one request the loop serves: ``hand_off`` passes the loop on (once)."""
    _local.hand_off = hand_off
    try:
        yield
    finally:
        _local.hand_off = None


def ahead() -> None:
    """The calling thread is about to wait or to run long: let the loop go on without it."""
    hand_off: Callable[[], None] | None = getattr(_local, "hand_off", None)
    if hand_off is not None:
        _local.hand_off = None
        hand_off()
