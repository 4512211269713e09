"""Suite-wide fixtures: a ledger on SQLite and on a throwaway PostgreSQL, and poold's API.

Each test gets its own database (copied from a migrated template), so tests
never see each other's rows.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import uvicorn

from poold.api.app import create_app
from poold.api.client import PooldClient
from poold.ledger import migrate
from poold.ledger.db import Ledger
from tests import pg

ADMIN_TOKEN = "pt1.admin.test-token"
_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.PgServer]:
    try:
        server = pg.start_server()
    except Exception as exc:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL could not start in CI: {exc}")
        pytest.skip(f"PostgreSQL not available: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_template(pg_server: pg.PgServer) -> str:
    with psycopg.connect(
        f"host=127.0.0.1 port={pg_server.port} user=postgres dbname=postgres", autocommit=True
    ) as conn:
        conn.execute("CREATE DATABASE poold_template")
    migrate.upgrade(pg_server.url("poold_template"))
    return "poold_template"


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "ledger.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


def new_pg_database(server: pg.PgServer, template: str | None) -> str:
    name = f"t_{os.getpid()}_{next(_counter)}"
    clause = f" TEMPLATE {template}" if template else ""
    with psycopg.connect(
        f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", autocommit=True
    ) as conn:
        conn.execute(f"CREATE DATABASE {name}{clause}")
    return name


def drop_pg_database(server: pg.PgServer, name: str) -> None:
    with psycopg.connect(
        f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", autocommit=True
    ) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty ledger database on each backend."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "ledger.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    template_name: str = request.getfixturevalue("pg_template")
    name = new_pg_database(server, template_name)
    yield server.url(name)
    drop_pg_database(server, name)


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    led = Ledger(ledger_url)
    yield led
    led.dispose()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadedServer:
    """poold's app served by a real uvicorn on loopback, inside the test process."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.port = free_port()
        config = uvicorn.Config(
            create_app(ledger, ADMIN_TOKEN),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            http="httptools",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.ledger.news.close()  # as poold serve does: no long poll holds the shutdown
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def api(ledger: Ledger) -> Iterator[ThreadedServer]:
    with ThreadedServer(ledger) as server:
        yield server


@pytest.fixture
def admin(api: ThreadedServer) -> Iterator[PooldClient]:
    with PooldClient(api.url, ADMIN_TOKEN) as client:
        yield client
