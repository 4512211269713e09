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
``recover=False`` always starts empty. Crash ordering of a put: the slot's state byte
is cleared, the data copied, the record's fields written, and the state byte set last.
A one-byte store cannot tear, so a holder killed at any instant leaves a free slot or a
complete record, never a record naming half-written data. That ordering, not a checksum,
is what keeps records sound (a per-record CRC32 cost ~1 us per put, 4% of a 256 KiB
copy); the header, read once per open, does carry a CRC32.

Accounting is in *slot bytes* (memory a block occupies, which is what dropping it gives
back): ``used = exclusive + replica`` always, so a snapshot read from another thread
while the engine runs is always a valid report, and each counter is O(1) to read.

The store is not thread-safe: one engine thread (or the engine's own lock) drives it.
The :class:`~agent.kv_report.Reporter` thread only reads its counters. Views returned
by :meth:`get`, :meth:`peek` and :meth:`reserve` are live: valid until that key is
overwritten, deleted or evicted. numpy is never imported; ``numpy.frombuffer(kv.get(key), dtype)``
gives a zero-copy array, and :meth:`put` takes any C-contiguous buffer.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal

from agent.kv_layout import (
    MAGIC,
    MAX_KEY_BYTES,
    MAX_LEASE_ID_BYTES,
    REC_BYTES_KEY,
    REC_FIELDS,
    REC_FREE,
    REC_KEY_OFFSET,
    REC_STR_KEY,
    RECORD_BYTES,
    Geometry,
    SlabClass,
    header_mismatch,
    round_up,
)
from agent.kv_report import Reporter
from poold.errors import PoolError

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    from agent.client import Lease

log = logging.getLogger(__name__)

Key = bytes | str
OpenState = Literal["new", "recovered", "reset"]

_PLACES: Final = frozenset({"gpu", "dram"})


class BlockTooLarge(ValueError):
    """The data is larger than every slab class's slot."""


class KeyTooLong(ValueError):
    """The key does not fit in a slot record (:data:`agent.kv_layout.MAX_KEY_BYTES` encoded)."""


def _check_where(where: str) -> None:
    if where not in _PLACES and not (where.startswith("host:") and len(where) > 5):
        raise ValueError(f'where must be "gpu", "dram" or "host:<name>", got {where!r}')


class _Block:
    """One stored block: its slot, data length, and where else it lives (None: nowhere)."""

    __slots__ = (
        "cls",
        "key",
        "key_bytes",
        "length",
        "offset",
        "record",
        "slot_bytes",
        "state",
        "tick",
        "where",
    )

    def __init__(self, key: Key, key_bytes: bytes, cls: _Class, offset: int, record: int) -> None:
        self.key = key
        self.key_bytes = key_bytes
        self.state = REC_STR_KEY if isinstance(key, str) else REC_BYTES_KEY
        self.cls = cls
        self.slot_bytes = cls.slot_bytes
        self.offset = offset
        self.record = record
        self.length = 0
        self.where: str | None = None
        self.tick = 0


class _Class:
    """Runtime state of one slab class: free slots and two LRU orders (oldest first)."""

    __slots__ = ("exclusive", "free", "replica", "slot_bytes", "spec")

    def __init__(self, spec: SlabClass) -> None:
        self.spec = spec
        self.slot_bytes = spec.slot_bytes
        # (data offset, record offset); popped from the end, so lowest offsets go first.
        self.free: list[tuple[int, int]] = []
        self.exclusive: dict[Key, _Block] = {}
        self.replica: dict[Key, _Block] = {}


@dataclass(frozen=True, slots=True)
class KVStats:
    """A snapshot of a store's accounting; ``used = exclusive + replica`` (slot bytes)."""

    leased_bytes: int
    capacity_bytes: int
    capacity_blocks: int
    used_bytes: int
    exclusive_bytes: int
    replica_bytes: int
    used_blocks: int
    exclusive_blocks: int
    replica_blocks: int
    hits: int
    misses: int
    evictions: int

    @property
    def exclusive_ratio(self) -> float:
        """Exclusive bytes over leased bytes: what the lease is worth to the pool."""
        return self.exclusive_bytes / self.leased_bytes if self.leased_bytes else 0.0


class KVStore:
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
        view = memoryview(mapping)
        if view.readonly:
            raise ValueError("the kv store needs a writable mapping")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        lease_bytes = lease_id.encode()
        if not lease_bytes or len(lease_bytes) > MAX_LEASE_ID_BYTES:
            raise ValueError(f"lease id must be 1..{MAX_LEASE_ID_BYTES} bytes, got {lease_id!r}")
        if not 0 <= epoch < 1 << 64:
            raise ValueError(f"epoch must fit in 64 bits, got {epoch}")
        self._slab_spec = tuple(slab_classes if slab_classes is not None else [(block_bytes, 1.0)])
        self.geometry = Geometry.plan(len(view), self._slab_spec)
        self.lease_id = lease_id
        self.epoch = epoch
        self.on_evict = on_evict
        self._mapping: mmap.mmap | memoryview | bytearray | None = mapping
        self._owns_mapping = False
        self._view = view
        self._lease_bytes = lease_bytes
        self._classes = [_Class(c) for c in self.geometry.classes if c.slot_count]
        self._index: dict[Key, _Block] = {}
        self._seq = 0
        self._tick = 0
        self._exclusive_bytes = 0
        self._replica_bytes = 0
        self._exclusive_blocks = 0
        self._replica_blocks = 0
        self.version = 0  # bumped by every accounting change; the reporter's "dirty" bit
        self.hits = 0
        self.misses = 0
        self.evictions = 0
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

        mismatch = header_mismatch(view, lease_bytes, epoch, self.geometry)
        if mismatch is None and recover:
            self.open_state: OpenState = "recovered"
            self.open_reason = "header matches lease id, epoch and geometry"
            self._recover()
        else:
            self.open_state = "reset" if bytes(view[: len(MAGIC)]) == MAGIC else "new"
            self.open_reason = mismatch or "recovery disabled (recover=False)"
            self._format()
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

    # --- layout ---------------------------------------------------------------

    def _slots(self) -> Iterator[tuple[_Class, int, int]]:
        record = self.geometry.records_offset
        for spec in self.geometry.classes:
            cls = next((c for c in self._classes if c.spec is spec), None)
            for i in range(spec.slot_count):
                if cls is not None:
                    yield cls, spec.region_offset + i * spec.slot_bytes, record
                record += RECORD_BYTES

    def _format(self) -> None:
        view = self._view
        view[: len(MAGIC)] = bytes(len(MAGIC))  # invalid first: a crash below opens empty
        start = self.geometry.records_offset
        end = start + self.geometry.record_count * RECORD_BYTES
        chunk = bytes(min(end - start, 1 << 20))
        for at in range(start, end, len(chunk)):
            stop = min(end, at + len(chunk))
            view[at:stop] = chunk[: stop - at]
        for cls, offset, record in self._slots():
            cls.free.append((offset, record))
        for cls in self._classes:
            cls.free.reverse()
        header = self.geometry.header(self._lease_bytes, self.epoch)
        view[len(MAGIC) : len(header)] = header[len(MAGIC) :]
        view[: len(MAGIC)] = MAGIC

    def _recover(self) -> None:
        view = self._view
        found: list[tuple[int, _Block]] = []
        for cls, offset, record in self._slots():
            raw = bytes(view[record : record + RECORD_BYTES])
            state = raw[0]
            key_len, _, _, length, seq = REC_FIELDS.unpack_from(raw, 1)
            valid = (
                state in (REC_BYTES_KEY, REC_STR_KEY)
                and key_len <= MAX_KEY_BYTES
                and length <= cls.slot_bytes
            )
            key: Key | None = None
            if valid:
                key_bytes = raw[REC_KEY_OFFSET : REC_KEY_OFFSET + key_len]
                try:
                    key = key_bytes.decode() if state == REC_STR_KEY else key_bytes
                except UnicodeDecodeError:
                    key = None
            if key is None:
                cls.free.append((offset, record))
                continue
            block = _Block(key, key_bytes, cls, offset, record)
            block.length = length
            found.append((seq, block))
        for cls in self._classes:
            cls.free.reverse()
        found.sort(key=lambda item: item[0])
        for seq, block in found:
            old = self._index.get(block.key)
            if old is not None:  # cannot happen through this class; keep the newest
                self._unlink(old)
                self._free_slot(old)
            self._tick += 1
            block.tick = self._tick
            self._index[block.key] = block
            block.cls.exclusive[block.key] = block
            self._exclusive_bytes += block.slot_bytes
            self._exclusive_blocks += 1
            self._seq = max(self._seq, seq)
        self.version += 1

    # --- hot path -------------------------------------------------------------

    def _class_for(self, nbytes: int) -> _Class:
        for cls in self._classes:
            if nbytes <= cls.slot_bytes:
                return cls
        largest = self._classes[-1].slot_bytes
        raise BlockTooLarge(f"a block of {nbytes} bytes exceeds the largest slot ({largest})")

    def _allocate(self, key: Key, nbytes: int, replica_of: str | None) -> _Block:
        """A slot for ``key`` (its record invalidated), accounted under its new residency."""
        if replica_of is not None and replica_of not in _PLACES:
            _check_where(replica_of)
        first = self._classes[0]
        cls = first if nbytes <= first.slot_bytes else self._class_for(nbytes)
        block = self._index.get(key)
        if block is not None and block.cls is cls:
            # New data in the same slot: the hot overwrite path, kept free of allocations.
            self._view[block.record] = REC_FREE
            block.length = nbytes
            if block.where is None and replica_of is None:
                self._tick += 1
                block.tick = self._tick
                lru = cls.exclusive
                lru[key] = lru.pop(key)
            else:
                self._unlink(block)
                block.where = replica_of
                self._link(block)
            return block
        key_bytes = key.encode() if isinstance(key, str) else bytes(key)
        if len(key_bytes) > MAX_KEY_BYTES:
            raise KeyTooLong(f"keys are at most {MAX_KEY_BYTES} bytes, got {len(key_bytes)}")
        if block is not None:  # moves to another class
            self._unlink(block)
            self._free_slot(block)
        if not cls.free:
            self._evict(self._victim(cls))
        offset, record = cls.free.pop()
        block = _Block(key, key_bytes, cls, offset, record)
        self._index[key] = block
        self._view[record] = REC_FREE
        at = record + REC_KEY_OFFSET
        self._view[at : at + len(key_bytes)] = key_bytes
        block.length = nbytes
        block.where = replica_of
        self._link(block)
        return block

    def _commit(self, block: _Block) -> None:
        """Complete ``block``'s slot record (its key is written at allocation), state last."""
        self._seq += 1
        record = block.record
        REC_FIELDS.pack_into(
            self._view, record + 1, len(block.key_bytes), 0, 0, block.length, self._seq
        )
        self._view[record] = block.state

    def put(self, key: Key, data: Buffer, *, replica_of: str | None = None) -> None:
        """Store ``data`` under ``key`` (replacing it), evicting LRU (replicas first) if full.

        ``replica_of`` ("gpu", "dram", "host:<name>") says a copy also lives there; by
        default the new block is the only copy (exclusive).
        """
        if type(data) is bytes or type(data) is bytearray:
            nbytes = len(data)
        else:
            data = memoryview(data)
            if data.format != "B" or data.ndim != 1:
                data = data.cast("B")
            nbytes = data.nbytes
        block = self._allocate(key, nbytes, replica_of)
        offset = block.offset
        self._view[offset : offset + nbytes] = data
        self._commit(block)

    def reserve(self, key: Key, nbytes: int, *, replica_of: str | None = None) -> memoryview:
        """A writable view of ``nbytes`` in a slot now holding ``key``, for the engine to fill.

        The block counts as stored at once; what it holds is whatever the caller writes.
        """
        block = self._allocate(key, nbytes, replica_of)
        self._commit(block)
        return self._view[block.offset : block.offset + nbytes]

    def get(self, key: Key) -> memoryview | None:
        """A zero-copy view of ``key``'s data (most recently used now), or None."""
        block = self._index.get(key)
        if block is None:
            self.misses += 1
            return None
        self.hits += 1
        self._tick += 1
        block.tick = self._tick
        lru = block.cls.exclusive if block.where is None else block.cls.replica
        lru[key] = lru.pop(key)
        return self._view[block.offset : block.offset + block.length]

    def get_into(self, key: Key, out: Buffer) -> int | None:
        """Copy ``key``'s data into the start of ``out``; its length, or None if absent."""
        block = self._index.get(key)
        if block is None:
            self.misses += 1
            return None
        self.hits += 1
        self._tick += 1
        block.tick = self._tick
        lru = block.cls.exclusive if block.where is None else block.cls.replica
        lru[key] = lru.pop(key)
        target = out if type(out) is memoryview else memoryview(out)
        if target.format != "B" or target.ndim != 1:
            target = target.cast("B")
        n = block.length
        target[:n] = self._view[block.offset : block.offset + n]
        return n

    def peek(self, key: Key) -> memoryview | None:
        """Like :meth:`get`, without counting as a use (LRU order and hits unchanged)."""
        block = self._index.get(key)
        if block is None:
            return None
        return self._view[block.offset : block.offset + block.length]

    def mark_replica(self, key: Key, where: str = "gpu") -> bool:
        """A copy of ``key`` now also lives at ``where``; False if the store lacks ``key``."""
        block = self._index.get(key)
        if block is None:
            return False
        if where not in _PLACES:
            _check_where(where)
        cls = block.cls
        self._tick += 1
        block.tick = self._tick
        if block.where is None:
            del cls.exclusive[key]
            cls.replica[key] = block
            self._exclusive_bytes -= block.slot_bytes
            self._exclusive_blocks -= 1
            self._replica_bytes += block.slot_bytes
            self._replica_blocks += 1
            self.version += 1
        else:
            cls.replica[key] = cls.replica.pop(key)
        block.where = where
        return True

    def mark_exclusive(self, key: Key) -> bool:
        """The other copy of ``key`` was dropped: this is the only one; False if absent."""
        block = self._index.get(key)
        if block is None:
            return False
        cls = block.cls
        self._tick += 1
        block.tick = self._tick
        if block.where is not None:
            del cls.replica[key]
            cls.exclusive[key] = block
            self._replica_bytes -= block.slot_bytes
            self._replica_blocks -= 1
            self._exclusive_bytes += block.slot_bytes
            self._exclusive_blocks += 1
            self.version += 1
            block.where = None
        else:
            cls.exclusive[key] = cls.exclusive.pop(key)
        return True

    # --- removal and pressure -------------------------------------------------

    def _link(self, block: _Block) -> None:
        self._tick += 1
        block.tick = self._tick
        if block.where is None:
            block.cls.exclusive[block.key] = block
            self._exclusive_bytes += block.slot_bytes
            self._exclusive_blocks += 1
        else:
            block.cls.replica[block.key] = block
            self._replica_bytes += block.slot_bytes
            self._replica_blocks += 1
        self.version += 1

    def _unlink(self, block: _Block) -> None:
        if block.where is None:
            del block.cls.exclusive[block.key]
            self._exclusive_bytes -= block.slot_bytes
            self._exclusive_blocks -= 1
        else:
            del block.cls.replica[block.key]
            self._replica_bytes -= block.slot_bytes
            self._replica_blocks -= 1
        self.version += 1

    def _free_slot(self, block: _Block) -> None:
        self._view[block.record] = REC_FREE
        block.cls.free.append((block.offset, block.record))

    def _victim(self, cls: _Class) -> _Block:
        lru = cls.replica or cls.exclusive
        return lru[next(iter(lru))]

    def _evict(self, block: _Block) -> None:
        where = block.where
        self._unlink(block)
        self._free_slot(block)
        del self._index[block.key]
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(block.key, where)

    def delete(self, key: Key) -> bool:
        """Forget ``key`` (its slot is free again); False if absent. Not an eviction."""
        block = self._index.pop(key, None)
        if block is None:
            return False
        self._unlink(block)
        self._free_slot(block)
        return True

    def _oldest(self, replicas: bool) -> _Block | None:
        oldest: _Block | None = None
        for cls in self._classes:
            lru = cls.replica if replicas else cls.exclusive
            if lru:
                head = lru[next(iter(lru))]
                if oldest is None or head.tick < oldest.tick:
                    oldest = head
        return oldest

    def drop_replicas(self, target_bytes: int | None = None) -> int:
        """Evict replicas, oldest first, until ``target_bytes`` are freed (None: all)."""
        freed = 0
        while target_bytes is None or freed < target_bytes:
            block = self._oldest(replicas=True)
            if block is None:
                break
            freed += block.slot_bytes
            self._evict(block)
        return freed

    def shrink(self, target_bytes: int) -> int:
        """Free ``target_bytes`` of slots: replicas first, then exclusive blocks (LRU); bytes freed.

        What a tenant does under pool pressure (DESIGN.md "Exclusive-copy accounting"):
        replicas cost nothing to drop, exclusive blocks cost a recompute.
        """
        freed = self.drop_replicas(target_bytes)
        while freed < target_bytes:
            block = self._oldest(replicas=False)
            if block is None:
                break
            freed += block.slot_bytes
            self._evict(block)
        return freed

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
        client = lease._client
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

    def _exclusive_fit(self, geometry: Geometry) -> bool:
        """Every class's exclusive blocks have a slot in ``geometry``."""
        counts = {c.slot_bytes: c.slot_count for c in geometry.classes}
        return all(len(c.exclusive) <= counts.get(c.slot_bytes, 0) for c in self._classes)

    def _release_mapping(self) -> None:
        mapping, self._mapping = self._mapping, None
        with suppress(BufferError):
            self._view.release()
        if isinstance(mapping, mmap.mmap):
            try:
                mapping.close()
            except BufferError:  # the engine still holds views into it: they die with it
                log.warning("kv store on lease %s: old mapping still viewed", self.lease_id)

    def _attach(self, mapping: mmap.mmap, lease_id: str, epoch: int) -> None:
        """Start empty on a new lease's mapping (relet); counters of use carry over."""
        view = memoryview(mapping)
        self.geometry = Geometry.plan(len(view), self._slab_spec)
        self.lease_id = lease_id
        self.epoch = epoch
        self._lease_bytes = lease_id.encode()
        self._mapping = mapping
        self._view = view
        self._classes = [_Class(c) for c in self.geometry.classes if c.slot_count]
        self._index = {}
        self._exclusive_bytes = self._replica_bytes = 0
        self._exclusive_blocks = self._replica_blocks = 0
        self.version += 1
        self._format()

    def _cut_to(self, new_len: int) -> tuple[SlabClass, ...]:
        """Keep only slots that end by ``new_len``: move or evict the blocks past it."""
        by_spec = {id(c.spec): c for c in self._classes}
        kept_specs: list[SlabClass] = []
        kept_classes: list[_Class] = []
        for spec in self.geometry.classes:
            keep = max(0, min(spec.slot_count, (new_len - spec.region_offset) // spec.slot_bytes))
            kept = SlabClass(spec.slot_bytes, keep, spec.region_offset)
            kept_specs.append(kept)
            cls = by_spec.get(id(spec))
            if cls is None:
                continue
            end = spec.region_offset + keep * spec.slot_bytes
            while len(cls.exclusive) + len(cls.replica) > keep:  # LRU, replicas first
                self._evict(self._victim(cls))
            cls.free = [(o, r) for o, r in cls.free if o < end]
            for block in [*cls.exclusive.values(), *cls.replica.values()]:
                if block.offset >= end:
                    self._relocate(block, *cls.free.pop())
            cls.spec = kept  # same slots, fewer of them
            if keep:
                kept_classes.append(cls)
        self._classes = kept_classes
        return tuple(kept_specs)

    def _relocate(self, block: _Block, offset: int, record: int) -> None:
        """Move a block to a free slot: data, then its new record (state last), then the old
        record cleared, so a crash in between recovers one copy or the other."""
        view = self._view
        view[offset : offset + block.length] = view[block.offset : block.offset + block.length]
        old_record = block.record
        view[record] = REC_FREE
        at = record + REC_KEY_OFFSET
        view[at : at + len(block.key_bytes)] = block.key_bytes
        block.offset, block.record = offset, record
        self._commit(block)
        view[old_record] = REC_FREE

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

    # --- introspection --------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Key]:
        """The stored keys (a snapshot: the store may change while iterating)."""
        return iter(list(self._index))

    def keys(self) -> list[Key]:
        """Every stored key, in no particular order."""
        return list(self._index)

    def residency(self, key: Key) -> str | None:
        """``"exclusive"``, ``"replica:<where>"``, or None when ``key`` is not stored."""
        block = self._index.get(key)
        if block is None:
            return None
        return "exclusive" if block.where is None else f"replica:{block.where}"

    @property
    def used_bytes(self) -> int:
        return self._exclusive_bytes + self._replica_bytes

    @property
    def exclusive_bytes(self) -> int:
        return self._exclusive_bytes

    @property
    def replica_bytes(self) -> int:
        return self._replica_bytes

    @property
    def exclusive_blocks(self) -> int:
        return self._exclusive_blocks

    @property
    def replica_blocks(self) -> int:
        return self._replica_blocks

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all slots (the lease minus header, records and alignment)."""
        return sum(c.slot_bytes * c.spec.slot_count for c in self._classes)

    def stats(self) -> KVStats:
        """A snapshot of the accounting (O(classes))."""
        exclusive_bytes, replica_bytes = self._exclusive_bytes, self._replica_bytes
        exclusive_blocks, replica_blocks = self._exclusive_blocks, self._replica_blocks
        return KVStats(
            leased_bytes=len(self._view),
            capacity_bytes=self.capacity_bytes,
            capacity_blocks=sum(c.spec.slot_count for c in self._classes),
            used_bytes=exclusive_bytes + replica_bytes,
            exclusive_bytes=exclusive_bytes,
            replica_bytes=replica_bytes,
            used_blocks=exclusive_blocks + replica_blocks,
            exclusive_blocks=exclusive_blocks,
            replica_blocks=replica_blocks,
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
        )

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
