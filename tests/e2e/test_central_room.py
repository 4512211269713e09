"""A tenant whose quota sits in another host's unspent budget gets its lease (real
`poold serve` and two `pool-agent serve` with delegation on).

Host A's agent holds the tenant's whole (small) quota as a budget it has not spent; the
tenant asks host B for a lease larger than any share. Without waiting it hears
`quota_exceeded` saying why and to retry; with ``wait_s`` the agent tries again while
poold keeps room beside the budgets and tells host A (news, and the reply to A's next
delegation call: its heartbeat interval here is a minute), whose agent gives its budget
back. Measured here: granted 0.8-1.1 s into the wait (1.8-2.1 s without the news).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.client import PoolClient
from poold import procs
from poold.api.client import PooldClient
from poold.errors import QuotaExceeded
from poold.wire.admin import TenantSpec
from tests.e2e.conftest import POOLD_TEST_ENV, query_ledger

MiB = 1 << 20
TENANT = "tight"
QUOTA = 48 * MiB
HEARTBEAT_S = 60.0  # news, not a heartbeat, must carry what poold decided


@dataclass
class TwoHosts:
    admin: PooldClient
    socks: dict[str, Path]
    database_url: str
    children: list[procs.Child]

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        return query_ledger(self.database_url, sql)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.log_tail(20)}" for c in self.children)


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TwoHosts]:
    monkeypatch.setenv("POOL_AGENT_DELEGATION", "true")
    state = tmp_path / "poold"
    port = procs.free_port()
    children = [procs.start_poold(state, port, env=POOLD_TEST_ENV)]
    run_dir = Path(tempfile.mkdtemp(prefix="poold-room-"))
    try:
        admin = procs.admin_client(state, port)
        admin.create_tenant(
            TenantSpec(name=TENANT, quota_bytes=QUOTA, quota_leases=3, allowed_uids=[os.getuid()])
        )
        socks: dict[str, Path] = {}
        for host in ("room-a", "room-b"):
            cred = tmp_path / f"{host}.cred"
            cred.write_text(admin.add_host(host).credential)
            socks[host] = run_dir / f"{host}.sock"
            children.append(
                procs.start_agent(
                    tmp_path,
                    host=host,
                    poold_url=f"http://127.0.0.1:{port}",
                    credential_file=cred,
                    socket_path=socks[host],
                    emulated_capacity_bytes=512 * MiB,
                    heartbeat_interval_s=HEARTBEAT_S,
                )
            )
        yield TwoHosts(admin, socks, f"sqlite:///{state / 'ledger.db'}", children)
        admin.close()
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _budget_bytes(pool: TwoHosts, host: str) -> int:
    rows = pool.query(
        "SELECT budgets.bytes FROM budgets JOIN hosts ON hosts.id = budgets.host_id "
        f"WHERE hosts.name = '{host}'"
    )
    return int(rows[0][0]) if rows else 0


def test_a_lease_held_back_by_another_hosts_unspent_budget_is_granted_within_its_wait(
    two_hosts: TwoHosts,
) -> None:
    pool = two_hosts
    # Demand on host A: its agent asks for a budget and gets the whole quota.
    with PoolClient(pool.socks["room-a"], timeout_s=10) as a:
        deadline = time.monotonic() + 20
        while _budget_bytes(pool, "room-a") < QUOTA:
            assert time.monotonic() < deadline, pool.logs()
            a.lease(2 * MiB, tenant=TENANT, ttl_s=60, renew=False).release()
            time.sleep(0.3)
    with PoolClient(pool.socks["room-b"], timeout_s=30) as b:
        # Holding nothing, the tenant is refused on B: A's budget holds its quota.
        with pytest.raises(QuotaExceeded) as refused:
            b.lease(32 * MiB, tenant=TENANT, ttl_s=60, renew=False)
        assert "retry" in refused.value.message, refused.value.message
        # Within a wait it is granted, once A's agent has given its budget back (A's
        # next heartbeat is a minute away: it heard it otherwise).
        started = time.monotonic()
        lease = b.lease(32 * MiB, tenant=TENANT, ttl_s=60, renew=False, wait_s=20)
        waited = time.monotonic() - started
        assert waited < 10, (waited, pool.logs())
        assert _budget_bytes(pool, "room-a") == 0
        [(reservation_id, state)] = pool.query(
            f"SELECT reservation_id, state FROM leases WHERE id = '{lease.lease_id}'"
        )
        assert reservation_id is None and state == "active"  # granted centrally
        (room,) = pool.query("SELECT count(*) FROM events WHERE kind = 'budget.room'")
        assert room == (1,)
        lease.release()
