"""How is a KV store laid out on a lease's memory, and does a header say it is this lease's?

Layout (little endian)::

    0                     header: magic, version, lease id, epoch, mapping length,
                          slot geometry, CRC32 (HEADER_BYTES reserved)
    HEADER_BYTES          one RECORD_BYTES record per slot: state byte, key length,
                          data length, put sequence number, key (str or bytes)
    region_offset[c]      slab class c: slot_count[c] slots of slot_bytes[c], aligned
                          to min(slot_bytes, 2 MiB)

:class:`Geometry` carves a mapping into the header, the slot records and the regions of
its slab classes (:class:`SlabClass`); :func:`header_mismatch` says why the header found
at offset 0 is not the one a (lease, epoch, geometry) would write, which is what decides
whether :class:`agent.kv.KVStore` recovers the blocks it finds or starts empty. Pure
arithmetic and byte packing: no I/O, no store state.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

MAGIC: Final = b"POOLDKV1"
FORMAT_VERSION: Final = 1
HEADER_BYTES: Final = 512
RECORD_BYTES: Final = 256
MAX_CLASSES: Final = 8
MAX_LEASE_ID_BYTES: Final = 64
MIN_SLOT_BYTES: Final = 512
_HUGE_PAGE_BYTES: Final = 2 << 20

# magic, version, class count, header bytes, lease id, epoch, mapping length,
# record bytes, max key bytes, reserved, records offset, record count
_HEAD: Final = struct.Struct("<8sHHI64sQQIIIQQ")
_CLASS: Final = struct.Struct("<QQQ")  # slot bytes, slot count, region offset
_CRC: Final = struct.Struct("<I")
_HEAD_CRC_OFFSET: Final = _HEAD.size + MAX_CLASSES * _CLASS.size
# record: state (1 byte, written last), then these fields, then the key
REC_FIELDS: Final = struct.Struct("<BHIQQ")  # key length, 2 reserved, data length, put seq
REC_KEY_OFFSET: Final = 1 + REC_FIELDS.size
MAX_KEY_BYTES: Final = RECORD_BYTES - REC_KEY_OFFSET
# A record's state byte: a free slot, or one whose key is bytes or str.
REC_FREE: Final = 0
REC_BYTES_KEY: Final = 1
REC_STR_KEY: Final = 2

assert _HEAD_CRC_OFFSET + _CRC.size <= HEADER_BYTES


def round_up(value: int, align: int) -> int:
    """``value`` rounded up to a multiple of ``align``."""
    return -(-value // align) * align


@dataclass(frozen=True, slots=True)
class SlabClass:
    """One class of equal slots: where it sits in the mapping and how many it has."""

    slot_bytes: int
    slot_count: int
    region_offset: int


@dataclass(frozen=True, slots=True)
class Geometry:
    """How a mapping of ``length_bytes`` is carved: header, slot records, slab regions."""

    length_bytes: int
    records_offset: int
    record_count: int
    classes: tuple[SlabClass, ...]

    @classmethod
    def plan(cls, length_bytes: int, slab_classes: Sequence[tuple[int, float]]) -> Geometry:
        """Carve ``length_bytes`` into ``(slot_bytes, share)`` classes after the metadata."""
        if not 1 <= len(slab_classes) <= MAX_CLASSES:
            raise ValueError(f"between 1 and {MAX_CLASSES} slab classes, got {len(slab_classes)}")
        sizes = [size for size, _ in slab_classes]
        if sorted(set(sizes)) != sizes:
            raise ValueError(f"slab class slot sizes must be strictly increasing, got {sizes}")
        total_share = sum(share for _, share in slab_classes)
        for size, share in slab_classes:
            if size < MIN_SLOT_BYTES or size % 8:
                raise ValueError(f"slot_bytes must be >= {MIN_SLOT_BYTES} and a multiple of 8")
            if share <= 0:
                raise ValueError(f"slab class shares must be positive, got {share}")
        # Records for an upper bound of slots (as if metadata took no room), so that the
        # real counts, computed once the metadata is placed, always have a record each.
        upper = sum(int(length_bytes * share / total_share) // size for size, share in slab_classes)
        records_offset = HEADER_BYTES
        cursor = records_offset + upper * RECORD_BYTES
        data_bytes = max(0, length_bytes - cursor)
        classes = []
        for size, share in slab_classes:
            start = round_up(cursor, max(mmap.PAGESIZE, min(size, _HUGE_PAGE_BYTES)))
            budget = int(data_bytes * share / total_share)
            count = max(0, min(budget // size, (length_bytes - start) // size))
            classes.append(SlabClass(size, count, start))
            cursor = start + count * size
        if not any(c.slot_count for c in classes):
            raise ValueError(
                f"a mapping of {length_bytes} bytes holds no slot of {sizes} after its "
                f"{HEADER_BYTES + upper * RECORD_BYTES}-byte header"
            )
        return cls(length_bytes, records_offset, upper, tuple(classes))

    def header(self, lease_id: bytes, epoch: int) -> bytes:
        """The header bytes for this geometry, CRC included."""
        head = bytearray(_HEAD_CRC_OFFSET)
        _HEAD.pack_into(
            head,
            0,
            MAGIC,
            FORMAT_VERSION,
            len(self.classes),
            HEADER_BYTES,
            lease_id,
            epoch,
            self.length_bytes,
            RECORD_BYTES,
            MAX_KEY_BYTES,
            0,
            self.records_offset,
            self.record_count,
        )
        for i, c in enumerate(self.classes):
            _CLASS.pack_into(
                head, _HEAD.size + i * _CLASS.size, c.slot_bytes, c.slot_count, c.region_offset
            )
        return bytes(head) + _CRC.pack(zlib.crc32(head))


def header_mismatch(
    memory: memoryview, lease_id: bytes, epoch: int, geometry: Geometry
) -> str | None:
    """Why the header at offset 0 is not this (lease, epoch, geometry)'s; None when it is."""
    raw = bytes(memory[: _HEAD_CRC_OFFSET + _CRC.size])
    if raw[: len(MAGIC)] != MAGIC:
        return "no kv store header (fresh or foreign memory)"
    (crc,) = _CRC.unpack_from(raw, _HEAD_CRC_OFFSET)
    if crc != zlib.crc32(raw[:_HEAD_CRC_OFFSET]):
        return "header checksum mismatch (torn or corrupted header)"
    version, _, _, stored_id, stored_epoch = _HEAD.unpack_from(raw)[1:6]
    if version != FORMAT_VERSION:
        return f"header format version {version}, this store writes {FORMAT_VERSION}"
    if stored_id != lease_id.ljust(MAX_LEASE_ID_BYTES, b"\0"):
        old = stored_id.rstrip(b"\0").decode("utf-8", "replace")
        return f"header belongs to lease {old!r}"
    if stored_epoch != epoch:
        return f"header has epoch {stored_epoch}, lease has epoch {epoch} (memory reused)"
    if raw[:_HEAD_CRC_OFFSET] != geometry.header(lease_id, epoch)[:_HEAD_CRC_OFFSET]:
        return "header slot geometry differs from the one requested"
    return None
