"""Extent arithmetic: unit cases and properties that must hold after any allocation history."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from poold import extents
from poold.extents import Extent

MiB = 1 << 20


# --- unit cases -------------------------------------------------------------


def test_extent_end_and_overlap() -> None:
    a = Extent(0, 10)
    assert a.end == 10
    assert a.overlaps(Extent(9, 5))
    assert not a.overlaps(Extent(10, 5)), "half-open: touching is not overlapping"
    assert not Extent(10, 5).overlaps(a)
    assert Extent(2, 3).overlaps(a)


@pytest.mark.parametrize(
    ("value", "alignment", "up", "down"),
    [
        (0, 4, 0, 0),
        (1, 4, 4, 0),
        (4, 4, 4, 4),
        (5, 4, 8, 4),
        (7, 1, 7, 7),
        (2 * MiB + 1, MiB, 3 * MiB, 2 * MiB),
    ],
)
def test_align(value: int, alignment: int, up: int, down: int) -> None:
    assert extents.align_up(value, alignment) == up
    assert extents.align_down(value, alignment) == down


@pytest.mark.parametrize("alignment", [0, -1])
def test_align_rejects_non_positive_alignment(alignment: int) -> None:
    with pytest.raises(ValueError, match="alignment"):
        extents.align_up(1, alignment)
    with pytest.raises(ValueError, match="alignment"):
        extents.align_down(1, alignment)


def test_normalise_merges_clips_and_drops_empty() -> None:
    used = [
        Extent(50, 10),
        Extent(0, 10),
        Extent(5, 10),
        Extent(90, 20),
        Extent(30, 0),
        Extent(-5, 3),
    ]
    assert extents.normalise_used(100, used) == [Extent(0, 15), Extent(50, 10), Extent(90, 10)]


def test_normalise_merges_touching_extents() -> None:
    assert extents.normalise_used(100, [Extent(0, 10), Extent(10, 10)]) == [Extent(0, 20)]


def test_free_extents_of_empty_and_full_device() -> None:
    assert extents.free_extents(100, []) == [Extent(0, 100)]
    assert extents.free_extents(100, [Extent(0, 100)]) == []
    assert extents.free_extents(0, []) == []
    assert extents.free_extents(100, [Extent(20, 10), Extent(60, 10)]) == [
        Extent(0, 20),
        Extent(30, 30),
        Extent(70, 30),
    ]
    assert extents.free_bytes(100, [Extent(20, 10), Extent(25, 10)]) == 85


def test_best_fit_rounds_up_to_alignment() -> None:
    assert extents.best_fit(8 * MiB, 2 * MiB, [], 1) == Extent(0, 2 * MiB)
    assert extents.best_fit(8 * MiB, 2 * MiB, [], 2 * MiB + 1) == Extent(0, 4 * MiB)


def test_best_fit_picks_smallest_hole_that_fits() -> None:
    # Holes: [0,4) len 4, [6,8) len 2, [10,13) len 3 (units of MiB, alignment 1 MiB).
    used = [Extent(4 * MiB, 2 * MiB), Extent(8 * MiB, 2 * MiB), Extent(13 * MiB, 3 * MiB)]
    assert extents.best_fit(16 * MiB, MiB, used, 2 * MiB) == Extent(6 * MiB, 2 * MiB)
    assert extents.best_fit(16 * MiB, MiB, used, 3 * MiB) == Extent(10 * MiB, 3 * MiB)
    assert extents.best_fit(16 * MiB, MiB, used, 4 * MiB) == Extent(0, 4 * MiB)
    assert extents.best_fit(16 * MiB, MiB, used, 5 * MiB) is None


def test_best_fit_ties_go_to_lowest_offset() -> None:
    used = [Extent(2 * MiB, 2 * MiB), Extent(6 * MiB, 2 * MiB)]
    assert extents.best_fit(10 * MiB, MiB, used, MiB) == Extent(0, MiB)


def test_best_fit_respects_alignment_inside_unaligned_hole() -> None:
    # A quarantined range ends off-alignment: the hole [1 MiB, 8 MiB) only has
    # aligned room from 2 MiB, so a 6 MiB request needs [2, 8) and fits; 8 MiB does not.
    used = [Extent(0, MiB)]
    assert extents.best_fit(8 * MiB, 2 * MiB, used, 6 * MiB) == Extent(2 * MiB, 6 * MiB)
    assert extents.best_fit(8 * MiB, 2 * MiB, used, 7 * MiB) is None
    assert extents.largest_free(8 * MiB, 2 * MiB, used) == 6 * MiB


def test_best_fit_ignores_unaligned_tail_of_capacity() -> None:
    assert extents.largest_free(3 * MiB, 2 * MiB, []) == 2 * MiB
    assert extents.best_fit(3 * MiB, 2 * MiB, [], 3 * MiB) is None


@pytest.mark.parametrize("size", [0, -1])
def test_best_fit_rejects_non_positive_size(size: int) -> None:
    with pytest.raises(ValueError, match="size"):
        extents.best_fit(MiB, 1, [], size)


def test_largest_free_of_full_device_is_zero() -> None:
    assert extents.largest_free(4 * MiB, MiB, [Extent(0, 4 * MiB)]) == 0
    assert extents.largest_free(4 * MiB, 4 * MiB, [Extent(MiB, MiB)]) == 0


# --- properties -------------------------------------------------------------

alignments = st.sampled_from([1, 2, 4, 8, 4096])


@st.composite
def device_and_used(draw: st.DrawFn) -> tuple[int, int, list[Extent]]:
    alignment = draw(alignments)
    capacity = draw(st.integers(0, 64)) * alignment + draw(st.integers(0, alignment - 1))
    used = draw(
        st.lists(
            st.builds(Extent, st.integers(-10, capacity + 10), st.integers(0, capacity + 10)),
            max_size=8,
        )
    )
    return capacity, alignment, used


@given(device_and_used(), st.integers(1, 70 * 4096))
@settings(max_examples=200)
def test_best_fit_and_largest_free_agree(dev: tuple[int, int, list[Extent]], size: int) -> None:
    capacity, alignment, used = dev
    ext = extents.best_fit(capacity, alignment, used, size)
    largest = extents.largest_free(capacity, alignment, used)
    assert (ext is not None) == (extents.align_up(size, alignment) <= largest)
    assert largest % alignment == 0
    if ext is not None:
        assert ext.offset % alignment == 0
        assert ext.length == extents.align_up(size, alignment)
        assert ext.offset >= 0 and ext.end <= capacity
        assert not any(ext.overlaps(u) for u in used if u.length > 0)
        # Best fit: no other free hole that could hold it is smaller.
        holes = extents.free_extents(capacity, used)
        mine = next(h for h in holes if h.offset <= ext.offset and ext.end <= h.end)
        fitting = [h for h in holes if extents.align_up(h.offset, alignment) + ext.length <= h.end]
        assert mine.length == min(h.length for h in fitting)
    # A request of exactly the largest free size always fits.
    if largest:
        assert extents.best_fit(capacity, alignment, used, largest) is not None


def test_whole_fit_is_all_or_nothing() -> None:
    cap, align = 8 * MiB, 2 * MiB
    assert extents.whole_fit(cap, align, [], [], cap) == Extent(0, cap)
    assert extents.whole_fit(cap, align, [], [], cap - 1) == Extent(0, cap)  # rounded up
    assert extents.whole_fit(cap, align, [], [], 2 * MiB) is None  # smaller: never carved
    assert extents.whole_fit(cap, align, [], [], cap + align) is None
    assert extents.whole_fit(cap, align, [Extent(0, cap)], [], cap) is None  # leased
    assert extents.whole_fit(cap, align, [Extent(6 * MiB, 2 * MiB)], [], 6 * MiB) is None
    # Reserved bytes are not part of the usable size: the rest is the whole.
    tail = [Extent(6 * MiB, 2 * MiB)]
    assert extents.whole_fit(cap, align, tail, tail, 6 * MiB) == Extent(0, 6 * MiB)
    assert extents.whole_free(cap, align, tail, tail) == 6 * MiB
    assert extents.whole_free(cap, align, [Extent(0, 2 * MiB), *tail], tail) == 0
    middle = [Extent(2 * MiB, 2 * MiB)]  # two holes: no one lease is the whole device
    assert extents.whole_fit(cap, align, middle, middle, 6 * MiB) is None
    assert extents.whole_free(cap, align, middle, middle) == 0


@given(
    device_and_used(),
    st.lists(st.builds(Extent, st.integers(0, 300), st.integers(1, 300)), max_size=3),
    st.integers(1, 70 * 4096),
)
@settings(max_examples=200)
def test_whole_fit_gives_the_usable_space_or_nothing(
    dev: tuple[int, int, list[Extent]], reserved: list[Extent], size: int
) -> None:
    capacity, alignment, leases = dev
    used = [*leases, *reserved]
    ext = extents.whole_fit(capacity, alignment, used, reserved, size)
    usable = extents.free_bytes(capacity, reserved)
    if ext is None:
        # Refused: something besides the reserved bytes is on it, or the size is not the
        # whole, or the whole is not one aligned hole; whole_free says which size it takes.
        whole = extents.whole_free(capacity, alignment, used, reserved)
        assert whole == 0 or extents.align_up(size, alignment) != whole
        return
    assert ext.length == usable == extents.align_up(size, alignment)
    assert ext.offset % alignment == 0
    assert extents.free_extents(capacity, used) == [ext]  # nothing was on it
    assert not any(ext.overlaps(u) for u in used if u.length > 0)
    assert extents.whole_free(capacity, alignment, used, reserved) == ext.length
    # Once leased, the device has no whole to give to anyone else.
    assert extents.whole_fit(capacity, alignment, [*used, ext], reserved, size) is None


@given(device_and_used())
def test_free_extents_are_disjoint_sorted_and_conserve_bytes(
    dev: tuple[int, int, list[Extent]],
) -> None:
    capacity, _alignment, used = dev
    free = extents.free_extents(capacity, used)
    merged = extents.normalise_used(capacity, used)
    assert all(f.length > 0 for f in free)
    assert all(a.end < b.offset for a, b in itertools.pairwise(free))
    assert all(a.end < b.offset for a, b in itertools.pairwise(merged))
    assert sum(f.length for f in free) + sum(m.length for m in merged) == capacity
    assert not any(f.overlaps(m) for f in free for m in merged)


@given(
    st.integers(0, 64),
    st.lists(st.tuples(st.integers(-8, 72), st.integers(-4, 24)), max_size=12),
)
def test_normalise_used_is_the_union_clipped_to_the_device(
    capacity: int, spans: list[tuple[int, int]]
) -> None:
    """Byte by byte: the merged extents cover exactly the used bytes inside the device,
    in runs as long as they can be (touching extents merge)."""
    used = [Extent(offset, length) for offset, length in spans]
    covered = {b for e in used if e.length > 0 for b in range(e.offset, e.end) if 0 <= b < capacity}
    merged = extents.normalise_used(capacity, used)
    assert {b for m in merged for b in range(m.offset, m.end)} == covered
    assert all(m.length > 0 for m in merged)
    assert all(a.end < b.offset for a, b in itertools.pairwise(merged))


class Allocator(RuleBasedStateMachine):
    """A device through any sequence of best-fit allocations and frees."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.alignment = 1
        self.used: list[Extent] = []

    @initialize(alignment=alignments, blocks=st.integers(0, 32), tail=st.integers(0, 4095))
    def device(self, alignment: int, blocks: int, tail: int) -> None:
        self.alignment = alignment
        self.capacity = blocks * alignment + tail % alignment

    @rule(target=leases, size=st.integers(1, 40 * 4096))
    def allocate(self, size: int) -> Extent:
        largest = extents.largest_free(self.capacity, self.alignment, self.used)
        holes = extents.free_extents(self.capacity, self.used)
        ext = extents.best_fit(self.capacity, self.alignment, self.used, size)
        length = extents.align_up(size, self.alignment)
        if ext is None:
            assert length > largest
            return Extent(-1, 0)  # a placeholder the free rule ignores
        assert length <= largest
        hole = next(h for h in holes if h.offset <= ext.offset and ext.end <= h.end)
        assert all(
            h.length >= hole.length
            for h in holes
            if extents.align_up(h.offset, self.alignment) + length <= h.end
        ), "best fit chose a larger hole than needed"
        self.used.append(ext)
        return ext

    @rule(ext=consumes(leases))
    def free(self, ext: Extent) -> None:
        if ext.length:
            self.used.remove(ext)

    @invariant()
    def no_overlap_in_bounds_aligned(self) -> None:
        ordered = sorted(self.used)
        for a, b in itertools.pairwise(ordered):
            assert a.end <= b.offset, f"{a} overlaps {b}"
        for e in self.used:
            assert e.offset >= 0 and e.end <= self.capacity
            assert e.offset % self.alignment == 0
            assert e.length % self.alignment == 0

    @invariant()
    def free_space_conserved(self) -> None:
        used_bytes = sum(e.length for e in self.used)
        assert extents.free_bytes(self.capacity, self.used) + used_bytes == self.capacity


TestAllocator = Allocator.TestCase
TestAllocator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
