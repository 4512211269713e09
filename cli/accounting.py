"""`poolctl accounting`: what the pool holds exclusively, and what it served and cost.

Two tables from ``GET /v1/accounting``: usage of the live leases now (leased, used,
exclusive and replica bytes, exclusive ratio), pool-wide and per tenant, host, device
or media class; and GiB-hours per tenant and media class over ``--since``/``--until``,
priced at each device's cost basis, with what recycled DDR4 saved against new DDR5.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any, get_args

import click

from cli.common import Ctx, emit_json, json_option, pass_ctx, run, table, wants_json
from cli.units import format_size
from poold.wire.admin import AccountingBy, AccountingReport, ServedRow, UsageRow

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*(?:ago)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, now: datetime) -> datetime:
    """'now', '7d' / '12h ago' (before `now`), or ISO 8601 (no zone: UTC)."""
    if text.strip().lower() == "now":
        return now
    match = _AGO.match(text.lower())
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise ValueError(
            f"not a time: {text!r} (try 2026-12-01, 2026-12-01T08:00Z, 7d or 12h ago)"
        ) from exc
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at


class Time(click.ParamType):  # type: ignore[type-arg]
    name = "time"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            return parse_time(str(value), datetime.now(UTC))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _ratio(value: float) -> str:
    return f"{value:.1%}"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _hours(value: float) -> str:
    return f"{value:,.3f}"


def _print(title: str, columns: list[str], rows: list[list[str]], left: int) -> None:
    """A table whose first `left` columns are names; the rest are numbers."""
    table(title, columns, rows, right=columns[left:])


def usage_cells(row: UsageRow) -> list[str]:
    return [
        row.group,
        str(row.leases),
        str(row.reported_leases),
        format_size(row.leased_bytes),
        format_size(row.used_bytes),
        format_size(row.exclusive_bytes),
        format_size(row.replica_bytes),
        _ratio(row.exclusive_ratio),
    ]


def served_cells(row: ServedRow) -> list[str]:
    return [
        row.tenant,
        row.media,
        _hours(row.gib_hours),
        _hours(row.recycled_gib_hours),
        _hours(row.unpriced_gib_hours),
        _money(row.cost),
        _money(row.savings),
    ]


def print_report(report: AccountingReport) -> None:
    _print(
        f"usage by {report.by} (live leases)",
        [report.by, "leases", "reported", "leased", "used", "exclusive", "replica", "excl/leased"],
        [usage_cells(g) for g in report.groups] + [usage_cells(report.pool)],
        left=1,
    )
    total = report.served_total.model_copy(update={"tenant": "total", "media": ""})
    _print(
        f"served {report.since:%Y-%m-%d %H:%M} .. {report.until:%Y-%m-%d %H:%M} UTC",
        ["tenant", "media", "GiB-h", "recycled GiB-h", "unpriced GiB-h", "cost", "DDR4 saved"],
        [served_cells(r) for r in report.served] + [served_cells(total)],
        left=2,
    )
    pool = report.pool
    click.echo(
        f"pool: {format_size(pool.leased_bytes)} leased, {format_size(pool.used_bytes)} used, "
        f"{format_size(pool.exclusive_bytes)} exclusive, {format_size(pool.replica_bytes)} "
        f"replica; exclusive ratio {_ratio(pool.exclusive_ratio)}"
    )
    if report.ddr5_cost_per_gib_month is None:
        click.echo("DDR4 savings: no DDR5 price configured (POOLD_DDR5_COST_PER_GIB_MONTH)")
    else:
        click.echo(
            f"recycled DDR4 saved {_money(report.served_total.savings)} against new DDR5 at "
            f"{_money(report.ddr5_cost_per_gib_month)} per GiB-month"
        )


@click.command("accounting")
@click.option(
    "--by",
    type=click.Choice(get_args(AccountingBy)),
    default="tenant",
    show_default=True,
    help="group usage by",
)
@click.option("--since", type=Time(), default=None, help="period start (default: 30 days ago)")
@click.option("--until", type=Time(), default=None, help="period end (default: now)")
@json_option
@pass_ctx
def accounting(
    c: Ctx, by: AccountingBy, since: datetime | None, until: datetime | None, as_json: bool
) -> None:
    """Leased, used, exclusive and replica bytes; GiB-hours, cost and DDR4 savings."""
    report = run(lambda: c.client.accounting(by, since=since, until=until))
    if wants_json(as_json):
        emit_json(report)
        return
    print_report(report)
