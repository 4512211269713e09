"""A revocation reaches an agent within a round trip of poold deciding it, not at its next
heartbeat: the agent waits on poold for news (a long poll) and heartbeats when told.

The agent here heartbeats every 30 s, so anything it learns within a few seconds it
learnt from the news; the tenant asks it (a renewal's reply carries the revocation).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from agent.client import PoolClient
from poold import procs
from tests.e2e.conftest import AGENT_CAPACITY, Cluster

MiB = 1 << 20
HOST = "news-host"
SLOW_HEARTBEAT_S = 30.0


@contextlib.contextmanager
def slow_agent(cluster: Cluster) -> Iterator[Path]:
    cred = cluster.work / f"{HOST}.credential"
    cred.write_text(cluster.admin.add_host(HOST).credential)
    sock = cluster.socket_path.parent / f"{HOST}.sock"
    agent = procs.start_agent(
        cluster.work,
        host=HOST,
        poold_url=cluster.url,
        credential_file=cred,
        socket_path=sock,
        emulated_capacity_bytes=AGENT_CAPACITY,
        heartbeat_interval_s=SLOW_HEARTBEAT_S,
    )
    try:
        yield sock
    finally:
        agent.stop()


def test_a_revocation_reaches_the_agent_long_before_its_next_heartbeat(
    any_cluster: Cluster,
) -> None:
    c = any_cluster
    with slow_agent(c) as sock, PoolClient(sock, timeout_s=10) as client:
        lease = client.lease(4 * MiB, ttl_s=120, renew=False)
        time.sleep(1)  # the agent's first wait for news is in poold
        revoked_at = time.monotonic()
        c.admin.revoke(lease.lease_id, reason="failing DIMM", deadline_s=60)
        while True:
            result = client.renew(lease.lease_id, ttl_s=120)
            if result.revoke_deadline_at is not None:
                break
            assert time.monotonic() - revoked_at < 5, "the agent did not hear of it"
            time.sleep(0.1)
        assert time.monotonic() - revoked_at < SLOW_HEARTBEAT_S / 4
        lease.release()
