"""`poolctl db`: which alembic revision the ledger is at, and how to bring it to head.

These commands open the ledger database directly (not through poold), resolving its
URL exactly as `poold serve` does. Only `db upgrade` may create anything (the state
dir, the SQLite file); `db current` reads, and refuses a SQLite file that does not
exist (`not_found`) rather than creating an empty ledger to report on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cli.common import emit_json, fail, json_option, wants_json
from poold.errors import BadRequest, LedgerUnavailable, NotFound
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
    show_envvar=True,
    default=None,
    help="SQLAlchemy URL (default: SQLite in poold's state dir)",
)
state_dir_option = click.option(
    "--state-dir",
    envvar="POOLD_STATE_DIR",
    show_envvar=True,
    type=click.Path(path_type=Path),
    # Looked up when the command runs (not bound at import), so tests can point it away.
    default=lambda: default_state_dir(),
    show_default="poold's state dir",
)


def _url(database_url: str | None, state_dir: Path, *, create: bool) -> str:
    """The ledger URL exactly as `poold serve` resolves it (SQLite in the state dir by
    default), refused (`bad_request`, by PooldSettings) when SQLAlchemy cannot parse it or
    has no driver for it; the state dir is made only when `create`."""
    if not database_url and create:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return PooldSettings(state_dir=state_dir, database_url=database_url).resolved_database_url()


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (None: not SQLite, or an in-memory database)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    name = parsed.database or ""
    if parsed.query.get("uri") in ("true", "1"):
        name = name.removeprefix("file:").partition("?")[0]
        if parsed.query.get("mode") == "memory":
            return None
    if name in ("", ":memory:"):
        return None
    return Path(name)


def _why(exc: Exception) -> str:
    """The driver's own words, without SQLAlchemy's statement dump and help link."""
    return str(getattr(exc, "orig", None) or exc).strip()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@db_url_option
@state_dir_option
@json_option
def db_upgrade(revision: str, database_url: str | None, state_dir: Path, as_json: bool) -> None:
    """Apply alembic migrations up to REVISION (creating the SQLite ledger if need be)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from poold.ledger import migrate
    from poold.ledger.db import make_engine

    url = _url(database_url, state_dir, create=True)
    try:
        migrate.upgrade(url, revision)
        # What the ledger is at now, not what was asked: upgrading to a revision it is
        # already past changes nothing.
        engine = make_engine(url)
        try:
            current = migrate.current_revision(engine)
        finally:
            engine.dispose()
    except CommandError as exc:  # alembic's: no such revision, or not an upgrade
        fail(BadRequest(f"--revision {revision!r}: {exc}", revision=revision))
    except SQLAlchemyError as exc:
        fail(LedgerUnavailable(f"cannot upgrade the ledger at {_redact(url)}: {_why(exc)}"))
    if wants_json(as_json):
        emit_json({"revision": revision, "current": current, "url": _redact(url)})
    else:
        click.echo(f"ledger at revision {current} ({_redact(url)})")


@db.command("current")
@db_url_option
@state_dir_option
@json_option
def db_current(database_url: str | None, state_dir: Path, as_json: bool) -> None:
    """Print the ledger's current and head revisions (reads only: creates nothing)."""
    from sqlalchemy.exc import SQLAlchemyError

    from poold.ledger import migrate
    from poold.ledger.db import make_engine

    url = _url(database_url, state_dir, create=False)
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        fail(
            NotFound(
                f"no ledger at {path}: give --state-dir or --database-url, or create it with "
                "`poolctl db upgrade`",
                path=str(path),
            )
        )
    engine = make_engine(url)
    try:
        out: dict[str, Any] = {
            "current": migrate.current_revision(engine),
            "head": migrate.head_revision(url),
        }
    except SQLAlchemyError as exc:
        fail(LedgerUnavailable(f"cannot read the ledger at {_redact(url)}: {_why(exc)}"))
    finally:
        engine.dispose()
    if wants_json(as_json):
        emit_json({**out, "url": _redact(url)})
    else:
        click.echo(f"current: {out['current']}  head: {out['head']}")
