"""poold failing under a live agent: renewals survive errors, lost grant replies are
retried under their request id without leaking a lease, and an agent given two poold
processes on one ledger fails over when one is killed.

Real processes and sockets: `poold serve` and `pool-agent serve` as children, tenants
on the agent socket (in-test clients, or processes of their own under load), and a
fault proxy (tests/agent/faultproxy.py) between the agent and poold where a test
needs a chosen request to fail.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from agent.client import PoolClient
from poold import procs
from tests.agent.faultproxy import Action, FaultProxy, Seen
from tests.e2e.conftest import AGENT_CAPACITY, POOLD_TEST_ENV, Cluster

MiB = 1 << 20
HOST = "failover-host"


@contextlib.contextmanager
def agent_via(cluster: Cluster, urls: list[str]) -> Iterator[Path]:
    """A second host's agent, started on ``urls`` (proxies or poold processes)."""
    cred = cluster.work / f"{HOST}.credential"
    cred.write_text(cluster.admin.add_host(HOST).credential)
    sock = cluster.socket_path.parent / f"{HOST}.sock"
    agent = procs.start_agent(
        cluster.work,
        host=HOST,
        poold_url=urls,
        credential_file=cred,
        socket_path=sock,
        emulated_capacity_bytes=AGENT_CAPACITY,
        heartbeat_interval_s=0.2,
        # A lost reply is given up on after 2 s, not httpx's default 10.
        extra=["--poold-timeout", "2"],
    )
    try:
        yield sock
    finally:
        agent.stop()


def test_a_heartbeat_answered_500_then_200_keeps_every_renewal(any_cluster: Cluster) -> None:
    c = any_cluster
    with (
        FaultProxy(c.port) as proxy,
        agent_via(c, [proxy.url]) as sock,
        PoolClient(sock, timeout_s=10) as client,
    ):
        lease = client.lease(4 * MiB, ttl_s=2, renew=False)
        before = c.admin.show_lease(lease.lease_id)
        failed: list[Seen] = []

        def rule(seen: Seen) -> Action:
            # The heartbeats carrying the tenant's renewal: three 500s, then through.
            if seen.path == "/v1/agent/heartbeat" and len(failed) < 3:
                renewed = [r["lease_id"] for r in seen.json()["renewals"]]
                if lease.lease_id in renewed:
                    failed.append(seen)
                    return 500
            return "pass"

        proxy.rule = rule
        client.renew(lease.lease_id, ttl_s=30)  # accepted by the agent at once
        # Past the original ttl and poold's grace: a renewal lost to a 500 shows here.
        time.sleep(4)
        after = c.admin.show_lease(lease.lease_id)
        assert len(failed) == 3
        assert after.state == "active"
        assert after.expires_at >= before.expires_at + timedelta(seconds=20)
        lease.release()


def test_a_grant_whose_reply_is_lost_is_retried_under_its_id_and_leaks_nothing(
    any_cluster: Cluster,
) -> None:
    c = any_cluster
    with FaultProxy(c.port) as proxy, agent_via(c, [proxy.url]) as sock:
        dropped: list[Seen] = []

        def rule(seen: Seen) -> Action:
            if seen.method == "POST" and seen.path == "/v1/leases" and not dropped:
                dropped.append(seen)
                return "drop"  # poold grants it; the agent never hears
            return "pass"

        proxy.rule = rule
        with PoolClient(sock, timeout_s=30) as client:
            lease = client.lease(4 * MiB, ttl_s=30, renew=False)
            grants = [s.json() for s in proxy.requests("POST", "/v1/leases")]
            assert len(grants) == 2
            assert grants[0]["request_id"] == grants[1]["request_id"]
            assert grants[0]["request_id"]
            # poold answers the repeated id with the lease the first attempt made (the
            # ledger's agent_requests): one lease, the tenant's. Were a second one made,
            # the reconciliation after the failed exchange would end it (the live check).
            deadline = time.monotonic() + 15
            while True:
                on_host = c.admin.list_leases(host=HOST)
                live = [x.id for x in on_host if x.state in ("granted", "active")]
                if live == [lease.lease_id] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert live == [lease.lease_id], [(x.id, x.state) for x in on_host]
            assert [x.id for x in on_host] == [lease.lease_id]
            lease.release()


# One tenant process: lease, renew, release in a loop; a line per finished cycle (its
# wall time), and a traceback and a non-zero exit on the first operation that fails.
TENANT_LOOP = textwrap.dedent(
    """
    import sys, time
    from agent.client import PoolClient
    sock, until = sys.argv[1], float(sys.argv[2])
    with PoolClient(sock, timeout_s=30) as client:
        while time.time() < until:
            lease = client.lease(2 << 20, ttl_s=10, renew=False)
            client.renew(lease.lease_id, ttl_s=10)
            lease.release()
            print(time.time(), flush=True)
    """
)


@pytest.mark.postgres
def test_one_of_two_poold_killed_under_load_fails_no_tenant_operation(
    pg_cluster: Cluster,
) -> None:
    c = pg_cluster
    port = procs.free_port()
    second = procs.start_poold(
        c.work / "poold-2", port, database_url=c.database_url, env=POOLD_TEST_ENV
    )
    try:
        with agent_via(c, [c.url, f"http://127.0.0.1:{port}"]) as sock:
            until = time.time() + 6
            tenants = [
                subprocess.Popen(
                    [sys.executable, "-c", TENANT_LOOP, str(sock), str(until)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(3)
            ]
            time.sleep(2)
            killed_at = time.time()
            c.poold.kill()  # SIGKILL: requests in flight lose their replies
            outcomes = [t.communicate(timeout=90) for t in tenants]
            for tenant, (_out, err) in zip(tenants, outcomes, strict=True):
                assert tenant.returncode == 0, err
            after = [sum(float(t) > killed_at + 0.5 for t in out.split()) for out, _ in outcomes]
            assert all(n > 0 for n in after), after  # every tenant went on working
            # Nothing leaked: every lease of the host ends up released or reclaimed.
            deadline = time.monotonic() + 20
            with procs.admin_client(c.work / "poold-2", port) as admin:
                while True:
                    live = [
                        (x.id, x.state)
                        for x in admin.list_leases(host=HOST)
                        if x.state in ("granted", "active")
                    ]
                    if not live or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            assert live == []
    finally:
        second.stop()
