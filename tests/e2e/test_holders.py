"""Leases end properly when their holder dies, survive a reconnect, and survive the agent.

Real processes throughout: the tenant that dies is a child Python process, the
agent is killed with SIGKILL and restarted on its journal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from agent.client import PoolClient
from tests.e2e.conftest import Cluster


def test_dead_holder_is_orphaned_then_reclaimed(cluster: Cluster) -> None:
    script = textwrap.dedent(f"""
        import os
        from agent.client import PoolClient
        c = PoolClient({str(cluster.socket_path)!r})
        lease = c.lease(4 << 20, ttl_s=60, renew=False)
        print(lease.lease_id, flush=True)
        os._exit(0)  # dies holding the lease: no release, no goodbye
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lease_id = out.stdout.strip()
    assert cluster.wait_state(lease_id, "orphaned") == "orphaned"
    assert cluster.wait_state(lease_id, "reclaimed") == "reclaimed"
    kinds = [r[3] for r in cluster.ledger_rows("events")["events"] if r[4] == lease_id]
    assert kinds == ["lease.grant", "lease.activate", "lease.orphan", "lease.reclaim"]
    assert cluster.admin.status().leased_bytes == 0


def test_reconnecting_holder_keeps_its_leases(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client:
        lease = client.lease(2 << 20, renew=False)
        client._disconnect()  # the connection drops; the process lives on
        time.sleep(1.5)  # longer than the agent's holder check
        assert client.renew(lease.lease_id).lease_id == lease.lease_id
        assert cluster.admin.show_lease(lease.lease_id).state == "active"
        lease.release()


def test_agent_crash_and_restart_keeps_tenant_mappings(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client:
        lease = client.lease(2 << 20, ttl_s=60, renew=False)
        mm = lease.mmap()
        mm[:4] = b"kept"
        cluster.restart_agent(kill=True)
        assert mm[:4] == b"kept"  # the mapping never noticed
        # The next renew reconnects to the new agent, which re-adopted the lease.
        assert client.renew(lease.lease_id).lease_id == lease.lease_id
        assert cluster.admin.show_lease(lease.lease_id).state == "active"
        mm.close()
        lease.release()
        assert cluster.wait_state(lease.lease_id, "released") == "released"


def test_restarted_agent_reconciles_leases_it_has_no_memory_for(cluster: Cluster) -> None:
    import os

    from poold.api.client import PooldClient
    from poold.wire.agent import GrantRequest

    # A grant poold committed but the agent never journalled (as if it died in between).
    cred = (cluster.work / "agent.credential").read_text().strip()
    with PooldClient(cluster.url, cred) as as_agent:
        stray = as_agent.grant(
            GrantRequest(size_bytes=2 << 20, uid=os.getuid(), pid=1, ttl_s=600, activate=True)
        )
    assert cluster.admin.show_lease(stray.id).state == "active"
    cluster.restart_agent(kill=True)
    assert cluster.wait_state(stray.id, "reclaimed") == "reclaimed"
    kinds = [r[3] for r in cluster.ledger_rows("events")["events"] if r[4] == stray.id]
    assert kinds[-2:] == ["lease.orphan", "lease.reclaim"]
