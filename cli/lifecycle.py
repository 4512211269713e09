"""`poolctl leases revoke`, `poolctl devices drain|undrain`, `poolctl hosts drain|undrain`.

The commands that take memory back from tenants. poolctl attaches each to its
group (`leases`, `hosts`, and the `devices` group of cli/devices.py) with one
line; this module only formats.
"""

from __future__ import annotations

import click

from cli.devices import resolve
from cli.poolctl import Ctx, emit_json, json_option, pass_ctx, run
from poold.wire.admin import DrainResult


def _drained(out: DrainResult, as_json: bool) -> None:
    if as_json:
        emit_json(out)
        return
    line = f"{out.target}: {out.state}"
    if out.deadline_at is not None:
        line += f"; live leases revoked at {out.deadline_at.isoformat(timespec='seconds')}"
    if out.live_leases:
        line += f"; {out.live_leases} live lease(s)"
    if out.revoked:
        line += f"; revoked now: {len(out.revoked)}"
    click.echo(line)


@click.command("revoke")
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
    if as_json:
        emit_json(x)
    else:
        click.echo(
            f"lease {lease_id}: {x.state}; reclaimed by "
            f"{x.expires_at.isoformat(timespec='seconds')} at the latest"
        )


@click.command("drain")
@click.argument("device")
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="live leases are revoked after this long",
)
@click.option("--now", "now_", is_flag=True, help="revoke the live leases at once")
@json_option
@pass_ctx
def devices_drain(c: Ctx, device: str, deadline_s: float, now_: bool, as_json: bool) -> None:
    """Stop placing leases on a device; revoke its leases at the deadline (or --now)."""
    target = resolve(run(lambda: c.client.status()).devices, device)
    _drained(
        run(lambda: c.client.drain_device(target.uid, deadline_s=deadline_s, now=now_)), as_json
    )


@click.command("undrain")
@click.argument("device")
@json_option
@pass_ctx
def devices_undrain(c: Ctx, device: str, as_json: bool) -> None:
    """Put a draining device back online."""
    target = resolve(run(lambda: c.client.status()).devices, device)
    _drained(run(lambda: c.client.undrain_device(target.uid)), as_json)


@click.command("drain")
@click.argument("host")
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=0),
    default=None,
    help="revoke the host's live leases after this long (default: they run to their end)",
)
@click.option("--now", "now_", is_flag=True, help="revoke the host's live leases at once")
@json_option
@pass_ctx
def hosts_drain(c: Ctx, host: str, deadline_s: float | None, now_: bool, as_json: bool) -> None:
    """Place no new leases on a host; revoke its leases at the deadline (or --now).

    Without --deadline-s or --now its leases run to their end. `hosts undrain`
    cancels a deadline not yet reached.
    """
    _drained(run(lambda: c.client.drain_host(host, deadline_s=deadline_s, now=now_)), as_json)


@click.command("undrain")
@click.argument("host")
@json_option
@pass_ctx
def hosts_undrain(c: Ctx, host: str, as_json: bool) -> None:
    """Let a draining host take new leases again."""
    _drained(run(lambda: c.client.undrain_host(host)), as_json)


# Declared types for poolctl, which imports this module at its end: in that import
# cycle mypy cannot infer the type of a decorated name (see cli/devices.py).
revoke_command: click.Command = leases_revoke
device_drain_command: click.Command = devices_drain
device_undrain_command: click.Command = devices_undrain
host_drain_command: click.Command = hosts_drain
host_undrain_command: click.Command = hosts_undrain
