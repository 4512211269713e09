"""When the pool is full, which waiting lease request gets the room that frees up?

The oldest one on this agent. A request with ``wait_s`` that poold refuses with
``no_capacity`` queues here, first come first served: only the request at the head
retries its grant (after a heartbeat reply, a local release or shrink, or every
:data:`ADMISSION_RETRY_S`), so a later or smaller request never overtakes it. Each
heartbeat tells poold how many bytes the head wants (:meth:`Admission.wanted_bytes`),
which poold may free for it (pressure, replicas first). A request counts there only
once poold has refused it ``no_capacity``, which it says only to a caller it has
authorised: a stranger's request never makes poold press other tenants.

How much lease work may run at once is :class:`InFlight`'s: a request slot per uid
while the request runs, then, once poold has granted the lease, its bytes against a
per-uid and a host-wide budget while its memory is made. Both are bounded, so neither
one uid nor everyone together can have the agent make more memory at once than the
budget (each check of free memory alone would let concurrent requests all pass).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from agent import hand_off
from poold.errors import InFlightLimit, NoCapacity, QuotaExceeded
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut

# A lease request waiting for capacity (wait_s) retries its grant when a heartbeat reply
# arrives or a local lease is released, and at least this often otherwise.
ADMISSION_RETRY_S = 1.0
# A grant refused for hosts' unspent budgets tries again this often while it may wait:
# the hosts told give their budgets back within a delegation step (agent/link.py).
BUDGETS_RETRY_S = 0.25
BUDGETS_RETRY_MAX_S = 2.0

DEFAULT_MAX_REQUESTS_PER_UID: Final = 16
DEFAULT_MAX_IN_FLIGHT_BYTES: Final = 8 << 30
DEFAULT_MAX_IN_FLIGHT_BYTES_PER_UID: Final = 4 << 30
DEFAULT_IN_FLIGHT_WAIT_S: Final = 5.0


class _Waiting:
    """A lease request waiting for capacity; identity is its place in the queue."""

    __slots__ = ("authorised", "size_bytes")

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        # poold refused it no_capacity, so it knows the caller: only then does poold
        # hear of the bytes it wants.
        self.authorised = False


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
        """Grant through poold; on no_capacity, wait up to ``wait_s`` in arrival order;
        on a quota_exceeded that only hosts' unspent budgets caused (``held_by_budgets``:
        poold now keeps room for it, poold/ledger/central_room.py), try again after
        :data:`BUDGETS_RETRY_S`, doubling, within the same ``wait_s``, outside the queue
        (it waits for its own tenant's budgets, not for capacity others need).

        Past the wait, the request fails with the last refusal seen (a no_capacity's
        details name the free bytes per device).
        """
        deadline = time.monotonic() + wait_s
        pause = BUDGETS_RETRY_S
        while True:
            try:
                return self._grant_in_turn(req, deadline)
            except QuotaExceeded as err:
                remaining = deadline - time.monotonic()
                if not err.detail.get("held_by_budgets") or remaining <= 0 or self._closed.is_set():
                    raise
                hand_off.ahead()
                if self._closed.wait(min(remaining, pause)):
                    raise
                # Doubling: hosts give budgets back within a second or two; past that
                # the tenant's quota is held for real, and each try costs poold a grant.
                pause = min(2 * pause, BUDGETS_RETRY_MAX_S)

    def _grant_in_turn(self, req: GrantRequest, deadline: float) -> LeaseOut:
        """`grant` until ``deadline`` for no_capacity, in arrival order."""
        wait_s = deadline - time.monotonic()
        if wait_s <= 0:
            return self._grant(req)
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
                        hand_off.ahead()
                        self._changed.wait(remaining)
                    epoch = self._capacity_epoch
                try:
                    return self._grant(req)
                except NoCapacity as err:
                    if "host_status" in err.detail:  # draining: no capacity will come
                        raise
                    ticket.authorised = True
                    last = err
                    self._last_refusal = err
                with self._changed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed.is_set():
                        raise last
                    if self._capacity_epoch == epoch and not self._closed.is_set():
                        hand_off.ahead()
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
        """What the oldest waiting lease request needs (FIFO: only it), for the heartbeat;
        0 until poold has authorised it (its first refusal was no_capacity)."""
        with self._changed:
            head = self._waiting[0] if self._waiting else None
            return head.size_bytes if head is not None and head.authorised else 0

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


@dataclass(frozen=True, slots=True)
class InFlightLimits:
    """How much lease work may run at once; see :class:`InFlight`."""

    max_requests_per_uid: int = DEFAULT_MAX_REQUESTS_PER_UID
    max_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES
    max_bytes_per_uid: int = DEFAULT_MAX_IN_FLIGHT_BYTES_PER_UID
    # How long a request past a limit waits for room before in_flight_limit.
    wait_s: float = DEFAULT_IN_FLIGHT_WAIT_S


class InFlight:
    """Lease requests running now, per uid, and the bytes being made for them (thread-safe).

    ``request(uid)`` holds one of the uid's request slots for a whole lease request;
    ``making(uid, n)`` holds ``n`` bytes of the uid's and of the host's budget while a
    granted lease's memory is made. Either waits up to ``wait_s`` for room, then refuses
    with ``in_flight_limit`` (retryable). A lone request larger than a budget still
    runs when nothing else is being made in that scope: the budgets bound what runs
    together, never which single lease may be made. ``available`` (bytes of RAM free
    now) makes a request also wait while the bytes others are making, plus its own,
    exceed it.
    """

    def __init__(self, limits: InFlightLimits | None = None) -> None:
        self.limits = limits or InFlightLimits()
        self._changed = threading.Condition()
        self._requests: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._bytes_total = 0

    @contextlib.contextmanager
    def request(self, uid: int, wait_s: float | None = None) -> Iterator[None]:
        """One of the uid's lease-request slots, for the block."""
        limit = self.limits.max_requests_per_uid
        self._wait(
            lambda: self._requests.get(uid, 0) < limit,
            wait_s,
            lambda: InFlightLimit(
                f"uid {uid} already has {limit} lease requests in flight on this agent; "
                "retry when one has finished",
                limit="requests_per_uid",
                max_requests=limit,
                retry_after_s=1,
            ),
            take=lambda: self._requests.__setitem__(uid, self._requests.get(uid, 0) + 1),
        )
        try:
            yield
        finally:
            with self._changed:
                left = self._requests[uid] - 1
                if left:
                    self._requests[uid] = left
                else:
                    del self._requests[uid]
                self._changed.notify_all()

    @contextlib.contextmanager
    def making(
        self,
        uid: int,
        size_bytes: int,
        *,
        wait_s: float | None = None,
        available: Callable[[], int | None] | None = None,
    ) -> Iterator[None]:
        """``size_bytes`` of the uid's and the host's in-flight budgets, for the block."""
        limits = self.limits

        def fits() -> bool:
            mine = self._bytes.get(uid, 0)
            if mine and mine + size_bytes > limits.max_bytes_per_uid:
                return False
            if self._bytes_total and self._bytes_total + size_bytes > limits.max_bytes:
                return False
            if available is not None and self._bytes_total:
                free = available()
                if free is not None and self._bytes_total + size_bytes > free:
                    return False
            return True

        def refusal() -> InFlightLimit:
            mine = self._bytes.get(uid, 0)
            if mine and mine + size_bytes > limits.max_bytes_per_uid:
                scope, limit, used = "bytes_per_uid", limits.max_bytes_per_uid, mine
            else:
                scope, limit, used = "bytes", limits.max_bytes, self._bytes_total
            whom = "this host" if scope == "bytes" else f"uid {uid}"
            return InFlightLimit(
                f"{used} bytes of memory are being made for {whom} already; {size_bytes} "
                f"more would pass the in-flight limit of {limit} bytes: retry shortly",
                limit=scope,
                in_flight_bytes=used,
                max_bytes=limit,
                size_bytes=size_bytes,
                retry_after_s=1,
            )

        self._wait(fits, wait_s, refusal, take=lambda: self._take_bytes(uid, size_bytes))
        try:
            yield
        finally:
            with self._changed:
                left = self._bytes[uid] - size_bytes
                if left:
                    self._bytes[uid] = left
                else:
                    del self._bytes[uid]
                self._bytes_total -= size_bytes
                self._changed.notify_all()

    def _take_bytes(self, uid: int, size_bytes: int) -> None:
        self._bytes[uid] = self._bytes.get(uid, 0) + size_bytes
        self._bytes_total += size_bytes

    def _wait(
        self,
        fits: Callable[[], bool],
        wait_s: float | None,
        refusal: Callable[[], InFlightLimit],
        take: Callable[[], None] | None = None,
    ) -> None:
        """Wait (under the condition) until ``fits``; then ``take``, in the same hold."""
        deadline = time.monotonic() + (self.limits.wait_s if wait_s is None else wait_s)
        with self._changed:
            while not fits():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise refusal()
                # Re-checked at least every second: `available` is not notified.
                hand_off.ahead()
                self._changed.wait(min(remaining, ADMISSION_RETRY_S))
            if take is not None:
                take()

    def bytes_in_flight(self, uid: int | None = None) -> int:
        """Bytes being made now, for ``uid`` or (None) on the whole host."""
        with self._changed:
            return self._bytes_total if uid is None else self._bytes.get(uid, 0)

    def requests_in_flight(self, uid: int) -> int:
        with self._changed:
            return self._requests.get(uid, 0)
