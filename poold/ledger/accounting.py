"""What is the pooled memory worth, and what did it cost? Exclusive-copy accounting.

Tenants report, per lease, how many of the bytes they use hold the only copy of a
KV block (exclusive) and how many are copies of blocks that live elsewhere too
(replica); see DESIGN.md "Exclusive-copy accounting". This module answers:

* usage now: leased, used, exclusive and replica bytes of the live leases, pool-wide
  and per tenant, host, device or media class, and the exclusive ratio
  (exclusive / leased: the share of the pool holding data nobody else has);
* service over a period: GiB-hours per tenant and media class, clipped to
  [since, until], priced at each device's cost basis, and what recycled DDR4 saved
  against the configured price of new DDR5.

The aggregation functions are pure (plain values in, plain values out); the two
queries at the bottom turn ledger rows into those values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from poold.lease_states import LIVE_STATE_VALUES, LIVE_STATES, MAPPED_STATES, LeaseState
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Host, Lease, Tenant
from poold.ledger.types import utcnow
from poold.wire.admin import AccountingBy, AccountingReport, ServedRow, UsageRow
from poold.wire.agent import LeaseReport

GIB = 1 << 30
# A month of a cost basis is a twelfth of a 365-day year, as cloud price lists count it.
HOURS_PER_MONTH = 365 * 24 / 12
# Only recycled DIMMs of this media class are priced against new DDR5 (issue 6).
SAVINGS_MEDIA = "ddr4"

# The holder still has the memory (and so its KV blocks): reports are accepted and
# counted. A scrubbing lease is live (its bytes are taken) but its holder released it,
# so its last report is history, not usage. So is a lease that ended with its memfd still
# mapped (released_mapped, revoked_mapped): its bytes count as leased (and accrue
# GiB-hours) until no process maps them, but nobody reports on it any more.
MEMORY_HELD: frozenset[str] = frozenset(
    s.value for s in LIVE_STATES - {LeaseState.SCRUBBING} - MAPPED_STATES
)
# Never handed to a tenant: no GiB-hours.
NOT_SERVED: frozenset[str] = frozenset({LeaseState.ABORTED.value})


# --- plain values ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseUsage:
    """One lease as accounting sees it: where it is, how big, and what was last reported."""

    tenant: str
    host: str
    device_uid: str
    media: str
    state: str
    length_bytes: int
    reported: bool = False
    used_bytes: int = 0
    exclusive_bytes: int = 0
    replica_bytes: int = 0
    exclusive_blocks: int = 0
    replica_blocks: int = 0


@dataclass(frozen=True, slots=True)
class LeaseSpan:
    """One lease over time: who, on what media at what price, from grant to end."""

    tenant: str
    media: str
    recycled: bool
    cost_per_gib_month: float | None
    length_bytes: int
    granted_at: datetime
    ended_at: datetime | None  # None: still live


def report_problem(report: LeaseReport, length_bytes: int) -> str | None:
    """Why a report cannot be true of a lease of `length_bytes`, or None when it can."""
    if report.exclusive_bytes + report.replica_bytes > report.used_bytes:
        return (
            f"exclusive ({report.exclusive_bytes}) + replica ({report.replica_bytes}) "
            f"bytes exceed used bytes ({report.used_bytes})"
        )
    if report.used_bytes > length_bytes:
        return f"used bytes ({report.used_bytes}) exceed the lease's {length_bytes} bytes"
    return None


def _ratio(exclusive_bytes: int, leased_bytes: int) -> float:
    return exclusive_bytes / leased_bytes if leased_bytes else 0.0


def usage_row(group: str, leases: Iterable[LeaseUsage]) -> UsageRow:
    """Sum live leases into one row. Only leases whose holder still has the memory
    contribute reported counts; every live lease contributes its leased bytes."""
    count = reported = leased = used = exclusive = replica = ex_blocks = rep_blocks = 0
    for lease in leases:
        if lease.state not in LIVE_STATES:
            continue
        count += 1
        leased += lease.length_bytes
        if lease.state not in MEMORY_HELD or not lease.reported:
            continue
        reported += 1
        used += lease.used_bytes
        exclusive += lease.exclusive_bytes
        replica += lease.replica_bytes
        ex_blocks += lease.exclusive_blocks
        rep_blocks += lease.replica_blocks
    return UsageRow(
        group=group,
        leases=count,
        reported_leases=reported,
        leased_bytes=leased,
        used_bytes=used,
        exclusive_bytes=exclusive,
        replica_bytes=replica,
        exclusive_blocks=ex_blocks,
        replica_blocks=rep_blocks,
        exclusive_ratio=_ratio(exclusive, leased),
    )


GROUP_KEYS: dict[str, Callable[[LeaseUsage], str]] = {
    "tenant": lambda lease: lease.tenant,
    "host": lambda lease: lease.host,
    "device": lambda lease: lease.device_uid,
    "media": lambda lease: lease.media,
}


def usage(leases: Iterable[LeaseUsage], by: AccountingBy) -> tuple[UsageRow, list[UsageRow]]:
    """The pool-wide row and one row per group (sorted by group name) of the live leases."""
    live = [lease for lease in leases if lease.state in LIVE_STATES]
    key = GROUP_KEYS[by]
    groups: dict[str, list[LeaseUsage]] = {}
    for lease in live:
        groups.setdefault(key(lease), []).append(lease)
    return usage_row("pool", live), [usage_row(name, groups[name]) for name in sorted(groups)]


def gib_hours(
    length_bytes: int,
    granted_at: datetime,
    ended_at: datetime | None,
    since: datetime,
    until: datetime,
) -> float:
    """GiB-hours of a lease inside [since, until]; a live lease (no end) runs to `until`."""
    start = max(granted_at, since)
    end = min(ended_at if ended_at is not None else until, until)
    if end <= start:
        return 0.0
    return length_bytes / GIB * (end - start).total_seconds() / 3600


def served(
    spans: Iterable[LeaseSpan],
    since: datetime,
    until: datetime,
    ddr5_cost_per_gib_month: float | None,
) -> tuple[ServedRow, list[ServedRow]]:
    """GiB-hours, cost and DDR4 savings per (tenant, media), and their total.

    Cost counts only GiB-hours on devices with a cost basis (the rest are shown as
    unpriced). Savings are (DDR5 price - device price) over the GiB-hours on recycled
    DDR4 with a cost basis; None when no DDR5 price is configured.
    """
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for span in spans:
        hours = gib_hours(span.length_bytes, span.granted_at, span.ended_at, since, until)
        if hours <= 0:
            continue
        acc = rows.setdefault(
            (span.tenant, span.media),
            {"gib_hours": 0.0, "recycled": 0.0, "cost": 0.0, "unpriced": 0.0, "savings": 0.0},
        )
        acc["gib_hours"] += hours
        if span.recycled:
            acc["recycled"] += hours
        if span.cost_per_gib_month is None:
            acc["unpriced"] += hours
            continue
        acc["cost"] += hours * span.cost_per_gib_month / HOURS_PER_MONTH
        if span.recycled and span.media == SAVINGS_MEDIA and ddr5_cost_per_gib_month is not None:
            acc["savings"] += (
                hours * (ddr5_cost_per_gib_month - span.cost_per_gib_month) / HOURS_PER_MONTH
            )

    def row(tenant: str, media: str, acc: dict[str, float]) -> ServedRow:
        return ServedRow(
            tenant=tenant,
            media=media,
            gib_hours=acc["gib_hours"],
            recycled_gib_hours=acc["recycled"],
            cost=acc["cost"],
            unpriced_gib_hours=acc["unpriced"],
            savings=acc["savings"] if ddr5_cost_per_gib_month is not None else None,
        )

    out = [row(tenant, media, rows[tenant, media]) for tenant, media in sorted(rows)]
    total = {
        name: sum(acc[name] for acc in rows.values())
        for name in ("gib_hours", "recycled", "cost", "unpriced", "savings")
    }
    return row("*", "*", total), out


# --- queries --------------------------------------------------------------------------


def live_usage(session: Session) -> list[LeaseUsage]:
    """Every live lease with its last report."""
    stmt = (
        select(
            Tenant.name,
            Host.name,
            Device.uid,
            Device.media,
            Lease.state,
            Lease.length_bytes,
            Lease.reported_at,
            Lease.used_bytes,
            Lease.exclusive_bytes,
            Lease.replica_bytes,
            Lease.exclusive_blocks,
            Lease.replica_blocks,
        )
        .join(Tenant, Tenant.id == Lease.tenant_id)
        .join(Host, Host.id == Lease.host_id)
        .join(Device, Device.id == Lease.device_id)
        .where(Lease.state.in_(LIVE_STATE_VALUES))
    )
    return [
        LeaseUsage(
            tenant=tenant,
            host=host,
            device_uid=uid,
            media=media,
            state=state,
            length_bytes=length,
            reported=reported_at is not None,
            used_bytes=used,
            exclusive_bytes=exclusive,
            replica_bytes=replica,
            exclusive_blocks=ex_blocks,
            replica_blocks=rep_blocks,
        )
        for (
            tenant,
            host,
            uid,
            media,
            state,
            length,
            reported_at,
            used,
            exclusive,
            replica,
            ex_blocks,
            rep_blocks,
        ) in session.execute(stmt)
    ]


def spans(session: Session, since: datetime, until: datetime) -> list[LeaseSpan]:
    """Leases that held memory at some point of [since, until] (aborted ones never did).

    Media, recycled and cost are the device's now (an administrator's annotation wins,
    devices.apply_effective): the ledger keeps no history of a device's price.
    """
    stmt = (
        select(
            Tenant.name,
            Device.media,
            Device.recycled,
            Device.cost_per_gib_month,
            Lease.length_bytes,
            Lease.granted_at,
            Lease.ended_at,
        )
        .join(Tenant, Tenant.id == Lease.tenant_id)
        .join(Device, Device.id == Lease.device_id)
        .where(
            Lease.state.not_in(sorted(NOT_SERVED)),
            Lease.granted_at < until,
            or_(Lease.ended_at.is_(None), Lease.ended_at > since),
        )
    )
    return [
        LeaseSpan(
            tenant=tenant,
            media=media,
            recycled=bool(recycled),
            cost_per_gib_month=cost,
            length_bytes=length,
            granted_at=granted_at,
            ended_at=ended_at,
        )
        for tenant, media, recycled, cost, length, granted_at, ended_at in session.execute(stmt)
    ]


def report(
    ledger: Ledger,
    by: AccountingBy,
    since: datetime,
    until: datetime,
    ddr5_cost_per_gib_month: float | None,
) -> AccountingReport:
    """Usage now (grouped `by`) and service over [since, until], in one read transaction."""
    with ledger.read() as session:
        now_usage = live_usage(session)
        period = spans(session, since, until)
    pool, groups = usage(now_usage, by)
    total, rows = served(period, since, until, ddr5_cost_per_gib_month)
    return AccountingReport(
        by=by,
        generated_at=utcnow(),
        pool=pool,
        groups=groups,
        since=since,
        until=until,
        ddr5_cost_per_gib_month=ddr5_cost_per_gib_month,
        served=rows,
        served_total=total,
    )
