"""poold's /metrics over real HTTP: the ledger's gauges, the process's counters, an outage.

The dashboard and the metrics page are checked against a real scrape too: every series
docs/metrics.md lists, and every one docs/grafana/poold.json queries, exists after a
lease cycle through a real agent service (poold's and the agent's endpoints both).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.client import PoolClient
from agent.metrics import start_metrics_server
from agent.server import AgentServer
from poold import procs
from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.wire.agent import GrantRequest, Heartbeat, LeaseReport
from tests import pg
from tests.agent.conftest import emulated_device, linked_agent
from tests.conftest import ThreadedServer, drop_pg_database, new_pg_database
from tests.poold.api.conftest import Agent, Raw
from tests.poold.conftest import GID, UID, MiB

DOCS = Path(__file__).resolve().parents[3] / "docs"
GRANT = GrantRequest(tenant="t1", size_bytes=3 * MiB, uid=UID, gids=[GID], pid=4242)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of a /metrics answer, by (name, sorted labels)."""
    resp = httpx.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def lease_cycle(agent: Agent) -> str:
    """Grant, activate, report, release one lease of t1 on h1; its id."""
    lease = agent.client.grant(GRANT)
    agent.client.activate(lease.id)
    agent.client.heartbeat(
        Heartbeat(
            agent_version="test",
            reports=[
                LeaseReport(
                    lease_id=lease.id, used_bytes=MiB, exclusive_bytes=MiB // 2, replica_bytes=1024
                )
            ],
        )
    )
    return lease.id


def test_a_scrape_reports_the_pool_as_the_ledger_has_it(
    api: ThreadedServer, admin: PooldClient, agent: Agent, raw: Raw
) -> None:
    before = scrape(api.url)
    assert value(before, "poold_ledger_up") == 1
    assert value(before, "poold_lease_transitions_total", kind="grant") == 0
    lease_id = lease_cycle(agent)
    admin.audit()
    during = scrape(api.url)
    dev = "h1/emulated:0"
    assert value(during, "poold_device_capacity_bytes", device=dev) == 64 * MiB
    assert value(during, "poold_device_leased_bytes", device=dev) == 4 * MiB  # aligned to 2 MiB
    assert value(during, "poold_device_free_bytes", device=dev) == 60 * MiB
    assert value(during, "poold_device_largest_free_extent_bytes", device=dev) == 60 * MiB
    assert value(during, "poold_device_reserved_bytes", device=dev) == 0
    assert value(during, "poold_device_live_leases", device=dev) == 1
    assert value(during, "poold_device_info", device=dev, kind="emulated", media="emulated") == 1
    assert value(during, "poold_device_health", device=dev, health="ok") == 1
    assert value(during, "poold_device_health", device=dev, health="critical") == 0
    assert value(during, "poold_device_state", device=dev, state="online") == 1
    assert value(during, "poold_tenant_quota_bytes", tenant="t1") == 32 * MiB
    assert value(during, "poold_tenant_quota_leases", tenant="t1") == 8
    assert value(during, "poold_tenant_leased_bytes", tenant="t1") == 4 * MiB
    assert value(during, "poold_tenant_live_leases", tenant="t1") == 1
    assert value(during, "poold_tenant_used_bytes", tenant="t1") == MiB
    assert value(during, "poold_tenant_exclusive_bytes", tenant="t1") == MiB // 2
    assert value(during, "poold_tenant_replica_bytes", tenant="t1") == 1024
    assert value(during, "poold_host_up", host="h1") == 1
    assert value(during, "poold_host_status", host="h1", status="up") == 1
    assert 0 <= value(during, "poold_host_heartbeat_age_seconds", host="h1") < 30
    assert value(during, "poold_host_leased_bytes", host="h1") == 4 * MiB
    assert value(during, "poold_live_leases", state="active") == 1
    assert value(during, "poold_live_leases", state="granted") == 0
    assert value(during, "poold_audit_last_exit_code") in (0, 1)
    assert value(during, "poold_audit_last_run_timestamp_seconds") > 0
    assert sum(v for (n, lab), v in during.items() if n == "poold_audit_runs_total") == 1
    # In process: transitions committed here, requests by route name, never raw paths.
    assert value(during, "poold_lease_transitions_total", kind="grant") == 1
    assert value(during, "poold_lease_transitions_total", kind="activate") == 1
    assert value(during, "poold_http_requests_total", route="grant", status="201") == 1
    assert value(during, "poold_http_request_duration_seconds_count", route="grant") == 1
    assert value(during, "poold_http_request_duration_seconds_count", route="activate") == 1
    assert not any(lab and "v1" in dict(lab).get("route", "") for _, lab in during)

    agent.client.release(lease_id)
    # A refused request is counted by its code and its route.
    assert raw.request("GET", "/v1/tenants/nobody").status_code == 404
    assert raw.request("GET", "/v1/no/such/path").status_code == 404
    after = scrape(api.url)
    assert value(after, "poold_lease_transitions_total", kind="release") == 1
    assert value(after, "poold_device_leased_bytes", device=dev) == 0
    assert value(after, "poold_device_free_bytes", device=dev) == 64 * MiB
    assert value(after, "poold_tenant_live_leases", tenant="t1") == 0
    assert value(after, "poold_live_leases", state="active") == 0
    assert value(after, "poold_api_errors_total", code="unknown_tenant") == 1
    assert value(after, "poold_http_requests_total", route="get_tenant", status="404") == 1
    assert value(after, "poold_http_requests_total", route="unmatched", status="404") == 1
    assert value(after, "process_resident_memory_bytes") > 0


