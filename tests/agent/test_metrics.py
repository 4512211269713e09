"""The agent's metrics endpoint, over a real agent service, socket and poold."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.client import PoolClient
from agent.metrics import MetricsServer, start_metrics_server
from agent.server import AgentServer
from poold.api.client import PooldClient
from tests.agent.conftest import LinkedAgent, emulated_device, linked_agent
from tests.conftest import ThreadedServer

MiB = 1 << 20


def scrape(served: MetricsServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = httpx.get(f"{served.url}/metrics", timeout=10)
    assert resp.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def value(served: MetricsServer, name: str, **labels: str) -> float:
    return scrape(served)[(name, tuple(sorted(labels.items())))]


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


@pytest.fixture
def agent_with_metrics(
    api: ThreadedServer, admin: PooldClient
) -> Iterator[tuple[LinkedAgent, AgentServer, MetricsServer]]:
    directory = Path(tempfile.mkdtemp(prefix="poold-agent-"))  # sun_path is short
    with (
        linked_agent(api.url, admin, emulated_device(64 * MiB), ["alpha"]) as linked,
        AgentServer(directory / "agent.sock", linked.service) as server,
    ):
        server.start_in_thread()
        served = start_metrics_server(linked.service, "127.0.0.1", 0, server=server)
        try:
            yield linked, server, served
        finally:
            served.close()
            shutil.rmtree(directory, ignore_errors=True)


def test_held_leases_connections_and_materialise_time(
    agent_with_metrics: tuple[LinkedAgent, AgentServer, MetricsServer],
) -> None:
    linked, server, served = agent_with_metrics
    first = scrape(served)
    assert first[("pool_agent_leases_held", (("backend", "emulated"),))] == 0
    assert first[("pool_agent_socket_connections", ())] == 0
    assert first[("pool_agent_poold_reachable", ())] == 1
    assert first[("pool_agent_build_info", (("host", "h1"), ("version", first_version(first))))]
    made = (
        "pool_agent_materialise_duration_seconds_count",
        (("backend", "emulated"), ("result", "ok")),
    )
    assert first[made] == 0

    with PoolClient(server.socket_path) as client, client.lease(2 * MiB, tenant="alpha") as lease:
        during = scrape(served)
        assert during[("pool_agent_leases_held", (("backend", "emulated"),))] == 1
        assert during[("pool_agent_held_bytes", (("backend", "emulated"),))] == 2 * MiB
        assert during[("pool_agent_socket_connections", ())] == 1
        assert during[made] == 1
        assert during[("pool_agent_outbox_ops", ())] == 0
        lease_id = lease.lease_id
    eventually(lambda: value(served, "pool_agent_socket_connections") == 0)
    # The release went into the outbox; nothing delivers it here (the link is not started).
    after = scrape(served)
    assert after[("pool_agent_leases_held", (("backend", "emulated"),))] == 0
    assert after[("pool_agent_outbox_ops", ())] == 1
    linked.link.flush()
    assert value(served, "pool_agent_outbox_ops") == 0
    assert linked.client.show_lease(lease_id).state == "released"


def first_version(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> str:
    for name, labels in samples:
        if name == "pool_agent_build_info":
            return dict(labels)["version"]
    raise AssertionError("no pool_agent_build_info")


def test_a_scrub_is_timed_with_its_result(
    agent_with_metrics: tuple[LinkedAgent, AgentServer, MetricsServer],
) -> None:
    linked, _server, served = agent_with_metrics
    failed = (
        "pool_agent_scrub_duration_seconds_count",
        (("backend", "emulated"), ("result", "failed")),
    )
    # A memfd backend has no range to scrub: the scrub fails, is timed, and its verdict
    # waits in the outbox for poold.
    linked.service.memory.scrub_later("emulated", 0, 0, 2 * MiB, "lease-never-granted")
    eventually(lambda: scrape(served).get(failed) == 1)
    assert value(served, "pool_agent_outbox_ops") == 1
    assert value(served, "pool_agent_scrubs_running") == 0


def test_closed_metrics_server_frees_its_port(
    agent_with_metrics: tuple[LinkedAgent, AgentServer, MetricsServer],
) -> None:
    linked, _server, served = agent_with_metrics
    other = start_metrics_server(linked.service, "127.0.0.1", 0)  # no socket server given
    url = other.url
    samples = scrape(other)
    assert ("pool_agent_socket_connections", ()) not in samples
    assert samples[("pool_agent_poold_reachable", ())] == 1
    other.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/metrics", timeout=5)
    assert value(served, "pool_agent_socket_connections") == 0
