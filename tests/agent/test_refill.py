"""agent/refill.py as plain values: headroom from demand, when to reserve more or give
back (whole, unoccupied reservations, smallest first), and the budget a tenant asks."""

from __future__ import annotations

import pytest

from agent.refill import (
    Demand,
    HeldReservation,
    RefillPolicy,
    budget_ask_moves,
    budget_want,
    reservation_want,
)

MiB = 1 << 20
POLICY = RefillPolicy(min_reserve_bytes=8 * MiB, max_reserve_bytes=64 * MiB, min_budget_leases=4)


def test_headroom_is_the_horizon_of_demand_within_the_bounds() -> None:
    assert POLICY.headroom_bytes(0.0) == 8 * MiB
    assert POLICY.headroom_bytes(4 * MiB) == 16 * MiB  # 4 intervals
    assert POLICY.headroom_bytes(100 * MiB) == 64 * MiB
    assert POLICY.headroom_leases(0.5) == 4
    assert POLICY.headroom_leases(3.0) == 12


def test_demand_folds_each_interval_into_an_ewma_per_media_and_tenant() -> None:
    d = Demand()
    d.note("kv", "ddr5", 10 * MiB)
    d.note("kv", "cxl", 20 * MiB)
    d.note("other", "ddr5", 10 * MiB)
    by_media, by_tenant = d.close_interval(0.5)
    assert by_media == {"ddr5": 10 * MiB, "cxl": 10 * MiB}
    assert by_tenant == {"kv": (15 * MiB, 1.0), "other": (5 * MiB, 0.5)}
    by_media, _ = d.close_interval(0.5)  # nothing granted since: half again
    assert by_media["cxl"] == 5 * MiB
    d.forget("kv")
    _, by_tenant = d.close_interval(0.5)
    assert set(by_tenant) == {"other"}


def test_reservations_refill_below_the_low_watermark() -> None:
    held = [HeldReservation("r1", 8 * MiB, 2 * MiB, True)]
    assert reservation_want(POLICY, 4 * MiB, held) == (14 * MiB, [])  # 16 - 2
    assert reservation_want(POLICY, 4 * MiB, []) == (16 * MiB, [])


def test_above_the_high_watermark_whole_empty_reservations_go_back_smallest_first() -> None:
    held = [
        HeldReservation("big", 32 * MiB, 32 * MiB, False),
        HeldReservation("busy", 8 * MiB, 4 * MiB, True),
        HeldReservation("small", 8 * MiB, 8 * MiB, False),
        HeldReservation("mid", 16 * MiB, 16 * MiB, False),
    ]
    # 60 MiB free against 8 MiB of headroom: give back while at least 8 MiB stay free.
    assert reservation_want(POLICY, 0.0, held) == (None, ["small", "mid"])
    # Between the watermarks: nothing either way.
    assert reservation_want(POLICY, 0.0, held[1:3]) == (None, [])


@pytest.mark.parametrize(
    ("held", "share", "want"),
    [
        (None, None, (2 * MiB + 8 * MiB, 1 + 4)),  # no budget yet: ask used + headroom
        ((12 * MiB, 6), None, None),  # enough free, not too much: keep it
        ((64 * MiB, 40), None, (10 * MiB, 5)),  # far above: ask less
        ((12 * MiB, 6), (4 * MiB, 2), (4 * MiB, 2)),  # a fair share caps the ask
        ((12 * MiB, 6), (1 * MiB, 0), (2 * MiB, 1)),  # never below what is granted here
    ],
)
def test_budget_want(
    held: tuple[int, int] | None, share: tuple[int, int] | None, want: tuple[int, int] | None
) -> None:
    assert budget_want(POLICY, (0.0, 0.0), (2 * MiB, 1), held, share) == want


def test_budget_want_never_goes_below_the_floor() -> None:
    """The floor: local leases poold has yet to hear the end of (released ones included),
    whose commits must still fit when poold applies them after the ask."""
    share = (0, 0)  # other hosts hold the quota
    assert budget_want(POLICY, (0.0, 0.0), (0, 0), (8 * MiB, 1), share) == (0, 0)
    floor = (8 * MiB, 1)
    assert budget_want(POLICY, (0.0, 0.0), (0, 0), (8 * MiB, 1), share, floor) == floor
    assert budget_want(POLICY, (0.0, 0.0), (0, 0), (64 * MiB, 9), share, floor) == floor


@pytest.mark.parametrize(
    ("want", "budget", "last_raise", "moves"),
    [
        ((4 * MiB, 2), (4 * MiB, 2), None, False),  # what is held: poold keeps it
        ((2 * MiB, 2), (4 * MiB, 2), (999.0, (4 * MiB, 2)), True),  # less: always
        ((8 * MiB, 4), (4 * MiB, 2), None, True),  # more, never asked
        ((8 * MiB, 4), (4 * MiB, 2), (998.0, (4 * MiB, 2)), False),  # left unmoved 2 s ago
        ((8 * MiB, 4), (4 * MiB, 2), (994.0, (4 * MiB, 2)), True),  # the hold has passed
        ((8 * MiB, 4), (4 * MiB, 2), (999.0, (2 * MiB, 1)), True),  # poold moved it since
    ],
)
def test_budget_ask_moves(
    want: tuple[int, int],
    budget: tuple[int, int],
    last_raise: tuple[float, tuple[int, int]] | None,
    moves: bool,
) -> None:
    policy = RefillPolicy(unmoved_hold_s=5.0)
    assert budget_ask_moves(policy, want, budget, last_raise, now=1000.0) is moves
