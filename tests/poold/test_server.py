"""How poold runs (poold/server.py): what it sets in the process before it serves."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import psycopg
import pytest

from poold import procs
from tests import conftest, pg


@pytest.mark.postgres
def test_ledger_connections_are_kept_across_bursts(
    pg_server: pg.PgServer, pg_template: str, tmp_path: Path
) -> None:
    # SQLAlchemy's default pool keeps 5 connections and opens up to 10 more for a burst,
    # closing each after it: a PostgreSQL connection start per request past the fifth.
    name = conftest.new_pg_database(pg_server, pg_template)
    child = procs.start_poold(
        tmp_path / "state",
        procs.free_port(),
        database_url=pg_server.url(name),
        env={"POOLD_DB_POOL_SIZE": "4", "POOLD_REAP_INTERVAL_S": "0"},
        extra=["--no-upgrade-db"],
    )
    token = (tmp_path / "state" / "admin.token").read_text().strip()
    port = child.proc.args[child.proc.args.index("--port") + 1]  # type: ignore[index, union-attr]
    url = f"http://127.0.0.1:{port}/v1/tenants"

    def burst() -> set[int]:
        with (
            httpx.Client(headers={"authorization": f"Bearer {token}"}) as http,
            concurrent.futures.ThreadPoolExecutor(16) as pool,
        ):
            codes = list(pool.map(lambda _: http.get(url).status_code, range(64)))
        assert set(codes) == {200}
        with psycopg.connect(pg_server.url(name).replace("+psycopg", ""), autocommit=True) as c:
            rows = c.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
                " AND query NOT LIKE 'LISTEN%%'",  # the news listener's (poold/ledger/news.py)
                (name,),
            ).fetchall()
        return {int(r[0]) for r in rows}

    try:
        first = burst()
        assert 1 <= len(first) <= 4
        second = burst()
        assert first <= second and len(second) <= 4  # kept, not closed and opened again
    finally:
        child.stop()
        conftest.drop_pg_database(pg_server, name)
