"""`poolctl db`: which alembic revision the ledger is at, and how to bring it to head.

These commands open the ledger database directly (not through poold), resolving its
URL exactly as `poold serve` does.
"""

from __future__ import annotations

from pathlib import Path

import click

from poold.settings import PooldSettings, default_state_dir

# The ledger (SQLAlchemy, alembic) is imported inside the commands that use it: every
# other poolctl command talks HTTP only, and would otherwise pay a third of a second
# importing a database stack it never touches.


@click.group("db")
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
    if not database_url:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return PooldSettings(state_dir=state_dir, database_url=database_url).resolved_database_url()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


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
