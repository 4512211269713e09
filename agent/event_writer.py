"""How do pushed events reach a tenant session without stalling anyone?

A session's events wait in its :class:`Outbox` (bounded: revoke and lost are queued
once per lease, a newer shrink replaces an older one of the same lease, a full queue
drops its oldest shrink, and one full of revokes and losts refuses: the server then
hangs up). Its own writer thread (:func:`write_events`) sends them, each whole under
the connection's send lock and each within the reply timeout (:func:`send_within`),
so :meth:`agent.server.AgentServer.push` never blocks whatever thread calls it.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import threading
import time
from typing import Final

from agent.protocol import CRITICAL_EVENTS

log = logging.getLogger("agent.server")  # it logs as the server it was split from

# (kind, lease id) pairs a session remembers having queued (revoke/lost go once each).
_TOLD_MEMORY: Final = 4096


class Outbox:
    """A session's queued events (see the module docstring for what is kept and dropped)."""

    def __init__(self, bound: int) -> None:
        self._bound = max(1, bound)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, str, bytes]] = collections.deque()
        self._told: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._closed = False
        self.dropped = 0  # shrink events dropped for room

    def put(self, kind: str, lease_id: str, frame: bytes) -> bool:
        """Queue an event; False when it cannot be (full of critical events: hang up)."""
        with self._cond:
            if self._closed:
                return True
            if kind in CRITICAL_EVENTS:
                key = (kind, lease_id)
                if key in self._told:
                    return True  # said once is enough
                self._told[key] = None
                while len(self._told) > _TOLD_MEMORY:
                    self._told.popitem(last=False)
            else:  # a newer shrink request supersedes the one not yet sent
                for queued in self._queue:
                    if queued[0] == kind and queued[1] == lease_id:
                        self._queue.remove(queued)
                        break
            if len(self._queue) >= self._bound:
                oldest = next((q for q in self._queue if q[0] not in CRITICAL_EVENTS), None)
                if oldest is None:
                    return False
                self._queue.remove(oldest)
                self.dropped += 1
            self._queue.append((kind, lease_id, frame))
            self._cond.notify()
            return True

    def take(self) -> bytes | None:
        """The next frame to send, waiting for one; None once closed."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            return self._queue.popleft()[2]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)


def send_within(sock: socket.socket, frame: bytes, timeout_s: float) -> bool:
    """Send all of ``frame`` by ``timeout_s`` from now without blocking past it.

    Its own poll and MSG_DONTWAIT: the socket's timeout is the reader's to
    set (it changes with every frame it reads), never the writer's.
    """
    deadline = time.monotonic() + timeout_s
    view = memoryview(frame)
    writable = select.poll()
    writable.register(sock.fileno(), select.POLLOUT)
    try:
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = writable.poll(left * 1000)
            if not ready:
                return False
            if ready[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return False
            try:
                sent = sock.send(view, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                continue
            view = view[sent:]
    except OSError as err:
        log.debug("event not delivered: %s", err)
        return False
    return True
