"""Which memory can the agent hand out without making it on the request path? A warm pool.

For memfd-backed leases the agent keeps a few freshly made, prefaulted,
sealed memfds of the lengths tenants recently asked for, refilled in the
background. Prefaulting a 2 MiB memfd costs about 0.5 ms here, a third of the
lease latency budget; taking one from the pool costs microseconds.

What is in the pool is fresh memory or a memfd a tenant released, that the
kernel said no one else holds and the agent then zeroed (agent/release_check.py:
zeroing 2 MiB in place costs a fifth of freeing its pages and allocating new
ones). Each is handed out once, then gone from the pool until released again.
Only small lengths are kept warm, and the pool's total is capped, so it never
holds meaningful RAM.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

from agent.backends import Backend, Materialised

log = logging.getLogger("pool_agent.warm")

MAX_WARM_LENGTH_BYTES = 16 << 20
DEFAULT_MAX_TOTAL_BYTES = 64 << 20
# Deep enough that a tenant leasing back to back finds one ready: with 2 per length a
# tight lease+release loop missed 44 % of the time (each miss a fallocate on the request
# path, ~0.85 ms for 2 MiB here), with 8 21 %; the byte cap above still bounds the pool.
PER_LENGTH = 8
# Each miss deepens its length's pool by PER_LENGTH // 2, up to this: with 8 tenants
# leasing at once, 8 per length missed on most leases (8 held, more on their way back)
# and the agent spent 2.5 ms of CPU per lease+release, 1.5 at 32.
MAX_PER_LENGTH = 32
# A take that leaves fewer than half its length's depth (ready, or released and on
# their way back: `promise`) wakes the refill thread, which makes fresh memfds up to
# the depth. Released memfds (zeroed, far cheaper than fresh ones) come back into the
# room promised them, so a tenant leasing and releasing back to back is served from its
# own released memory, and fresh ones are made only when the punch thread falls behind.

# Lengths kept warm at once (the least recently asked is evicted).
MAX_LENGTHS = 4


class WarmPool:
    def __init__(self, backend: Backend, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        self.backend = backend
        self.max_total_bytes = max_total_bytes
        self._lock = threading.Lock()
        self._ready: OrderedDict[int, deque[Materialised]] = OrderedDict()
        self._want: set[int] = set()
        # Released memfds promised to the pool (:meth:`promise`) and not back yet: the
        # punch thread zeroes them a few ms after the release. Counted as in the pool, or
        # every take meanwhile asked for fresh ones (0.85 ms of fallocate each) and the
        # recycled ones, back, found the pool full and were punched: churn for nothing.
        self._coming: dict[int, int] = {}
        self._depth: dict[int, int] = {}  # per length, once a miss deepened it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = 0
        self.misses = 0
        self.recycled = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._refill_loop, name="agent-warm", daemon=True)
        self._thread.start()

    def take(self, length_bytes: int) -> Materialised | None:
        """A ready memfd of exactly this length, if there is one; asks for a refill when
        fewer than half its depth are left (waking the thread on every take cost the request
        thread a sixth of its time, and a released one usually comes back anyway)."""
        if length_bytes > MAX_WARM_LENGTH_BYTES or self.max_total_bytes <= 0:
            return None
        with self._lock:
            queue = self._ready.get(length_bytes)
            got = queue.pop() if queue else None  # the last returned: its pages are warm
            if got is not None:
                self.hits += 1
            else:
                self.misses += 1
                depth = self._depth_of(length_bytes)
                if queue is not None and depth < MAX_PER_LENGTH:  # asked before: too shallow
                    self._depth[length_bytes] = depth + PER_LENGTH // 2
            if queue is None:
                self._ready[length_bytes] = deque()  # a released one may come back now
            else:
                self._ready.move_to_end(length_bytes)  # recently asked: evicted last
            refill = self._low(length_bytes)
            if refill:
                self._want.add(length_bytes)
        if refill:
            self._wake.set()
        return got

    def give_back(self, memory: Materialised) -> None:
        """Return an fd that was taken but never handed to a tenant (the grant failed)."""
        with self._lock:
            queue = self._ready.setdefault(memory.length_bytes, deque())
            if len(queue) < self._depth_of(memory.length_bytes):
                queue.append(memory)
                return
        self.backend.release(memory)

    def ready(self, length_bytes: int) -> int:
        """How many memfds of this length are ready now."""
        with self._lock:
            return len(self._ready.get(length_bytes, ()))

    def wants(self, length_bytes: int) -> bool:
        """Whether a released memfd of this length would be kept (:meth:`recycle`): a
        length tenants asked for recently, with room under both caps."""
        with self._lock:
            return self._room(length_bytes)

    def promise(self, length_bytes: int) -> bool:
        """:meth:`wants`, and if so its room held for the released memfd until it comes
        back (:meth:`recycle` with ``promised``) or will not (:meth:`unpromise`)."""
        with self._lock:
            if not self._room(length_bytes):
                return False
            self._coming[length_bytes] = self._coming.get(length_bytes, 0) + 1
            return True

    def unpromise(self, length_bytes: int) -> None:
        """A promised memfd will not come back (punched instead): its room is free."""
        with self._lock:
            self._settle(length_bytes)

    def recycle(self, memory: Materialised, *, promised: bool = False) -> bool:
        """Keep a released memfd, zeroed and with fresh copies, to hand out again; False
        when there is no room for it now (the caller frees it)."""
        with self._lock:
            if promised:
                self._settle(memory.length_bytes)
            if not self._room(memory.length_bytes):
                return False
            self._ready[memory.length_bytes].append(memory)
            self.recycled += 1
            return True

    def _settle(self, length_bytes: int) -> None:
        left = self._coming.get(length_bytes, 0) - 1
        if left > 0:
            self._coming[length_bytes] = left
        else:
            self._coming.pop(length_bytes, None)

    def _room(self, length_bytes: int) -> bool:
        queue = self._ready.get(length_bytes)
        if queue is None or self._stop.is_set():
            return False
        if self._held(length_bytes) >= self._depth_of(length_bytes):
            return False
        return self._total() + length_bytes <= self.max_total_bytes

    # The three below are read under the lock.
    def _depth_of(self, length_bytes: int) -> int:
        return self._depth.get(length_bytes, PER_LENGTH)

    def _held(self, length_bytes: int) -> int:
        """Ready, or released and on the way back (promised)."""
        queue = self._ready.get(length_bytes)
        return (len(queue) if queue else 0) + self._coming.get(length_bytes, 0)

    def _low(self, length_bytes: int) -> bool:
        """Fewer than half its depth held: what a take wakes the refill thread for."""
        return self._held(length_bytes) < self._depth_of(length_bytes) // 2

    def _total(self) -> int:
        ready = sum(m.length_bytes for q in self._ready.values() for m in q)
        return ready + sum(length * n for length, n in self._coming.items())

    def _refill_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._lock:
                wanted = list(self._want)
                self._want.clear()
                for length in wanted:
                    self._ready.setdefault(length, deque())
                    self._ready.move_to_end(length)
                evicted: list[Materialised] = []
                while len(self._ready) > MAX_LENGTHS:
                    gone, old = self._ready.popitem(last=False)
                    self._depth.pop(gone, None)
                    evicted.extend(old)
            for memory in evicted:
                self.backend.release(memory)
            for length in reversed(list(self._ready)):
                with self._lock:
                    low = self._low(length)
                if length not in wanted and not low:
                    # Woken by the clock, not a take: a few short of the depth are out
                    # with tenants and come back released (fresh ones now would take
                    # their room, and the released ones be punched).
                    continue
                while not self._stop.is_set():
                    with self._lock:
                        if length not in self._ready:
                            break
                        if self._held(length) >= self._depth_of(length):
                            break
                        if self._total() + length > self.max_total_bytes:
                            break
                    try:
                        memory = self.backend.materialise(length, "poold-warm")
                    except Exception:
                        log.warning("could not pre-make a %d-byte memfd", length, exc_info=True)
                        break
                    with self._lock:
                        self._ready.setdefault(length, deque()).append(memory)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            ready, self._ready = self._ready, OrderedDict()
        for queue in ready.values():
            for memory in queue:
                self.backend.release(memory)
