"""When the pool is full, which waiting lease request gets the room that frees up?

The oldest one on this agent. A request with ``wait_s`` that poold refuses with
``no_capacity`` queues here, first come first served: only the request at the head
retries its grant (after a heartbeat reply, a local release or shrink, or every
:data:`ADMISSION_RETRY_S`), so a later or smaller request never overtakes it. Each
heartbeat tells poold how many bytes the head wants (:meth:`Admission.wanted_bytes`),
which poold may free for it (pressure, replicas first).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from poold.errors import NoCapacity
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut

# A lease request waiting for capacity (wait_s) retries its grant when a heartbeat reply
# arrives or a local lease is released, and at least this often otherwise.
ADMISSION_RETRY_S = 1.0


class _Waiting:
    """A lease request waiting for capacity; identity is its place in the queue."""

    __slots__ = ("size_bytes",)

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes


class Admission:
    """The FIFO of lease requests waiting for capacity, around poold's grant (thread-safe)."""

    def __init__(self, grant: Callable[[GrantRequest], LeaseOut]) -> None:
        self._grant = grant
        self._changed = threading.Condition()
        self._waiting: deque[_Waiting] = deque()
        self._capacity_epoch = 0  # bumped whenever capacity may have been freed
        self._last_refusal: NoCapacity | None = None
        self._closed = threading.Event()

    def grant(self, req: GrantRequest, wait_s: float) -> LeaseOut:
        """Grant through poold; on no_capacity, wait up to ``wait_s`` in arrival order.

        Past the wait, the request fails with the last no_capacity seen (the details
        name the free bytes per device).
        """
        if wait_s <= 0:
            return self._grant(req)
        deadline = time.monotonic() + wait_s
        ticket = _Waiting(req.size_bytes)
        last: NoCapacity | None = None
        with self._changed:
            self._waiting.append(ticket)
        try:
            while True:
                with self._changed:
                    while self._waiting[0] is not ticket:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self._closed.is_set():
                            raise self._still_no_capacity(req, wait_s, last)
                        self._changed.wait(remaining)
                    epoch = self._capacity_epoch
                try:
                    return self._grant(req)
                except NoCapacity as err:
                    if "host_status" in err.detail:  # draining: no capacity will come
                        raise
                    last = err
                    self._last_refusal = err
                with self._changed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed.is_set():
                        raise last
                    if self._capacity_epoch == epoch and not self._closed.is_set():
                        self._changed.wait(min(remaining, ADMISSION_RETRY_S))
        finally:
            with self._changed:
                self._waiting.remove(ticket)
                self._changed.notify_all()

    def _still_no_capacity(
        self, req: GrantRequest, wait_s: float, last: NoCapacity | None
    ) -> NoCapacity:
        """The refusal of a request that waited its whole time behind older ones."""
        seen = last or self._last_refusal
        details = dict(seen.detail) if seen is not None else {}
        because = f": {seen.message}" if seen is not None else ""
        return NoCapacity(
            f"no capacity for {req.size_bytes} bytes within {wait_s:g} s "
            f"(older requests were waiting first){because}",
            **{**details, "waited_s": wait_s},
        )

    def wanted_bytes(self) -> int:
        """What the oldest waiting lease request needs (FIFO: only it), for the heartbeat."""
        with self._changed:
            return self._waiting[0].size_bytes if self._waiting else 0

    def waiting(self) -> int:
        """How many lease requests wait for capacity now."""
        with self._changed:
            return len(self._waiting)

    def capacity_changed(self) -> None:
        """Capacity may have been freed: the oldest waiting lease request retries."""
        with self._changed:
            self._capacity_epoch += 1
            self._changed.notify_all()

    def close(self) -> None:
        """The agent stops: every waiting request gives up at once."""
        self._closed.set()
        self.capacity_changed()
