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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poold import __version__
from poold.errors import LedgerUnavailable
from poold.lease_states import LeaseEvent
from poold.ledger import transitions
from poold.ledger.db import Ledger
from poold.ledger.metrics_views import (
    DeviceGauges,
    HostGauges,
    PoolView,
    TenantGauges,
    count_committed_events,
    pool_view,
)
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
        self.request_cpu = Counter(
            "poold_request_cpu_seconds",
            "CPU time of the worker thread that parsed a request's body, ran its ledger "
            "work and rendered its reply, by route name (the event loop's share is not "
            "in it)",
            ["route"],
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
        self.registry.register(_RerunCollector())
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

    def worker_cpu(self, route: str, seconds: float) -> None:
        """One request's worker-thread CPU (`poold.api.binding`): where poold's CPU goes,
        by route, without a profiler."""
        self.request_cpu.labels(route).inc(seconds)

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


_Row = TypeVar("_Row")
# A gauge's figure for one row: one sample, none (the row lacks it), or one sample per
# value of the gauge's own labels (a state set, a device's kind and media).
_Value = float | None | Mapping[tuple[str, ...], float]


@dataclass(frozen=True)
class _Gauge(Generic[_Row]):
    """One gauge family of a table: its name, help, own labels and figure for a row.

    ``value(row, view)`` reads the row; the view is there for what is relative to the
    scrape (a heartbeat's age at ``view.read_at``).
    """

    name: str
    help: str
    value: Callable[[_Row, PoolView], _Value]
    labels: tuple[str, ...] = ()  # after the table's own label (device, tenant, host)


@dataclass(frozen=True)
class _Table(Generic[_Row]):
    """Gauges with one sample (or a set) per row of a ledger view: devices, tenants..."""

    rows: Callable[[PoolView], Iterable[_Row]]
    key: Callable[[_Row], tuple[str, ...]]  # the row's own label values
    key_labels: tuple[str, ...]
    gauges: tuple[_Gauge[_Row], ...]

    def families(self) -> list[GaugeMetricFamily]:
        return [_gauge(g.name, g.help, (*self.key_labels, *g.labels)) for g in self.gauges]

    def collect(self, view: PoolView) -> list[GaugeMetricFamily]:
        families = self.families()
        for row in self.rows(view):
            key = self.key(row)
            for gauge, family in zip(self.gauges, families, strict=True):
                value = gauge.value(row, view)
                if value is None:
                    continue
                if isinstance(value, Mapping):
                    for own, figure in value.items():
                        family.add_metric([*key, *own], figure)
                else:
                    family.add_metric(list(key), value)
        return families


def _with(known: tuple[str, ...], value: str) -> tuple[str, ...]:
    """A state set's values: the known ones, plus the row's own if a newer poold wrote it."""
    return known if value in known else (*known, value)


def _one_of(known: tuple[str, ...], value: str) -> dict[tuple[str, ...], float]:
    """A state set as samples: 1 for ``value``, 0 for the others it could have been."""
    return {(state,): 1.0 if state == value else 0.0 for state in _with(known, value)}


def _heartbeat_age(h: HostGauges, view: PoolView) -> float | None:
    if h.last_heartbeat_at is None:
        return None
    return max(0.0, (view.read_at - h.last_heartbeat_at).total_seconds())


def _audit_code(pool: PoolView, _: PoolView) -> float | None:
    if pool.last_audit_at is None:
        return None
    code = pool.last_audit_exit_code
    return float(code) if code is not None else -1.0


_DEVICES = _Table[DeviceGauges](
    rows=lambda view: view.devices,
    key=lambda d: (d.uid,),
    key_labels=("device",),
    gauges=(
        _Gauge(
            "poold_device_info",
            "A pool device's kind and media (always 1)",
            lambda d, _: {(d.kind, d.media): 1.0},
            ("kind", "media"),
        ),
        _Gauge("poold_device_capacity_bytes", "Device capacity", lambda d, _: d.capacity_bytes),
        _Gauge(
            "poold_device_leased_bytes",
            "Bytes of the device's live leases",
            lambda d, _: d.leased_bytes,
        ),
        _Gauge(
            "poold_device_reserved_bytes",
            "Bytes held by dax devices poold did not create (never placed on)",
            lambda d, _: d.reserved_bytes,
        ),
        _Gauge(
            "poold_device_quarantined_bytes",
            "Bytes quarantined (poison, failed scrub)",
            lambda d, _: d.quarantined_bytes,
        ),
        _Gauge(
            "poold_device_free_bytes",
            "Bytes no live lease, quarantined range or reserved extent occupies",
            lambda d, _: d.free_bytes,
        ),
        _Gauge(
            "poold_device_largest_free_extent_bytes",
            "The largest aligned lease the device could place now",
            lambda d, _: d.largest_free_bytes,
        ),
        _Gauge("poold_device_live_leases", "Live leases on the device", lambda d, _: d.live_leases),
        _Gauge(
            "poold_device_delegated_bytes",
            "Bytes of the device reserved for hosts' agents",
            lambda d, _: d.delegated_bytes,
        ),
        _Gauge(
            "poold_device_delegated_unleased_bytes",
            "Bytes reserved for hosts' agents that no lease uses yet",
            lambda d, _: d.delegated_unleased_bytes,
        ),
        _Gauge(
            "poold_device_health",
            "1 for the device's health, 0 for the others",
            lambda d, _: _one_of(HEALTH_STATES, d.health),
            ("health",),
        ),
        _Gauge(
            "poold_device_state",
            "1 for the device's state, 0 for the others",
            lambda d, _: _one_of(DEVICE_STATES, d.state),
            ("state",),
        ),
    ),
)

_TENANTS = _Table[TenantGauges](
    rows=lambda view: view.tenants,
    key=lambda t: (t.name,),
    key_labels=("tenant",),
    gauges=(
        _Gauge("poold_tenant_quota_bytes", "The tenant's byte quota", lambda t, _: t.quota_bytes),
        _Gauge(
            "poold_tenant_quota_leases",
            "The tenant's lease-count quota",
            lambda t, _: t.quota_leases,
        ),
        _Gauge(
            "poold_tenant_leased_bytes",
            "Bytes of the tenant's live leases",
            lambda t, _: t.leased_bytes,
        ),
        _Gauge("poold_tenant_live_leases", "The tenant's live leases", lambda t, _: t.live_leases),
        _Gauge(
            "poold_tenant_used_bytes",
            "Bytes the tenant's holders last reported in use",
            lambda t, _: t.used_bytes,
        ),
        _Gauge(
            "poold_tenant_exclusive_bytes",
            "Reported bytes holding the only copy of a KV block",
            lambda t, _: t.exclusive_bytes,
        ),
        _Gauge(
            "poold_tenant_replica_bytes",
            "Reported bytes holding copies of blocks kept elsewhere",
            lambda t, _: t.replica_bytes,
        ),
        _Gauge(
            "poold_tenant_budget_bytes",
            "The tenant's quota bytes delegated to hosts",
            lambda t, _: t.budget_bytes,
        ),
        _Gauge(
            "poold_tenant_budget_leases",
            "The tenant's lease quota delegated to hosts",
            lambda t, _: t.budget_leases,
        ),
        _Gauge(
            "poold_tenant_central_room_bytes",
            "The tenant's quota kept out of hosts' budgets for central grants",
            lambda t, _: t.central_room_bytes,
        ),
    ),
)

_HOSTS = _Table[HostGauges](
    rows=lambda view: view.hosts,
    key=lambda h: (h.name,),
    key_labels=("host",),
    gauges=(
        _Gauge(
            "poold_host_up",
            "1 unless the host is marked down",
            lambda h, _: 0.0 if h.status == "down" else 1.0,
        ),
        _Gauge(
            "poold_host_status",
            "1 for the host's status, 0 for the others",
            lambda h, _: _one_of(HOST_STATUSES, h.status),
            ("status",),
        ),
        _Gauge(
            "poold_host_leased_bytes",
            "Bytes of the host's live leases",
            lambda h, _: h.leased_bytes,
        ),
        _Gauge(
            "poold_host_live_leases", "Live leases held on the host", lambda h, _: h.live_leases
        ),
        _Gauge(
            "poold_host_delegated_bytes",
            "Bytes reserved for the host's agent",
            lambda h, _: h.delegated_bytes,
        ),
        _Gauge(
            "poold_host_last_heartbeat_timestamp_seconds",
            "When the host last heartbeated (Unix time)",
            lambda h, _: (
                h.last_heartbeat_at.timestamp() if h.last_heartbeat_at is not None else None
            ),
        ),
        _Gauge(
            "poold_host_heartbeat_age_seconds",
            "Seconds since the host last heartbeated",
            _heartbeat_age,
        ),
    ),
)

# The pool as a whole: one row, the view itself, with no label of its own.
_POOL = _Table[PoolView](
    rows=lambda view: (view,),
    key=lambda _: (),
    key_labels=(),
    gauges=(
        _Gauge(
            "poold_live_leases",
            "Live leases in the pool, by state",
            lambda v, _: {(state,): n for state, n in sorted(v.live_leases_by_state.items())},
            ("state",),
        ),
        _Gauge(
            "poold_audit_last_run_timestamp_seconds",
            "When the last audit finished (Unix time)",
            lambda v, _: v.last_audit_at.timestamp() if v.last_audit_at is not None else None,
        ),
        _Gauge(
            "poold_audit_last_exit_code",
            "The last audit's exit code (0 clean, 1, 2)",
            _audit_code,
        ),
    ),
)

# Every gauge read from the ledger view, by the row it has a sample for.
_LEDGER_TABLES: tuple[_Table[Any], ...] = (_DEVICES, _TENANTS, _HOSTS, _POOL)


# Exported from the start at 0, so that rate() sees the first one.
RERUN_SERIES = (
    ("lost_race", "tenants"),
    ("lost_race", "devices"),
    ("lost_race", "hosts"),
    ("lost_race", "leases"),
    ("lost_race", "constraint"),
    ("contention", ""),
    ("stale_connection", ""),
)


class _RerunCollector(Collector):
    """Ledger transactions this process ran again (`transitions.reruns`), read at scrape."""

    def describe(self) -> Iterator[Metric]:
        yield self._family({})

    def collect(self) -> Iterator[Metric]:
        yield self._family(transitions.reruns())

    @staticmethod
    def _family(counts: Mapping[tuple[str, str], int]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "poold_ledger_reruns",
            "Ledger transactions run again by this process: a lost race (by the row whose "
            "generation swap was lost, or 'constraint'), contention (a deadlock, a "
            "serialisation failure, SQLite locked) or a stale pooled connection",
            labels=["cause", "row"],
        )
        for key in dict.fromkeys((*RERUN_SERIES, *sorted(counts))):
            family.add_metric(list(key), counts.get(key, 0))
        return family


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
        return [*_status_families(), *(f for t in _LEDGER_TABLES for f in t.families())]

    def _pool(self, view: PoolView) -> Iterator[Metric]:
        for table in _LEDGER_TABLES:
            yield from table.collect(view)


def _status_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    return (
        _gauge("poold_ledger_up", "1 when this scrape could read the ledger, else 0"),
        _gauge("poold_ledger_scrape_duration_seconds", "How long this scrape's ledger read took"),
        _gauge(
            "poold_ledger_down_seconds",
            "How long this process has found the ledger unreachable (0: reachable)",
        ),
    )
