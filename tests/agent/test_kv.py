"""agent.kv: the KV block store on real memfd mappings, its accounting and its reporter."""

from __future__ import annotations

import array
import logging
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.backends.emulated import materialise
from agent.kv import KVStore
from agent.kv_index import BlockTooLarge, Key, KeyTooLong
from agent.kv_layout import HEADER_BYTES, MAGIC, MAX_KEY_BYTES, RECORD_BYTES
from agent.kv_report import Reporter

if TYPE_CHECKING:
    from agent.client import Lease

KIB = 1 << 10
MIB = 1 << 20


class Memfd:
    """A real memfd (the emulated backend's) and a shared read/write mapping of it."""

    def __init__(self, length: int) -> None:
        self.fd = materialise(length, "poold-test-kv")
        self.mm = mmap.mmap(
            self.fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.stores: list[KVStore] = []

    def close(self) -> None:
        for store in self.stores:  # a failed test may not have closed its stores
            store.close()
        self.mm.close()
        os.close(self.fd)


@pytest.fixture
def memfd() -> Iterator[Memfd]:
    region = Memfd(8 * MIB)
    yield region
    region.close()


def store_on(memfd: Memfd, epoch: int = 1, **kwargs: object) -> KVStore:
    kwargs.setdefault("block_bytes", MIB)
    store = KVStore(memfd.mm, "lease-1", epoch, **kwargs)  # type: ignore[arg-type]
    memfd.stores.append(store)
    return store


def pattern(tag: str, n: int) -> bytes:
    unit = f"<{tag}>".encode()
    return (unit * (n // len(unit) + 1))[:n]


# --- the model ----------------------------------------------------------------

SMALL, LARGE = 1 * KIB, 4 * KIB
CLASSES = [(SMALL, 0.5), (LARGE, 0.5)]
KEYS: list[Key] = [f"k{i}" for i in range(12)] + [f"k{i}".encode() for i in range(12)]
WHERES = [None, "gpu", "dram", "host:b"]


@dataclass
class ModelBlock:
    data: bytes
    where: str | None
    slot_bytes: int
    tick: int
    seq: int


@dataclass
class Model:
    """What the store must hold: blocks, their residency, and LRU order by tick."""

    capacity: dict[int, int]
    blocks: dict[Key, ModelBlock] = field(default_factory=dict)
    tick: int = 0
    seq: int = 0

    def touch(self, key: Key) -> None:
        self.tick += 1
        self.blocks[key].tick = self.tick

    def class_for(self, nbytes: int) -> int:
        return min(size for size, count in self.capacity.items() if count and nbytes <= size)

    def oldest(self, candidates: list[Key]) -> Key | None:
        return min(candidates, key=lambda k: self.blocks[k].tick, default=None)

    def victim_in(self, slot_bytes: int) -> Key:
        """Who a put into a full class must evict: its LRU replica, else its LRU block."""
        mine = [k for k, b in self.blocks.items() if b.slot_bytes == slot_bytes]
        replicas = [k for k in mine if self.blocks[k].where is not None]
        victim = self.oldest(replicas or mine)
        assert victim is not None
        return victim

    def shrink_order(self, target: int | None, replicas_only: bool) -> list[Key]:
        replicas = sorted(
            (k for k, b in self.blocks.items() if b.where is not None),
            key=lambda k: self.blocks[k].tick,
        )
        exclusive = sorted(
            (k for k, b in self.blocks.items() if b.where is None),
            key=lambda k: self.blocks[k].tick,
        )
        order, freed = [], 0
        for key in replicas + ([] if replicas_only else exclusive):
            if target is not None and freed >= target:
                break
            order.append(key)
            freed += self.blocks[key].slot_bytes
        return order


class KVStoreMachine(RuleBasedStateMachine):
    """Random put/get/mark/delete/shrink/reopen against a model of blocks and LRU order."""

    def __init__(self) -> None:
        super().__init__()
        self.region = Memfd(64 * KIB)
        self.epoch = 1
        self.evicted: list[tuple[Key, str | None]] = []
        self.store = self._open()
        self.region.stores.append(self.store)
        capacity = {c.slot_bytes: c.slot_count for c in self.store.geometry.classes}
        assert capacity[SMALL] > 4 and capacity[LARGE] > 2
        self.model = Model(capacity)
        self.puts = 0

    def _open(self) -> KVStore:
        return KVStore(
            self.region.mm,
            "lease-hyp",
            self.epoch,
            slab_classes=CLASSES,
            on_evict=lambda key, where: self.evicted.append((key, where)),
        )

    def teardown(self) -> None:
        self.store.close()
        self.region.close()

    def _expect_evicted(self, keys: list[Key]) -> None:
        got = self.evicted
        self.evicted = []
        assert [k for k, _ in got] == keys
        for key, where in got:
            assert where == self.model.blocks[key].where
            del self.model.blocks[key]

    @rule(
        key=st.sampled_from(KEYS),
        nbytes=st.integers(0, LARGE),
        where=st.sampled_from(WHERES),
    )
    def put(self, key: Key, nbytes: int, where: str | None) -> None:
        model = self.model
        self.puts += 1
        data = pattern(f"{key!r}:{self.puts}", nbytes)
        slot_bytes = model.class_for(nbytes)
        old = model.blocks.get(key)
        if old is not None and old.slot_bytes != slot_bytes:
            del model.blocks[key]  # moves class: its old slot is freed, not evicted
        used = sum(1 for b in model.blocks.values() if b.slot_bytes == slot_bytes)
        full = key not in model.blocks and used == model.capacity[slot_bytes]
        expected = [model.victim_in(slot_bytes)] if full else []
        self.store.put(key, data, replica_of=where)
        self._expect_evicted(expected)
        model.seq += 1
        model.blocks[key] = ModelBlock(data, where, slot_bytes, 0, model.seq)
        model.touch(key)

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: Key) -> None:
        view = self.store.get(key)
        if key not in self.model.blocks:
            assert view is None
            return
        assert view is not None and bytes(view) == self.model.blocks[key].data
        self.model.touch(key)

    @rule(key=st.sampled_from(KEYS))
    def get_into(self, key: Key) -> None:
        out = bytearray(LARGE + 8)
        n = self.store.get_into(key, out)
        if key not in self.model.blocks:
            assert n is None
            return
        data = self.model.blocks[key].data
        assert n == len(data) and bytes(out[:n]) == data
        self.model.touch(key)

    @rule(key=st.sampled_from(KEYS), where=st.sampled_from(["gpu", "dram", "host:a"]))
    def mark_replica(self, key: Key, where: str) -> None:
        assert self.store.mark_replica(key, where) == (key in self.model.blocks)
        if key in self.model.blocks:
            self.model.blocks[key].where = where
            self.model.touch(key)

    @rule(key=st.sampled_from(KEYS))
    def mark_exclusive(self, key: Key) -> None:
        assert self.store.mark_exclusive(key) == (key in self.model.blocks)
        if key in self.model.blocks:
            self.model.blocks[key].where = None
            self.model.touch(key)

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: Key) -> None:
        assert self.store.delete(key) == (key in self.model.blocks)
        self.model.blocks.pop(key, None)
        assert self.evicted == []

    @rule(want=st.integers(0, 48 * KIB))
    def shrink(self, want: int) -> None:
        expected = self.model.shrink_order(want, replicas_only=False)
        freed = self.store.shrink(want)
        assert freed == sum(self.model.blocks[k].slot_bytes for k in expected)
        self._expect_evicted(expected)

    @rule(want=st.one_of(st.none(), st.integers(0, 16 * KIB)))
    def drop_replicas(self, want: int | None) -> None:
        expected = self.model.shrink_order(want, replicas_only=True)
        freed = self.store.drop_replicas(want)
        assert freed == sum(self.model.blocks[k].slot_bytes for k in expected)
        self._expect_evicted(expected)
        if want is None:
            assert self.store.replica_bytes == 0

    @rule()
    def reopen_same_epoch(self) -> None:
        """Recovery: same blocks, all exclusive, LRU order = order of last put."""
        self.store.close()
        self.store = self._open()
        assert self.store.open_state == "recovered"
        model = self.model
        for key in sorted(model.blocks, key=lambda k: model.blocks[k].seq):
            model.blocks[key].where = None
            model.touch(key)

    @precondition(lambda self: self.epoch < 4)
    @rule()
    def reopen_new_epoch(self) -> None:
        self.store.close()
        self.epoch += 1
        self.store = self._open()
        assert self.store.open_state == "reset"
        assert "epoch" in self.store.open_reason
        self.model.blocks.clear()

    @invariant()
    def accounting_matches(self) -> None:
        blocks = self.model.blocks.values()
        exclusive = [b.slot_bytes for b in blocks if b.where is None]
        replica = [b.slot_bytes for b in blocks if b.where is not None]
        stats = self.store.stats()
        assert (stats.exclusive_bytes, stats.exclusive_blocks) == (sum(exclusive), len(exclusive))
        assert (stats.replica_bytes, stats.replica_blocks) == (sum(replica), len(replica))
        assert stats.used_bytes == sum(exclusive) + sum(replica) == self.store.used_bytes
        assert stats.used_blocks == len(self.model.blocks) == len(self.store)
        assert self.store.exclusive_bytes == stats.exclusive_bytes
        assert self.store.replica_blocks == stats.replica_blocks

    @invariant()
    def data_and_residency_match(self) -> None:
        assert sorted(map(repr, self.store.keys())) == sorted(map(repr, self.model.blocks))
        for key, block in self.model.blocks.items():
            view = self.store.peek(key)
            assert view is not None and bytes(view) == block.data
            expected = "exclusive" if block.where is None else f"replica:{block.where}"
            assert self.store.residency(key) == expected


TestKVStoreModel = KVStoreMachine.TestCase
TestKVStoreModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- put / get ------------------------------------------------------------------


def test_put_get_round_trip_zero_copy(memfd: Memfd) -> None:
    store = store_on(memfd)
    block = os.urandom(MIB)
    store.put(b"prefix", block)
    view = store.get(b"prefix")
    assert view is not None and view.nbytes == MIB and bytes(view) == block
    # The view is the lease's memory itself, not a copy.
    offset = store.geometry.classes[0].region_offset
    assert memfd.mm[offset : offset + 16] == block[:16]
    store.close()


def test_put_accepts_any_contiguous_buffer(memfd: Memfd) -> None:
    store = store_on(memfd)
    floats = array.array("d", [1.5, -2.0, 3.25])
    store.put("floats", floats)
    store.put("view", memoryview(b"abcdef")[1:4])
    got = store.get("floats")
    assert got is not None and bytes(got) == floats.tobytes()
    assert bytes(store.get("view") or b"") == b"bcd"
    out = array.array("d", [0.0] * 4)
    assert store.get_into("floats", out) == 24
    assert out.tolist()[:3] == [1.5, -2.0, 3.25]
    store.close()


def test_str_and_bytes_keys_are_distinct(memfd: Memfd) -> None:
    store = store_on(memfd)
    store.put("k", b"str key")
    store.put(b"k", b"bytes key")
    assert bytes(store.get("k") or b"") == b"str key"
    assert bytes(store.get(b"k") or b"") == b"bytes key"
    store.close()


def test_overwrite_reuses_the_slot_and_resets_residency(memfd: Memfd) -> None:
    store = store_on(memfd)
    store.put("a", b"one", replica_of="gpu")
    assert store.residency("a") == "replica:gpu" and store.replica_blocks == 1
    store.put("a", b"two")
    assert store.residency("a") == "exclusive"
    assert (store.exclusive_blocks, store.replica_blocks, len(store)) == (1, 0, 1)
    assert bytes(store.get("a") or b"") == b"two"
    store.close()


def test_reserve_gives_a_writable_view_of_the_slot(memfd: Memfd) -> None:
    store = store_on(memfd)
    view = store.reserve("r", 8, replica_of="dram")
    view[:] = b"12345678"
    assert bytes(store.get("r") or b"") == b"12345678"
    assert store.residency("r") == "replica:dram"
    store.close()


def test_misses_and_refusals_leave_the_store_unchanged(memfd: Memfd) -> None:
    store = store_on(memfd)
    store.put("a", b"x")
    before = store.stats()
    assert store.get("nope") is None and store.get_into("nope", bytearray(4)) is None
    assert not store.mark_replica("nope") and not store.mark_exclusive("nope")
    assert not store.delete("nope")
    with pytest.raises(BlockTooLarge):
        store.put("big", bytes(MIB + 1))
    with pytest.raises(KeyTooLong):
        store.put("k" * (MAX_KEY_BYTES + 1), b"x")
    with pytest.raises(ValueError, match="where"):
        store.put("a", b"y", replica_of="nvme")
    with pytest.raises(ValueError, match="where"):
        store.mark_replica("a", "host:")
    after = store.stats()
    assert (after.used_bytes, after.exclusive_blocks) == (before.used_bytes, 1)
    assert "big" not in store and bytes(store.get("a") or b"") == b"x"
    store.close()


def test_mapping_must_be_writable_and_hold_a_slot() -> None:
    with pytest.raises(ValueError, match="writable"):
        KVStore(memoryview(bytes(4 * MIB)), "l", 1)
    with pytest.raises(ValueError, match="no slot"):
        KVStore(bytearray(MIB), "l", 1, block_bytes=MIB)


def test_numpy_is_not_imported() -> None:
    code = "import sys, agent.kv; assert 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- eviction ---------------------------------------------------------------------


def test_full_store_evicts_lru_replica_before_older_exclusive(memfd: Memfd) -> None:
    evicted: list[tuple[Key, str | None]] = []
    store = store_on(memfd, on_evict=lambda key, where: evicted.append((key, where)))
    slots = store.geometry.classes[0].slot_count
    for i in range(slots):
        store.put(f"b{i}", b"x", replica_of="gpu" if i % 2 else None)
    store.get("b1")  # b1 is now the most recently used replica; b3 the oldest one
    store.put("new", b"y")
    assert evicted == [("b3", "gpu")]
    assert "b0" in store  # the oldest block of all is exclusive: kept
    store.close()


def test_exclusive_evicted_lru_only_when_no_replica_remains(memfd: Memfd) -> None:
    evicted: list[tuple[Key, str | None]] = []
    store = store_on(memfd, on_evict=lambda key, where: evicted.append((key, where)))
    for i in range(store.geometry.classes[0].slot_count):
        store.put(f"b{i}", b"x")
    store.get("b0")
    store.put("new", b"y")
    assert evicted == [("b1", None)]
    assert store.evictions == 1
    store.close()


def test_shrink_drops_every_replica_before_any_exclusive(memfd: Memfd) -> None:
    evicted: list[tuple[Key, str | None]] = []
    store = store_on(memfd, on_evict=lambda key, where: evicted.append((key, where)))
    store.put("e0", b"x")
    store.put("r0", b"x", replica_of="gpu")
    store.put("e1", b"x")
    store.put("r1", b"x", replica_of="host:peer")
    assert store.shrink(3 * MIB) == 3 * MIB
    assert evicted == [("r0", "gpu"), ("r1", "host:peer"), ("e0", None)]
    assert store.keys() == ["e1"] and store.replica_bytes == 0
    assert store.shrink(10 * MIB) == MIB and len(store) == 0
    store.close()


def test_drop_replicas_never_touches_exclusive_blocks(memfd: Memfd) -> None:
    store = store_on(memfd)
    store.put("e", b"x")
    store.put("r0", b"x", replica_of="gpu")
    store.put("r1", b"x", replica_of="dram")
    assert store.drop_replicas(1) == MIB  # one block covers one byte
    assert store.keys() == ["e", "r1"]
    assert store.drop_replicas() == MIB
    assert store.drop_replicas() == 0
    assert store.keys() == ["e"]
    store.close()


# --- header, epochs and recovery ---------------------------------------------------


def test_fresh_memory_gets_a_header(memfd: Memfd) -> None:
    store = store_on(memfd)
    assert store.open_state == "new"
    assert memfd.mm[: len(MAGIC)] == MAGIC
    assert b"lease-1" in memfd.mm[:HEADER_BYTES]
    store.close()


def test_same_lease_and_epoch_recovers_blocks_as_exclusive(memfd: Memfd) -> None:
    store = store_on(memfd)
    store.put("first", b"1" * 100, replica_of="gpu")
    store.put(b"second", b"2" * 200)
    store.put("third", b"3" * 300)
    store.get("first")  # reads are not persisted: order after recovery is put order
    store.close()

    evicted: list[Key] = []
    again = store_on(memfd, on_evict=lambda key, where: evicted.append(key))
    assert again.open_state == "recovered"
    assert bytes(again.get("first") or b"") == b"1" * 100
    assert bytes(again.peek(b"second") or b"") == b"2" * 200
    assert again.residency("first") == "exclusive"
    assert (again.exclusive_blocks, again.replica_blocks) == (3, 0)
    for i in range(again.geometry.classes[0].slot_count - 3 + 1):
        again.put(f"fill{i}", b"f")
    assert evicted == [b"second"]  # oldest put not read since recovery
    again.close()


def test_new_epoch_on_reused_memory_starts_empty_and_rewrites_the_header(
    memfd: Memfd,
) -> None:
    old = store_on(memfd, epoch=1)
    old.put("secret", b"old tenant data")
    old.close()

    reused = store_on(memfd, epoch=2)
    assert reused.open_state == "reset"
    assert "epoch 1" in reused.open_reason and "epoch 2" in reused.open_reason
    assert len(reused) == 0 and reused.used_bytes == 0 and reused.get("secret") is None
    reused.close()
    # The header now names epoch 2: epoch 2 re-opens (empty), epoch 1 no longer matches.
    assert store_on(memfd, epoch=2).open_state == "recovered"
    stale = store_on(memfd, epoch=1)
    assert stale.open_state == "reset" and len(stale) == 0


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("other_lease", "belongs to lease 'lease-1'"),
        ("geometry", "geometry"),
        ("torn_header", "checksum"),
        ("foreign", "no kv store header"),
        ("no_recover", "recover=False"),
    ],
)
def test_header_mismatch_is_detected(memfd: Memfd, damage: str, reason: str) -> None:
    store = store_on(memfd)
    store.put("k", b"v")
    store.close()
    kwargs: dict[str, object] = {}
    lease_id = "lease-1"
    if damage == "other_lease":
        lease_id = "lease-2"
    elif damage == "geometry":
        kwargs["block_bytes"] = 512 * KIB
    elif damage == "torn_header":
        memfd.mm[40] ^= 0xFF
    elif damage == "foreign":
        memfd.mm[:HEADER_BYTES] = os.urandom(HEADER_BYTES)
    elif damage == "no_recover":
        kwargs["recover"] = False
    kwargs.setdefault("block_bytes", MIB)
    reopened = KVStore(memfd.mm, lease_id, 1, **kwargs)  # type: ignore[arg-type]
    memfd.stores.append(reopened)
    assert reopened.open_state in ("reset", "new")
    assert reason in reopened.open_reason
    assert len(reopened) == 0 and reopened.get("k") is None
    reopened.close()


