"""A revocation reaches the tenant before its memory goes away, then the lease is reclaimed."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

from agent.client import Lease, PoolClient
from tests.e2e.conftest import Cluster


def test_revocation_reaches_the_tenant_callback_before_the_deadline(cluster: Cluster) -> None:
    told = threading.Event()
    seen: dict[str, datetime] = {}

    def on_revoke(lease: Lease, deadline_at: datetime) -> None:
        seen["at"] = datetime.now(UTC)
        seen["deadline"] = deadline_at
        told.set()

    with PoolClient(cluster.socket_path) as client:
        lease = client.lease(2 << 20, ttl_s=3, on_revoke=on_revoke)  # renews every ~1 s
        cluster.admin.revoke(lease.lease_id, reason="failing DIMM")
        assert told.wait(10), "the tenant never heard of the revocation"
        assert seen["at"] < seen["deadline"]  # told before the memory goes
        deadline = time.monotonic() + 15
        while cluster.admin.show_lease(lease.lease_id).state != "reclaimed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    events = [
        (r[3], r[2]) for r in cluster.ledger_rows("events")["events"] if r[4] == lease.lease_id
    ]
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["lease.revoke", "lease.reclaim"]
    # The agent tore it down and confirmed; the reaper did not have to force it.
    assert events[-1][1] == "agent:e2e-host"
