"""`poolctl hosts`: which hosts run a pool agent, and whether poold places leases on them.

add (issuing the agent's credential), list, delete, and drain/undrain: a draining host
takes no new leases, and its live leases are revoked at a deadline if one is given.
Draining twice, or undraining a host that is not draining, succeeds and says nothing
changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from cli.common import (
    HOST_NAME,
    Ctx,
    emit_drained,
    emit_json,
    exclusive,
    json_option,
    pass_ctx,
    run,
    table,
    wants_json,
)


@click.group("hosts")
def hosts() -> None:
    """Hosts running a pool agent."""


@hosts.command("add")
@click.argument("name", type=HOST_NAME)
@click.option(
    "--credential-file",
    type=click.Path(path_type=Path),
    default=None,
    help="write the agent credential here (mode 0600) instead of printing it",
)
@json_option
@pass_ctx
def hosts_add(c: Ctx, name: str, credential_file: Path | None, as_json: bool) -> None:
    """Add a host and issue its agent credential (shown once)."""
    out = run(lambda: c.client.add_host(name))
    if credential_file is not None:
        fd = os.open(credential_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(out.credential + "\n")
    if wants_json(as_json):
        emit_json(out)
    elif credential_file is not None:
        click.echo(f"host {name} added; credential written to {credential_file}")
    else:
        click.echo(f"host {name} added; agent credential (shown once):\n{out.credential}")


@hosts.command("list")
@json_option
@pass_ctx
def hosts_list(c: Ctx, as_json: bool) -> None:
    """List hosts and when their agents last reported."""
    items = run(lambda: c.client.list_hosts())
    if wants_json(as_json):
        emit_json(items)
    else:
        table(
            "hosts",
            ["host", "status", "last heartbeat", "added"],
            [
                (
                    h.name,
                    h.status,
                    h.last_heartbeat_at.isoformat(timespec="seconds")
                    if h.last_heartbeat_at
                    else None,
                    h.created_at.isoformat(timespec="seconds"),
                )
                for h in items
            ],
        )


@hosts.command("delete")
@click.argument("name", type=HOST_NAME)
@click.option(
    "--force",
    is_flag=True,
    help="end the host's live leases at once first (no agent will confirm: the host is going away)",
)
@json_option
@pass_ctx
def hosts_delete(c: Ctx, name: str, force: bool, as_json: bool) -> None:
    """Delete a host: its agent credential stops working at once.

    Refused (host_busy) while the host holds live leases, unless --force: then each is
    ended now, one event per move (granted: aborted; active, expired: revoked and
    reclaimed; orphaned, revoking: reclaimed), and a devdax range no agent zeroed is
    quarantined. Devices no other host reaches leave placement: removed if no lease ever
    used them, else kept as `missing` for their history (online again if an agent
    reports them). The host's name is free for `hosts add` again.
    """
    out = run(lambda: c.client.delete_host(name, force=force))
    if wants_json(as_json):
        emit_json(out)
        return
    line = f"host {name} deleted"
    if out.ended_leases:
        line += f"; {len(out.ended_leases)} live lease(s) ended"
    if out.quarantined_leases:
        line += f" ({len(out.quarantined_leases)} devdax range(s) quarantined, never zeroed)"
    if out.devices_missing:
        line += f"; devices out of placement (missing): {', '.join(out.devices_missing)}"
    if out.devices_removed:
        line += f"; devices removed: {', '.join(out.devices_removed)}"
    click.echo(line)


@hosts.command("drain")
@click.argument("host", type=HOST_NAME)
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=0),
    default=None,
    help="revoke the host's live leases after this long (default: they run to their end)",
)
@click.option("--now", "now_", is_flag=True, help="revoke the host's live leases at once")
@json_option
@click.pass_context
def hosts_drain(
    ctx: click.Context, host: str, deadline_s: float | None, now_: bool, as_json: bool
) -> None:
    """Place no new leases on a host; revoke its leases at the deadline (or --now).

    Without --deadline-s or --now its leases run to their end. Draining again never
    postpones: the earliest deadline set stands (a shorter one brings it forward).
    `hosts undrain` cancels a deadline not yet reached.
    """
    exclusive(ctx, "deadline_s", "now_")
    c = ctx.find_object(Ctx)
    assert c is not None  # poolctl's main group always sets it
    emit_drained(run(lambda: c.client.drain_host(host, deadline_s=deadline_s, now=now_)), as_json)


@hosts.command("undrain")
@click.argument("host", type=HOST_NAME)
@json_option
@pass_ctx
def hosts_undrain(c: Ctx, host: str, as_json: bool) -> None:
    """Let a draining host take new leases again (a host not draining is left as it is)."""
    emit_drained(run(lambda: c.client.undrain_host(host)), as_json)
