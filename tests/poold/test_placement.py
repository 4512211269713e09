"""Placement: which device (and extent) a request gets, or why none fits."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poold.extents import Extent
from poold.placement import Candidate, Choice, Refusal, Request, eligible, place

MiB = 1 << 20
GiB = 1 << 30


def dev(device_id: int, **kw: Any) -> Candidate:
    fields: dict[str, Any] = {
        "device_id": device_id,
        "kind": "devdax",
        "media": "ddr5",
        "state": "online",
        "health": "ok",
        "capacity_bytes": GiB,
        "alignment_bytes": 2 * MiB,
    }
    fields.update(kw)
    return Candidate(**fields)


def chosen(req: Request, candidates: list[Candidate]) -> Choice:
    result = place(req, candidates)
    assert isinstance(result, Choice), result
    return result


def test_media_filter() -> None:
    cands = [dev(1, media="ddr4"), dev(2, media="ddr5")]
    assert chosen(Request(MiB, media="ddr5"), cands).candidate.device_id == 2
    assert chosen(Request(MiB, media="ddr4"), cands).candidate.device_id == 1
    refusal = place(Request(MiB, media="hbm"), cands)
    assert isinstance(refusal, Refusal)
    assert refusal.largest_free_bytes == 0
    assert refusal.free_by_device == {}


def test_allowed_media_restricts_the_choice() -> None:
    # ddr4 is closer, but the tenant may only use ddr5.
    cands = [dev(1, media="ddr4", read_latency_ns=100), dev(2, media="ddr5", read_latency_ns=300)]
    req = Request(MiB, allowed_media=frozenset({"ddr5"}))
    assert chosen(req, cands).candidate.device_id == 2
    assert isinstance(
        place(Request(MiB, media="ddr4", allowed_media=frozenset({"ddr5"})), cands), Refusal
    )


def test_emulated_never_chosen_beside_real_far_memory() -> None:
    emulated = dev(1, kind="emulated", media="emulated", read_latency_ns=1)
    real = dev(2, media="ddr5", read_latency_ns=500)
    assert chosen(Request(MiB), [emulated, real]).candidate.device_id == 2
    assert [c.device_id for c in eligible(Request(MiB), [emulated, real])] == [2]
    # Even when the real device is full, the tenant gets a refusal, not DRAM.
    full = dev(2, media="ddr5", used=(Extent(0, GiB),))
    refusal = place(Request(MiB), [emulated, full])
    assert isinstance(refusal, Refusal)
    assert refusal.free_by_device == {2: 0}
    # Asked for by name, it is chosen.
    assert chosen(Request(MiB, media="emulated"), [emulated, real]).candidate.device_id == 1


def test_emulated_kind_counts_as_emulated_whatever_its_media() -> None:
    memfd = dev(1, kind="emulated", media="unknown")
    real = dev(2, media="ddr5", read_latency_ns=900)
    assert chosen(Request(MiB), [memfd, real]).candidate.device_id == 2


def test_emulated_used_when_host_has_nothing_else() -> None:
    emulated = dev(1, kind="emulated", media="emulated")
    assert chosen(Request(MiB), [emulated]).candidate.device_id == 1


@pytest.mark.parametrize("state", ["draining", "failed", "retired", "missing"])
def test_devices_not_online_are_skipped(state: str) -> None:
    cands = [dev(1, state=state, read_latency_ns=1), dev(2, read_latency_ns=900)]
    assert chosen(Request(MiB), cands).candidate.device_id == 2
    refusal = place(Request(MiB), [dev(1, state=state)])
    assert isinstance(refusal, Refusal)
    assert refusal.largest_free_bytes == 0


def test_critical_health_skipped_and_warning_ranked_last() -> None:
    critical = dev(1, health="critical", read_latency_ns=1)
    warning = dev(2, health="warning", read_latency_ns=1)
    ok = dev(3, health="ok", read_latency_ns=900)
    assert chosen(Request(MiB), [critical, warning, ok]).candidate.device_id == 3
    assert chosen(Request(MiB), [critical, warning]).candidate.device_id == 2
    assert (
        chosen(
            Request(MiB), [warning, dev(4, health="unknown", read_latency_ns=900)]
        ).candidate.device_id
        == 4
    )


def test_latency_tier_prefers_hmat_latency_then_distance() -> None:
    near = dev(1, read_latency_ns=150, distance=30)
    far = dev(2, read_latency_ns=300, distance=10)
    assert chosen(Request(MiB), [far, near]).candidate.device_id == 1
    # Same latency: distance decides.
    a = dev(3, read_latency_ns=150, distance=20)
    b = dev(4, read_latency_ns=150, distance=12)
    assert chosen(Request(MiB), [a, b]).candidate.device_id == 4
    # No HMAT at all: distance alone.
    c = dev(5, distance=20)
    d = dev(6, distance=14)
    assert chosen(Request(MiB), [c, d]).candidate.device_id == 6
    # A device with a known latency beats one that only reports a distance.
    assert chosen(Request(MiB), [d, dev(7, read_latency_ns=10_000)]).candidate.device_id == 7


def test_lower_tier_used_when_nearer_is_full() -> None:
    near = dev(1, read_latency_ns=150, used=(Extent(0, GiB - 2 * MiB),))
    far = dev(2, read_latency_ns=300)
    assert chosen(Request(2 * MiB), [near, far]).candidate.device_id == 1
    assert chosen(Request(4 * MiB), [near, far]).candidate.device_id == 2


def test_best_fit_within_a_tier() -> None:
    # Same tier: device 1 has a 64 MiB hole, device 2 a 6 MiB hole; 4 MiB goes to 2.
    roomy = dev(1, read_latency_ns=200, capacity_bytes=64 * MiB)
    snug = dev(2, read_latency_ns=200, capacity_bytes=64 * MiB, used=(Extent(6 * MiB, 58 * MiB),))
    choice = chosen(Request(4 * MiB), [roomy, snug])
    assert choice.candidate.device_id == 2
    assert choice.extent == Extent(0, 4 * MiB)
    # Equal holes: lowest device id.
    twin = dev(0, read_latency_ns=200, capacity_bytes=64 * MiB, used=(Extent(6 * MiB, 58 * MiB),))
    assert chosen(Request(4 * MiB), [snug, twin]).candidate.device_id == 0


def test_extent_is_aligned_best_fit_on_the_device() -> None:
    used = (Extent(0, 2 * MiB), Extent(6 * MiB, 2 * MiB))  # holes [2,6) and [8, 1024)
    choice = chosen(Request(3 * MiB), [dev(1, used=used)])
    assert choice.extent == Extent(2 * MiB, 4 * MiB)


def test_refusal_reports_largest_free() -> None:
    a = dev(1, capacity_bytes=16 * MiB, used=(Extent(0, 10 * MiB),))  # 6 MiB free
    b = dev(2, capacity_bytes=16 * MiB, used=(Extent(4 * MiB, 12 * MiB),))  # 4 MiB free
    off = dev(3, state="draining", capacity_bytes=GiB)  # not counted
    refusal = place(Request(8 * MiB), [a, b, off])
    assert isinstance(refusal, Refusal)
    assert refusal.largest_free_bytes == 6 * MiB
    assert refusal.free_by_device == {1: 6 * MiB, 2: 4 * MiB}
    assert "free extent" in refusal.reason


def test_no_candidates_at_all() -> None:
    refusal = place(Request(MiB), [])
    assert isinstance(refusal, Refusal)
    assert refusal.largest_free_bytes == 0


# --- whole-only devices (static dax regions, leased whole) ---------------------------------


def test_whole_only_device_takes_only_a_lease_of_its_usable_size() -> None:
    static = dev(1, whole_only=True, capacity_bytes=250 * MiB, read_latency_ns=100)
    carvable = dev(2, read_latency_ns=300)
    # 2 MiB: the nearer static device cannot be carved, the farther carvable one can.
    small = chosen(Request(2 * MiB), [static, carvable])
    assert small.candidate.device_id == 2
    whole = chosen(Request(250 * MiB), [static, carvable])
    assert (whole.candidate.device_id, whole.extent) == (1, Extent(0, 250 * MiB))


def test_whole_only_device_alone_refuses_a_part_with_no_capacity() -> None:
    static = dev(1, whole_only=True, capacity_bytes=250 * MiB)
    refusal = place(Request(2 * MiB), [static])
    assert isinstance(refusal, Refusal)
    assert refusal.free_by_device == {1: 250 * MiB}
    assert "whole-only devices take exactly 262144000 bytes" in refusal.reason
    # Leased: nothing left to give, not even the whole.
    leased = dev(1, whole_only=True, capacity_bytes=250 * MiB, used=(Extent(0, 250 * MiB),))
    assert isinstance(place(Request(250 * MiB), [leased]), Refusal)
    # Scrubbing after release (quarantine in used): still nothing, until it is free again.
    scrubbing = dev(1, whole_only=True, capacity_bytes=250 * MiB, used=(Extent(0, 2 * MiB),))
    refusal = place(Request(250 * MiB), [scrubbing])
    assert isinstance(refusal, Refusal) and refusal.free_by_device == {1: 0}


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 64), st.integers(0, 64)), min_size=1, max_size=5
    ),
    st.integers(1, 64),
)
@settings(max_examples=200)
def test_placement_never_puts_a_part_on_a_whole_only_device(
    devices: list[tuple[bool, int, int]], size_units: int
) -> None:
    cands = [
        dev(
            i,
            whole_only=whole,
            capacity_bytes=units * 2 * MiB,
            used=(Extent(0, leased * 2 * MiB),) if leased else (),
        )
        for i, (whole, units, leased) in enumerate(devices)
    ]
    result = place(Request(size_units * 2 * MiB), cands)
    if isinstance(result, Choice):
        c = result.candidate
        if c.whole_only:
            assert not c.used and result.extent == Extent(0, c.capacity_bytes)
        return
    # Refused: no carvable device had room, and no whole-only one was free at exactly that size.
    for c in cands:
        free = c.capacity_bytes - min(sum(e.length for e in c.used), c.capacity_bytes)
        if c.whole_only:
            assert c.used or c.capacity_bytes != size_units * 2 * MiB
        else:
            assert free < size_units * 2 * MiB