def test_a_retried_or_failed_transaction_is_not_counted(api: ThreadedServer, agent: Agent) -> None:
    """Counted at COMMIT: a grant refused for quota wrote nothing, so counts nothing."""
    big = GRANT.model_copy(update={"size_bytes": 33 * MiB})
    with pytest.raises(Exception, match="quota"):
        agent.client.grant(big)
    lease = agent.client.grant(GRANT)
    samples = scrape(api.url)
    assert value(samples, "poold_lease_transitions_total", kind="grant") == 1
    assert value(samples, "poold_api_errors_total", code="quota_exceeded") == 1
    agent.client.release(lease.id)


def test_the_worker_cpu_of_each_route_is_counted_refusals_included(
    api: ThreadedServer, agent: Agent
) -> None:
    """Where poold's CPU goes, by route, without a profiler: the worker thread's CPU of
    every threaded request, a refused one too; routes not run have no sample."""
    before = scrape(api.url)
    assert ("poold_request_cpu_seconds_total", (("route", "grant"),)) not in before
    big = GRANT.model_copy(update={"size_bytes": 33 * MiB})
    with pytest.raises(Exception, match="quota"):
        agent.client.grant(big)
    after_refusal = value(scrape(api.url), "poold_request_cpu_seconds_total", route="grant")
    assert after_refusal > 0
    lease_cycle(agent)
    samples = scrape(api.url)
    assert value(samples, "poold_request_cpu_seconds_total", route="grant") > after_refusal
    assert value(samples, "poold_request_cpu_seconds_total", route="heartbeat") > 0
    assert ("poold_request_cpu_seconds_total", (("route", "delegate"),)) not in samples


def test_several_poold_on_one_ledger_report_the_same_gauges(
    ledger: Ledger, api: ThreadedServer, agent: Agent
) -> None:
    lease_cycle(agent)
    with ThreadedServer(ledger) as second:
        one, two = scrape(api.url), scrape(second.url)
    pool = {k: v for k, v in one.items() if k[0].startswith(("poold_device_", "poold_tenant_"))}
    assert pool and pool == {k: two[k] for k in pool}
    # What the process did is its own: the second poold granted nothing.
    assert value(two, "poold_lease_transitions_total", kind="grant") == 0


def test_a_scrape_while_the_ledger_cannot_be_opened_still_answers(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'gone' / 'ledger.db'}")
    try:
        with ThreadedServer(ledger) as server:
            samples = scrape(server.url)
            again = scrape(server.url)
    finally:
        ledger.dispose()
    assert value(samples, "poold_ledger_up") == 0
    assert value(again, "poold_ledger_down_seconds") > 0
    assert value(samples, "process_resident_memory_bytes") > 0
    assert not any(n.startswith("poold_device_") for n in names(samples))


@pytest.mark.postgres
def test_a_scrape_after_the_database_went_away_still_answers(pg_server: pg.PgServer) -> None:
    template: str = "poold_template"
    name = new_pg_database(pg_server, template)
    ledger = Ledger(pg_server.url(name))
    try:
        with ThreadedServer(ledger) as server:
            assert value(scrape(server.url), "poold_ledger_up") == 1
            drop_pg_database(pg_server, name)  # WITH (FORCE): our connections are killed
            samples = scrape(server.url)
            assert value(samples, "poold_ledger_up") == 0
            assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
    finally:
        ledger.dispose()
        drop_pg_database(pg_server, name)


# --- the documentation and the dashboard against a real scrape ------------------------

