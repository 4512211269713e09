"""What does poold export at /metrics, and where does each figure come from?

Two sources (docs/metrics.md lists every series):

* The pool as the ledger has it (devices, tenants, hosts, live leases, the last
  audit) is read at scrape time by `_LedgerCollector`, in one read transaction
  (`poold.ledger.metrics_views.pool_view`), never kept in this process: several
  poold on one PostgreSQL report the same figures. A scrape while the ledger is
  down still answers, with `poold_ledger_up 0` and the process's own series.
* What this process did (requests by route, lease transitions it committed, API
  errors by code, reaper passes, audits) are counters and histograms kept here.

Label sets are bounded: a route is its name in `poold.wire.routes` (never the raw
path), a transition its kind, an error its stable code; devices, tenants and hosts
are the ledger's rows.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poold import __version__
from poold.errors import LedgerUnavailable
from poold.lease_states import LeaseEvent
from poold.ledger.db import Ledger
from poold.ledger.metrics_views import PoolView, count_committed_events, pool_view
from poold.wire.common import DeviceState, HealthState

log = logging.getLogger("poold.metrics")

# Request latency buckets: a grant is a few ms, a 100,000-lease heartbeat seconds.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REAPER_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
# Every kind a lease event can have ("lease.<kind>"): exported from the start at 0, so
# that rate() sees the first one.
TRANSITION_KINDS = ("grant", "shrink", *(e.value for e in LeaseEvent))
DEVICE_STATES: tuple[str, ...] = typing.get_args(DeviceState)
HEALTH_STATES: tuple[str, ...] = typing.get_args(HealthState)
HOST_STATUSES = ("up", "down", "draining")
UNMATCHED_ROUTE = "unmatched"  # a 404 or 405: no route of the table
SCRAPE_ERROR_LOG_EVERY_S = 60.0


class PooldMetrics:
    """poold's registry: the ledger collector, process metrics and the in-process series."""

    def __init__(self, ledger: Ledger) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Info("poold_build", "The poold version serving", registry=self.registry).info(
            {"version": __version__}
        )
        self.requests = Counter(
            "poold_http_requests",
            "HTTP requests answered, by route name and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "poold_http_request_duration_seconds",
            "Time from a request's arrival to the end of its reply, by route name",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.transitions = Counter(
            "poold_lease_transitions",
            "Lease events this process committed, by kind (grant, activate, release, ...)",
            ["kind"],
            registry=self.registry,
        )
        for kind in TRANSITION_KINDS:
            self.transitions.labels(kind)
        self.reaper_runs = Counter(
            "poold_reaper_runs",
            "Reaper passes run by this process, by result (ok, ledger_unavailable, failed)",
            ["result"],
            registry=self.registry,
        )
        for result in ("ok", "ledger_unavailable", "failed"):
            self.reaper_runs.labels(result)
        self.reaper_seconds = Histogram(
            "poold_reaper_run_duration_seconds",
            "How long one reaper pass took",
            buckets=REAPER_BUCKETS,
            registry=self.registry,
        )
        self.audit_runs = Counter(
            "poold_audit_runs",
            "Audits run through this process's API, by exit code (0 clean, 1 findings, "
            "2 violations) or 'failed'",
            ["result"],
            registry=self.registry,
        )
        for result in ("0", "1", "2", "failed"):
            self.audit_runs.labels(result)
        self.registry.register(_LedgerCollector(ledger))
        count_committed_events(ledger, self.committed)

    def committed(self, kinds: list[str]) -> None:
        """One transaction's events committed: count its lease transitions."""
        for kind in kinds:
            if kind.startswith("lease."):
                self.transitions.labels(kind.removeprefix("lease.")).inc()

    def request(self, route: str, status: int | None, seconds: float) -> None:
        """One request answered (`status` None: the client left before a reply started)."""
        self.requests.labels(route, str(status) if status is not None else "none").inc()
        self.request_seconds.labels(route).observe(seconds)

    def reaper_pass(self, result: str, seconds: float) -> None:
        self.reaper_runs.labels(result).inc()
        self.reaper_seconds.observe(seconds)

    def audit_run(self, exit_code: int | None) -> None:
        self.audit_runs.labels(str(exit_code) if exit_code is not None else "failed").inc()

    def render(self) -> bytes:
        """The text exposition of every series (reads the ledger: call it in a worker thread)."""
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class _LedgerCollector(Collector):
    """The pool's gauges, read from the ledger at each scrape (one read transaction)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._last_error_log = 0.0

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would collect, i.e. read the ledger, at register.
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            view: PoolView | None = pool_view(self.ledger)
        except Exception as exc:  # a scrape answers whatever the ledger does
            view = None
            self._log_failure(exc)
        up, took, down = _status_families()
        up.add_metric([], 1.0 if view is not None else 0.0)
        took.add_metric([], time.perf_counter() - started)
        down_since = self.ledger.health.down_since
        down.add_metric([], time.monotonic() - down_since if down_since is not None else 0.0)
        yield from (up, took, down)
        if view is not None:
            yield from self._pool(view)

    def _log_failure(self, exc: Exception) -> None:
        # A ledger outage is logged once by the Ledger itself; anything else once a minute.
        if isinstance(exc, LedgerUnavailable):
            return
        now = time.monotonic()
        if now - self._last_error_log >= SCRAPE_ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.error("metrics: reading the ledger failed", exc_info=exc)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [*_status_families(), *_pool_families().values()]

    def _pool(self, view: PoolView) -> Iterator[Metric]:
        f = _pool_families()
        for d in view.devices:
            dev = [d.uid]
            f["info"].add_metric([d.uid, d.kind, d.media], 1.0)
            f["capacity"].add_metric(dev, d.capacity_bytes)
            f["leased"].add_metric(dev, d.leased_bytes)
            f["reserved"].add_metric(dev, d.reserved_bytes)
            f["quarantined"].add_metric(dev, d.quarantined_bytes)
            f["free"].add_metric(dev, d.free_bytes)
            f["largest"].add_metric(dev, d.largest_free_bytes)
            f["dev_leases"].add_metric(dev, d.live_leases)
            f["delegated"].add_metric(dev, d.delegated_bytes)
            f["delegated_unleased"].add_metric(dev, d.delegated_unleased_bytes)
            for health in _with(HEALTH_STATES, d.health):
                f["health"].add_metric([d.uid, health], 1.0 if health == d.health else 0.0)
            for state in _with(DEVICE_STATES, d.state):
                f["state"].add_metric([d.uid, state], 1.0 if state == d.state else 0.0)
        for t in view.tenants:
            ten = [t.name]
            f["quota"].add_metric(ten, t.quota_bytes)
            f["quota_leases"].add_metric(ten, t.quota_leases)
            f["t_leased"].add_metric(ten, t.leased_bytes)
            f["t_leases"].add_metric(ten, t.live_leases)
            f["t_used"].add_metric(ten, t.used_bytes)
            f["t_exclusive"].add_metric(ten, t.exclusive_bytes)
            f["t_replica"].add_metric(ten, t.replica_bytes)
            f["t_budget"].add_metric(ten, t.budget_bytes)
            f["t_budget_leases"].add_metric(ten, t.budget_leases)
        for h in view.hosts:
            host = [h.name]
            f["host_up"].add_metric(host, 0.0 if h.status == "down" else 1.0)
            for status in _with(HOST_STATUSES, h.status):
                f["host_status"].add_metric([h.name, status], 1.0 if status == h.status else 0.0)
            f["h_leased"].add_metric(host, h.leased_bytes)
            f["h_leases"].add_metric(host, h.live_leases)
            f["h_delegated"].add_metric(host, h.delegated_bytes)
            if h.last_heartbeat_at is not None:
                f["heard_at"].add_metric(host, h.last_heartbeat_at.timestamp())
                age = (view.read_at - h.last_heartbeat_at).total_seconds()
                f["heard_age"].add_metric(host, max(0.0, age))
        for state, count in sorted(view.live_leases_by_state.items()):
            f["leases"].add_metric([state], count)
        if view.last_audit_at is not None:
            f["audit_at"].add_metric([], view.last_audit_at.timestamp())
            code = view.last_audit_exit_code
            f["audit_code"].add_metric([], float(code) if code is not None else -1.0)
        yield from f.values()


def _with(known: tuple[str, ...], value: str) -> tuple[str, ...]:
    """A state set's values: the known ones, plus the row's own if a newer poold wrote it."""
    return known if value in known else (*known, value)


def _status_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    return (
        _gauge("poold_ledger_up", "1 when this scrape could read the ledger, else 0"),
        _gauge("poold_ledger_scrape_duration_seconds", "How long this scrape's ledger read took"),
        _gauge(
            "poold_ledger_down_seconds",
            "How long this process has found the ledger unreachable (0: reachable)",
        ),
    )


def _pool_families() -> dict[str, GaugeMetricFamily]:
    dev, ten, host = ("device",), ("tenant",), ("host",)
    return {
        "info": _gauge(
            "poold_device_info",
            "A pool device's kind and media (always 1)",
            (*dev, "kind", "media"),
        ),
        "capacity": _gauge("poold_device_capacity_bytes", "Device capacity", dev),
        "leased": _gauge("poold_device_leased_bytes", "Bytes of the device's live leases", dev),
        "reserved": _gauge(
            "poold_device_reserved_bytes",
            "Bytes held by dax devices poold did not create (never placed on)",
            dev,
        ),
        "quarantined": _gauge(
            "poold_device_quarantined_bytes", "Bytes quarantined (poison, failed scrub)", dev
        ),
        "free": _gauge(
            "poold_device_free_bytes",
            "Bytes no live lease, quarantined range or reserved extent occupies",
            dev,
        ),
        "largest": _gauge(
            "poold_device_largest_free_extent_bytes",
            "The largest aligned lease the device could place now",
            dev,
        ),
        "dev_leases": _gauge("poold_device_live_leases", "Live leases on the device", dev),
        "delegated": _gauge(
            "poold_device_delegated_bytes", "Bytes of the device reserved for hosts' agents", dev
        ),
        "delegated_unleased": _gauge(
            "poold_device_delegated_unleased_bytes",
            "Bytes reserved for hosts' agents that no lease uses yet",
            dev,
        ),
        "t_budget": _gauge(
            "poold_tenant_budget_bytes", "The tenant's quota bytes delegated to hosts", ten
        ),
        "t_budget_leases": _gauge(
            "poold_tenant_budget_leases", "The tenant's lease quota delegated to hosts", ten
        ),
        "h_delegated": _gauge(
            "poold_host_delegated_bytes", "Bytes reserved for the host's agent", host
        ),
        "health": _gauge(
            "poold_device_health", "1 for the device's health, 0 for the others", (*dev, "health")
        ),
        "state": _gauge(
            "poold_device_state", "1 for the device's state, 0 for the others", (*dev, "state")
        ),
        "quota": _gauge("poold_tenant_quota_bytes", "The tenant's byte quota", ten),
        "quota_leases": _gauge("poold_tenant_quota_leases", "The tenant's lease-count quota", ten),
        "t_leased": _gauge("poold_tenant_leased_bytes", "Bytes of the tenant's live leases", ten),
        "t_leases": _gauge("poold_tenant_live_leases", "The tenant's live leases", ten),
        "t_used": _gauge(
            "poold_tenant_used_bytes", "Bytes the tenant's holders last reported in use", ten
        ),
        "t_exclusive": _gauge(
            "poold_tenant_exclusive_bytes",
            "Reported bytes holding the only copy of a KV block",
            ten,
        ),
        "t_replica": _gauge(
            "poold_tenant_replica_bytes",
            "Reported bytes holding copies of blocks kept elsewhere",
            ten,
        ),
        "host_up": _gauge("poold_host_up", "1 unless the host is marked down", host),
        "host_status": _gauge(
            "poold_host_status", "1 for the host's status, 0 for the others", (*host, "status")
        ),
        "h_leased": _gauge("poold_host_leased_bytes", "Bytes of the host's live leases", host),
        "h_leases": _gauge("poold_host_live_leases", "Live leases held on the host", host),
        "heard_at": _gauge(
            "poold_host_last_heartbeat_timestamp_seconds",
            "When the host last heartbeated (Unix time)",
            host,
        ),
        "heard_age": _gauge(
            "poold_host_heartbeat_age_seconds", "Seconds since the host last heartbeated", host
        ),
        "leases": _gauge("poold_live_leases", "Live leases in the pool, by state", ("state",)),
        "audit_at": _gauge(
            "poold_audit_last_run_timestamp_seconds", "When the last audit finished (Unix time)"
        ),
        "audit_code": _gauge(
            "poold_audit_last_exit_code", "The last audit's exit code (0 clean, 1, 2)"
        ),
    }
