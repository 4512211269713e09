"""poolctl: the administrator's view of the pool, over poold's HTTP API.

Listings print rich tables, or JSON with --json; every error prints one line
with its stable code and exits non-zero.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.units import format_size, parse_size
from poold.api.client import PooldClient
from poold.errors import PoolError
from poold.settings import DEFAULT_PORT, default_state_dir
from poold.wire.admin import TenantSpec, TenantUpdate

F = TypeVar("F", bound=Callable[..., Any])


class Size(click.ParamType):  # type: ignore[type-arg]
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


class Ctx:
    def __init__(self, url: str, token: str | None, token_file: Path | None) -> None:
        self.url = url
        self._token = token
        self._token_file = token_file
        self._client: PooldClient | None = None

    def token(self) -> str:
        if self._token:
            return self._token
        path = self._token_file or default_state_dir() / "admin.token"
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise click.ClickException(
                f"no admin token: pass --token, set POOLD_TOKEN, or make {path} readable ({exc})"
            ) from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def client(self) -> PooldClient:
        if self._client is None:
            self._client = PooldClient(self.url, self.token())
        return self._client


def fail(err: PoolError) -> None:
    click.echo(f"poolctl: error[{err.code}]: {err.message}", err=True)
    raise SystemExit(1)


def run(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except PoolError as err:
        fail(err)


def emit_json(data: Any) -> None:
    def conv(obj: Any) -> Any:
        if isinstance(obj, BaseModel):
            return obj.model_dump(mode="json")
        if isinstance(obj, list):
            return [conv(o) for o in obj]
        return obj

    click.echo(json.dumps(conv(data), indent=2, sort_keys=True))


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=title)
    for col in columns:
        t.add_column(
            col,
            justify="right"
            if col.endswith(("bytes", "free", "leased", "capacity", "quota"))
            else "left",
        )
    for row in rows:
        # Text, not str: device uids like "cxl:ram:..." must not turn into markup or emoji.
        t.add_row(*[Text(str(c) if c is not None else "-") for c in row])
    Console().print(t)


json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


@click.group()
@click.option(
    "--url",
    envvar="POOLD_URL",
    default=f"http://127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    help="poold's API",
)
@click.option("--token", envvar="POOLD_TOKEN", default=None, help="admin token")
@click.option(
    "--token-file",
    envvar="POOLD_TOKEN_FILE",
    type=click.Path(path_type=Path),
    default=None,
    help="file holding the admin token (default: poold's state dir)",
)
@click.pass_context
def main(ctx: click.Context, url: str, token: str | None, token_file: Path | None) -> None:
    """Administer a poold far-memory pool."""
    ctx.obj = Ctx(url, token, token_file)
    ctx.call_on_close(ctx.obj.close)


pass_ctx = click.make_pass_decorator(Ctx)


# --- status -------------------------------------------------------------------
@main.command()
@json_option
@pass_ctx
def status(c: Ctx, as_json: bool) -> None:
    """Capacity per host and device: total, leased, free."""
    st = run(lambda: c.client.status())
    if as_json:
        emit_json(st)
        return
    table(
        "hosts",
        ["host", "status", "capacity", "leased", "free", "leases"],
        [
            (
                h.name,
                h.status,
                format_size(h.capacity_bytes),
                format_size(h.leased_bytes),
                format_size(h.free_bytes),
                h.live_leases,
            )
            for h in st.hosts
        ],
    )
    table(
        "devices",
        [
            "device",
            "kind",
            "media",
            "state",
            "health",
            "hosts",
            "capacity",
            "leased",
            "free",
            "leases",
        ],
        [
            (
                d.uid,
                d.kind,
                d.media + (" (recycled)" if d.recycled else ""),
                d.state,
                d.health,
                ",".join(d.hosts),
                format_size(d.capacity_bytes),
                format_size(d.leased_bytes),
                format_size(d.free_bytes),
                d.live_leases,
            )
            for d in st.devices
        ],
    )
    click.echo(
        f"pool: {format_size(st.capacity_bytes)} total, {format_size(st.leased_bytes)} "
        f"leased, {format_size(st.free_bytes)} free"
    )


# --- tenants ------------------------------------------------------------------
@main.group()
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


# --- hosts --------------------------------------------------------------------
@main.group()
def hosts() -> None:
    """Hosts running a pool agent."""


@hosts.command("add")
@click.argument("name")
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
    if as_json:
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
    if as_json:
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


# --- leases -------------------------------------------------------------------
@main.group()
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
]


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
        )
        for x in items
    ]


@leases.command("list")
@click.option("--tenant", default=None)
@click.option("--host", default=None)
@click.option("--state", "states", multiple=True, help="filter by state (repeatable)")
@click.option("--live", is_flag=True, help="only leases that still hold bytes")
@click.option("--limit", type=int, default=1000, show_default=True)
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
    items = run(
        lambda: c.client.list_leases(
            tenant=tenant, host=host, states=list(states), live=live, limit=limit
        )
    )
    if as_json:
        emit_json(items)
    else:
        table("leases", LEASE_COLUMNS, _lease_rows(items))


@leases.command("show")
@click.argument("lease_id")
@json_option
@pass_ctx
def leases_show(c: Ctx, lease_id: str, as_json: bool) -> None:
    """Show one lease."""
    x = run(lambda: c.client.show_lease(lease_id))
    if as_json:
        emit_json(x)
        return
    t = Table(title=f"lease {lease_id}", show_header=False)
    for key, value in x.model_dump().items():
        t.add_row(key, str(value))
    Console().print(t)


@leases.command("release")
@click.argument("lease_id")
@click.option("--reason", default="released by administrator", show_default=True)
@json_option
@pass_ctx
def leases_release(c: Ctx, lease_id: str, reason: str, as_json: bool) -> None:
    """Release a lease in the ledger."""
    x = run(lambda: c.client.release(lease_id, reason))
    if as_json:
        emit_json(x)
    else:
        click.echo(f"lease {lease_id}: {x.state}")


# --- db -----------------------------------------------------------------------
@main.group()
def db() -> None:
    """The ledger database (runs locally, not through poold)."""


db_url_option = click.option(
    "--database-url",
    envvar="POOLD_DATABASE_URL",
    default=None,
    help="SQLAlchemy URL (default: SQLite in poold's state dir)",
)
state_dir_option = click.option(
    "--state-dir",
    envvar="POOLD_STATE_DIR",
    type=click.Path(path_type=Path),
    default=default_state_dir,
)


def _url(database_url: str | None, state_dir: Path) -> str:
    """The ledger URL exactly as `poold serve` resolves it (SQLite in the state dir by default)."""
    from poold.settings import PooldSettings

    if not database_url:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return PooldSettings(state_dir=state_dir, database_url=database_url).resolved_database_url()


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@db_url_option
@state_dir_option
def db_upgrade(revision: str, database_url: str | None, state_dir: Path) -> None:
    """Apply alembic migrations up to REVISION."""
    from poold.ledger import migrate

    url = _url(database_url, state_dir)
    migrate.upgrade(url, revision)
    click.echo(f"ledger at revision {revision} ({_redact(url)})")


@db.command("current")
@db_url_option
@state_dir_option
def db_current(database_url: str | None, state_dir: Path) -> None:
    """Print the ledger's current and head revisions."""
    from poold.ledger import migrate
    from poold.ledger.db import make_engine

    url = _url(database_url, state_dir)
    engine = make_engine(url)
    try:
        click.echo(
            f"current: {migrate.current_revision(engine)}  head: {migrate.head_revision(url)}"
        )
    finally:
        engine.dispose()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


from cli.devices import devices_command  # noqa: E402  (cli.devices imports this module's helpers)

main.add_command(devices_command, "devices")

from cli import lifecycle  # noqa: E402  (cli.lifecycle imports this module's helpers)
from cli.audit import audit  # noqa: E402

leases.add_command(lifecycle.revoke_command)
hosts.add_command(lifecycle.host_drain_command)
hosts.add_command(lifecycle.host_undrain_command)
devices_command.add_command(lifecycle.device_drain_command)
devices_command.add_command(lifecycle.device_undrain_command)
main.add_command(audit)

from cli.accounting import accounting  # noqa: E402  (cli.accounting imports this module's helpers)

main.add_command(accounting)
