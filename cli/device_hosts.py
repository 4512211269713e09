"""`poolctl devices allow-host` / `disallow-host`: which hosts may report a device.

poold binds a device to the host that first reports it and refuses every other
host's report of it (`device_not_bound`, poold/ledger/device_hosts.py). A shared
(multi-headed or switched CXL) device gains its other heads here; disallowing a host
takes the device out of that host's placement at once (its live leases stay until
they end: drain or revoke them to hurry). A host-scoped device has one host only.
"""

from __future__ import annotations

import click

from cli.common import HOST_NAME, Ctx, emit_json, json_option, pass_ctx, run, wants_json
from poold.wire.admin import DeviceHosts, PoolStatus


def _uid(c: Ctx, device: str) -> str:
    """A device's uid from its uid or numeric id (`poolctl devices` shows both)."""
    if device.isdigit():
        status: PoolStatus = run(lambda: c.client.status())
        for d in status.devices:
            if str(d.id) == device:
                return d.uid
    return device  # poold answers unknown_device for a uid it does not have


def _emit(out: DeviceHosts, as_json: bool) -> None:
    if wants_json(as_json):
        emit_json(out)
        return
    click.echo(f"{out.uid} ({out.scope}): may be reported by {', '.join(out.hosts) or 'no host'}")


@click.command("allow-host")
@click.argument("device")
@click.argument("host", type=HOST_NAME)
@json_option
@pass_ctx
def allow_host(c: Ctx, device: str, host: str, as_json: bool) -> None:
    """Let HOST report (and place on) DEVICE, a shared CXL device another host reaches."""
    uid = _uid(c, device)
    _emit(run(lambda: c.client.allow_device_host(uid, host)), as_json)


@click.command("disallow-host")
@click.argument("device")
@click.argument("host", type=HOST_NAME)
@json_option
@pass_ctx
def disallow_host(c: Ctx, device: str, host: str, as_json: bool) -> None:
    """Refuse HOST's reports of DEVICE from now on; no new lease of HOST goes there."""
    uid = _uid(c, device)
    _emit(run(lambda: c.client.disallow_device_host(uid, host)), as_json)


COMMANDS = (allow_host, disallow_host)
