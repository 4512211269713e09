"""Many tenants, many clients, several poolds on one ledger: throughput, tails and invariants.

    .venv/bin/python bench/scale.py [--database-url URL | --sqlite] [--poolds 1,4]
                                    [--clients 8,32,128] [--operations 10000] [--hosts 4]
                                    [--tenants 64] [--host-capacity 2GiB]
                                    [--heartbeat-items 100000] [--delegation] [--json]

Starts a throwaway PostgreSQL (tests/pg.py; `--database-url` uses yours, `--sqlite` a
temp SQLite file instead) and migrates it once. For each N of `--poolds` it starts N
`poold serve` processes on that ledger (only the first runs the reaper) and `--hosts`
agents with emulated capacity (each pointed at all poolds if `pool-agent serve
--poold-url` takes several, else round-robin over them). `--tenants` tenants may lease
on every host for this uid; every fourth has a quota too small for the largest lease,
so `quota_exceeded` happens. For each C of `--clients`, C client processes spread over
the agent sockets share `--operations` lease operations: lease 2-64 MiB (timed from the
client), hold a few ms, sometimes renew, release.

Per phase: grants/s, grant p50/p99, poold and agent CPU per grant (psutil), poold's
worker-thread CPU per grant by route (its `poold_request_cpu_seconds_total`), errors by
code, and /v1/health p50/p99 polled from a thread during the phase. The floor, measured
idle just before each phase: one trivial ledger write transaction from this process
(p50) and one idle /v1/health round trip. Invariants are read from the ledger with SQL,
sampled during the phase and checked after it: no two live leases overlap on a device,
no tenant holds more than its quota, every grant a client saw is in the ledger, every
release it saw is ended there, no lease is left `granted`. Exit status 1 if one fails.

After each N's phases, the heartbeat probe: an extra host sends one heartbeat with
`--heartbeat-items` renewals of unknown leases while a thread polls /v1/health.

`--delegation` turns delegated capacity on in the agents (POOL_AGENT_DELEGATION=true):
leases are granted by the agent inside the reservations and budgets poold hands it and
reach poold in batched commits; poold's CPU is then divided by those leases. Without it
the agents are told POOL_AGENT_DELEGATION=false, so every lease is a central grant
whatever the agent's default.

Targets (the issue's): poold CPU per grant <= 1.5 ms (with --delegation: per lease
<= 0.3 ms, issue "Delegated capacity"); at 128 clients grant p99 <= 100
ms and grants/s >= 0.8 x the 8-client figure (judged at the largest and smallest C of the
run); /v1/health p99 <= 50 ms during the 100,000-item heartbeat.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from sqlalchemy import Engine, select, update  # noqa: E402

from agent.client import PoolClient  # noqa: E402
from poold import procs  # noqa: E402
from poold.api.client import PooldClient  # noqa: E402
from poold.errors import PoolError  # noqa: E402
from poold.lease_states import LIVE_STATE_VALUES, TERMINAL_STATES  # noqa: E402
from poold.ledger import migrate  # noqa: E402
from poold.ledger.db import Ledger, make_engine  # noqa: E402
from poold.ledger.models import Host, Lease, Tenant  # noqa: E402
from poold.wire.admin import TenantSpec  # noqa: E402
from poold.wire.agent import Heartbeat, Renewal  # noqa: E402

MiB = 1 << 20
# Lease sizes and their weights: mostly small, some large (mean ~16 MiB).
SIZES = (2 * MiB, 8 * MiB, 32 * MiB, 64 * MiB)
SIZE_WEIGHTS = (4, 3, 2, 1)
RENEW_FRACTION = 0.25
HOLD_MAX_S = 0.005
TIGHT_QUOTA_BYTES = 48 * MiB  # under the largest lease: quota_exceeded is certain
TIGHT_QUOTA_LEASES = 3
HEALTH_INTERVAL_S = 0.02
SAMPLE_INTERVAL_S = 1.0
SETTLE_S = 30.0
FLOOR_ITERATIONS = 200
TERMINAL = tuple(s.value for s in TERMINAL_STATES)

TARGET_CPU_MS = 1.5
TARGET_DELEGATED_CPU_MS = 0.3
TARGET_P99_MS = 100.0
TARGET_SCALING = 0.8
TARGET_HEALTH_P99_MS = 50.0


# --- figures ------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ms(seconds: Sequence[float]) -> list[float]:
    return [s * 1000 for s in seconds]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rnd(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def parse_size(raw: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", raw, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {raw!r} (e.g. 2GiB, 512MiB, 1073741824)")
    unit = (m.group(2) or "B").upper()[0]
    scale = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def parse_ints(raw: str) -> list[int]:
    try:
        values = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {raw!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {raw!r}")
    return values


# --- the client processes ----------------------------------------------------------


@dataclass
class WorkerJob:
    index: int
    socket_path: str
    tenants: list[str]
    seed: int
    result_path: str
    deadline: float  # time.monotonic()


def worker_main(
    job: WorkerJob,
    counter: Any,  # multiprocessing Value('q'): operations taken so far
    operations: int,
    ready: Any,  # multiprocessing Value('i'): workers connected
    start: Any,  # multiprocessing Event
) -> None:
    # Forked from the bench: its signal handlers are not ours; Ctrl-C simply ends us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    rng = random.Random(job.seed)  # noqa: S311 - workload shape, not secrets
    grants: list[float] = []
    refusals: list[float] = []
    errors: Counter[str] = Counter()
    other_errors: Counter[str] = Counter()
    granted: list[str] = []
    released: list[str] = []
    renewed = 0
    with PoolClient(job.socket_path, timeout_s=60) as client:
        try:
            client.hello(client_name="bench-scale")
        except PoolError as err:
            other_errors[f"hello:{err.code}"] += 1
        with ready.get_lock():
            ready.value += 1
        start.wait()
        while time.monotonic() < job.deadline:
            with counter.get_lock():
                if counter.value >= operations:
                    break
                counter.value += 1
            size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
            tenant = rng.choice(job.tenants)
            t0 = time.perf_counter()
            try:
                lease = client.lease(size, ttl_s=60, tenant=tenant, renew=False)
            except PoolError as err:
                refusals.append(time.perf_counter() - t0)
                errors[err.code] += 1
                continue
            except Exception as exc:  # a broken bench must still report
                refusals.append(time.perf_counter() - t0)
                errors[f"exception:{type(exc).__name__}"] += 1
                continue
            grants.append(time.perf_counter() - t0)
            granted.append(lease.lease_id)
            time.sleep(rng.uniform(0, HOLD_MAX_S))
            if rng.random() < RENEW_FRACTION:
                try:
                    lease.renew()
                    renewed += 1
                except PoolError as err:
                    other_errors[f"renew:{err.code}"] += 1
            try:
                lease.release()
            except PoolError as err:
                other_errors[f"release:{err.code}"] += 1
            else:
                released.append(lease.lease_id)
    done_at = time.monotonic()
    Path(job.result_path).write_text(
        json.dumps(
            {
                "grants": grants,
                "refusals": refusals,
                "errors": errors,
                "other_errors": other_errors,
                "granted": granted,
                "released": released,
                "renewed": renewed,
                "done_at": done_at,
            }
        )
    )


# --- the ledger, read directly ------------------------------------------------------


def snapshot_violations(engine: Engine) -> list[str]:
    """Overlap and quota, from one statement (one snapshot) of every live lease."""
    stmt = (
        select(
            Lease.id,
            Lease.device_id,
            Lease.offset_bytes,
            Lease.length_bytes,
            Tenant.name,
            Tenant.quota_bytes,
            Tenant.quota_leases,
        )
        .join(Tenant, Tenant.id == Lease.tenant_id)
        .where(Lease.state.in_(LIVE_STATE_VALUES))
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    found: list[str] = []
    by_device: dict[int, list[tuple[int, int, str]]] = {}
    usage: dict[str, list[int]] = {}
    for lease_id, device_id, offset, length, tenant, quota_bytes, quota_leases in rows:
        by_device.setdefault(device_id, []).append((int(offset), int(length), lease_id))
        u = usage.setdefault(tenant, [0, 0, int(quota_bytes), int(quota_leases)])
        u[0] += int(length)
        u[1] += 1
    for device_id, extents in by_device.items():
        extents.sort()
        end, holder = -1, ""  # the furthest end so far and whose it is
        for offset, length, lease_id in extents:
            if offset < end:
                found.append(
                    f"overlap on device {device_id}: lease {lease_id} at {offset} "
                    f"inside lease {holder} (ends {end})"
                )
            if offset + length > end:
                end, holder = offset + length, lease_id
    for tenant, (used, count, quota_bytes, quota_leases) in usage.items():
        if used > quota_bytes:
            found.append(f"tenant {tenant} holds {used} live bytes, quota {quota_bytes}")
        if count > quota_leases:
            found.append(f"tenant {tenant} holds {count} live leases, quota {quota_leases}")
    return found


def lease_states(engine: Engine, ids: Sequence[str]) -> dict[str, str]:
    states: dict[str, str] = {}
    with engine.connect() as conn:
        for i in range(0, len(ids), 500):
            chunk = list(ids[i : i + 500])
            for lease_id, state in conn.execute(
                select(Lease.id, Lease.state).where(Lease.id.in_(chunk))
            ):
                states[lease_id] = state
    return states


def granted_locally(engine: Engine, ids: Sequence[str]) -> int:
    """How many of these leases the agents granted inside a reservation (delegation)."""
    n = 0
    with engine.connect() as conn:
        for i in range(0, len(ids), 500):
            chunk = list(ids[i : i + 500])
            n += len(
                conn.execute(
                    select(Lease.id).where(Lease.id.in_(chunk), Lease.reservation_id.is_not(None))
                ).all()
            )
    return n


def stuck_granted(engine: Engine, host_ids: Sequence[int]) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(Lease.id).where(Lease.state == "granted", Lease.host_id.in_(list(host_ids)))
            ).scalars()
        )


def after_phase_checks(
    engine: Engine, granted: Sequence[str], released: Sequence[str], host_ids: Sequence[int]
) -> dict[str, Any]:
    """The after-phase invariants, waiting up to SETTLE_S for the agents' outboxes."""
    deadline = time.monotonic() + SETTLE_S
    t0 = time.monotonic()
    while True:
        states = lease_states(engine, granted)
        missing = [i for i in granted if i not in states]
        released_set = set(released)
        not_ended = [i for i in released_set if states.get(i) not in TERMINAL]
        stuck = stuck_granted(engine, host_ids)
        if (not not_ended and not stuck) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    overlap_quota = snapshot_violations(engine)
    checks = {
        "no_overlap_no_over_quota": not overlap_quota,
        "grants_in_ledger": not missing,
        "releases_ended": not not_ended,
        "none_stuck_granted": not stuck,
    }
    problems = list(overlap_quota)
    problems += [f"lease {i} granted to a client is not in the ledger" for i in missing[:10]]
    problems += [
        f"lease {i} released by a client is {states.get(i)!r} in the ledger" for i in not_ended[:10]
    ]
    problems += [f"lease {i} still granted after {SETTLE_S:g}s" for i in stuck[:10]]
    return {
        "checks": checks,
        "violations": problems,
        "settle_s": round(time.monotonic() - t0, 2),
        "leases_checked": len(granted),
    }


