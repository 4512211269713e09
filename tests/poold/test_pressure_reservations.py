"""poold/pressure.py with reservations: reserved-but-unleased bytes are asked back first,
whole, the biggest first; one already on its way back counts and is not asked again; a
reservation with a lease inside is never asked; leases cover only the rest."""

from __future__ import annotations

from datetime import UTC, datetime

from poold import pressure

MiB = 1 << 20
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _device(free: int, wanted: int = 0) -> pressure.DeviceFree:
    return pressure.DeviceFree(1, 100 * MiB, free, wanted_bytes=wanted, alignment_bytes=MiB)


def _lease(lease_id: str = "L", length: int = 40 * MiB) -> pressure.LeaseUse:
    return pressure.LeaseUse(lease_id, 1, 1, length, reported=True, used_bytes=0)


def _res(
    rid: str, length: int, *, empty: bool = True, recalled: bool = False
) -> pressure.ReservationUse:
    return pressure.ReservationUse(rid, 1, length, empty=empty, recalled=recalled)


def test_empty_reservations_go_first_the_biggest_first() -> None:
    # 1 MiB free, watermark 5 MiB: 4 MiB short.
    plan = pressure.plan_all(
        [_device(MiB)], [_lease()], [_res("a", 2 * MiB), _res("b", 8 * MiB)], now=NOW
    )
    assert plan.recalls == ["b"]
    assert plan.shrinks == []


def test_a_recalled_reservation_counts_and_busy_ones_are_never_asked() -> None:
    reservations = [_res("coming", 3 * MiB, recalled=True), _res("busy", 50 * MiB, empty=False)]
    plan = pressure.plan_all([_device(MiB)], [_lease()], reservations, now=NOW)
    assert plan.recalls == []
    # 4 MiB short, 3 on their way back: the lease is asked for the last 1 MiB.
    assert [(s.lease_id, s.target_bytes) for s in plan.shrinks] == [("L", MiB)]


def test_a_waiting_request_recalls_what_it_needs_then_asks_leases() -> None:
    plan = pressure.plan_all(
        [_device(10 * MiB, wanted=30 * MiB)], [_lease()], [_res("a", 16 * MiB)], now=NOW
    )
    assert plan.recalls == ["a"]
    # 30 + 5 - 10 = 25 short; 16 from the reservation, 9 from the lease.
    assert [(s.lease_id, s.target_bytes) for s in plan.shrinks] == [("L", 9 * MiB)]
    # plan() (leases only) is unchanged for callers without reservations.
    assert [s.target_bytes for s in pressure.plan([_device(MiB)], [_lease()], now=NOW)] == [4 * MiB]