def test_unfinished_or_garbled_slot_records_are_not_recovered(memfd: Memfd) -> None:
    store = store_on(memfd)
    for key in ("good", "unfinished", "garbled"):
        store.put(key, b"data")
    store.close()
    records = [HEADER_BYTES + i * RECORD_BYTES for i in range(3)]
    assert [memfd.mm[r] for r in records] == [2, 2, 2]  # state byte: a str key, complete
    memfd.mm[records[1]] = 0  # the holder died mid-put: the state byte was never set
    memfd.mm[records[2] + 1] = MAX_KEY_BYTES + 1  # a key length no record can have
    again = store_on(memfd)
    assert again.open_state == "recovered"
    assert again.keys() == ["good"] and again.used_bytes == MIB
    again.put("next", b"n")
    again.put("more", b"m")  # both slots of the dropped records are free again
    assert len(again) == 3
    again.close()


# --- reporting -----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeReport:
    """Records what ``Lease.report`` would have sent; may fail or refuse on demand."""

    def __init__(self) -> None:
        self.sent: list[dict[str, int]] = []
        self.error: Exception | None = None
        self.accept = True

    def __call__(
        self,
        *,
        used_bytes: int,
        exclusive_bytes: int,
        replica_bytes: int,
        exclusive_blocks: int = 0,
        replica_blocks: int = 0,
    ) -> bool:
        if self.error is not None:
            raise self.error
        self.sent.append(
            {
                "used_bytes": used_bytes,
                "exclusive_bytes": exclusive_bytes,
                "replica_bytes": replica_bytes,
                "exclusive_blocks": exclusive_blocks,
                "replica_blocks": replica_blocks,
            }
        )
        return self.accept


