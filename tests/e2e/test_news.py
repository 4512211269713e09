"""A revocation reaches an agent within a round trip of poold deciding it, not at its next
heartbeat: the agent waits on poold for news (a long poll) and heartbeats when told.

The agent here heartbeats every 30 s, so anything it learns within a few seconds it
learnt from the news; the tenant asks it (a renewal's reply carries the revocation).
"""

from __future__ import annotations

import time

from agent.client import PoolClient
from tests.e2e.conftest import SLOW_HEARTBEAT_S, Cluster, slow_agent

MiB = 1 << 20
HOST = "news-host"


def test_a_revocation_reaches_the_agent_long_before_its_next_heartbeat(
    any_cluster: Cluster,
) -> None:
    c = any_cluster
    with slow_agent(c, HOST) as sock, PoolClient(sock, timeout_s=10) as client:
        lease = client.lease(4 * MiB, ttl_s=120, renew=False)
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