class Sampler(threading.Thread):
    """Overlap and quota from the ledger every SAMPLE_INTERVAL_S while a phase runs."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(name="invariant-sampler", daemon=True)
        self.engine = engine
        self.stop_event = threading.Event()
        self.samples = 0
        self.violations: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while True:
            try:
                found = snapshot_violations(self.engine)
            except Exception as exc:  # report it, keep sampling
                self.errors.append(f"{type(exc).__name__}: {exc}")
                found = []
            else:
                self.samples += 1
            self.violations.extend(found[: max(0, 20 - len(self.violations))])
            if self.stop_event.wait(SAMPLE_INTERVAL_S):
                return

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


class HealthPoller(threading.Thread):
    """GET /v1/health round trips, over the given poolds in turn, until stopped."""

    def __init__(self, urls: Sequence[str], interval_s: float = HEALTH_INTERVAL_S) -> None:
        super().__init__(name="health-poller", daemon=True)
        self.urls = list(urls)
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.latencies: list[float] = []
        self.failures = 0

    def run(self) -> None:
        with httpx.Client(timeout=30) as http:
            i = 0
            while not self.stop_event.is_set():
                url = self.urls[i % len(self.urls)]
                i += 1
                t0 = time.perf_counter()
                try:
                    ok = http.get(f"{url}/v1/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                if ok:
                    self.latencies.append(dt)
                else:
                    self.failures += 1
                self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=60)


# --- the cluster ----------------------------------------------------------------------


def agent_url_mode() -> str:
    """How `pool-agent serve` takes several poold URLs: repeat, comma, or single (not)."""
    try:
        from agent import cli as agent_cli

        serve = agent_cli.main.commands["serve"]
    except Exception:
        return "single"
    for param in serve.params:
        if param.name in ("poold_url", "poold_urls"):
            if getattr(param, "multiple", False):
                return "repeat"
            if "comma" in (getattr(param, "help", None) or "").lower():
                return "comma"
    return "single"


def start_poold(
    state_dir: Path, port: int, database_url: str, *, reaper: bool, upgrade: bool
) -> procs.Child:
    """One poold of the cluster: only one runs the reaper, only one migrates."""
    return procs.start_poold(
        state_dir,
        port,
        database_url=database_url,
        timeout_s=60.0,
        env={} if reaper else {"POOLD_REAP_INTERVAL_S": "0"},
        extra=[] if upgrade else ["--no-upgrade-db"],
    )


@dataclass
class Cluster:
    poolds: list[procs.Child] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    agents: list[procs.Child] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    agent_metrics: list[str] = field(default_factory=list)  # each agent's /metrics base URL
    url_mode: str = "single"

    def stop(self) -> None:
        for child in [*reversed(self.agents), *reversed(self.poolds)]:
            with contextlib.suppress(Exception):
                child.stop()


@contextlib.contextmanager
def cluster(
    work: Path,
    database_url: str,
    n_poolds: int,
    hosts: Sequence[tuple[str, Path]],
    admin_token: str,
    capacity: int,
    delegation: bool = False,
) -> Iterator[Cluster]:
    c = Cluster(url_mode=agent_url_mode())
    # Said either way: the agents inherit it (pool-agent reads POOL_AGENT_* settings).
    saved = os.environ.get("POOL_AGENT_DELEGATION")
    os.environ["POOL_AGENT_DELEGATION"] = "true" if delegation else "false"
    try:
        for i in range(n_poolds):
            state = work / f"poold-{i}"
            state.mkdir(parents=True, mode=0o700)
            # One admin token for every poold: poold reads state_dir/admin.token first.
            fd = os.open(state / "admin.token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(admin_token + "\n")
            port = procs.free_port()
            c.poolds.append(start_poold(state, port, database_url, reaper=i == 0, upgrade=i == 0))
            c.urls.append(f"http://127.0.0.1:{port}")
        for i, (host, cred) in enumerate(hosts):
            sock = work / f"agent-{i}.sock"
            # Several URLs are tried in order (failover): each agent starts on its own.
            mine = c.urls[i % n_poolds :] + c.urls[: i % n_poolds]
            if c.url_mode == "repeat":
                first, extra = mine[0], [a for u in mine[1:] for a in ("--poold-url", u)]
            elif c.url_mode == "comma":
                first, extra = ",".join(mine), []
            else:
                first, extra = c.urls[i % n_poolds], []
            metrics_port = procs.free_port()
            extra = [*extra, "--metrics-listen", f"127.0.0.1:{metrics_port}"]
            c.agent_metrics.append(f"http://127.0.0.1:{metrics_port}")
            c.agents.append(
                procs.start_agent(
                    work,
                    host=host,
                    poold_url=first,
                    credential_file=cred,
                    socket_path=sock,
                    emulated_capacity_bytes=capacity,
                    heartbeat_interval_s=5.0,
                    extra=extra,
                    timeout_s=60,
                )
            )
            c.sockets.append(str(sock))
        yield c
    finally:
        c.stop()
        if saved is None:
            os.environ.pop("POOL_AGENT_DELEGATION", None)
        else:
            os.environ["POOL_AGENT_DELEGATION"] = saved


def cpu_each(children: Sequence[procs.Child]) -> list[float]:
    """User + system CPU seconds of each child so far (0 for one that is gone)."""
    out = []
    for child in children:
        try:
            t = psutil.Process(child.proc.pid).cpu_times()
        except psutil.Error:
            out.append(0.0)
            continue
        out.append(t.user + t.system)
    return out


def cpu_s(children: Sequence[procs.Child]) -> float:
    return sum(cpu_each(children))


# --- floors and probes ------------------------------------------------------------


def scraped(url: str) -> Iterator[Any]:
    """Every sample a process serves at `url`/metrics (its Prometheus text)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        yield from family.samples


