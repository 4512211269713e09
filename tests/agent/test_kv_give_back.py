"""KVStore.give_back: a store shrinks its lease and keeps what fits, replicas dropped first.

The lease here is a real memfd (unsealed against shrinking) whose ``shrink`` does what
the agent does, ftruncate; the socket path is covered in test_pressure_path.py.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.kv import KVStore

if TYPE_CHECKING:
    from agent.client import Lease

KIB = 1 << 10
MIB = 1 << 20
BLOCK = 64 * KIB
ALIGN = 256 * KIB


class MemfdLease:
    """The parts of agent.client.Lease that KVStore.open and give_back use."""

    def __init__(self, length: int) -> None:
        self.fd = os.memfd_create("kv-give-back", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, length)
        self.length_bytes = length
        self.lease_id = "lease-shrink"
        self.epoch = 3
        self.alignment_bytes = ALIGN
        self.page_size_bytes = mmap.PAGESIZE
        self.shrinkable = True
        self.on_shrink = None

    def mmap(self) -> mmap.mmap:
        return mmap.mmap(self.fd, self.length_bytes, flags=mmap.MAP_SHARED)

    def shrink(self, size_bytes: int) -> int:
        new = -(-size_bytes // ALIGN) * ALIGN
        assert new < self.length_bytes
        os.ftruncate(self.fd, new)
        self.length_bytes = new
        return new

    def report(self, **_: int) -> bool:
        return True


def payload(key: str) -> bytes:
    return (key.encode() * (BLOCK // len(key) + 1))[:BLOCK]


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(0, 200), st.booleans()), max_size=60),
    target_kib=st.integers(1, 3 * 1024),
    keep_exclusive=st.booleans(),
)
def test_give_back_keeps_what_fits(
    blocks: list[tuple[int, bool]], target_kib: int, keep_exclusive: bool
) -> None:
    lease = MemfdLease(4 * MIB)
    store = KVStore.open(cast("Lease", lease), block_bytes=BLOCK, report=False)
    try:
        for n, replica in blocks:
            store.put(f"k{n}", payload(f"k{n}"), replica_of="gpu" if replica else None)
        before_exclusive = {k for k in store if store.residency(k) == "exclusive"}
        before_replica = {k for k in store if store.residency(k) != "exclusive"}
        old = lease.length_bytes
        given_back = store.give_back(target_kib * KIB, drop_exclusive=not keep_exclusive)
        assert given_back == old - lease.length_bytes
        assert os.fstat(lease.fd).st_size == lease.length_bytes
        assert store.stats().leased_bytes == lease.length_bytes
        if given_back:
            assert lease.length_bytes % ALIGN == 0
        after = set(store.keys())
        # Every block that stayed holds its own data, inside the new length.
        for key in after:
            view = store.get(key)
            assert view is not None and bytes(view) == payload(str(key))
        lost_exclusive = before_exclusive - after
        if keep_exclusive:
            assert not lost_exclusive
        if lost_exclusive:  # replicas go first
            assert not (before_replica & after)
        # The counters still add up.
        stats = store.stats()
        assert stats.used_blocks == len(after)
        assert stats.used_bytes == stats.exclusive_bytes + stats.replica_bytes
        assert stats.used_bytes <= lease.length_bytes
        # And the store keeps working in the smaller lease.
        store.put("new", payload("new"))
        assert bytes(store.get("new") or b"") == payload("new")
    finally:
        store.close()
        os.close(lease.fd)


def test_give_back_within_the_slack_moves_blocks_and_drops_none() -> None:
    lease = MemfdLease(4 * MIB)
    store = KVStore.open(cast("Lease", lease), block_bytes=BLOCK, report=False)
    try:
        capacity = store.stats().capacity_blocks
        for i in range(capacity):
            store.put(f"k{i}", payload(f"k{i}"))
        for i in range(0, capacity, 2):  # every other slot free: the tail's blocks move down
            store.delete(f"k{i}")
        kept = set(store.keys())
        assert store.give_back(MIB) >= MIB
        assert set(store.keys()) == kept
        assert store.evictions == 0
        for key in kept:
            assert bytes(store.get(key) or b"") == payload(str(key))
    finally:
        store.close()
        os.close(lease.fd)
