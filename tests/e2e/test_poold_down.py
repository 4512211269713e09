"""poold down: leases keep working, new ones are refused, renewals are held and replayed.

Real processes: poold is killed with SIGKILL under a live agent and tenant, kept
down past the lease's ttl, and started again on the same ledger and port
(poold/ledger/reaper.py, "the outage rule").
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from agent.client import PoolClient
from poold.errors import PoolError
from tests.e2e.conftest import Cluster

MiB = 1 << 20


@pytest.fixture(autouse=True)
def central_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The central path (every lease granted by poold, delegation off in the agent this
    module starts): what happens to it with poold down. Local grants while poold is
    down are tests/e2e/test_delegation.py's."""
    monkeypatch.setenv("POOL_AGENT_DELEGATION", "false")


def test_leases_survive_poold_down_and_renewals_are_replayed(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path, timeout_s=10) as client:
        lease = client.lease(4 * MiB, ttl_s=2, renew=False)
        mm = lease.mmap()
        mm[:5] = b"hello"
        before = cluster.admin.show_lease(lease.lease_id)
        assert before.state == "active"

        cluster.poold.kill()
        # The existing lease is plain memory: it keeps working.
        assert mm[:5] == b"hello"
        mm[4096:4101] = b"world"
        assert mm[4096:4101] == b"world"
        # A new lease needs poold's placement: refused with a stable code, no fd leaked.
        with pytest.raises(PoolError) as refused:
            client.lease(4 * MiB, ttl_s=2, renew=False)
        assert refused.value.code == "poold_unreachable"
        # A renewal is the agent's to accept; poold hears of it when it is back. A ttl
        # well past the hold poold applies on restart (host_silent_after_s, 10 s) shows
        # that what lands is the replayed renewal, not the hold.
        renewed = client.renew(lease.lease_id, ttl_s=60)
        assert renewed.lease_id == lease.lease_id
        time.sleep(3)  # the lease's original expiry passes while poold is down

        cluster.restart_poold()
        replayed_by = before.expires_at + timedelta(seconds=30)
        deadline = time.monotonic() + 10
        after = cluster.admin.show_lease(lease.lease_id)
        while time.monotonic() < deadline and after.expires_at < replayed_by:
            time.sleep(0.1)
            after = cluster.admin.show_lease(lease.lease_id)
        assert after.state == "active"
        assert after.expires_at >= replayed_by, (before.expires_at, after.expires_at)
        kinds = [r[3] for r in cluster.ledger_rows("events")["events"] if r[4] == lease.lease_id]
        assert kinds == ["lease.grant", "lease.activate"]  # never expired

        # Back to normal: renewals go through, new leases are granted, nothing leaked.
        client.renew(lease.lease_id)
        assert mm[:5] == b"hello"
        with client.lease(4 * MiB, ttl_s=5, renew=False) as second:
            assert cluster.admin.show_lease(second.lease_id).state == "active"
            assert cluster.admin.status().leased_bytes == lease.length_bytes + second.length_bytes
        mm.close()
        lease.release()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cluster.admin.status().leased_bytes:
        time.sleep(0.1)
    assert cluster.admin.status().leased_bytes == 0