def poold_counts(urls: Sequence[str]) -> tuple[Counter[str], Counter[str]]:
    """What the poolds did so far, summed over them, from one scrape of each /metrics:
    requests by route (and status when not 200) and ledger transactions run again, by
    cause and row; and their worker-thread CPU seconds by route
    (`poold_request_cpu_seconds_total`; a poold too old to export it adds nothing)."""
    out: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    for url in urls:
        for s in scraped(url):
            if s.name == "poold_http_requests_total" and s.labels["route"] != "health":
                status = s.labels["status"]
                out[s.labels["route"] + ("" if status == "200" else f" {status}")] += int(s.value)
            elif s.name == "poold_ledger_reruns_total":
                row = s.labels["row"]
                out["rerun " + s.labels["cause"] + (f" {row}" if row else "")] += int(s.value)
            elif s.name == "poold_request_cpu_seconds_total":
                cpu[s.labels["route"]] += s.value
    return out, cpu


def agent_counts(urls: Sequence[str]) -> Counter[str]:
    """The agents' lease grant attempts so far, summed, by path and why they went to poold
    (`pool_agent_grant_attempts_total`; an agent too old to export it adds nothing)."""
    out: Counter[str] = Counter()
    for url in urls:
        try:
            samples = list(scraped(url))
        except httpx.HTTPError:
            continue
        for s in samples:
            if s.name == "pool_agent_grant_attempts_total":
                reason = s.labels["reason"]
                out[s.labels["path"] + (f" {reason}" if reason else "")] += int(s.value)
    return out


