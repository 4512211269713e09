"""`poolctl accounting` against a real poold API, on both ledger backends."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner, Result

import cli.poolctl
from cli.accounting import parse_time
from poold.api.client import PooldClient
from poold.wire.admin import DeviceAnnotate, TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice, LeaseReport
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20
DEVICE = "cxl:ram:serials=7:ways=1:gran=4096:size=536870912"


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        cli.poolctl.main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "250"}
    )


@pytest.fixture
def reported(api: ThreadedServer, admin: PooldClient) -> str:
    """One 64 MiB lease on recycled DDR4 at 2.5/GiB-month, 16 MiB exclusive, 32 MiB replica."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[1000]))
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=DEVICE,
                        kind="numa",
                        media="ddr4",
                        recycled=True,
                        cost_per_gib_month=4.0,
                        capacity_bytes=512 * MiB,
                        local_name="node2",
                        numa_node=2,
                    )
                ]
            )
        )
        lease = agent.grant(GrantRequest(size_bytes=64 * MiB, uid=1000, pid=42, activate=True))
        reply = agent.heartbeat(
            Heartbeat(
                reports=[
                    LeaseReport(
                        lease_id=lease.id,
                        used_bytes=48 * MiB,
                        exclusive_bytes=16 * MiB,
                        replica_bytes=32 * MiB,
                        exclusive_blocks=16,
                        replica_blocks=32,
                    )
                ]
            )
        )
        assert reply.report_errors == []
    admin.annotate_device(DEVICE, DeviceAnnotate(cost_per_gib_month=2.5))  # the admin wins
    return lease.id


def test_accounting_table(api: ThreadedServer, reported: str) -> None:
    r = poolctl(api, "accounting", "--by", "device")
    assert r.exit_code == 0, r.output
    for text in (DEVICE, "64.0 MiB", "48.0 MiB", "16.0 MiB", "32.0 MiB", "25.0%", "t1", "ddr4"):
        assert text in r.output, text
    assert "exclusive ratio 25.0%" in r.output
    assert "no DDR5 price configured" in r.output
    api.server.config.app.state.ddr5_cost_per_gib_month = 10.0
    r = poolctl(api, "accounting", "--by", "media")
    assert r.exit_code == 0, r.output
    assert "recycled DDR4 saved" in r.output and "10.00 per GiB-month" in r.output


def test_accounting_json_over_a_period(api: ThreadedServer, reported: str) -> None:
    api.server.config.app.state.ddr5_cost_per_gib_month = 10.0
    r = poolctl(api, "accounting", "--json", "--by", "host", "--since", "1h", "--until", "now")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["by"] == "host" and [g["group"] for g in data["groups"]] == ["h1"]
    pool = data["pool"]
    assert (pool["leased_bytes"], pool["exclusive_bytes"], pool["replica_bytes"]) == (
        64 * MiB,
        16 * MiB,
        32 * MiB,
    )
    assert pool["exclusive_ratio"] == 0.25
    (row,) = data["served"]
    # The lease was granted moments ago: a few seconds of 1/16 GiB.
    assert row["tenant"] == "t1" and row["media"] == "ddr4"
    assert 0 < row["gib_hours"] < 0.01
    assert row["cost"] == pytest.approx(row["gib_hours"] * 2.5 / 730)
    assert row["savings"] == pytest.approx(row["gib_hours"] * 7.5 / 730)
    since = datetime.fromisoformat(data["since"])
    until = datetime.fromisoformat(data["until"])
    assert until - since == pytest.approx(timedelta(hours=1), abs=timedelta(seconds=5))


def test_accounting_bad_input(api: ThreadedServer) -> None:
    r = poolctl(api, "accounting", "--since", "last tuesday")
    assert r.exit_code == 2 and "not a time" in r.output
    r = poolctl(api, "accounting", "--by", "rack")
    assert r.exit_code == 2
    r = poolctl(api, "accounting", "--since", "2026-12-02", "--until", "2026-12-01")
    assert r.exit_code == 1 and "error[bad_request]" in r.output


def test_parse_time() -> None:
    now = datetime(2026, 12, 9, 12, tzinfo=UTC)
    assert parse_time("now", now) == now
    assert parse_time("7d", now) == now - timedelta(days=7)
    assert parse_time("12h ago", now) == now - timedelta(hours=12)
    assert parse_time("90m", now) == now - timedelta(minutes=90)
    assert parse_time("2026-12-01", now) == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_time("2026-12-01T08:00+01:00", now) == datetime(2026, 12, 1, 7, tzinfo=UTC)
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday", now)
