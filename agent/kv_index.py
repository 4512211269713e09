"""Which KV block lives in which slot of a lease's mapping, and what does the store count?

:class:`BlockIndex` is the store's index over one mapping: slab classes and their free
slots, one record per slot (laid out by :mod:`agent.kv_layout`), exclusive and replica
LRU orders per class, eviction (replicas first), recovery from the records, and the
accounting. It knows nothing of leases or the agent: :class:`agent.kv.KVStore` is the
index bound to a lease (open, report, give back under pressure, relet, close).

Crash ordering of a put: the slot's state byte is cleared, the data copied, the record's
fields written, and the state byte set last. A one-byte store cannot tear, so a holder
killed at any instant leaves a free slot or a complete record, never a record naming
half-written data. That ordering, not a checksum, is what keeps records sound (a
per-record CRC32 cost ~1 us per put, 4% of a 256 KiB copy); the header, read once per
open, does carry a CRC32.

Accounting is in *slot bytes* (memory a block occupies, which is what dropping it gives
back): ``used = exclusive + replica`` always, so a snapshot read from another thread
while the engine runs is always a valid report, and each counter is O(1) to read.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
)

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

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


class BlockIndex:
    """The blocks in one mapping's slots: index, LRU, eviction, recovery, accounting."""

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

        mismatch = header_mismatch(view, lease_bytes, epoch, self.geometry)
        if mismatch is None and recover:
            self.open_state: OpenState = "recovered"
            self.open_reason = "header matches lease id, epoch and geometry"
            self._recover()
        else:
            self.open_state = "reset" if bytes(view[: len(MAGIC)]) == MAGIC else "new"
            self.open_reason = mismatch or "recovery disabled (recover=False)"
            self._format()

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

    def _exclusive_fit(self, geometry: Geometry) -> bool:
        """Every class's exclusive blocks have a slot in ``geometry``."""
        counts = {c.slot_bytes: c.slot_count for c in geometry.classes}
        return all(len(c.exclusive) <= counts.get(c.slot_bytes, 0) for c in self._classes)

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
