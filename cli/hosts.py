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
from click.core import ParameterSource

from cli import host_removal
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
    usage_error,
    wants_json,
)
from poold.wire.admin import HostDeleted


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
    help="revoke the host's live leases first, wait for its agent to tear them down, then delete",
)
@click.option(
    "--wait-s",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="with --force: how long to wait for the agent to tear the leases down",
)
@click.option(
    "--silent-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="with --force: an agent with no heartbeat for this long is taken as gone",
)
@json_option
@click.pass_context
def hosts_delete(
    ctx: click.Context, name: str, force: bool, wait_s: float, silent_s: float, as_json: bool
) -> None:
    """Delete a host: its agent credential stops working at once.

    Refused (host_busy) while the host holds live leases, unless --force: then the host
    is drained and each live lease revoked due now (reason "host deleted"; orphaned:
    reclaimed; granted: aborted), so its agent hears it, tears the memory down and tells
    its tenants; poolctl waits (at most --wait-s, progress on stderr) until no lease is
    live or the agent stops answering (down, or silent for --silent-s), and only then
    deletes the host, ending what its absent agent left (a devdax range nobody zeroed is
    quarantined). A host whose agent still answers but still holds leases when the wait
    ends is not deleted (host_busy). Each lease's outcome is shown (--json: `leases`).
    Devices no other host reaches leave placement: removed if no lease ever used them,
    else kept as `missing` for their history (online again if an agent reports them).
    The host's name is free for `hosts add` again.
    """
    for option in ("wait_s", "silent_s"):
        if not force and ctx.get_parameter_source(option) is ParameterSource.COMMANDLINE:
            usage_error(f"--{option.replace('_', '-')} goes with --force")
    c = ctx.find_object(Ctx)
    assert c is not None  # poolctl's main group always sets it
    if not force:
        _emit_deleted(name, run(lambda: c.client.delete_host(name)), [], as_json)
        return

    def say(line: str) -> None:
        click.echo(f"poolctl: {line}", err=True)

    forced = run(
        lambda: host_removal.delete_forced(
            c.client, name, wait_s=wait_s, silent_s=silent_s, progress=say
        )
    )
    _emit_deleted(name, forced.deleted, forced.leases, as_json, waited_s=forced.waited_s)


def _emit_deleted(
    name: str,
    out: HostDeleted,
    leases: list[host_removal.LeaseOutcome],
    as_json: bool,
    *,
    waited_s: float = 0.0,
) -> None:
    if wants_json(as_json):
        emit_json(
            {
                **out.model_dump(mode="json"),
                "leases": [x.as_dict() for x in leases],
                "waited_s": waited_s,
            }
        )
        return
    for x in leases:
        how = (
            "ended by the deletion (its agent was gone)"
            if x.outcome == "ended_with_host"
            else "ended before the host went"
        )
        click.echo(f"lease {x.lease_id}: {x.was} -> {x.state}, {how}")
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
