"""Do sixteen `poold serve` started at once on an empty ledger all come up?

Each upgrades the schema at start; the upgrade runs under a lock (an advisory lock
on PostgreSQL, a flock beside the SQLite file), so the first migrates and the
others find the schema current. Before the lock, half of them died on a unique
violation inside alembic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from poold import procs
from tests import conftest, pg
from tests.e2e.conftest import POOLD_TEST_ENV

PROCESSES = 16
PORT_ATTEMPTS = 3


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    name = conftest.new_pg_database(server, None)
    try:
        yield server.url(name)
    finally:
        conftest.drop_pg_database(server, name)


def test_sixteen_poolds_start_at_once_on_an_empty_ledger(
    empty_database: str, tmp_path: Path
) -> None:
    started: list[procs.Child] = []
    failures: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(PROCESSES)

    def start(n: int) -> None:
        barrier.wait()
        for attempt in range(PORT_ATTEMPTS):
            try:
                child = procs.start_poold(
                    tmp_path / f"poold-{n}" / "state",
                    procs.free_port(),
                    database_url=empty_database,
                    timeout_s=120,
                    env=POOLD_TEST_ENV,
                )
                break
            except RuntimeError as exc:
                # A port free when picked can be taken before poold binds it (sixteen
                # pick at once): a race of ports, not of the migration; another port.
                if "address already in use" in str(exc) and attempt + 1 < PORT_ATTEMPTS:
                    continue
                with lock:
                    failures.append(f"poold {n}: {exc}")
                return
        with lock:
            started.append(child)

    for n in range(PROCESSES):
        (tmp_path / f"poold-{n}").mkdir()
    threads = [threading.Thread(target=start, args=(n,)) for n in range(PROCESSES)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not failures, "\n\n".join(failures)
        assert len(started) == PROCESSES
        assert all(child.alive() for child in started)
    finally:
        for child in started:
            child.stop()