@pytest.fixture
def reporting(memfd: Memfd) -> Iterator[tuple[KVStore, Reporter, FakeReport, FakeClock]]:
    store = store_on(memfd)
    report, clock = FakeReport(), FakeClock()
    reporter = Reporter(store, report, min_interval_s=1.0, clock=clock)
    yield store, reporter, report, clock
    store.close()


def test_reporter_sends_only_changes(
    reporting: tuple[KVStore, Reporter, FakeReport, FakeClock],
) -> None:
    store, reporter, report, clock = reporting
    assert reporter.poll()  # the initial (empty) state, once
    clock.now += 5
    assert not reporter.poll() and not reporter.flush()
    store.get("nothing")  # reads change no accounting
    clock.now += 5
    assert not reporter.poll()
    assert report.sent == [dict.fromkeys(report.sent[0], 0)]


def test_reporter_batches_changes_within_the_interval(
    reporting: tuple[KVStore, Reporter, FakeReport, FakeClock],
) -> None:
    store, reporter, report, clock = reporting
    store.put("a", b"x")
    assert reporter.poll()
    store.put("b", b"x", replica_of="gpu")
    clock.now += 0.5
    assert not reporter.poll()
    store.put("c", b"x", replica_of="gpu")
    store.mark_exclusive("b")
    clock.now += 0.6
    assert reporter.poll()
    assert len(report.sent) == 2
    assert report.sent[-1] == {
        "used_bytes": 3 * MIB,
        "exclusive_bytes": 2 * MIB,
        "replica_bytes": MIB,
        "exclusive_blocks": 2,
        "replica_blocks": 1,
    }


