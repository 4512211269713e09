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
        lease.release()  # the engine moves its blocks away and lets go
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


def test_revoked_memfd_still_mapped_counts_as_used_until_its_holder_exits(
    cluster: Cluster,
) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        from agent.client import PoolClient
        c = PoolClient({str(cluster.socket_path)!r})
        lease = c.lease(2 << 20, ttl_s=60, renew=False)
        mm = lease.mmap()
        mm[:4] = b"mine"
        print(lease.lease_id, flush=True)
        sys.stdin.read()  # hold the mapping until the test closes stdin
    """)
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        lease_id = holder.stdout.readline().strip()
        cluster.admin.revoke(lease_id, reason="drain")
        time.sleep(6)  # past the 4 s revocation deadline
        # The pages are still mapped by a live process: not reclaimed, still used.
        assert cluster.admin.show_lease(lease_id).state == "revoked_mapped"
        assert cluster.admin.status().leased_bytes == 2 << 20
        with PoolClient(cluster.socket_path) as observer:
            stats = observer.stats()
        assert (stats.revoked_held_leases, stats.revoked_held_bytes) == (1, 2 << 20)
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()
    assert cluster.wait_state(lease_id, "reclaimed") == "reclaimed"
    assert cluster.admin.status().leased_bytes == 0
