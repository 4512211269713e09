"""PostgreSQL stopped for 10 s under load: tenants see only retryable errors
(`ledger_unavailable`, `poold_unreachable`), no lease leaks, a renewal the agent
accepted during the outage reaches the ledger, and the audit is clean afterwards.

The test runs its own PostgreSQL (the session's server is shared by other tests) and
stops it the way `systemctl stop postgresql` does, then starts it again on the same
data. Real processes throughout: `poold serve`, `pool-agent serve`, tenant processes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.client import PoolClient
from tests import conftest, pg
from tests.e2e.conftest import Cluster, _start

pytestmark = pytest.mark.postgres

MiB = 1 << 20
OUTAGE_S = 10
RETRYABLE = {"ledger_unavailable", "poold_unreachable"}

# One tenant process: lease, renew, release until a deadline. A line per operation
# outcome: "ok <time>" for a finished cycle, "err <code> <time>" for a refused
# operation (the tenant goes on: a retryable error is one to retry). A traceback and a
# non-zero exit on anything that is not a PoolError.
TENANT_LOOP = textwrap.dedent(
    """
    import sys, time
    from agent.client import PoolClient
    from poold.errors import PoolError
    sock, until = sys.argv[1], float(sys.argv[2])
    with PoolClient(sock, timeout_s=60) as client:
        while time.time() < until:
            lease = None
            try:
                lease = client.lease(2 << 20, ttl_s=10, renew=False)
                client.renew(lease.lease_id, ttl_s=10)
                lease.release()
                print("ok", time.time(), flush=True)
            except PoolError as exc:
                print("err", exc.code, time.time(), flush=True)
                if lease is not None and not lease.released:
                    try:
                        lease.release()
                    except PoolError as again:
                        print("err", again.code, time.time(), flush=True)
                time.sleep(0.2)
    """
)


@pytest.fixture
def own_pg() -> Iterator[pg.PgServer]:
    try:
        server = pg.start_server()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"PostgreSQL not available: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def outage_cluster(own_pg: pg.PgServer, tmp_path: Path) -> Iterator[Cluster]:
    name = conftest.new_pg_database(own_pg, None)
    yield from _start(tmp_path, own_pg.url(name))


def _audit(c: Cluster) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "audit", "--json"],
        env=c.poolctl_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stdout + out.stderr


def test_postgres_stopped_for_ten_seconds_under_load(
    own_pg: pg.PgServer, outage_cluster: Cluster
) -> None:
    c = outage_cluster
    with PoolClient(c.socket_path, timeout_s=60) as held_client:
        held = held_client.lease(4 * MiB, ttl_s=20, renew=False)
        until = time.time() + 4 + OUTAGE_S + 8
        tenants = [
            subprocess.Popen(
                [sys.executable, "-c", TENANT_LOOP, str(c.socket_path), str(until)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        time.sleep(4)
        down_at = time.time()
        own_pg.pause()
        try:
            time.sleep(OUTAGE_S / 2)
            # The agent takes a renewal while poold cannot write it; it must not be lost.
            held_client.renew(held.lease_id, ttl_s=120)
            renewed_at = datetime.now(UTC)
            time.sleep(OUTAGE_S / 2)
        finally:
            own_pg.resume()
        up_at = time.time()

        outcomes = [t.communicate(timeout=180) for t in tenants]
        codes: Counter[str] = Counter()
        after_outage = 0
        for tenant, (out, err) in zip(tenants, outcomes, strict=True):
            assert tenant.returncode == 0, err
            for row in out.splitlines():
                parts = row.split()
                if parts[0] == "err":
                    codes[parts[1]] += 1
                elif float(parts[1]) > up_at + 1:
                    after_outage += 1
        assert set(codes) <= RETRYABLE, codes
        assert after_outage > 0, "no tenant worked again after the database came back"
        assert down_at < up_at

        # The renewal taken during the outage is in the ledger once the agent replays it.
        deadline = time.monotonic() + 30
        while True:
            lease = c.admin.show_lease(held.lease_id)
            if lease.expires_at >= renewed_at + timedelta(seconds=100):
                break
            assert time.monotonic() < deadline, (lease.state, lease.expires_at, renewed_at)
            time.sleep(0.2)
        assert lease.state == "active"
        held.release()

    # Nothing leaked: every lease of the host ends released, reclaimed or aborted.
    deadline = time.monotonic() + 30
    while True:
        live = [
            (x.id, x.state)
            for x in c.admin.list_leases(host="e2e-host")
            if x.state not in ("released", "reclaimed", "aborted")
        ]
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert live == []
    rc, report = _audit(c)
    assert rc == 0, report
