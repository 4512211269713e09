"""A tenant leases far memory from a real agent, backed by a real poold: the Foundation story."""

from __future__ import annotations

import mmap
import os
import stat
import time

from agent.client import PoolClient
from tests.e2e.conftest import Cluster


def test_full_cycle_real_fd_mmap_renew_release(any_cluster: Cluster) -> None:
    c = any_cluster
    with PoolClient(c.socket_path) as client:
        lease = client.lease(10 << 20, ttl_s=30)
        # A real memfd crossed the socket: a file of exactly the granted length.
        st = os.fstat(lease.fd)
        assert stat.S_ISREG(st.st_mode)
        assert st.st_size == lease.length_bytes == 10 << 20
        assert os.readlink(f"/proc/self/fd/{lease.fd}").startswith("/memfd:")
        assert lease.media == "emulated" and lease.backend == "emulated"
        mm = lease.mmap()
        mm[:5] = b"hello"
        mm[-5:] = b"world"
        assert mm[:5] == b"hello" and mm[-5:] == b"world"
        mm.close()
        ledger = c.admin.show_lease(lease.lease_id)
        assert ledger.state == "active"
        assert ledger.tenant == "alpha" and ledger.host == "e2e-host"
        assert ledger.holder_uid == os.getuid() and ledger.holder_pid == os.getpid()
        before = ledger.expires_at
        time.sleep(0.05)
        lease.renew(ttl_s=60)
        deadline = time.monotonic() + 5  # renewals ride on the next heartbeat
        while c.admin.show_lease(lease.lease_id).expires_at <= before:
            assert time.monotonic() < deadline, "renewal never reached poold"
            time.sleep(0.05)
        lease.release()
        assert c.wait_state(lease.lease_id, "released") == "released"
    kinds = [r[3] for r in c.ledger_rows("events")["events"] if r[4] == lease.lease_id]
    assert kinds == ["lease.grant", "lease.activate", "lease.release"]


def test_released_memory_is_fresh_for_the_next_lease(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client:
        with client.lease(4 << 20) as first:
            mm = first.mmap()
            mm[:] = b"\xaa" * len(mm)
            mm.close()
            first_id = first.lease_id
        cluster.wait_state(first_id, "released")
        with client.lease(4 << 20) as second:
            mm = second.mmap()
            assert mm[:] == bytes(len(mm))
            mm.close()
            shown = cluster.admin.show_lease(second.lease_id)
            assert shown.offset_bytes == cluster.admin.show_lease(first_id).offset_bytes
            assert second.epoch > first.epoch


def test_memfd_is_sealed_against_resize(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client, client.lease(2 << 20) as lease:
        for size in (4 << 20, 1 << 20):
            try:
                os.ftruncate(lease.fd, size)
            except PermissionError:
                pass
            else:
                raise AssertionError("a sealed lease could be resized")
        mm = mmap.mmap(lease.fd, lease.length_bytes)
        mm.close()


def test_status_counts_the_lease(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client, client.lease(8 << 20):
        st = cluster.admin.status()
        assert st.leased_bytes == 8 << 20
        assert st.free_bytes == st.capacity_bytes - (8 << 20)
        (host,) = st.hosts
        assert host.name == "e2e-host" and host.status == "up" and host.live_leases == 1
