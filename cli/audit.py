"""`poolctl audit [--reclaim] [--json]`: the reclamation audit, for people and for cron.

poold runs the audit (`POST /v1/audit`, poold/ledger/audit.py) and records an
`audit_runs` row; this command prints the report as tables or JSON and exits
with the report's code: 0 clean, 1 reclaimed (or reclaimable), 2 needs a human.
Any failure (poold down, no token, a refused token) is 2 as well, and with --json it
is also a JSON object on stdout, `{"code", "message", "exit_code"}`, so that a cron
line `poolctl audit --json > file` always leaves a file a script can read. A progress
bar shows on a terminal only; piped output carries nothing extra.
"""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from cli.common import Ctx, emit_json, fail, json_option, output_format, pass_ctx, table
from poold.errors import PoolError
from poold.wire.admin import AuditItem, AuditReport

NEEDS_HUMAN = 2


def _device(it: AuditItem) -> str | None:
    """The device uid, the agent's sub-device name, or both."""
    if it.sub_device is None:
        return it.device_uid
    return f"{it.device_uid} ({it.sub_device})" if it.device_uid else it.sub_device


ITEM_COLUMNS = ("kind", "lease", "device", "tenant", "host", "state", "detail", "action")


def _items_table(title: str, items: list[AuditItem], console: Console) -> None:
    table(
        f"{title} ({len(items)})",
        ITEM_COLUMNS,
        [
            (it.kind, it.lease_id, _device(it), it.tenant, it.host, it.state, it.message, it.action)
            for it in items
        ],
        right=(),
        console=console,
    )


def print_report(report: AuditReport, console: Console) -> None:
    for title, items in (
        ("invariant violations: need a human", report.violations),
        ("reclaimable", report.reclaimable),
        ("pending (within grace, or the reaper's call)", report.pending),
    ):
        if items:
            _items_table(title, items, console)
    if not report.agents.available:
        _say(console, f"agent reports: not available ({report.agents.note})")
    for title, items in (
        ("stale: live leases whose agent holds no memory", report.agents.stale),
        (
            "leaked: memory agents hold (or sub-devices they left) for ended leases",
            report.agents.leaked,
        ),
        (
            "unfinished scrubs: scrubbing in the ledger, no scrub running on the agent",
            report.agents.unfinished_scrubs,
        ),
        ("holders the ledger and the agent disagree on", report.agents.holder_mismatches),
    ):
        if items:
            _items_table(title, items, console)
    verdict = {0: "clean", 1: "reclaimed" if report.reclaim else "reclaimable items found"}.get(
        report.exit_code, "needs a human"
    )
    _say(
        console,
        f"audit #{report.run_id}: {report.leases} leases ({report.live_leases} live) on "
        f"{report.devices} devices in {report.audit_s:.2f}s; {len(report.violations)} "
        f"violation(s), {len(report.reclaimable)} reclaimable, {report.reclaimed} "
        f"reclaimed: {verdict}",
    )


def _say(console: Console, line: str) -> None:
    """One line: through rich for a table, plain (never wrapped) otherwise."""
    if output_format() == "table":
        console.print(Text(line))
    else:
        click.echo(line)


def _failed(c: Ctx, err: PoolError, as_json: bool) -> NoReturn:
    """Exit 2 (needs a human); with --json, the error as JSON on stdout as well."""
    err = c.explain(err)
    if as_json:
        body = {"code": err.code, "message": err.message, "exit_code": NEEDS_HUMAN}
        click.echo(json.dumps(body, indent=2, sort_keys=True))
    fail(err, NEEDS_HUMAN)


@click.command("audit")
@click.option("--reclaim", is_flag=True, help="reclaim what is safe to reclaim")
@json_option
@pass_ctx
def audit(c: Ctx, reclaim: bool, as_json: bool) -> None:
    """Check the ledger's invariants and list (or --reclaim) what leases left behind.

    It also compares the ledger with what agents report: stale and leaked leases,
    leftover sub-devices (--reclaim has the agent delete them), unfinished scrubs
    (--reclaim re-issues the order) and holders the two disagree on.

    Exit codes: 0 clean, 1 reclaimed something (without --reclaim: something is
    reclaimable, or an agent disagrees with the ledger), 2 needs a human (an
    invariant is violated, a scrub is stuck on a host whose agent is down, or
    poold failed).
    """
    console = Console()
    as_json = output_format(as_json) == "json"
    try:
        if console.is_terminal and output_format(as_json) == "table":
            with Progress(
                SpinnerColumn(),
                TextColumn("auditing the ledger" + (" and reclaiming" if reclaim else "")),
                BarColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                progress.add_task("audit", total=None)
                report = c.client.audit(reclaim=reclaim)
        else:
            report = c.client.audit(reclaim=reclaim)
    except PoolError as err:
        _failed(c, err, as_json)
    except Exception as exc:  # anything else still leaves the cron line a readable answer
        _failed(c, PoolError(f"{type(exc).__name__}: {exc}"), as_json)
    if as_json:
        emit_json(report)
    else:
        print_report(report, console)
    sys.exit(report.exit_code)
