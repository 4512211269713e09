"""poold.ledger.accounting's pure half: usage rows, GiB-hours clipping, cost and savings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from poold.ledger.accounting import (
    HOURS_PER_MONTH,
    LeaseSpan,
    LeaseUsage,
    gib_hours,
    report_problem,
    served,
    usage,
    usage_row,
)
from poold.wire.agent import LeaseReport

MIB = 1 << 20
GIB = 1 << 30
T0 = datetime(2026, 12, 1, tzinfo=UTC)
H = timedelta(hours=1)


def lease(
    tenant: str = "t1",
    host: str = "h1",
    device: str = "d1",
    media: str = "ddr5",
    state: str = "active",
    length: int = 64 * MIB,
    reported: bool = True,
    used: int = 32 * MIB,
    exclusive: int = 24 * MIB,
    replica: int = 8 * MIB,
) -> LeaseUsage:
    return LeaseUsage(
        tenant=tenant,
        host=host,
        device_uid=device,
        media=media,
        state=state,
        length_bytes=length,
        reported=reported,
        used_bytes=used,
        exclusive_bytes=exclusive,
        replica_bytes=replica,
        exclusive_blocks=exclusive // MIB,
        replica_blocks=replica // MIB,
    )


def test_usage_row_sums_and_ratio() -> None:
    row = usage_row("pool", [lease(), lease(exclusive=32 * MIB, replica=0)])
    assert (row.leases, row.reported_leases) == (2, 2)
    assert row.leased_bytes == 128 * MIB and row.used_bytes == 64 * MIB
    assert (row.exclusive_bytes, row.replica_bytes) == (56 * MIB, 8 * MIB)
    assert (row.exclusive_blocks, row.replica_blocks) == (56, 8)
    assert row.exclusive_ratio == pytest.approx(56 / 128)


def test_unreported_and_scrubbing_leases_count_as_leased_only() -> None:
    row = usage_row(
        "pool", [lease(reported=False, used=0, exclusive=0, replica=0), lease(state="scrubbing")]
    )
    assert (row.leases, row.reported_leases, row.leased_bytes) == (2, 0, 128 * MIB)
    assert (row.used_bytes, row.exclusive_bytes, row.exclusive_ratio) == (0, 0, 0.0)


def test_ended_leases_are_not_usage_and_empty_is_zero() -> None:
    row = usage_row("pool", [lease(state="released"), lease(state="aborted")])
    assert row.leases == 0 and row.leased_bytes == 0 and row.exclusive_ratio == 0.0


@pytest.mark.parametrize(
    ("by", "groups"),
    [
        ("tenant", {"a": 2, "b": 1}),
        ("host", {"h1": 1, "h2": 2}),
        ("device", {"d1": 2, "d2": 1}),
        ("media", {"ddr4": 1, "ddr5": 2}),
    ],
)
def test_usage_groups_sum_to_the_pool(by: str, groups: dict[str, int]) -> None:
    leases = [
        lease(tenant="a", host="h1", device="d1", media="ddr5"),
        lease(tenant="a", host="h2", device="d1", media="ddr5", exclusive=0, replica=32 * MIB),
        lease(tenant="b", host="h2", device="d2", media="ddr4", state="orphaned"),
        lease(tenant="c", host="h3", device="d3", media="ddr4", state="released"),
    ]
    pool, rows = usage(leases, by)  # type: ignore[arg-type]
    assert {r.group: r.leases for r in rows} == groups
    assert [r.group for r in rows] == sorted(groups)
    for field in ("leases", "leased_bytes", "used_bytes", "exclusive_bytes", "replica_bytes"):
        assert sum(getattr(r, field) for r in rows) == getattr(pool, field), field
    assert pool.group == "pool" and pool.leases == 3


@pytest.mark.parametrize(
    ("granted", "ended", "hours"),
    [
        (T0, T0 + 2 * H, 2.0),  # inside the period
        (T0 - 5 * H, T0 + H, 1.0),  # started before: clipped at since
        (T0 + 9 * H, None, 1.0),  # still live: runs to until
        (T0 - 5 * H, None, 10.0),  # spans the whole period
        (T0 - 5 * H, T0 - H, 0.0),  # ended before
        (T0 + 11 * H, None, 0.0),  # granted after
        (T0 + H, T0 + H, 0.0),  # zero length
    ],
)
def test_gib_hours_clipped_to_the_period(
    granted: datetime, ended: datetime | None, hours: float
) -> None:
    assert gib_hours(2 * GIB, granted, ended, T0, T0 + 10 * H) == pytest.approx(2 * hours)


def span(
    tenant: str = "t1",
    media: str = "ddr4",
    recycled: bool = True,
    cost: float | None = 2.0,
    length: int = GIB,
    hours: float = 730.0,
) -> LeaseSpan:
    return LeaseSpan(
        tenant=tenant,
        media=media,
        recycled=recycled,
        cost_per_gib_month=cost,
        length_bytes=length,
        granted_at=T0,
        ended_at=T0 + timedelta(hours=hours),
    )


def test_cost_and_ddr4_savings_per_tenant_and_media() -> None:
    until = T0 + timedelta(hours=HOURS_PER_MONTH)
    total, rows = served(
        [
            span(),  # 1 GiB-month of recycled DDR4 at 2.0: saved 10 - 2
            span(media="ddr5", recycled=False, cost=10.0, length=2 * GIB),
            span(tenant="t2", cost=None),  # no cost basis: unpriced, no savings
            span(tenant="t2", media="ddr5", recycled=True, cost=4.0),  # recycled, not DDR4
        ],
        T0,
        until,
        ddr5_cost_per_gib_month=10.0,
    )
    by = {(r.tenant, r.media): r for r in rows}
    assert list(by) == [("t1", "ddr4"), ("t1", "ddr5"), ("t2", "ddr4"), ("t2", "ddr5")]
    t1_ddr4 = by["t1", "ddr4"]
    assert t1_ddr4.gib_hours == pytest.approx(730)
    assert t1_ddr4.recycled_gib_hours == pytest.approx(730)
    assert t1_ddr4.cost == pytest.approx(2.0) and t1_ddr4.savings == pytest.approx(8.0)
    assert by["t1", "ddr5"].cost == pytest.approx(20.0) and by["t1", "ddr5"].savings == 0.0
    t2_ddr4 = by["t2", "ddr4"]
    assert t2_ddr4.unpriced_gib_hours == pytest.approx(730) and t2_ddr4.cost == 0.0
    assert t2_ddr4.savings == 0.0
    assert by["t2", "ddr5"].savings == 0.0 and by["t2", "ddr5"].cost == pytest.approx(4.0)
    assert (total.tenant, total.media) == ("*", "*")
    assert total.gib_hours == pytest.approx(730 * 5)
    assert total.cost == pytest.approx(26.0) and total.savings == pytest.approx(8.0)
    assert total.unpriced_gib_hours == pytest.approx(730)


def test_no_ddr5_price_means_no_savings_and_nothing_outside_the_period() -> None:
    total, rows = served([span()], T0 + timedelta(days=365), T0 + timedelta(days=366), None)
    assert rows == [] and total.gib_hours == 0.0 and total.savings is None
    total, (row,) = served([span()], T0, T0 + timedelta(hours=73), None)
    assert row.savings is None and row.cost == pytest.approx(2.0 * 73 / HOURS_PER_MONTH)


def report(used: int, exclusive: int, replica: int) -> LeaseReport:
    return LeaseReport(
        lease_id="l", used_bytes=used, exclusive_bytes=exclusive, replica_bytes=replica
    )


def test_report_problem() -> None:
    assert report_problem(report(4 * MIB, 3 * MIB, MIB), 4 * MIB) is None
    assert report_problem(report(4 * MIB, 0, 0), 4 * MIB) is None
    assert "exceed used" in (report_problem(report(MIB, MIB, 1), 4 * MIB) or "")
    assert "exceed the lease" in (report_problem(report(5 * MIB, 0, 0), 4 * MIB) or "")