_DOC_SERIES = re.compile(r"^\| `((?:poold|pool_agent|process)_[a-z0-9_]+)`", re.MULTILINE)
# A metric name in PromQL: our prefixes, then word characters (not a label or function).
_PROMQL_NAME = re.compile(r"\b((?:poold|pool_agent)_[a-z0-9_]+)\b")
_HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def documented_series() -> set[str]:
    found = set(_DOC_SERIES.findall((DOCS / "metrics.md").read_text()))
    assert len(found) > 30, "docs/metrics.md lists its series as `| `name` | ...` rows"
    return found


def dashboard_series() -> set[str]:
    board = json.loads((DOCS / "grafana" / "poold.json").read_text())
    exprs = [
        target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(exprs) > 10
    found = {m for expr in exprs for m in _PROMQL_NAME.findall(expr)}
    # A label value such as {route="grant"} holds no metric name of ours; variables neither.
    return found


def present(series: str, samples: Samples) -> bool:
    have = names(samples)
    if series in have:
        return True
    # A histogram or counter is documented by its family name; its samples carry suffixes.
    return any(f"{series}{suffix}" in have for suffix in (*_HISTOGRAM_PARTS, "_total", "_info"))


@pytest.fixture
def after_a_cycle(api: ThreadedServer, admin: PooldClient) -> Iterator[tuple[Samples, Samples]]:
    """A lease cycle through a real agent service and socket; poold's and the agent's scrape."""
    device = emulated_device(64 * MiB)
    directory = Path(tempfile.mkdtemp(prefix="poold-metrics-"))  # sun_path is short
    with (
        linked_agent(api.url, admin, device, ["alpha"]) as linked,
        AgentServer(directory / "agent.sock", linked.service) as server,
    ):
        server.start_in_thread()
        served = start_metrics_server(linked.service, "127.0.0.1", 0, server=server)
        try:
            with PoolClient(server.socket_path) as client:
                with client.lease(2 * MiB, tenant="alpha", ttl_s=30) as lease:
                    lease.report(used_bytes=MiB, exclusive_bytes=MiB, replica_bytes=0)
                    linked.link.heartbeat()
                    admin.audit()
                    during = scrape(api.url), scrape(served.url)
                linked.link.flush()  # the release reaches poold
            # Demand, then a delegation step: the agent holds a reservation, and the
            # series that say so (the TTL left) are exported from then on.
            linked.service.delegation.capacity.note_demand("alpha", "emulated", 2 * MiB)
            linked.service.delegation.step()
            assert linked.service.delegation.capacity.reservations()
            yield during[0], {**during[1], **scrape(served.url)}
        finally:
            served.close()
            shutil.rmtree(directory, ignore_errors=True)


def test_every_documented_series_exists_after_a_lease_cycle(
    after_a_cycle: tuple[Samples, Samples],
) -> None:
    poold, agent = after_a_cycle
    missing = sorted(s for s in documented_series() if not present(s, {**poold, **agent}))
    assert not missing, f"documented but not exported: {missing}"


def test_every_dashboard_series_exists_after_a_lease_cycle(
    after_a_cycle: tuple[Samples, Samples],
) -> None:
    poold, agent = after_a_cycle
    missing = sorted(s for s in dashboard_series() if not present(s, {**poold, **agent}))
    assert not missing, f"queried by docs/grafana/poold.json but not exported: {missing}"


def test_every_exported_series_is_documented(after_a_cycle: tuple[Samples, Samples]) -> None:
    poold, agent = after_a_cycle
    documented = documented_series()

    def listed(name: str) -> bool:
        base = name.removesuffix("_created")  # a counter's or histogram's creation time
        forms = {base, f"{base}_total"}
        forms |= {base.removesuffix(suffix) for suffix in _HISTOGRAM_PARTS}
        return bool(forms & documented)

    ours = {n for n in names({**poold, **agent}) if n.startswith(("poold_", "pool_agent_"))}
    undocumented = sorted(n for n in ours if not listed(n))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"


def test_names_follow_prometheus_conventions(after_a_cycle: tuple[Samples, Samples]) -> None:
    poold, agent = after_a_cycle
    for name in names({**poold, **agent}):
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), name
        assert not name.endswith(("_ms", "_milliseconds", "_kb", "_mib")), name


def test_a_real_poold_serve_counts_its_reaper_passes(tmp_path: Path) -> None:
    """server.py wires the reaper to the metrics: the first pass and the thread's."""
    port = procs.free_port()
    child = procs.start_poold(tmp_path / "state", port, env={"POOLD_REAP_INTERVAL_S": "0.1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while value(scrape(url), "poold_reaper_runs_total", result="ok") < 3:
            assert time.monotonic() < deadline, "the reaper passes were never counted"
            time.sleep(0.1)
        samples = scrape(url)
        assert value(samples, "poold_reaper_run_duration_seconds_count") >= 3
        assert value(samples, "poold_ledger_up") == 1
    finally:
        child.stop()
