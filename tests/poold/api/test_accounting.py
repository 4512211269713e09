"""GET /v1/accounting: usage now, GiB-hours and cost over a period, on both ledgers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from poold.api.client import PooldClient
from poold.errors import BadRequest, Forbidden
from poold.ledger.accounting import HOURS_PER_MONTH
from poold.ledger.db import Ledger
from poold.ledger.models import Lease
from poold.settings import PooldSettings
from poold.wire.admin import DeviceAnnotate
from poold.wire.agent import GrantRequest, Heartbeat, LeaseReport
from tests.conftest import ThreadedServer
from tests.poold.api.conftest import Agent, Raw
from tests.poold.conftest import UID, MiB

T0 = datetime(2026, 12, 1, 8, tzinfo=UTC)
H = timedelta(hours=1)


def grant(agent: Agent, size: int, *, activate: bool = True) -> str:
    req = GrantRequest(size_bytes=size, uid=UID, pid=42, activate=activate)
    return agent.client.grant(req).id


def set_times(ledger: Ledger, lease_id: str, granted: datetime, ended: datetime | None) -> None:
    with ledger.write() as s:
        s.execute(
            update(Lease).where(Lease.id == lease_id).values(granted_at=granted, ended_at=ended)
        )


def test_gib_hours_cost_and_ddr4_savings_over_a_period(
    api: ThreadedServer, agent: Agent, admin: PooldClient, ledger: Ledger
) -> None:
    ended = grant(agent, 8 * MiB)
    agent.client.release(ended)
    live = grant(agent, 16 * MiB)
    aborted = grant(agent, 4 * MiB, activate=False)
    agent.client.abort(aborted)
    before = grant(agent, 2 * MiB)  # granted and released before the period
    agent.client.release(before)
    set_times(ledger, ended, T0 - H, T0 + 2 * H)  # 2 h inside
    set_times(ledger, live, T0 + 4 * H, None)  # 6 h, to until
    set_times(ledger, aborted, T0 + H, T0 + 2 * H)  # never served
    set_times(ledger, before, T0 - 5 * H, T0 - H)
    # What the agent said about the device is overridden by the administrator.
    admin.annotate_device(
        agent.device.uid, DeviceAnnotate(media="ddr4", recycled=True, cost_per_gib_month=3.0)
    )
    period = {"since": T0, "until": T0 + 10 * H}

    report = admin.accounting("media", **period)
    assert report.ddr5_cost_per_gib_month is None
    (row,) = report.served
    gib_h = (8 * 2 + 16 * 6) / 1024
    assert (row.tenant, row.media) == ("t1", "ddr4")
    assert row.gib_hours == pytest.approx(gib_h) and row.recycled_gib_hours == pytest.approx(gib_h)
    assert row.cost == pytest.approx(gib_h * 3.0 / HOURS_PER_MONTH)
    assert row.unpriced_gib_hours == 0.0 and row.savings is None
    assert report.served_total.gib_hours == pytest.approx(gib_h)
    assert report.since == T0 and report.until == T0 + 10 * H
    assert [g.group for g in report.groups] == ["ddr4"] and report.pool.leased_bytes == 16 * MiB

    # server.py hands the configured DDR5 price to the app this way.
    api.server.config.app.state.ddr5_cost_per_gib_month = 9.0
    report = admin.accounting("tenant", **period)
    assert report.ddr5_cost_per_gib_month == 9.0
    assert report.served[0].savings == pytest.approx(gib_h * (9.0 - 3.0) / HOURS_PER_MONTH)
    assert report.served_total.savings == report.served[0].savings


def test_default_period_is_the_last_30_days_and_naive_times_are_utc(
    agent: Agent, admin: PooldClient, raw: Raw
) -> None:
    grant(agent, 2 * MiB)
    report = admin.accounting()
    assert report.until - report.since == timedelta(days=30)
    assert report.served[0].gib_hours > 0 and report.served[0].unpriced_gib_hours > 0
    r = raw.request("GET", "/v1/accounting?since=2026-12-01T00:00:00&until=2026-12-02T00:00:00")
    assert r.status_code == 200, r.text
    assert r.json()["since"].startswith("2026-12-01T00:00:00") and r.json()["by"] == "tenant"


def test_usage_by_every_grouping(agent: Agent, other_agent: Agent, admin: PooldClient) -> None:
    a = grant(agent, 8 * MiB)
    grant(other_agent, 4 * MiB)
    agent.client.heartbeat(
        Heartbeat(
            reports=[
                LeaseReport(
                    lease_id=a,
                    used_bytes=6 * MiB,
                    exclusive_bytes=2 * MiB,
                    replica_bytes=4 * MiB,
                    exclusive_blocks=2,
                    replica_blocks=4,
                )
            ]
        )
    )
    expected = {
        "tenant": {"t1": 12 * MiB},
        "host": {"h1": 8 * MiB, "h2": 4 * MiB},
        "device": {agent.device.uid: 8 * MiB, other_agent.device.uid: 4 * MiB},
        "media": {"emulated": 12 * MiB},
    }
    for by, leased in expected.items():
        report = admin.accounting(by)  # type: ignore[arg-type]
        assert report.by == by
        assert {g.group: g.leased_bytes for g in report.groups} == leased
        assert report.pool.exclusive_ratio == pytest.approx(2 / 12)
        assert (report.pool.used_bytes, report.pool.replica_blocks) == (6 * MiB, 4)
        assert (report.pool.leases, report.pool.reported_leases) == (2, 1)
    host = {g.group: g for g in admin.accounting("host").groups}
    assert host["h1"].exclusive_ratio == pytest.approx(2 / 8) and host["h2"].used_bytes == 0


def test_accounting_is_for_the_administrator_and_checks_its_input(
    agent: Agent, admin: PooldClient, raw: Raw
) -> None:
    with pytest.raises(Forbidden):
        agent.client.accounting()
    with pytest.raises(BadRequest):
        admin.accounting(since=T0, until=T0)
    for query in ("by=rack", "since=yesterday", "until=2026-13-01"):
        r = raw.request("GET", f"/v1/accounting?{query}")
        assert r.status_code == 400 and r.json()["code"] == "bad_request", query


def test_ddr5_price_setting_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POOLD_DDR5_COST_PER_GIB_MONTH", raising=False)
    assert PooldSettings().ddr5_cost_per_gib_month is None
    monkeypatch.setenv("POOLD_DDR5_COST_PER_GIB_MONTH", "7.5")
    assert PooldSettings().ddr5_cost_per_gib_month == 7.5
