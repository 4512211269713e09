"""The `poold` command: `poold serve` (the default) and `poold demo`."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from poold.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, PooldSettings, default_state_dir


@click.group(invoke_without_command=True)
@click.pass_context
def main(ctx: click.Context) -> None:
    """poold: the central far-memory pool daemon."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(serve)


@main.command()
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    envvar="POOLD_STATE_DIR",
    default=default_state_dir,
    show_default="/var/lib/poold or XDG state dir",
)
@click.option(
    "--database-url",
    envvar="POOLD_DATABASE_URL",
    default=None,
    help="SQLAlchemy URL; default SQLite in the state dir",
)
@click.option(
    "--listen", "listen_host", envvar="POOLD_LISTEN", default="127.0.0.1", show_default=True
)
@click.option("--port", envvar="POOLD_PORT", type=int, default=DEFAULT_PORT, show_default=True)
@click.option(
    "--upgrade-db/--no-upgrade-db",
    default=True,
    show_default=True,
    help="apply pending alembic migrations at start",
)
@click.option(
    "--max-body-bytes",
    envvar="POOLD_MAX_BODY_BYTES",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    help="refuse request bodies past this many bytes (413), unread",
)
@click.option("--log-level", default="info", envvar="POOLD_LOG_LEVEL", show_default=True)
def serve(
    state_dir: Path,
    database_url: str | None,
    listen_host: str,
    port: int,
    upgrade_db: bool,
    max_body_bytes: int,
    log_level: str,
) -> None:
    """Serve the poold HTTP API."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from poold.server import serve as run

    run(
        PooldSettings(
            state_dir=state_dir,
            database_url=database_url,
            listen_host=listen_host,
            listen_port=port,
            upgrade_db=upgrade_db,
            max_body_bytes=max_body_bytes,
        )
    )


@main.command()
@click.option("--size-mib", default=64, show_default=True, help="how much the tenant leases")
@click.option("--keep", is_flag=True, help="keep the temporary state directory")
def demo(size_mib: int, keep: bool) -> None:
    """Run poold, an agent and a sample tenant end to end on SQLite, then stop."""
    from poold.demo import run_demo

    raise SystemExit(run_demo(size_mib=size_mib, keep=keep))
