"""`poolctl leases`: which leases of far memory exist, and how an administrator ends one.

list, show, release (ends it in the ledger now), revoke (the host's agent tears it
down, or it is reclaimed at the deadline) and end (at once, whatever its live state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.common import (
    HOST_NAME,
    MAX_LEASES_PER_CALL,
    TENANT_NAME,
    Ctx,
    current_ctx,
    emit_json,
    fail,
    json_option,
    key_values,
    output_format,
    pass_ctx,
    run,
    table,
    usage_error,
    wants_json,
)
from cli.units import format_size
from poold.errors import PoolError, UnknownHost
from poold.lease_states import LIVE_STATES, LeaseState
from poold.wire.admin import LeaseEnded

LEASE_STATES = [s.value for s in LeaseState]


@click.group("leases")
def leases() -> None:
    """Leases of far memory."""


LEASE_COLUMNS = [
    "lease",
    "tenant",
    "host",
    "device",
    "offset",
    "length",
    "state",
    "epoch",
    "expires",
    # "central" (granted by poold) or "<host>:<reservation id's first 8>" (by its agent)
    "granted",
]


def granted_where(x: Any) -> str:
    """Where a lease was granted, as `poolctl leases list` shows it."""
    rid = getattr(x, "reservation_id", None)
    return "central" if rid is None else f"{x.host}:{rid[:8]}"


def _lease_rows(items: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            x.id,
            x.tenant,
            x.host,
            x.device_uid,
            x.offset_bytes,
            format_size(x.length_bytes),
            x.state,
            x.epoch,
            x.expires_at.isoformat(timespec="seconds"),
            granted_where(x),
        )
        for x in items
    ]


@leases.command("list")
@click.option("--tenant", type=TENANT_NAME, default=None)
@click.option("--host", type=HOST_NAME, default=None)
@click.option(
    "--state",
    "states",
    type=click.Choice(LEASE_STATES),
    multiple=True,
    help="filter by state (repeatable)",
)
@click.option("--live", is_flag=True, help="only leases that still hold bytes")
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=MAX_LEASES_PER_CALL),
    default=1000,
    show_default=True,
)
@json_option
@pass_ctx
def leases_list(
    c: Ctx,
    tenant: str | None,
    host: str | None,
    states: tuple[str, ...],
    live: bool,
    limit: int,
    as_json: bool,
) -> None:
    """List leases, newest first."""
    ended = [st for st in states if LeaseState(st) not in LIVE_STATES]
    if live and ended:
        # poold would answer with an empty list: say why instead.
        usage_error(
            f"--live lists leases that still hold bytes, and a lease {ended[0]!r} holds "
            "none: drop --live or that --state"
        )
    items = run(
        lambda: c.client.list_leases(
            tenant=tenant, host=host, states=list(states), live=live, limit=limit
        )
    )
    if not items:
        _check_filters_name_something(c, tenant, host)
    if wants_json(as_json):
        emit_json(items)
    else:
        table("leases", LEASE_COLUMNS, _lease_rows(items), right={"offset", "length", "epoch"})


def _check_filters_name_something(c: Ctx, tenant: str | None, host: str | None) -> None:
    """No lease matched: say so when a filter names no tenant or host at all (a typo),
    rather than print an empty list. Asked only then, so a tenant or host since deleted
    still lists the leases it had."""
    if tenant is not None:
        run(lambda: c.client.get_tenant(tenant))  # unknown_tenant
    if host is not None and host not in {h.name for h in run(c.client.list_hosts)}:
        fail(UnknownHost(f"no host named {host!r}", host=host))


@leases.command("show")
@click.argument("lease_id")
@json_option
@pass_ctx
def leases_show(c: Ctx, lease_id: str, as_json: bool) -> None:
    """Show one lease."""
    x = run(lambda: c.client.show_lease(lease_id))
    if wants_json(as_json):
        emit_json(x)
        return
    fields = list(x.model_dump().items())
    if output_format() == "plain":
        key_values(f"lease {lease_id}", fields)
        return
    t = Table(title=f"lease {lease_id}", show_header=False)
    for key, value in fields:
        t.add_row(Text(key), Text(str(value)))
    Console().print(t)


@leases.command("release")
@click.argument("lease_id")
@click.option("--reason", default="released by administrator", show_default=True)
@json_option
@pass_ctx
def leases_release(c: Ctx, lease_id: str, reason: str, as_json: bool) -> None:
    """Release a lease in the ledger."""
    x = run(lambda: c.client.release(lease_id, reason))
    if wants_json(as_json):
        emit_json(x)
    else:
        click.echo(f"lease {lease_id}: {x.state}")


@leases.command("revoke")
@click.argument("lease_id")
@click.option("--reason", required=True, help="why (journalled, shown to the tenant's agent)")
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=0),
    default=None,
    help="how long the agent has to give the memory back (default: poold's revoke_deadline_s)",
)
@json_option
@pass_ctx
def leases_revoke(
    c: Ctx, lease_id: str, reason: str, deadline_s: float | None, as_json: bool
) -> None:
    """Revoke a lease: its agent tears it down, or it is reclaimed at the deadline."""
    x = run(lambda: c.client.revoke(lease_id, reason, deadline_s))
    if wants_json(as_json):
        emit_json(x)
    else:
        click.echo(
            f"lease {lease_id}: {x.state}; reclaimed by "
            f"{x.expires_at.isoformat(timespec='seconds')} at the latest"
        )


def _ended_line(lease_id: str, x: LeaseEnded) -> str:
    if not x.changed:
        if x.action == "revoked":
            return f"lease {lease_id}: revoking, due now already; nothing changed"
        return f"lease {lease_id}: already {x.lease.state}; nothing changed"
    if x.action == "revoked":
        return (
            f"lease {lease_id}: revoking, due now; its agent tears it down at its next "
            "heartbeat and the range is reclaimed when it confirms"
        )
    if x.lease.state == "revoked_mapped":
        return (
            f"lease {lease_id}: {x.action} (revoked_mapped): its agent last reported it "
            "mapped, so its bytes stay counted until the agent reports it unmapped"
        )
    return f"lease {lease_id}: {x.action} ({x.lease.state})"


@leases.command("end")
@click.argument("lease_ids", metavar="LEASE_ID...", nargs=-1, required=True)
@click.option("--reason", default="ended by administrator", show_default=True)
@json_option
@pass_ctx
def leases_end(c: Ctx, lease_ids: tuple[str, ...], reason: str, as_json: bool) -> None:
    """End leases at once, whatever their live state; each on its own.

    An orphaned lease (no holder left) is reclaimed now (a devdax range is zeroed
    first) and stops counting against its tenant's quota. An active or expired lease,
    whose holder may still map it, is revoked with a deadline of now (a revoking one has
    its deadline pulled in): the bytes are not handed out again while its agent may
    still have them mapped; the agent learns it at its next heartbeat, tears the memory
    down and confirms, and the range is reclaimed (the reaper reclaims it should the
    agent not answer). A granted lease is aborted. A scrubbing lease is refused: its
    range is being zeroed. A lease that already ended is left as it is (exit 0).

    Exit 1 when any lease could not be ended (each failure is one error line).
    """
    results: list[dict[str, object]] = []
    failed = False
    for lease_id in lease_ids:
        try:
            x = c.client.end_lease(lease_id, reason)
        except PoolError as err:
            failed = True
            ctx = current_ctx()
            err = ctx.explain(err) if ctx is not None else err
            results.append({"lease_id": lease_id, "error": err.to_dict()})
            message = " ".join(err.message.split())
            click.echo(f"poolctl: error[{err.code}]: lease {lease_id}: {message}", err=True)
            continue
        results.append({"lease_id": lease_id, **x.model_dump(mode="json")})
        if not wants_json(as_json):
            click.echo(_ended_line(lease_id, x))
    if wants_json(as_json):
        emit_json(results)
    if failed:
        raise SystemExit(1)
