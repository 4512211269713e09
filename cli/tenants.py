"""`poolctl tenants`: who may lease far memory, how much, and as which unix users.

add, list, show, set-quota and delete, over poold's ``/v1/tenants``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
from pydantic import ValidationError

from cli.common import (
    HOST_NAME,
    MEDIA_CLASS,
    QUOTA,
    TENANT_NAME,
    Ctx,
    describe_validation,
    emit_json,
    fail,
    json_option,
    pass_ctx,
    run,
    table,
    usage_error,
    wants_json,
)
from cli.units import format_size
from poold.errors import BadRequest
from poold.wire.admin import TenantSpec, TenantUpdate

UNIX_ID = click.IntRange(min=0, max=(1 << 32) - 1)


class LeaseCount(click.IntRange):
    """A tenant's most live leases: 1 or more. Like a 0-byte quota (cli.common.QUOTA), a
    limit of 0 leases lets the tenant lease nothing, never what creating or resizing one
    means."""

    def __init__(self) -> None:
        super().__init__(min=1, max=1 << 31)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if str(value).strip() == "0":  # said why, before IntRange's "not in the range"
            self.fail(
                "0 leases: a tenant that may hold no lease can lease nothing: give 1 or more, "
                "or delete the tenant (`poolctl tenants delete`)",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


LEASE_COUNT = LeaseCount()


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
@click.argument("name", type=TENANT_NAME)
@click.option("--quota", "quota_bytes", type=QUOTA, required=True, help="e.g. 64GiB")
@click.option("--max-leases", "quota_leases", type=LEASE_COUNT, default=1024, show_default=True)
@click.option("--uid", "uids", type=UNIX_ID, multiple=True, help="unix uid allowed (repeatable)")
@click.option("--gid", "gids", type=UNIX_ID, multiple=True, help="unix gid allowed (repeatable)")
@click.option(
    "--media",
    type=MEDIA_CLASS,
    multiple=True,
    help="allowed media class (repeatable; default any)",
)
@click.option(
    "--host", "hosts", type=HOST_NAME, multiple=True, help="restrict to these hosts (repeatable)"
)
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
    except ValidationError as exc:  # what the parameter types left: e.g. a quota over 1 EiB
        fail(BadRequest(describe_validation(exc)))
    out = run(lambda: c.client.create_tenant(spec))
    if wants_json(as_json):
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
    if wants_json(as_json):
        emit_json(items)
    else:
        table("tenants", TENANT_COLUMNS, _tenant_rows(items))


@tenants.command("show")
@click.argument("name", type=TENANT_NAME)
@json_option
@pass_ctx
def tenants_show(c: Ctx, name: str, as_json: bool) -> None:
    """Show one tenant."""
    t = run(lambda: c.client.get_tenant(name))
    if wants_json(as_json):
        emit_json(t)
        return
    table(f"tenant {name}", TENANT_COLUMNS, _tenant_rows([t]))
    if t.central_room_until is not None:
        until = t.central_room_until.isoformat(timespec="seconds")
        click.echo(
            f"central room: {format_size(t.central_room_bytes)} of the quota kept out of "
            f"hosts' budgets until {until} (a central grant was refused for their unspent "
            "budgets)"
        )


@tenants.command("set-quota")
@click.argument("name", type=TENANT_NAME)
@click.option("--bytes", "quota_bytes", type=QUOTA, default=None, help="e.g. 128GiB")
@click.option("--leases", "quota_leases", type=LEASE_COUNT, default=None)
@json_option
@pass_ctx
def tenants_set_quota(
    c: Ctx, name: str, quota_bytes: int | None, quota_leases: int | None, as_json: bool
) -> None:
    """Change a tenant's quota in bytes and/or number of leases."""
    if quota_bytes is None and quota_leases is None:
        usage_error("nothing to change: give --bytes and/or --leases")
    try:
        change = TenantUpdate(quota_bytes=quota_bytes, quota_leases=quota_leases)
    except ValidationError as exc:
        fail(BadRequest(describe_validation(exc)))
    out = run(lambda: c.client.update_tenant(name, change))
    if wants_json(as_json):
        emit_json(out)
    else:
        click.echo(
            f"tenant {name}: quota {format_size(out.quota_bytes)}, {out.quota_leases} leases"
        )


@tenants.command("delete")
@click.argument("name", type=TENANT_NAME)
@json_option
@pass_ctx
def tenants_delete(c: Ctx, name: str, as_json: bool) -> None:
    """Delete a tenant that holds no live lease."""
    run(lambda: c.client.delete_tenant(name))
    if wants_json(as_json):
        emit_json({"tenant": name, "deleted": True})
    else:
        click.echo(f"tenant {name} deleted")