def test_reporter_flush_ignores_the_interval(
    reporting: tuple[KVStore, Reporter, FakeReport, FakeClock],
) -> None:
    store, reporter, report, _clock = reporting
    store.put("a", b"x")
    assert reporter.poll()
    store.mark_replica("a", "gpu")
    assert not reporter.poll()
    assert reporter.flush()
    assert report.sent[-1]["replica_bytes"] == MIB and reporter.sent == 2


def test_reporter_survives_an_absent_agent(
    reporting: tuple[KVStore, Reporter, FakeReport, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, reporter, report, clock = reporting
    store.put("a", b"x")
    report.error = ConnectionRefusedError("agent gone")
    with caplog.at_level(logging.DEBUG, logger="agent.kv"):
        assert not reporter.poll()
        clock.now += 0.5
        assert not reporter.poll()  # retries are rate-limited too
        clock.now += 1
        assert not reporter.poll() and not reporter.flush()
    assert reporter.failures == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "agent gone" in warnings[0].getMessage()
    report.error = None
    clock.now += 1
    assert reporter.poll()
    assert report.sent[-1]["used_bytes"] == MIB


def test_reporter_does_not_repeat_a_refused_report(
    reporting: tuple[KVStore, Reporter, FakeReport, FakeClock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, reporter, report, clock = reporting
    report.accept = False
    store.put("a", b"x")
    with caplog.at_level(logging.WARNING, logger="agent.kv"):
        assert reporter.poll()
    clock.now += 5
    assert not reporter.poll()
    assert len(report.sent) == 1 and "did not accept" in caplog.text


def test_reporter_thread_flushes_on_stop(memfd: Memfd) -> None:
    store = store_on(memfd)
    report = FakeReport()
    reporter = Reporter(store, report, min_interval_s=0.01)
    reporter.start()
    store.put("a", b"x")
    reporter.stop()
    assert report.sent[-1]["used_bytes"] == MIB
    store.close()


class FakeLease:
    """The parts of :class:`agent.client.Lease` that ``KVStore.open`` uses."""

    def __init__(self, region: Memfd) -> None:
        self.region = region
        self.lease_id = "lease-open"
        self.epoch = 7
        self.report = FakeReport()

    def mmap(self) -> mmap.mmap:
        length = len(self.region.mm)
        return mmap.mmap(
            self.region.fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )


def test_open_on_a_lease_reports_and_unmaps_at_close(memfd: Memfd) -> None:
    lease = FakeLease(memfd)
    with KVStore.open(cast("Lease", lease), report_interval_s=60) as store:
        store.put("a", b"x", replica_of="gpu")
        assert store.epoch == 7
    assert lease.report.sent[-1]["replica_bytes"] == MIB
    # The data is in the lease's memory: another mapping sees it.
    again = KVStore(memfd.mm, "lease-open", 7, block_bytes=MIB)
    memfd.stores.append(again)
    assert again.keys() == ["a"]
