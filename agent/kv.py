"""Where does an inference engine keep its KV blocks inside a lease, and which are the only copy?

In a :class:`KVStore`: a block store laid out on any writable mapping of a lease (an
``mmap`` from :meth:`agent.client.Lease.mmap`, or a ``memoryview`` of one)::

    with PoolClient() as pool, pool.lease(8 << 30) as lease:
        with KVStore.open(lease, block_bytes=1 << 20) as kv:   # reports to the agent
            kv.put(prefix_hash, block, replica_of="gpu")       # still in GPU memory too
            ...
            kv.mark_exclusive(prefix_hash)                     # GPU copy dropped
            view = kv.get(prefix_hash)                         # zero-copy memoryview

The layout on the lease (header, one record per slot, the slab classes' slots) is
:mod:`agent.kv_layout`'s; the batched reports of the store's accounting to the agent are
:mod:`agent.kv_report`'s.

Slab classes: one (``block_bytes``) by default, or a few (``slab_classes``) sharing the
lease in fixed proportions. A block goes to the smallest class it fits; when that class
is full the least recently used block *of that class* is evicted, replicas first.

Re-opening (the choice, and why): a store opened on memory whose header carries the
same lease id, epoch and geometry *recovers* its index from the slot records, because
the same grant still holds the same bytes (an engine's KV connector restarting inside
the process that holds the lease). Every recovered block comes back **exclusive**: the
store cannot know whether the other copies (GPU, DRAM, another host) still exist, and
claiming a replica that is really the last copy would let pressure drop data that must
then be recomputed; the engine marks replicas again as it learns of them. LRU order
after recovery is the order of the last ``put`` (reads are not persisted: that would
cost a write per read). Anything else at offset 0 (a new epoch on reused memory, another
lease id, another geometry, a torn or foreign header) is reported in
:attr:`KVStore.open_reason` and the store starts **empty**: records are cleared and the
header rewritten, header last, so a crash halfway leaves memory that again opens empty.
``recover=False`` always starts empty. Which block lives in which slot, the crash
ordering of a put and the accounting are :mod:`agent.kv_index`'s (:class:`KVStore` is
its :class:`~agent.kv_index.BlockIndex` bound to a lease); this module answers how the
store lives on a lease: opened on it, reporting through the agent, giving memory back
under pool pressure (shrink in place or relet), closed.

The store is not thread-safe: one engine thread (or the engine's own lock) drives it.
The :class:`~agent.kv_report.Reporter` thread only reads its counters. Views returned
by :meth:`get`, :meth:`peek` and :meth:`reserve` are live: valid until that key is
overwritten, deleted or evicted. numpy is never imported; ``numpy.frombuffer(kv.get(key), dtype)``
gives a zero-copy array, and :meth:`put` takes any C-contiguous buffer.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, suppress
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, cast

from agent.kv_index import BlockIndex, Key
from agent.kv_layout import MAGIC, Geometry, round_up
from agent.kv_report import Reporter
from poold.errors import PoolError

if TYPE_CHECKING:
    from agent.client import Lease, PoolClient

log = logging.getLogger(__name__)


class KVStore(BlockIndex):
    """A KV block store on one lease's mapping; see the module docstring."""

    def __init__(
        self,
        mapping: mmap.mmap | memoryview | bytearray,
        lease_id: str,
        epoch: int,
        *,
        block_bytes: int = 1 << 20,
        slab_classes: Sequence[tuple[int, float]] | None = None,
        recover: bool = True,
        on_evict: Callable[[Key, str | None], None] | None = None,
    ) -> None:
        super().__init__(
            mapping,
            lease_id,
            epoch,
            block_bytes=block_bytes,
            slab_classes=slab_classes,
            recover=recover,
            on_evict=on_evict,
        )
        self._owns_mapping = False
        self.reporter: Reporter | None = None
        # Pool pressure: (target_bytes, deadline_at) poold asked for, not yet given back.
        self.pending_shrink: tuple[int, datetime] | None = None
        self._engine_lock: AbstractContextManager[object] | None = None
        self._lease: Lease | None = None
        # Under pressure, a shrinkable lease may lose exclusive blocks (LRU) to cover
        # what poold asked, rather than be revoked whole at the deadline.
        self.give_exclusive = True
        # Under pressure, a lease that cannot shrink in place (devdax) is released and
        # leased smaller (relet); off: only replicas are dropped inside it.
        self.relet_under_pressure = False
        if self.open_state == "reset":
            log.info("kv store on lease %s starts empty: %s", lease_id, self.open_reason)

    @classmethod
    def open(
        cls,
        lease: Lease,
        *,
        block_bytes: int = 1 << 20,
        slab_classes: Sequence[tuple[int, float]] | None = None,
        recover: bool = True,
        on_evict: Callable[[Key, str | None], None] | None = None,
        report: bool = True,
        report_interval_s: float = 1.0,
        lock: AbstractContextManager[object] | None = None,
        give_exclusive: bool = True,
        relet: bool = False,
    ) -> KVStore:
        """A store on a fresh mapping of ``lease``, reporting through the agent unless told not.

        :meth:`close` flushes the last report and unmaps.

        Unless the lease has its own ``on_shrink``, the store answers poold's pressure
        hints with :meth:`apply_shrink` (a ``shrinkable`` lease gets smaller; any other
        drops replicas) and reports at once. The
        hint arrives on the lease's renewal thread and the store is not thread-safe:
        given ``lock`` (the one the engine holds around its store calls) it is applied
        there and then; otherwise it waits in :attr:`pending_shrink` until the engine
        calls :meth:`apply_shrink`.
        """
        mapping = lease.mmap()
        store = cls(
            mapping,
            lease.lease_id,
            lease.epoch,
            block_bytes=block_bytes,
            slab_classes=slab_classes,
            recover=recover,
            on_evict=on_evict,
        )
        store._owns_mapping = True
        if report:
            store.reporter = Reporter(store, lease.report, min_interval_s=report_interval_s)
            store.reporter.start()
        store._engine_lock = lock
        store.give_exclusive = give_exclusive
        store.relet_under_pressure = relet
        store._lease = lease
        # getattr: a lease-like object without on_shrink (a test double) gets no handler.
        if getattr(lease, "on_shrink", False) is None:
            lease.on_shrink = store.on_shrink
        return store

    # --- pressure: giving memory back ---------------------------------------

    def give_back(self, target_bytes: int, *, drop_exclusive: bool = True) -> int:
        """Shrink the lease by at least ``target_bytes`` (aligned), keeping what fits; bytes given.

        The pool gets memory back only when the lease itself gets smaller. The slots past
        the new end are cut: their blocks move into free slots below it, and when there
        are more blocks than the kept slots hold, the least recently used are evicted,
        replicas before exclusive blocks (none exclusive with ``drop_exclusive=False``,
        which gives back less instead). Then the header is rewritten for the smaller
        geometry and the agent cuts the memfd down (:meth:`agent.client.Lease.shrink`).

        Only for a store from :meth:`open` on a ``shrinkable`` lease; views returned
        before are invalid afterwards. A store re-opened after a shrink starts empty
        (its geometry no longer matches a fresh plan for the lease's length).
        """
        lease = self._lease
        if lease is None or not self._owns_mapping:
            raise RuntimeError("give_back needs a store opened with KVStore.open(lease)")
        if not getattr(lease, "shrinkable", False):
            raise RuntimeError(
                f"lease {self.lease_id} is not shrinkable (lease it with shrinkable=True, "
                "or relet() it)"
            )
        if target_bytes <= 0:
            return 0
        old_len = len(self._view)
        step = max(lease.alignment_bytes, lease.page_size_bytes, mmap.PAGESIZE)
        first = next(c for c in self.geometry.classes if c.slot_count)
        floor = round_up(first.region_offset + first.slot_bytes, step)
        new_len = max((old_len - target_bytes) // step * step, floor)
        if not drop_exclusive:
            for cls in self._classes:
                if cls.exclusive:
                    need = cls.spec.region_offset + len(cls.exclusive) * cls.slot_bytes
                    new_len = max(new_len, round_up(need, step))
        if new_len >= old_len:
            return 0
        kept = self._cut_to(new_len)
        self.geometry = Geometry(
            new_len, self.geometry.records_offset, self.geometry.record_count, kept
        )
        header = self.geometry.header(self._lease_bytes, self.epoch)
        view = self._view
        view[: len(MAGIC)] = bytes(len(MAGIC))
        view[len(MAGIC) : len(header)] = header[len(MAGIC) :]
        view[: len(MAGIC)] = MAGIC
        self.version += 1
        got = lease.shrink(new_len)
        self._remap(lease)
        log.info(
            "kv store on lease %s gave back %d bytes (%d -> %d)",
            self.lease_id,
            old_len - got,
            old_len,
            got,
        )
        if self.reporter is not None:
            self.reporter.flush()
        return old_len - got

    def relet(self, target_bytes: int, *, drop_exclusive: bool = True) -> int:
        """Give back ``target_bytes`` of a lease that cannot shrink in place (devdax); bytes given.

        The blocks that fit in the smaller lease (LRU evicted first, replicas before
        exclusive blocks) are copied to process memory, the lease is released and a
        smaller one leased with the same tenant, media, ttl and callbacks, and the blocks
        are put back with their residency. The store then lives on the new lease
        (:attr:`lease`, :attr:`lease_id`, :attr:`epoch` change). If the smaller lease
        cannot be had (someone took the space meanwhile), the copied blocks are lost
        and the store is closed: the error propagates.
        """
        lease = self._lease
        if lease is None or not self._owns_mapping:
            raise RuntimeError("relet needs a store opened with KVStore.open(lease)")
        if target_bytes <= 0:
            return 0
        old_len = len(self._view)
        step = max(lease.alignment_bytes, lease.page_size_bytes, mmap.PAGESIZE)
        new_len = old_len - target_bytes
        new_len -= new_len % step
        geometry: Geometry | None = None
        while new_len < old_len:
            try:
                geometry = Geometry.plan(new_len, self._slab_spec)
            except ValueError:  # holds no slot: too small to be worth keeping
                geometry = None
            if geometry is not None and (drop_exclusive or self._exclusive_fit(geometry)):
                break
            new_len += step
        if geometry is None or new_len >= old_len:
            return 0
        counts = {c.slot_bytes: c.slot_count for c in geometry.classes}
        for cls in self._classes:
            while len(cls.exclusive) + len(cls.replica) > counts.get(cls.slot_bytes, 0):
                self._evict(self._victim(cls))
        kept = sorted(self._index.values(), key=lambda b: b.tick)
        saved = [(b.key, b.where, bytes(self._view[b.offset : b.offset + b.length])) for b in kept]
        client = cast("PoolClient", lease._client)  # the client that granted it
        reporter, self.reporter = self.reporter, None
        if reporter is not None:
            reporter.stop(flush=False)
        self._release_mapping()
        if getattr(lease, "on_shrink", None) == self.on_shrink:
            lease.on_shrink = None
        lease.release()
        try:
            new = client.lease(
                new_len,
                ttl_s=lease.ttl_s,
                media=lease.media,
                tenant=lease.tenant,
                labels=lease.labels,
                on_lost=lease.on_lost,
                on_shrink=lease.on_shrink,
                on_revoke=lease.on_revoke,
            )
        except BaseException:
            self._lease = None
            self._mapping = None
            raise
        self._attach(new.mmap(), new.lease_id, new.epoch)
        for key, where, data in saved:
            self.put(key, data, replica_of=where)
        self._lease = new
        if new.on_shrink is None:
            new.on_shrink = self.on_shrink
        if reporter is not None:
            self.reporter = Reporter(self, new.report, min_interval_s=reporter.min_interval_s)
            self.reporter.start()
            self.reporter.flush()
        log.info(
            "kv store relet lease %s (%d bytes) as %s (%d bytes), %d blocks kept",
            lease.lease_id,
            old_len,
            new.lease_id,
            new.length_bytes,
            len(saved),
        )
        return old_len - new.length_bytes

    def _release_mapping(self) -> None:
        mapping, self._mapping = self._mapping, None
        with suppress(BufferError):
            self._view.release()
        if isinstance(mapping, mmap.mmap):
            try:
                mapping.close()
            except BufferError:  # the engine still holds views into it: they die with it
                log.warning("kv store on lease %s: old mapping still viewed", self.lease_id)

    def _remap(self, lease: Lease) -> None:
        """Map the lease's (new) length; the old mapping goes when nothing views it."""
        self._release_mapping()
        self._mapping = lease.mmap()
        self._view = memoryview(self._mapping)

    @property
    def lease(self) -> Lease | None:
        """The lease under the store (a new one after :meth:`relet`)."""
        return self._lease

    def on_shrink(self, lease: Lease, target_bytes: int, deadline_at: datetime) -> None:
        """The default ``Lease.on_shrink`` of :meth:`open`: see there."""
        self.pending_shrink = (target_bytes, deadline_at)
        if self._engine_lock is not None:
            with self._engine_lock:
                self.apply_shrink()

    def apply_shrink(self) -> int:
        """Give back what poold asked for and report now; bytes given back or dropped.

        On the engine's thread (or under its lock). A ``shrinkable`` lease shrinks
        (:meth:`give_back`): unused slots first, then replicas, then exclusive blocks
        (LRU) when :attr:`give_exclusive` allows, which beats being revoked whole at the
        deadline. Any other lease (devdax) can only drop replicas inside it: that is
        reported, so poold sees the slack, but the bytes stay leased.
        """
        pending, self.pending_shrink = self.pending_shrink, None
        if pending is None or self._mapping is None:
            return 0
        target_bytes, deadline_at = pending
        lease = self._lease
        if lease is not None and self._owns_mapping and getattr(lease, "shrinkable", False):
            try:
                given = self.give_back(target_bytes, drop_exclusive=self.give_exclusive)
            except PoolError as err:
                log.warning("kv store on lease %s: shrink refused: %s", self.lease_id, err)
            else:
                log.info(
                    "kv store on lease %s: pool pressure asked %d bytes by %s, gave back %d",
                    self.lease_id,
                    target_bytes,
                    deadline_at.isoformat(),
                    given,
                )
                return given
        if lease is not None and self._owns_mapping and self.relet_under_pressure:
            try:
                given = self.relet(target_bytes, drop_exclusive=self.give_exclusive)
            except PoolError as err:
                log.warning("kv store on lease %s: relet failed: %s", self.lease_id, err)
                return 0
            log.info(
                "kv store: pool pressure asked %d bytes by %s, relet gave back %d",
                target_bytes,
                deadline_at.isoformat(),
                given,
            )
            return given
        freed = self.drop_replicas(target_bytes)
        log.info(
            "kv store on lease %s: pool pressure asked %d bytes by %s, dropped %d of replicas",
            self.lease_id,
            target_bytes,
            deadline_at.isoformat(),
            freed,
        )
        if self.reporter is not None:
            self.reporter.flush()
        return freed

    # --- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Stop and flush the reporter; unmap when :meth:`open` mapped. Safe to call twice."""
        lease, self._lease = self._lease, None
        if lease is not None and getattr(lease, "on_shrink", None) == self.on_shrink:
            lease.on_shrink = None
        if self.reporter is not None:
            self.reporter.stop()
            self.reporter = None
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        self._view.release()
        if self._owns_mapping and isinstance(mapping, mmap.mmap):
            try:
                mapping.close()
            except BufferError:
                log.warning("kv store on lease %s: views still alive, left mapped", self.lease_id)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<KVStore lease {self.lease_id} epoch {self.epoch} {len(self._index)} blocks "
            f"{self._exclusive_bytes} exclusive / {self._replica_bytes} replica bytes>"
        )