def write_floor(ledger: Ledger, host_name: str, n: int) -> list[float]:
    """One trivial write transaction of the ledger's own kind (BEGIN IMMEDIATE on SQLite)."""
    stmt = update(Host).where(Host.name == host_name).values(agent_version=Host.agent_version)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with ledger.write_conn() as conn:
            conn.execute(stmt)
        out.append(time.perf_counter() - t0)
    return out


def health_floor(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            http.get(f"{url}/v1/health").raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def _send_heartbeat(url: str, credential: str, items: int, out: Any) -> None:
    """The probe's heartbeat, sent from a process of its own (`heartbeat_probe`)."""
    beat = Heartbeat(
        agent_version="bench-scale",
        renewals=[Renewal(lease_id=str(uuid.uuid4()), ttl_s=60) for _ in range(items)],
    )
    body = beat.model_dump_json().encode()
    with httpx.Client(timeout=600) as http:
        t0 = time.perf_counter()
        resp = http.post(
            f"{url}/v1/agent/heartbeat",
            content=body,
            headers={"Authorization": f"Bearer {credential}", "Content-Type": "application/json"},
        )
        beat_s = time.perf_counter() - t0
    refused, error = 0, None
    if resp.status_code == 200:
        refused = sum(1 for r in resp.json()["renewed"] if r.get("code"))
    else:
        error = resp.json().get("code", str(resp.status_code))
    out.put((beat_s, refused, error))


def heartbeat_probe(url: str, credential: str, items: int) -> dict[str, Any]:
    """One heartbeat of `items` renewals of unknown leases, /v1/health polled meanwhile.

    The heartbeat is built, sent and its reply read in a process of its own: in this one
    its JSON (6 MB out, 12 MB back) would hold this process's GIL for a few hundred ms,
    and the poller thread's latencies would be the bench's own, not poold's."""
    with PooldClient(url, credential, timeout_s=600) as agent:
        agent.register(Heartbeat(agent_version="bench-scale", inventory=[]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sender = ctx.Process(target=_send_heartbeat, args=(url, credential, items, out))
    poller = HealthPoller([url], interval_s=0.01)
    poller.start()
    time.sleep(0.2)  # a few idle polls first
    sender.start()
    beat_s, refused, error = out.get(timeout=900)
    sender.join(60)
    time.sleep(0.2)
    poller.stop()
    lat = ms(poller.latencies)
    return {
        "items": items,
        "heartbeat_s": rnd(beat_s),
        "refused": refused,
        "error": error,
        "health_polls": len(lat),
        "health_failures": poller.failures,
        "health_p50_ms": rnd(median(lat)),
        "health_p99_ms": rnd(pct(lat, 0.99)),
        "health_max_ms": rnd(max(lat) if lat else None),
    }


# --- one phase ----------------------------------------------------------------------


def run_phase(
    c: Cluster,
    *,
    engine: Engine,
    ledger: Ledger,
    probe_host: str,
    host_ids: Sequence[int],
    tenants: list[str],
    n_clients: int,
    operations: int,
    seed: int,
    tmp: Path,
    timeout_s: float,
) -> dict[str, Any]:
    floor_w: list[float] = []
    floor_h: list[float] = []
    for _ in range(4):  # interleaved, a quarter at a time
        floor_w += write_floor(ledger, probe_host, FLOOR_ITERATIONS // 4)
        floor_h += health_floor(c.urls[0], FLOOR_ITERATIONS // 4)

    ctx = mp.get_context("fork")  # no thread runs here now: forking is safe and cheap
    counter = ctx.Value("q", 0)
    ready = ctx.Value("i", 0)
    start = ctx.Event()
    deadline = time.monotonic() + timeout_s
    workers = []
    paths = []
    for i in range(n_clients):
        path = tmp / f"worker-{n_clients}-{i}.json"
        paths.append(path)
        job = WorkerJob(
            index=i,
            socket_path=c.sockets[i % len(c.sockets)],
            tenants=tenants,
            seed=seed * 100_003 + i,
            result_path=str(path),
            deadline=deadline,
        )
        p = ctx.Process(
            target=worker_main, args=(job, counter, operations, ready, start), daemon=True
        )
        p.start()
        workers.append(p)
    try:
        ready_by = time.monotonic() + 120
        while ready.value < n_clients:
            if time.monotonic() > ready_by or any(p.exitcode not in (None, 0) for p in workers):
                raise RuntimeError(f"only {ready.value} of {n_clients} clients connected")
            time.sleep(0.02)
        poller = HealthPoller(c.urls)
        sampler = Sampler(engine)
        counts0, worker0 = poold_counts(c.urls)
        tried0 = agent_counts(c.agent_metrics)
        each0 = cpu_each(c.poolds)
        cpu_p0, cpu_a0 = sum(each0), cpu_s(c.agents)
        t_start = time.monotonic()
        start.set()
        poller.start()
        sampler.start()
        for p in workers:
            p.join(max(1.0, deadline - time.monotonic() + 30))
        each1 = cpu_each(c.poolds)
        cpu_p1, cpu_a1 = sum(each1), cpu_s(c.agents)
        counts, worker = poold_counts(c.urls)
        counts.subtract(counts0)
        worker.subtract(worker0)
        tried = agent_counts(c.agent_metrics)
        tried.subtract(tried0)
        poller.stop()
        sampler.stop()
    finally:
        for p in workers:
            if p.is_alive():
                p.terminate()
                p.join(5)
    results = []
    crashed = 0
    for p, path in zip(workers, paths, strict=True):
        if p.exitcode != 0 or not path.exists():
            crashed += 1
            continue
        results.append(json.loads(path.read_text()))
    grants = [g for r in results for g in r["grants"]]
    refusals = [g for r in results for g in r["refusals"]]
    errors: Counter[str] = Counter()
    other: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
        other.update(r["other_errors"])
    granted = [i for r in results for i in r["granted"]]
    released = [i for r in results for i in r["released"]]
    wall = max((r["done_at"] for r in results), default=time.monotonic()) - t_start
    n = len(grants)

    after = after_phase_checks(engine, granted, released, host_ids)
    during_ok = not sampler.violations
    after["checks"]["during_phase_samples"] = during_ok
    after["violations"] = sampler.violations + after["violations"]
    if crashed:
        after["checks"]["clients_finished"] = False
        after["violations"].append(f"{crashed} client process(es) did not finish")
    g_ms, h_ms, fw_ms, fh_ms = ms(grants), ms(poller.latencies), ms(floor_w), ms(floor_h)
    poold_cpu = (cpu_p1 - cpu_p0) * 1000 / n if n else None
    agent_cpu = (cpu_a1 - cpu_a0) * 1000 / n if n else None
    fw50 = median(fw_ms)
    return {
        "poolds": len(c.poolds),
        "clients": n_clients,
        "hosts": len(c.agents),
        "operations": operations,
        "attempts": n + len(refusals),
        "grants": n,
        "renewals": sum(r["renewed"] for r in results),
        "granted_locally": granted_locally(engine, granted),
        "releases": len(released),
        "wall_s": rnd(wall, 2),
        "grants_per_s": rnd(n / wall if wall > 0 else None, 1),
        "grant_p50_ms": rnd(median(g_ms)),
        "grant_p99_ms": rnd(pct(g_ms, 0.99)),
        "refusal_p50_ms": rnd(median(ms(refusals))),
        "poold_cpu_ms_per_grant": rnd(poold_cpu),
        "agent_cpu_ms_per_grant": rnd(agent_cpu),
        "poold_cpu_s": rnd(cpu_p1 - cpu_p0, 2),
        "poold_cpu_s_each": [round(b - a, 2) for a, b in zip(each0, each1, strict=True)],
        "agent_cpu_s": rnd(cpu_a1 - cpu_a0, 2),
        "errors": dict(sorted(errors.items())),
        "other_errors": dict(sorted(other.items())),
        # Requests the poolds answered by route, and ledger transactions run again.
        "poold_counts": {k: v for k, v in sorted(counts.items()) if v},
        # poold's worker-thread CPU by route, ms per grant: where its CPU went.
        "poold_worker_cpu_ms_per_grant": {
            k: round(v * 1000 / n, 3) for k, v in worker.most_common() if n and v > 0
        },
        # The agents' grant attempts: local, or central and why.
        "agent_paths": {k: v for k, v in sorted(tried.items()) if v},
        "health_polls": len(h_ms),
        "health_failures": poller.failures,
        "health_p50_ms": rnd(median(h_ms)),
        "health_p99_ms": rnd(pct(h_ms, 0.99)),
        "floor_write_p50_ms": rnd(fw50),
        "floor_write_p99_ms": rnd(pct(fw_ms, 0.99)),
        "floor_health_p50_ms": rnd(median(fh_ms)),
        "floor_health_p99_ms": rnd(pct(fh_ms, 0.99)),
        "grant_p50_over_write_floor": rnd(ratio(median(g_ms), fw50), 1),
        "grant_p99_over_write_floor": rnd(ratio(pct(g_ms, 0.99), fw50), 1),
        "poold_cpu_over_write_floor": rnd(ratio(poold_cpu, fw50), 1),
        "health_p99_over_idle_p99": rnd(ratio(pct(h_ms, 0.99), pct(fh_ms, 0.99)), 1),
        "invariant_samples": sampler.samples,
        "sampler_errors": sampler.errors[:5],
        "invariants": after,
        "invariants_ok": all(after["checks"].values()),
    }


# --- targets and output ---------------------------------------------------------------


def judge(
    phases: list[dict[str, Any]], probes: list[dict[str, Any]], *, delegation: bool = False
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cpu_target = TARGET_DELEGATED_CPU_MS if delegation else TARGET_CPU_MS
    for ph in phases:
        v = ph["poold_cpu_ms_per_grant"]
        out.append(
            {
                "target": (
                    f"poold CPU per lease <= {cpu_target:g} ms (delegation on)"
                    if delegation
                    else f"poold CPU per grant <= {cpu_target:g} ms"
                ),
                "where": f"poolds={ph['poolds']} clients={ph['clients']}",
                "value": v,
                "met": v is not None and v <= cpu_target,
            }
        )
    for n in sorted({ph["poolds"] for ph in phases}):
        mine = sorted((ph for ph in phases if ph["poolds"] == n), key=lambda ph: ph["clients"])
        low, high = mine[0], mine[-1]
        note = "" if high["clients"] == 128 else " (target is stated at 128)"
        v = high["grant_p99_ms"]
        out.append(
            {
                "target": "grant p99 <= 100 ms at 128 clients",
                "where": f"poolds={n} clients={high['clients']}{note}",
                "value": v,
                "met": v is not None and v <= TARGET_P99_MS,
            }
        )
        if len(mine) > 1:
            s = ratio(high["grants_per_s"], low["grants_per_s"])
            out.append(
                {
                    "target": "grants/s at 128 clients >= 0.8 x at 8",
                    "where": f"poolds={n} clients={high['clients']} vs {low['clients']}{note}",
                    "value": rnd(s, 2),
                    "met": s is not None and s >= TARGET_SCALING,
                }
            )
    for pr in probes:
        v = pr["health_p99_ms"]
        note = "" if pr["items"] >= 100_000 else " (target is stated at 100,000 items)"
        out.append(
            {
                "target": "/v1/health p99 <= 50 ms during a 100,000-item heartbeat",
                "where": f"poolds={pr['poolds']} items={pr['items']}{note}",
                "value": v,
                "met": v is not None and v <= TARGET_HEALTH_P99_MS and pr["error"] is None,
            }
        )
    return out


def fmt(x: Any, width: int = 10, digits: int = 2) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.{digits}f}"
    return f"{x!s:>{width}}"


def print_phase(ph: dict[str, Any], backend: str) -> None:
    print(
        f"\n== poolds={ph['poolds']} clients={ph['clients']} hosts={ph['hosts']} "
        f"operations={ph['operations']} ({backend}) =="
    )
    print(f"{'':26}{'value':>10}{'floor':>10}{'ratio':>9}   floor is")
    rows = [
        ("grants/s", ph["grants_per_s"], None, None, ""),
        (
            "grant p50 ms",
            ph["grant_p50_ms"],
            ph["floor_write_p50_ms"],
            ph["grant_p50_over_write_floor"],
            "write txn p50",
        ),
        (
            "grant p99 ms",
            ph["grant_p99_ms"],
            ph["floor_write_p50_ms"],
            ph["grant_p99_over_write_floor"],
            "write txn p50",
        ),
        (
            "poold CPU ms/grant",
            ph["poold_cpu_ms_per_grant"],
            ph["floor_write_p50_ms"],
            ph["poold_cpu_over_write_floor"],
            "write txn p50",
        ),
        ("agent CPU ms/grant", ph["agent_cpu_ms_per_grant"], None, None, ""),
        ("health p50 ms", ph["health_p50_ms"], ph["floor_health_p50_ms"], None, "idle health"),
        (
            "health p99 ms",
            ph["health_p99_ms"],
            ph["floor_health_p99_ms"],
            ph["health_p99_over_idle_p99"],
            "idle health p99",
        ),
    ]
    for name, value, floor, r, what in rows:
        rs = f"{r:>8.1f}x" if r is not None else f"{'':9}"
        print(f"{name:26}{fmt(value)}{fmt(floor)}{rs}   {what}")
    print(
        f"grants {ph['grants']} of {ph['attempts']} attempts in {ph['wall_s']} s; "
        f"renewals {ph['renewals']}, releases {ph['releases']}, "
        f"granted locally {ph['granted_locally']}; "
        f"poold CPU s each {ph['poold_cpu_s_each']}"
    )
    errs = ", ".join(f"{k}={v}" for k, v in ph["errors"].items()) or "none"
    print(f"lease errors: {errs}")
    counted = ph["poold_counts"]
    print(
        "poold requests: "
        + (", ".join(f"{k}={v}" for k, v in counted.items() if not k.startswith("rerun")) or "none")
    )
    reruns = {k.removeprefix("rerun "): v for k, v in counted.items() if k.startswith("rerun")}
    per = f" ({sum(reruns.values()) / ph['grants']:.3f} per grant)" if ph["grants"] else ""
    print("ledger reruns: " + (", ".join(f"{k}={v}" for k, v in reruns.items()) or "none") + per)
    worker = ph.get("poold_worker_cpu_ms_per_grant", {})
    print(
        "poold worker CPU ms per grant, by route: "
        + (", ".join(f"{k}={v}" for k, v in worker.items()) or "none")
        + " (the rest: the event loop, the reaper, the news listener)"
    )
    paths = ph.get("agent_paths", {})
    print("agent grant attempts: " + (", ".join(f"{k}={v}" for k, v in paths.items()) or "none"))
    if ph["other_errors"]:
        print("other errors: " + ", ".join(f"{k}={v}" for k, v in ph["other_errors"].items()))
    inv = ph["invariants"]
    verdict = "HELD" if ph["invariants_ok"] else "BROKEN"
    checks = " ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in inv["checks"].items())
    print(
        f"invariants {verdict}: {checks} "
        f"({ph['invariant_samples']} samples during, settled in {inv['settle_s']} s)"
    )
    for v in inv["violations"][:10]:
        print(f"  ! {v}")


def print_summary(result: dict[str, Any]) -> None:
    phases = result["phases"]
    print("\n== summary ==")
    print(
        f"{'poolds':>6}{'clients':>8}{'grants/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'poold ms/g':>11}{'agent ms/g':>11}{'hlth p99':>9}{'floor w':>9}{'inv':>7}"
    )
    for ph in phases:
        print(
            f"{ph['poolds']:>6}{ph['clients']:>8}{fmt(ph['grants_per_s'], 10, 1)}"
            f"{fmt(ph['grant_p50_ms'], 9)}{fmt(ph['grant_p99_ms'], 9)}"
            f"{fmt(ph['poold_cpu_ms_per_grant'], 11)}{fmt(ph['agent_cpu_ms_per_grant'], 11)}"
            f"{fmt(ph['health_p99_ms'], 9)}{fmt(ph['floor_write_p50_ms'], 9)}"
            f"{'ok' if ph['invariants_ok'] else 'FAIL':>7}"
        )
    for pr in result["heartbeat_probes"]:
        print(
            f"heartbeat probe poolds={pr['poolds']}: {pr['items']} renewals in "
            f"{pr['heartbeat_s']} s ({pr['refused']} refused, error {pr['error']}); "
            f"health p50 {pr['health_p50_ms']} ms, p99 {pr['health_p99_ms']} ms, "
            f"max {pr['health_max_ms']} ms over {pr['health_polls']} polls"
        )
    print("\n== targets ==")
    targets = result["targets"]
    tw = max([len("target"), *(len(t["target"]) for t in targets)]) + 2
    ww = max([len("where"), *(len(t["where"]) for t in targets)]) + 2
    print(f"{'target':{tw}}{'where':{ww}}{'value':>9}  met")
    for t in targets:
        print(
            f"{t['target']:{tw}}{t['where']:{ww}}{fmt(t['value'], 9)}  "
            f"{'met' if t['met'] else 'NOT MET'}"
        )
    print(
        f"\nagents given poold URLs: {result['agent_poold_urls']}; "
        f"invariants {'HELD' if result['invariants_ok'] else 'BROKEN'}"
    )


# --- main -------------------------------------------------------------------------------


class Interrupted(BaseException):
    pass


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise Interrupted


@contextlib.contextmanager
def database(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, str]]:
    if args.database_url:
        yield args.database_url, "given"
        return
    if args.sqlite:
        yield f"sqlite:///{tmp / 'ledger.db'}", "sqlite"
        return
    import psycopg

    from tests import pg

    server = pg.start_server()
    try:
        with psycopg.connect(
            f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute("CREATE DATABASE poold_scale")
        yield server.url("poold_scale"), "postgresql (throwaway)"
    finally:
        with contextlib.suppress(Exception):
            server.stop()
        if not args.keep:
            shutil.rmtree(server.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    db = ap.add_mutually_exclusive_group()
    db.add_argument("--database-url", default=None, help="a ledger database (migrated here)")
    db.add_argument("--sqlite", action="store_true", help="a temp SQLite ledger (smoke runs)")
    ap.add_argument("--poolds", type=parse_ints, default=[1, 4])
    ap.add_argument("--clients", type=parse_ints, default=[8, 32, 128])
    ap.add_argument("--operations", type=int, default=10_000)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--host-capacity", type=parse_size, default=2 << 30)
    ap.add_argument("--heartbeat-items", type=int, default=100_000, help="0: no probe")
    ap.add_argument("--phase-timeout", type=float, default=900.0, help="seconds per phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--delegation", action="store_true", help="agents grant locally (delegated capacity)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--keep", action="store_true", help="keep the run's directory (daemon logs) to look at"
    )
    args = ap.parse_args()
    if args.hosts < 1 or args.tenants < 1 or args.operations < 1:
        ap.error("--hosts, --tenants and --operations must be positive")

    signal.signal(signal.SIGTERM, _on_sigterm)
    run_id = secrets.token_hex(3)
    admin_token = f"pt1.admin.{secrets.token_urlsafe(32)}"
    tmp = Path(tempfile.mkdtemp(prefix="poold-bench-scale-"))
    phases: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    url_mode = agent_url_mode()
    backend = "postgresql"
    tenants: list[str] = []
    try:
        with database(args, tmp) as (url, backend_desc):
            backend = url.split(":", 1)[0].split("+", 1)[0]
            migrate.upgrade(url)
            ledger = Ledger(url)
            engine = make_engine(url)
            try:
                host_names = [f"scale-{run_id}-h{i}" for i in range(args.hosts)]
                probe_host = f"scale-{run_id}-probe"
                tenants = [f"scale-{run_id}-t{i:02d}" for i in range(args.tenants)]
                hosts: list[tuple[str, Path]] = []
                probe_cred = ""
                for n_index, n in enumerate(args.poolds):
                    work = tmp / f"cluster-{n_index}-{n}"
                    work.mkdir()
                    if not hosts:  # hosts and tenants once, through a first poold
                        hosts, probe_cred = _provision(
                            tmp, url, admin_token, host_names, probe_host, tenants
                        )
                    with cluster(
                        work, url, n, hosts, admin_token, args.host_capacity, args.delegation
                    ) as c:
                        with engine.connect() as conn:
                            host_ids = list(
                                conn.execute(
                                    select(Host.id).where(Host.name.in_(host_names))
                                ).scalars()
                            )
                        for n_clients in args.clients:
                            ph = run_phase(
                                c,
                                engine=engine,
                                ledger=ledger,
                                probe_host=probe_host,
                                host_ids=host_ids,
                                tenants=tenants,
                                n_clients=n_clients,
                                operations=args.operations,
                                seed=args.seed + n_index * 1000 + n_clients,
                                tmp=tmp,
                                timeout_s=args.phase_timeout,
                            )
                            phases.append(ph)
                            if not args.json:
                                print_phase(ph, backend_desc)
                        if args.heartbeat_items > 0:
                            pr = heartbeat_probe(c.urls[0], probe_cred, args.heartbeat_items)
                            pr["poolds"] = n
                            probes.append(pr)
            finally:
                engine.dispose()
                ledger.dispose()
    except (KeyboardInterrupt, Interrupted):
        print("interrupted: everything started was stopped", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"kept the run's directory (logs, journals): {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    result: dict[str, Any] = {
        "database": backend,
        "config": {
            "poolds": args.poolds,
            "clients": args.clients,
            "operations": args.operations,
            "hosts": args.hosts,
            "tenants": args.tenants,
            "tight_tenants": len(tenants[3::4]),
            "host_capacity_bytes": args.host_capacity,
            "lease_sizes_bytes": list(SIZES),
            "heartbeat_items": args.heartbeat_items,
            "delegation": args.delegation,
            "cpus": os.cpu_count(),
        },
        "agent_poold_urls": "all" if url_mode != "single" else "round-robin",
        "phases": phases,
        "heartbeat_probes": probes,
    }
    result["targets"] = judge(phases, probes, delegation=args.delegation)
    result["invariants_ok"] = all(ph["invariants_ok"] for ph in phases)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)
    return 0 if result["invariants_ok"] else 1


def _provision(
    tmp: Path,
    url: str,
    admin_token: str,
    host_names: list[str],
    probe_host: str,
    tenants: list[str],
) -> tuple[list[tuple[str, Path]], str]:
    """Hosts (with credential files) and tenants, through a poold of their own."""
    state = tmp / "provision"
    state.mkdir()
    (state / "admin.token").write_text(admin_token + "\n")
    (state / "admin.token").chmod(0o600)
    port = procs.free_port()
    child = start_poold(state, port, url, reaper=False, upgrade=False)
    try:
        with PooldClient(f"http://127.0.0.1:{port}", admin_token) as admin:
            hosts = []
            for name in host_names:
                cred = tmp / f"{name}.cred"
                cred.write_text(admin.add_host(name).credential)
                cred.chmod(0o600)
                hosts.append((name, cred))
            probe_cred = admin.add_host(probe_host).credential
            for i, name in enumerate(tenants):
                tight = i % 4 == 3
                admin.create_tenant(
                    TenantSpec(
                        name=name,
                        quota_bytes=TIGHT_QUOTA_BYTES if tight else 1 << 40,
                        quota_leases=TIGHT_QUOTA_LEASES if tight else 100_000,
                        allowed_uids=[os.getuid()],
                        allowed_hosts=host_names,
                    )
                )
    finally:
        child.stop()
    return hosts, probe_cred


if __name__ == "__main__":
    raise SystemExit(main())
