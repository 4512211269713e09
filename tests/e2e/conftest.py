"""Real processes: `poold serve` and `pool-agent serve` as children, a tenant on the socket."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from poold import procs
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from tests import conftest, pg

AGENT_CAPACITY = 256 << 20
NOBODY = pwd.getpwnam("nobody")
NOGROUP = grp.getgrgid(NOBODY.pw_gid).gr_name
# Fast lifecycle for tests: reaper every 0.2 s, 1 s of grace before reclaiming.
POOLD_TEST_ENV = {
    "POOLD_REAP_INTERVAL_S": "0.2",
    "POOLD_EXPIRY_GRACE_S": "1",
    "POOLD_REVOKE_DEADLINE_S": "4",
}


def query_ledger(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    """The rows of one statement, read straight from the ledger's database."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


@dataclass
class Cluster:
    work: Path
    state_dir: Path
    port: int
    database_url: str
    poold: procs.Child
    agent: procs.Child
    socket_path: Path
    admin: PooldClient
    host: str = "e2e-host"
    agent_args: dict[str, Any] = field(default_factory=dict)

    def restart_agent(self, *, kill: bool = True) -> None:
        """Stop the agent (SIGKILL by default: a crash) and start it on the same state."""
        if kill:
            self.agent.kill()
        else:
            self.agent.stop()
        self.agent = procs.start_agent(self.work, **self.agent_args)

    def restart_poold(self, *, kill: bool = True) -> None:
        """Stop poold (SIGKILL by default: a crash) and start it on the same ledger and port."""
        if kill:
            self.poold.kill()
        else:
            self.poold.stop()
        self.poold = procs.start_poold(
            self.state_dir, self.port, database_url=self.database_url, env=POOLD_TEST_ENV
        )

    def wait_state(self, lease_id: str, want: str, timeout_s: float = 15) -> str:
        """Poll the ledger until the lease is in `want`; the last state seen otherwise."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.admin.show_lease(lease_id).state
            if state == want:
                break
            time.sleep(0.05)
        return state

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ledger_rows(self, *tables: str) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of the named tables, read straight from the database."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return {
                    t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY 1"))]
                    for t in tables
                }
        finally:
            engine.dispose()

    def poolctl_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "POOLD_URL": self.url,
            "POOLD_TOKEN_FILE": str(self.state_dir / "admin.token"),
            "COLUMNS": "200",
        }

    def poolctl(self, *argv: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
        """poolctl as a process against this cluster, stdout a pipe; never raises on its status."""
        return subprocess.run(
            [sys.executable, "-m", "cli", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.poolctl_env(),
            check=False,
        )


def _start(tmp_path: Path, database_url: str | None) -> Iterator[Cluster]:
    state_dir = tmp_path / "poold"
    port = procs.free_port()
    poold = procs.start_poold(state_dir, port, database_url=database_url, env=POOLD_TEST_ENV)
    children = [poold]
    cleanup: list[Path] = []
    try:
        admin = procs.admin_client(state_dir, port)
        cred = tmp_path / "agent.credential"
        cred.write_text(admin.add_host("e2e-host").credential)
        admin.create_tenant(
            TenantSpec(
                name="alpha", quota_bytes=128 << 20, quota_leases=8, allowed_uids=[os.getuid()]
            )
        )
        admin.create_tenant(
            TenantSpec(
                name="nobodies", quota_bytes=64 << 20, quota_leases=8, allowed_uids=[NOBODY.pw_uid]
            )
        )
        # pytest's tmp dirs are private (0700); tenants of other uids must reach the socket.
        run_dir = Path(tempfile.mkdtemp(prefix="poold-e2e-"))
        run_dir.chmod(0o755)
        cleanup.append(run_dir)
        sock = run_dir / "agent.sock"
        extra = ["--socket-group", NOGROUP] if os.geteuid() == 0 else []
        agent = procs.start_agent(
            tmp_path,
            host="e2e-host",
            poold_url=f"http://127.0.0.1:{port}",
            credential_file=cred,
            socket_path=sock,
            emulated_capacity_bytes=AGENT_CAPACITY,
            heartbeat_interval_s=0.2,
            extra=extra,
        )
        children.append(agent)
        url = database_url or f"sqlite:///{state_dir / 'ledger.db'}"
        cluster = Cluster(tmp_path, state_dir, port, url, poold, agent, sock, admin)
        cluster.agent_args = {
            "host": "e2e-host",
            "poold_url": f"http://127.0.0.1:{port}",
            "credential_file": cred,
            "socket_path": sock,
            "emulated_capacity_bytes": AGENT_CAPACITY,
            "heartbeat_interval_s": 0.2,
            "extra": extra,
        }
        yield cluster
        # A test may have restarted either: stop the processes running now.
        children[:] = [cluster.poold, cluster.agent]
        admin.close()
    finally:
        for child in reversed(children):
            child.stop()
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """poold on SQLite + one agent with a 256 MiB emulated device."""
    yield from _start(tmp_path, None)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """The same cluster on each ledger backend."""
    if request.param == "sqlite":
        yield from _start(tmp_path, None)
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    name = conftest.new_pg_database(server, None)
    try:
        yield from _start(tmp_path, server.url(name))
    finally:
        conftest.drop_pg_database(server, name)


@pytest.fixture
def pg_cluster(pg_server: pg.PgServer, tmp_path: Path) -> Iterator[Cluster]:
    """The cluster on PostgreSQL only: where several poold processes share one ledger."""
    name = conftest.new_pg_database(pg_server, None)
    try:
        yield from _start(tmp_path, pg_server.url(name))
    finally:
        conftest.drop_pg_database(pg_server, name)


# A second agent's heartbeat interval when a test must tell news from heartbeats.
SLOW_HEARTBEAT_S = 30.0


@contextlib.contextmanager
def slow_agent(cluster: Cluster, host: str) -> Iterator[Path]:
    """A second agent that heartbeats every 30 s: what it learns sooner came as news."""
    cred = cluster.work / f"{host}.credential"
    cred.write_text(cluster.admin.add_host(host).credential)
    sock = cluster.socket_path.parent / f"{host}.sock"
    agent = procs.start_agent(
        cluster.work,
        host=host,
        poold_url=cluster.url,
        credential_file=cred,
        socket_path=sock,
        emulated_capacity_bytes=AGENT_CAPACITY,
        heartbeat_interval_s=SLOW_HEARTBEAT_S,
    )
    try:
        time.sleep(1)  # its first wait for news is in poold
        yield sock
    finally:
        agent.stop()
