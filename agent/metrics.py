"""What does one agent export to Prometheus, and how is it served?

The agent's own registry (docs/metrics.md lists every series): what it holds, its
outbox, its socket and its link to poold are read at scrape time from the live
objects (`_AgentCollector`); how long backends take to make and to scrub memory is
timed where it happens (agent/memory.py's `LeaseMemory.timed`) into histograms.
`start_metrics_server` serves the registry over HTTP on a host:port of the
operator's choosing, from a daemon thread: a scrape never touches the socket
server's threads or poold.

Label sets are bounded: a backend is a device kind (emulated, devdax, numa), a
result ok or failed, a lease path local or one of the fixed reasons a request went to
poold (agent/delegation.py CENTRAL_REASONS).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.delegation import LOCAL
from agent.server import AgentServer
from agent.service import AgentService
from poold import __version__

# Making a memfd is microseconds, carving a dax sub-device tens of ms; a scrub zeroes
# gigabytes (seconds to minutes).
MATERIALISE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
SCRUB_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
BACKEND_KINDS = ("emulated", "devdax", "numa")


class AgentMetrics:
    """One agent's registry, over its service (and socket server, when it has one).

    One per service: it installs itself as the service's memory timing hook.
    """

    def __init__(self, service: AgentService, server: AgentServer | None = None) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Info("pool_agent_build", "The agent's version and host", registry=self.registry).info(
            {"version": __version__, "host": service.host}
        )
        self.materialise_seconds = Histogram(
            "pool_agent_materialise_duration_seconds",
            "How long a backend took to make a lease's memory, by device kind and result",
            ["backend", "result"],
            buckets=MATERIALISE_BUCKETS,
            registry=self.registry,
        )
        self.scrub_seconds = Histogram(
            "pool_agent_scrub_duration_seconds",
            "How long zeroing a released devdax range took, by device kind and result",
            ["backend", "result"],
            buckets=SCRUB_BUCKETS,
            registry=self.registry,
        )
        for kind in BACKEND_KINDS:  # exported from the start, so rate() sees the first one
            self.materialise_seconds.labels(kind, "ok")
        self.scrub_seconds.labels("devdax", "ok")  # only devdax ranges are scrubbed
        self.registry.register(_AgentCollector(service, server))
        service.memory.timed = self.timed

    def timed(self, what: str, backend: str, ok: bool, seconds: float) -> None:
        """agent/memory.py's hook: one make or scrub took `seconds`."""
        histogram = self.scrub_seconds if what == "scrub" else self.materialise_seconds
        histogram.labels(backend, "ok" if ok else "failed").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AgentCollector(Collector):
    """The agent's gauges, read from its live objects at each scrape."""

    def __init__(self, service: AgentService, server: AgentServer | None) -> None:
        self.service = service
        self.server = server

    def describe(self) -> Iterator[Metric]:
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        f = _families()
        service = self.service
        held = service.held.all()
        by_kind: dict[str, tuple[int, int]] = {}
        for h in held:
            kind = str(h.memory.backend if h.memory is not None else h.lease.device_kind)
            count, length = by_kind.get(kind, (0, 0))
            by_kind[kind] = (count + 1, length + h.lease.length_bytes)
        for kind in sorted({*BACKEND_KINDS, *by_kind}):
            count, length = by_kind.get(kind, (0, 0))
            f["held"].add_metric([kind], count)
            f["held_bytes"].add_metric([kind], length)
        f["revoked_held"].add_metric([], len(service.held.revoked_held_ids()))
        f["lost"].add_metric([], sum(1 for h in held if h.lost))
        running, _tied = service.memory.scrubs([])
        f["scrubs"].add_metric([], len(running))
        f["outbox"].add_metric([], service.link.outbox_size())
        f["reachable"].add_metric([], 0.0 if service.link.failing else 1.0)
        f["waiting"].add_metric([], service.admission.waiting())
        f["wanted"].add_metric([], service.admission.wanted_bytes())
        if self.server is not None:
            f["connections"].add_metric([], self.server.connection_count)
        local = service.delegation
        for reason, count in local.capacity.paths().items():
            path = LOCAL if reason == LOCAL else "central"
            f["paths"].add_metric([path, "" if reason == LOCAL else reason], count)
        f["reserved"].add_metric([], local.capacity.reserved_bytes())
        f["reserved_free"].add_metric([], local.capacity.free_reserved_bytes())
        f["uncommitted"].add_metric([], local.uncommitted_count())
        expires_in = local.capacity.expires_in()
        if expires_in is not None:
            f["expires_in"].add_metric([], expires_in)
        yield from (family for family in f.values() if family.samples)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    return {
        "held": _gauge(
            "pool_agent_leases_held", "Leases this agent holds memory for, by backend", ("backend",)
        ),
        "held_bytes": _gauge(
            "pool_agent_held_bytes",
            "Bytes of the leases this agent holds, by backend",
            ("backend",),
        ),
        "revoked_held": _gauge(
            "pool_agent_revoked_held_leases",
            "Revoked memfd leases whose live holder still maps the pages",
        ),
        "lost": _gauge("pool_agent_lost_leases", "Held leases poold has ended or revoked"),
        "scrubs": _gauge("pool_agent_scrubs_running", "Released devdax ranges being zeroed now"),
        "outbox": _gauge(
            "pool_agent_outbox_ops", "Lease ops (releases, aborts, scrub verdicts) not yet in poold"
        ),
        "reachable": _gauge(
            "pool_agent_poold_reachable", "1 when the last exchange with poold succeeded"
        ),
        "waiting": _gauge(
            "pool_agent_admission_waiting_requests", "Lease requests waiting for capacity"
        ),
        "wanted": _gauge(
            "pool_agent_admission_wanted_bytes",
            "Bytes the oldest waiting lease request needs (what pressure asks back)",
        ),
        "connections": _gauge(
            "pool_agent_socket_connections", "Tenant connections open on the agent's socket"
        ),
        "paths": CounterMetricFamily(
            "pool_agent_grant_attempts",
            "Lease grant attempts by path: granted inside the delegation (local), or sent to "
            "poold (central) and why; a request that waits for capacity may try again",
            labels=["path", "reason"],
        ),
        "reserved": _gauge(
            "pool_agent_reserved_bytes", "Bytes of the unexpired reservations this agent holds"
        ),
        "reserved_free": _gauge(
            "pool_agent_reserved_free_bytes",
            "Bytes of those reservations no local lease occupies (what local grants draw on)",
        ),
        "uncommitted": _gauge(
            "pool_agent_local_leases_uncommitted",
            "Leases granted locally whose grant poold has not applied yet",
        ),
        "expires_in": _gauge(
            "pool_agent_delegation_expires_in_seconds",
            "Seconds until the last held reservation's TTL ends unless poold renews it "
            "(negative: past it; absent: none held)",
        ),
    }


@dataclass
class MetricsServer:
    """The agent's metrics endpoint, serving until :meth:`close`."""

    metrics: AgentMetrics
    host: str
    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(
    service: AgentService, host: str, port: int, *, server: AgentServer | None = None
) -> MetricsServer:
    """Serve `service`'s metrics at http://host:port/metrics from a daemon thread.

    `port` 0 picks a free port (`MetricsServer.port` says which). `server`: the socket
    server, for the connection count (left out, that gauge is not exported). Binding
    loopback is the safe default: the series name tenants and hosts.
    """
    metrics = AgentMetrics(service, server)
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(metrics, host, httpd, thread)
