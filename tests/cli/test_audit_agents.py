"""`poolctl audit [--reclaim] [--json]` against a real poold API: what agents report.

Leftover sub-devices, unfinished scrubs and holder mismatches are listed; --reclaim
orders leftovers deleted and scrubs re-issued, which the host's next heartbeat reply
carries; a scrub stuck on a host whose agent is down needs a human (exit 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update

from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Host
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import (
    AgentLease,
    GrantRequest,
    Heartbeat,
    InventoryDevice,
    LeaseHolder,
    LeaseOp,
    LeftoverSubDevice,
)
from tests.cli.test_lifecycle import poolctl
from tests.conftest import ThreadedServer

MiB = 1 << 20


@pytest.fixture
def devdax_host(api: ThreadedServer, admin: PooldClient) -> Iterator[PooldClient]:
    credential = admin.add_host("h1").credential
    with PooldClient(api.url, credential) as client:
        client.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid="cxl:region0",
                        kind="devdax",
                        capacity_bytes=256 * MiB,
                        local_name="dax_region0",
                        health="ok",
                    )
                ]
            )
        )
        admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[1000]))
        yield client


def lease(agent: PooldClient) -> str:
    return agent.grant(GrantRequest(size_bytes=8 * MiB, uid=1000, pid=7, activate=True)).id


def test_audit_lists_and_reclaims_what_agents_report(
    api: ThreadedServer, devdax_host: PooldClient, ledger: Ledger
) -> None:
    agent = devdax_host
    held, ended, dirty = lease(agent), lease(agent), lease(agent)
    agent.apply_ops(
        [
            LeaseOp(lease_id=ended, op="release_dirty"),
            LeaseOp(lease_id=ended, op="scrubbed"),
            LeaseOp(lease_id=dirty, op="release_dirty"),
        ]
    )
    with ledger.write() as s:  # `dirty` went to scrubbing long ago
        s.execute(
            update(Event).where(Event.lease_id == dirty).values(at=utcnow() - timedelta(hours=1))
        )
    beat = Heartbeat(
        held_leases=[
            AgentLease(lease_id=held, holders=[LeaseHolder(pid=8, start_time=1.7e9)]),
        ],
        leftovers=[
            LeftoverSubDevice(sub_device="dax0.4", region_id=0, size_bytes=8 * MiB, lease_id=ended)
        ],
    )
    assert agent.heartbeat(beat).revocations == []

    r = poolctl(api, "audit")
    assert r.exit_code == 1, r.output
    for shown in ("leftover_sub_device", "dax0.4", "unfinished_scrub", "holder_mismatch"):
        assert shown in r.output
    r = poolctl(api, "audit", "--json")
    assert r.exit_code == 1
    agents = json.loads(r.output)["agents"]
    assert [(i["kind"], i["lease_id"], i["sub_device"]) for i in agents["leaked"]] == [
        ("leftover_sub_device", ended, "dax0.4")
    ]
    assert [i["lease_id"] for i in agents["unfinished_scrubs"]] == [dirty]
    assert [(i["kind"], i["lease_id"]) for i in agents["holder_mismatches"]] == [
        ("holder_mismatch", held)
    ]

    r = poolctl(api, "audit", "--reclaim", "--json")
    assert r.exit_code == 1, r.output
    agents = json.loads(r.output)["agents"]
    assert agents["leaked"][0]["action"] == "delete_ordered"
    assert agents["unfinished_scrubs"][0]["action"] == "scrub_reissued"
    reply = agent.heartbeat(beat)
    assert [x.lease_id for x in reply.revocations] == [ended]  # delete the leftover
    [order] = reply.scrub
    assert order.lease_id == dirty and order.reissued_at is not None

    # The agent goes down with the scrub unfinished: nobody can zero the range.
    with ledger.write() as s:
        s.execute(
            update(Host).values(status="down", last_heartbeat_at=utcnow() - timedelta(hours=1))
        )
        # ... and the re-issue was long ago too (a re-issue restarts the clock).
        s.execute(
            update(Event).where(Event.lease_id == dirty).values(at=utcnow() - timedelta(hours=1))
        )
    r = poolctl(api, "audit")
    assert r.exit_code == 2 and "needs_human" in r.output and "agent is down" in r.output


def test_audit_still_reads_an_old_agents_lease_ids(
    api: ThreadedServer, devdax_host: PooldClient
) -> None:
    agent = devdax_host
    kept, lost = lease(agent), lease(agent)
    agent.heartbeat(Heartbeat(held=[kept]))
    r = poolctl(api, "audit", "--json")
    report = json.loads(r.output)
    assert report["agents"]["available"] and report["agents"]["unfinished_scrubs"] == []
    # Granted just now: not yet stale (the report may predate it by a few seconds).
    assert report["agents"]["stale"] == [] and r.exit_code == 0
    assert lost not in json.dumps(report["agents"]["leaked"])
