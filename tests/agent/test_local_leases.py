"""agent/local_leases.py: the sums and the index always say what a pass over every
local lease says, whatever sequence of adds, removals, shrinks and releases (queued,
not yet applied by poold) came before."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.local_leases import LocalLease, LocalLeases
from poold.extents import Extent, free_extents

MiB = 1 << 20

steps = st.lists(
    st.tuples(
        st.sampled_from(["add", "pop", "shrink", "release"]),
        st.integers(0, 12),  # lease id
        st.sampled_from(["r1", "r2"]),
        st.sampled_from(["kv", "other"]),
        st.integers(0, 8),  # MiB
    ),
    max_size=80,
)


@given(steps)
def test_sums_and_index_agree_with_the_leases(ops: list[tuple[str, int, str, str, int]]) -> None:
    table = LocalLeases()
    model: dict[str, LocalLease] = {}
    for op, n, rid, tenant, mib in ops:
        lease_id = f"L{n}"
        if op == "add":
            lease = LocalLease(lease_id, rid, tenant, n * 16 * MiB, (mib + 1) * MiB, n)
            table.add(lease)
            model[lease_id] = LocalLease(**vars(lease))
        elif op == "pop":
            gone = table.pop(lease_id)
            assert (gone is None) == (lease_id not in model)
            model.pop(lease_id, None)
        elif op == "release":
            table.release(lease_id)
            if lease_id in model:
                model[lease_id].released = True
        else:
            table.shrink(lease_id, mib * MiB)
            if lease_id in model:
                model[lease_id].length_bytes = min(model[lease_id].length_bytes, mib * MiB)
        assert {x.lease_id for x in table} == set(model)
        for name in ("kv", "other"):
            # A lease whose release is queued spends its tenant's budget no more...
            mine = [x for x in model.values() if x.tenant == name and not x.released]
            assert table.used_by(name) == (sum(x.length_bytes for x in mine), len(mine))
        for r in ("r1", "r2"):
            # ... and occupies its extent until poold has applied the release (popped).
            inside = [x for x in model.values() if x.reservation_id == r]
            assert sorted(table.occupied(r)) == sorted(
                (x.offset_bytes, x.length_bytes) for x in inside
            )
            assert table.used_in(r) == sum(x.length_bytes for x in inside)
            assert table.any_in(r) == bool(inside)


placed = st.lists(
    st.tuples(
        st.sampled_from(["add", "pop", "shrink"]),
        st.integers(0, 12),  # lease id
        st.integers(0, 40),  # offset, MiB (some outside the window, some overlapping)
        st.integers(0, 6),  # MiB
    ),
    max_size=80,
)


@given(placed)
def test_kept_holes_are_the_free_extents_of_the_leases(
    ops: list[tuple[str, int, int, int]],
) -> None:
    """Cut as leases are added, made again after removals: always what free_extents says
    of the window with the reservation's leases (overlapping or not) used."""
    table = LocalLeases()
    start, end = 4 * MiB, 36 * MiB
    for op, n, at, mib in ops:
        lease_id = f"L{n}"
        if op == "add":
            table.add(LocalLease(lease_id, "r", "t", at * MiB, (mib + 1) * MiB, n))
        elif op == "pop":
            table.pop(lease_id)
        else:
            table.shrink(lease_id, mib * MiB)
        # Asked after every step, so every add cuts kept holes and every removal
        # makes them again.
        used = [Extent(0, start), *table.occupied("r")]
        assert table.holes("r", start, end) == free_extents(end, used)
