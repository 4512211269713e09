"""`poolctl tenants`: who may lease far memory, how much, and as which unix users.

add, list, show, set-quota and delete, over poold's ``/v1/tenants``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from cli.common import SIZE, Ctx, emit_json, json_option, pass_ctx, run, table
from cli.units import format_size
from poold.wire.admin import TenantSpec, TenantUpdate


@click.group("tenants")
def tenants() -> None:
    """Tenants, their quotas and who may act for them."""


def _tenant_rows(items: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            t.name,
            format_size(t.quota_bytes),
            t.quota_leases,
            format_size(t.leased_bytes),
            t.live_leases,
            ",".join(map(str, t.allowed_uids)) or "-",
            ",".join(map(str, t.allowed_gids)) or "-",
            ",".join(t.allowed_media) or "any",
        )
        for t in items
    ]


TENANT_COLUMNS = ["tenant", "quota", "max leases", "leased", "leases", "uids", "gids", "media"]


@tenants.command("add")
@click.argument("name")
@click.option("--quota", "quota_bytes", type=SIZE, required=True, help="e.g. 64GiB")
@click.option("--max-leases", "quota_leases", type=int, default=1024, show_default=True)
@click.option("--uid", "uids", type=int, multiple=True, help="unix uid allowed (repeatable)")
@click.option("--gid", "gids", type=int, multiple=True, help="unix gid allowed (repeatable)")
@click.option("--media", multiple=True, help="allowed media class (repeatable; default any)")
@click.option("--host", "hosts", multiple=True, help="restrict to these hosts (repeatable)")
@json_option
@pass_ctx
def tenants_add(
    c: Ctx,
    name: str,
    quota_bytes: int,
    quota_leases: int,
    uids: tuple[int, ...],
    gids: tuple[int, ...],
    media: tuple[str, ...],
    hosts: tuple[str, ...],
    as_json: bool,
) -> None:
    """Create a tenant."""
    try:
        spec = TenantSpec(
            name=name,
            quota_bytes=quota_bytes,
            quota_leases=quota_leases,
            allowed_uids=list(uids),
            allowed_gids=list(gids),
            allowed_media=list(media),
            allowed_hosts=list(hosts),
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    out = run(lambda: c.client.create_tenant(spec))
    if as_json:
        emit_json(out)
    else:
        click.echo(
            f"tenant {out.name} created: quota {format_size(out.quota_bytes)}, "
            f"{out.quota_leases} leases"
        )


@tenants.command("list")
@json_option
@pass_ctx
def tenants_list(c: Ctx, as_json: bool) -> None:
    """List tenants with their quotas and use."""
    items = run(lambda: c.client.list_tenants())
    if as_json:
        emit_json(items)
    else:
        table("tenants", TENANT_COLUMNS, _tenant_rows(items))


@tenants.command("show")
@click.argument("name")
@json_option
@pass_ctx
def tenants_show(c: Ctx, name: str, as_json: bool) -> None:
    """Show one tenant."""
    t = run(lambda: c.client.get_tenant(name))
    if as_json:
        emit_json(t)
    else:
        table(f"tenant {name}", TENANT_COLUMNS, _tenant_rows([t]))


@tenants.command("set-quota")
@click.argument("name")
@click.option("--bytes", "quota_bytes", type=SIZE, default=None, help="e.g. 128GiB")
@click.option("--leases", "quota_leases", type=int, default=None)
@json_option
@pass_ctx
def tenants_set_quota(
    c: Ctx, name: str, quota_bytes: int | None, quota_leases: int | None, as_json: bool
) -> None:
    """Change a tenant's quota in bytes and/or number of leases."""
    if quota_bytes is None and quota_leases is None:
        raise click.UsageError("give --bytes and/or --leases")
    out = run(
        lambda: c.client.update_tenant(
            name, TenantUpdate(quota_bytes=quota_bytes, quota_leases=quota_leases)
        )
    )
    if as_json:
        emit_json(out)
    else:
        click.echo(
            f"tenant {name}: quota {format_size(out.quota_bytes)}, {out.quota_leases} leases"
        )


@tenants.command("delete")
@click.argument("name")
@pass_ctx
def tenants_delete(c: Ctx, name: str) -> None:
    """Delete a tenant that holds no live lease."""
    run(lambda: c.client.delete_tenant(name))
    click.echo(f"tenant {name} deleted")
