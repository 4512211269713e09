"""Does `poolctl db current` only read: no state dir, no SQLite file made to report on?"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import cli.db
from cli.poolctl import main
from poold.ledger import migrate
from tests.conftest import free_port

NO_ENV: dict[str, str | None] = {"POOLD_STATE_DIR": None, "POOLD_DATABASE_URL": None}


def poolctl(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env=NO_ENV)


def refused(r: Result, code: str) -> str:
    assert r.exit_code == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"poolctl: error[{code}]: ")
    assert "Traceback" not in r.output and r.stdout == ""
    return line


def test_a_missing_state_dir_is_not_created(tmp_path: Path) -> None:
    state = tmp_path / "state"
    line = refused(poolctl("db", "current", "--state-dir", str(state)), "not_found")
    assert str(state / "ledger.db") in line and "poolctl db upgrade" in line
    assert not state.exists()


def test_a_missing_sqlite_file_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "nope.db"
    refused(poolctl("db", "current", "--database-url", f"sqlite:///{path}"), "not_found")
    assert list(tmp_path.iterdir()) == []


def test_the_default_state_dir_is_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without --state-dir: poold's default (/var/lib/poold for root), pointed away here.
    default = tmp_path / "var" / "lib" / "poold"
    monkeypatch.setattr(cli.db, "default_state_dir", lambda: default)
    assert str(default / "ledger.db") in refused(poolctl("db", "current"), "not_found")
    assert not (tmp_path / "var").exists()


def test_upgrade_creates_and_current_reads(tmp_path: Path) -> None:
    state = tmp_path / "state"
    r = poolctl("db", "upgrade", "--state-dir", str(state), "--json")
    assert r.exit_code == 0, r.output
    url = f"sqlite:///{state / 'ledger.db'}"
    head = migrate.head_revision(url)
    r = poolctl("db", "current", "--state-dir", str(state), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"current": head, "head": head, "url": url}
    r = poolctl("db", "current", "--database-url", url)
    assert r.exit_code == 0 and r.output == f"current: {head}  head: {head}\n"


def test_an_unreachable_database_is_one_line() -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/poold"
    line = refused(poolctl("db", "current", "--database-url", url), "ledger_unavailable")
    assert "cannot read the ledger at" in line


@pytest.mark.parametrize("command", ["current", "upgrade"])
@pytest.mark.parametrize(
    "url",
    [
        "not a url",
        "bogus://x",
        "postgresql+nodriver://poold:secret@127.0.0.1/poold",
        "mysql://poold:secret@127.0.0.1/poold",  # a dialect whose driver is not installed
    ],
)
def test_an_unusable_database_url_is_one_line(command: str, url: str, tmp_path: Path) -> None:
    r = poolctl("db", command, "--database-url", url, "--state-dir", str(tmp_path / "s"))
    line = refused(r, "bad_request")
    assert "secret" not in line
    assert not (tmp_path / "s").exists()


def test_upgrade_to_an_unknown_revision_is_one_line_and_says_where_it_is(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert poolctl("db", "upgrade", "--state-dir", str(state)).exit_code == 0
    url = f"sqlite:///{state / 'ledger.db'}"
    head = migrate.head_revision(url)
    assert "nosuch" in refused(
        poolctl("db", "upgrade", "--revision", "nosuch", "--state-dir", str(state)), "bad_request"
    )
    # Asking for a revision the ledger is already past changes nothing, and says so.
    r = poolctl("db", "upgrade", "--revision", "0001", "--state-dir", str(state), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["current"] == head
