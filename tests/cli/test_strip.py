"""Does the strip arithmetic of `poolctl devices map` hold for any device? (cli/strip.py)"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.strip import (
    Claim,
    Span,
    bytes_by_kind,
    cell_bounds,
    cells,
    fragmentation,
    layout,
)

MiB = 1 << 20

capacities = st.integers(min_value=0, max_value=1 << 40)
widths = st.integers(min_value=1, max_value=300)


@st.composite
def devices(draw: st.DrawFn) -> tuple[int, list[Claim]]:
    """A capacity and claims that may overlap each other and stick out of the device."""
    capacity = draw(st.integers(min_value=0, max_value=4096))
    n = draw(st.integers(min_value=0, max_value=12))
    claims = []
    for i in range(n):
        offset = draw(st.integers(min_value=-64, max_value=capacity + 64))
        length = draw(st.integers(min_value=0, max_value=capacity + 64))
        if draw(st.booleans()):
            tenant = draw(st.sampled_from(["alpha", "beta", "gamma"]))
            claims.append(Claim(offset, length, "leased", tenant, f"lease-{i}", "active"))
        else:
            claims.append(Claim(offset, length, "reserved"))
    return capacity, claims


def owner_of_byte(b: int, claims: list[Claim]) -> tuple[str, str | None]:
    """The rule of cli/strip.py, byte by byte: a lease (first starting, then first listed)
    over a reserved range over free."""
    covering = [(i, c) for i, c in enumerate(claims) if c.offset <= b < c.offset + c.length]
    leases = [(c.offset, i, c) for i, c in covering if c.kind == "leased"]
    if leases:
        c = min(leases, key=lambda x: (x[0], x[1]))[2]
        return "leased", c.lease_id
    if covering:
        return "reserved", None
    return "free", None


@settings(max_examples=300, database=None)
@given(devices())
def test_layout_partitions_the_device_exactly(device: tuple[int, list[Claim]]) -> None:
    capacity, claims = device
    spans = layout(capacity, claims)
    cursor = 0
    for s in spans:
        assert s.offset == cursor and s.length > 0
        cursor = s.end
    assert cursor == capacity
    for a, b in itertools.pairwise(spans):  # merged: neighbours differ
        assert (a.kind, a.tenant, a.lease_id) != (b.kind, b.tenant, b.lease_id)
    assert sum(bytes_by_kind(spans).values()) == capacity


@settings(max_examples=150, database=None)
@given(devices())
def test_every_byte_goes_to_the_claim_the_rule_names(device: tuple[int, list[Claim]]) -> None:
    capacity, claims = device
    for s in layout(capacity, claims):
        for b in {s.offset, s.end - 1, (s.offset + s.end) // 2}:
            assert (s.kind, s.lease_id) == owner_of_byte(b, claims)


@settings(max_examples=300, database=None)
@given(capacities, widths)
def test_cells_cover_the_device_in_near_equal_parts(capacity: int, width: int) -> None:
    bounds = cell_bounds(capacity, width)
    assert len(bounds) == min(width, capacity)
    cursor = 0
    for start, end in bounds:
        assert start == cursor and end > start
        cursor = end
    assert cursor == capacity
    lengths = {end - start for start, end in bounds}
    assert not lengths or max(lengths) - min(lengths) <= 1


@settings(max_examples=300, database=None)
@given(devices(), widths)
def test_a_cell_shows_the_kind_holding_most_of_its_bytes(
    device: tuple[int, list[Claim]], width: int
) -> None:
    capacity, claims = device
    spans = layout(capacity, claims)
    strip = cells(spans, capacity, width)
    assert [(c.offset, c.end) for c in strip] == cell_bounds(capacity, width)
    rank = {"leased": 0, "reserved": 1, "free": 2}
    for cell in strip:
        held: dict[str, int] = {"leased": 0, "reserved": 0, "free": 0}
        tenants: dict[str | None, int] = {}
        holders = set()
        for s in spans:
            overlap = min(s.end, cell.end) - max(s.offset, cell.offset)
            if overlap > 0:
                held[s.kind] += overlap
                holders.add((s.kind, s.tenant))
                if s.kind == "leased":
                    tenants[s.tenant] = tenants.get(s.tenant, 0) + overlap
        assert sum(held.values()) == cell.length
        # the majority; a tie goes to leased, then reserved
        best = min(held, key=lambda k: (-held[k], rank[k]))
        assert cell.kind == best
        if cell.kind == "leased":
            assert tenants[cell.tenant] == max(tenants.values())
        else:
            assert cell.tenant is None
        assert cell.mixed == (len(holders) > 1)


@settings(max_examples=200, database=None)
@given(devices())
def test_fragmentation_figures(device: tuple[int, list[Claim]]) -> None:
    capacity, claims = device
    spans = layout(capacity, claims)
    f = fragmentation(spans)
    free = [s.length for s in spans if s.kind == "free"]
    assert f.free_bytes == sum(free) == bytes_by_kind(spans)["free"]
    assert f.free_extents == len(free)
    assert f.largest_free_bytes == max(free, default=0)
    if f.free_bytes:
        assert f.largest_free_ratio is not None and 0 < f.largest_free_ratio <= 1
    else:
        assert f.largest_free_ratio is None


def test_a_zero_length_device_has_no_extents_and_no_cells() -> None:
    spans = layout(0, [Claim(0, 10, "leased", "t", "l1")])
    assert spans == []
    assert cells(spans, 0, 80) == []
    f = fragmentation(spans)
    assert (f.free_bytes, f.free_extents, f.largest_free_bytes, f.largest_free_ratio) == (
        0,
        0,
        0,
        None,
    )


def test_a_device_smaller_than_the_strip_gets_one_cell_per_byte() -> None:
    strip = cells(layout(3, [Claim(1, 1, "reserved")]), 3, 80)
    assert [(c.offset, c.length, c.kind) for c in strip] == [
        (0, 1, "free"),
        (1, 1, "reserved"),
        (2, 1, "free"),
    ]


def test_a_half_taken_cell_shows_as_taken_and_mixed() -> None:
    spans = layout(4 * MiB, [Claim(0, 1 * MiB, "leased", "alpha", "a")])
    (first, second) = cells(spans, 4 * MiB, 2)
    assert first.kind == "leased" and first.tenant == "alpha" and first.mixed
    assert second.kind == "free" and not second.mixed


def test_leases_win_over_reserved_ranges_they_overlap() -> None:
    spans = layout(100, [Claim(0, 50, "reserved"), Claim(40, 20, "leased", "t", "l1", "active")])
    assert spans == [
        Span(0, 40, "reserved"),
        Span(40, 20, "leased", "t", "l1", "active"),
        Span(60, 40, "free"),
    ]


def test_adjacent_leases_stay_apart_and_adjacent_reserved_ranges_merge() -> None:
    spans = layout(
        100,
        [
            Claim(0, 10, "reserved"),
            Claim(10, 10, "reserved"),
            Claim(20, 10, "leased", "t", "l1"),
            Claim(30, 10, "leased", "t", "l2"),
        ],
    )
    assert [(s.offset, s.length, s.kind, s.lease_id) for s in spans] == [
        (0, 20, "reserved", None),
        (20, 10, "leased", "l1"),
        (30, 10, "leased", "l2"),
        (40, 60, "free", None),
    ]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="width"):
        cell_bounds(10, 0)
    with pytest.raises(ValueError, match="capacity"):
        layout(-1, [])
