"""`poolctl hosts drain --deadline-s N | --now` and `hosts undrain` against a real poold API."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import httpx

from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.ledger.reaper import Reaper, ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, Heartbeat
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20

__all__ = ["agent"]  # the fixture, shared with the other lifecycle commands' tests


def test_host_drain_now_revokes_at_once(api: ThreadedServer, agent: PooldClient) -> None:
    lease_id = lease(agent)
    r = poolctl(api, "hosts", "drain", "h1", "--now", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["state"] == "draining" and out["revoked"] == [lease_id]
    assert [x.lease_id for x in agent.heartbeat(Heartbeat()).revocations] == [lease_id]


def test_host_drain_deadline_is_kept_and_reaped(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient, ledger: Ledger
) -> None:
    # A long ttl: the lease must still be live when the reaper passes the deadline.
    lease_id = agent.grant(GrantRequest(size_bytes=8 * MiB, uid=1000, pid=7, ttl_s=3600)).id
    agent.activate(lease_id)
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "600")
    assert r.exit_code == 0, r.output
    assert "draining" in r.output and "revoked at" in r.output and "1 live lease" in r.output
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "600", "--json")
    deadline = datetime.fromisoformat(json.loads(r.output)["deadline_at"])
    assert utcnow() + timedelta(seconds=590) < deadline
    reaper = Reaper(ledger, ReaperPolicy(), started_at=utcnow() - timedelta(days=1))
    assert reaper.run_once(now=deadline - timedelta(seconds=1)).revoked == []
    assert reaper.run_once(now=deadline + timedelta(seconds=1)).revoked == [lease_id]
    assert admin.show_lease(lease_id).state == "revoking"


def test_host_undrain_cancels_the_deadline(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient, ledger: Ledger
) -> None:
    lease_id = lease(agent)
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "60", "--json")
    deadline = datetime.fromisoformat(json.loads(r.output)["deadline_at"])
    r = poolctl(api, "hosts", "undrain", "h1")
    assert r.exit_code == 0 and "up" in r.output
    reaper = Reaper(ledger, ReaperPolicy(), started_at=utcnow() - timedelta(days=1))
    assert reaper.run_once(now=deadline + timedelta(seconds=1)).revoked == []
    assert admin.show_lease(lease_id).state == "active"
    # Without a deadline the drain is as before: leases run to their end.
    r = poolctl(api, "hosts", "drain", "h1", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["deadline_at"] is None
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "-1")
    assert r.exit_code == 2  # click refuses it before poold is asked


def test_an_older_client_drains_without_a_body(api: ThreadedServer, agent: PooldClient) -> None:
    resp = httpx.post(
        f"{api.url}/v1/hosts/h1/drain", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "draining" and resp.json()["deadline_at"] is None
