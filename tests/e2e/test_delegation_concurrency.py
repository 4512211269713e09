"""Delegated capacity under everything at once (issue 12, "Shown by"): one PostgreSQL, two
`poold serve`, four `pool-agent serve` granting locally (delegation on, each agent given
both poold URLs), tenant processes leasing, renewing and releasing concurrently, some
inside the delegation and some centrally, while a device drains, a quota is cut below
what is delegated, and pressure asks a device's memory back.

A sampler thread reads the ledger itself (SQL against PostgreSQL, one snapshot per
sample) about every 100 ms and checks the invariants that must hold at every instant:
no two live leases overlap on a device; no reservation overlaps another; a live lease
overlaps no reservation but its own; a local lease lies inside its reservation, of its
host; each tenant's quota use (central leases + per host max(budget, local leases),
poold/ledger/granting.py `quota_use`) is within its quota in bytes and in lease count.
At the end, once the agents have committed: every lease a tenant was granted is in the
ledger, none is left live, each lease a tenant released ends `released`, the same checks
pass, and `poolctl audit` exits 0.

Three races between a local grant and poold acting before it has heard of it were found
by this run (a heartbeat revoking it, a drain dropping its reservation, a quota cut
clawing its budget back); each is reproduced alone at the end of this file and passes.
The run tolerates one lost lease only: a local grant of the cut tenant made just before
the cut and refused at commit (counted by that signature; still open); every other lease
a tenant lost was revoked by poold (the drain, pressure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, text

from agent.client import Lease, PoolClient
from poold import procs
from poold.api.client import PooldClient
from poold.lease_states import LIVE_STATE_VALUES, LIVE_STATES_SQL
from poold.wire.admin import TenantSpec, TenantUpdate
from tests import conftest, pg
from tests.agent.faultproxy import FaultProxy
from tests.e2e.conftest import POOLD_TEST_ENV

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
HOSTS = ("cc-h1", "cc-h2", "cc-h3", "cc-h4")
DEVICE_BYTES = 1024 * MiB
RUN_S = 24.0
DRAIN_AT_S = 6.0  # the last host's only device
CUT_AT_S = 9.0  # tenant "cut": below its budgets, above what it can hold
PRESSURE_AT_S = 10.0  # a big lease on the third host's device
# The pressure lease may outlive the others by this much, until it has been asked once
# (a loaded machine can take seconds to grant it and a heartbeat or two to ask).
PRESSURE_EXTRA_S = 15.0
SAMPLE_EVERY_S = 0.1
# Pressure at 40 % free, not 5 %: reserved-but-unleased bytes count as free for the
# watermark (pressure does not ask reservations back yet), and the hosts keep some.
PRESSURE_WATERMARK = 0.4

# name -> (quota bytes, quota leases)
TENANTS: dict[str, tuple[int, int]] = {
    "roomy": (2048 * MiB, 1000),  # fits the delegation: local grants
    "tight": (48 * MiB, 16),  # three hosts want 72 MiB: quota_exceeded
    "cut": (512 * MiB, 256),  # cut to CUT_TO at CUT_AT_S
    "big": (1024 * MiB, 64),  # 96-160 MiB leases: central, mostly
    "press": (1024 * MiB, 8),  # the pressure lease
}
# Two processes of "cut" hold at most 8 leases of 2 MiB: the cut stays above that. The
# ledger may still count more (releases queued in the agents' outboxes): an excess the
# cut found is checked by `violations` as such (budgets clawed back, nothing granted since).
CUT_TO = (24 * MiB, 12)


@dataclass(frozen=True)
class Role:
    host: str
    tenant: str
    sizes: tuple[int, ...]
    hold: int


ROLES = (
    *(Role(h, "roomy", (2 * MiB, 4 * MiB), 6) for h in HOSTS),
    *(Role(h, "tight", (4 * MiB,), 6) for h in HOSTS[:3]),
    Role(HOSTS[0], "cut", (2 * MiB,), 4),
    Role(HOSTS[1], "cut", (2 * MiB,), 4),
    Role(HOSTS[1], "big", (96 * MiB, 160 * MiB), 2),
    Role(HOSTS[3], "big", (96 * MiB,), 2),
)

_LIVE = f"state IN {LIVE_STATES_SQL}"
# agent/revocation.py's words for a lease it tears down as revoked (memfd mapped or not).
_AGENT_REVOKED = re.compile(r"lease (\S+) revoked(?:, but pid| by poold; tearing it down)")
_LEASE_OVERLAPS = text(
    f"""
    SELECT a.id, b.id, a.device_id FROM leases a JOIN leases b
      ON a.device_id = b.device_id AND a.id < b.id
     AND a.offset_bytes < b.offset_bytes + b.length_bytes
     AND b.offset_bytes < a.offset_bytes + a.length_bytes
    WHERE a.{_LIVE} AND b.{_LIVE}
    """
)
_RESERVATION_OVERLAPS = text(
    """
    SELECT a.id, b.id, a.device_id FROM reservations a JOIN reservations b
      ON a.device_id = b.device_id AND a.id < b.id
     AND a.offset_bytes < b.offset_bytes + b.length_bytes
     AND b.offset_bytes < a.offset_bytes + a.length_bytes
    """
)
# A live lease on a reservation's bytes that is not one of its own local leases: another
# host's lease, or a central one (a reservation is used space for every central grant).
_LEASE_IN_FOREIGN_RESERVATION = text(
    f"""
    SELECT l.id, l.host_id, l.reservation_id, r.id, r.host_id FROM leases l
      JOIN reservations r ON l.device_id = r.device_id
     AND l.offset_bytes < r.offset_bytes + r.length_bytes
     AND r.offset_bytes < l.offset_bytes + l.length_bytes
    WHERE l.{_LIVE} AND (l.reservation_id IS NULL OR l.reservation_id <> r.id
                         OR l.host_id <> r.host_id)
    """
)
_LOCAL_OUTSIDE_ITS_RESERVATION = text(
    f"""
    SELECT l.id, l.reservation_id FROM leases l
      LEFT JOIN reservations r ON r.id = l.reservation_id
    WHERE l.{_LIVE} AND l.reservation_id IS NOT NULL
      AND (r.id IS NULL OR r.host_id <> l.host_id OR r.device_id <> l.device_id
           OR l.offset_bytes < r.offset_bytes
           OR l.offset_bytes + l.length_bytes > r.offset_bytes + r.length_bytes)
    """
)
_LIVE_USE = text(
    f"""
    SELECT tenant_id, host_id, reservation_id IS NULL, sum(length_bytes), count(*)
    FROM leases WHERE {_LIVE} GROUP BY tenant_id, host_id, reservation_id IS NULL
    """
)
_BUDGETS = text("SELECT tenant_id, host_id, bytes, leases FROM budgets")
# Per tenant: was its quota changed, and is any of its live leases granted after the
# last change? (A cut below what the ledger counts as held, releases still queued in
# the agents' outboxes, is what the cut found, not a grant past the quota.)
_CUT_AT = text(
    "SELECT tenant_id, max(at) FROM events WHERE kind = 'tenant.update' GROUP BY tenant_id"
)
_GRANTED_SINCE = text(
    f"""
    SELECT l.tenant_id, l.id, l.granted_at, l.reservation_id IS NULL FROM leases l
    JOIN (SELECT tenant_id, max(at) AS at FROM events WHERE kind = 'tenant.update'
          GROUP BY tenant_id) c ON c.tenant_id = l.tenant_id
    WHERE l.{_LIVE} AND l.granted_at > c.at
    """
)
_QUOTAS = text("SELECT id, name, quota_bytes, quota_leases FROM tenants")


def violations(conn: Connection) -> list[str]:
    """Every invariant broken in the snapshot ``conn`` reads (empty: none)."""
    found: list[str] = []
    for a, b, dev in conn.execute(_LEASE_OVERLAPS):
        found.append(f"live leases {a} and {b} overlap on device {dev}")
    for a, b, dev in conn.execute(_RESERVATION_OVERLAPS):
        found.append(f"reservations {a} and {b} overlap on device {dev}")
    for lease, host, own, res, res_host in conn.execute(_LEASE_IN_FOREIGN_RESERVATION):
        found.append(
            f"live lease {lease} (host {host}, reservation {own}) overlaps reservation "
            f"{res} of host {res_host}"
        )
    for lease, res in conn.execute(_LOCAL_OUTSIDE_ITS_RESERVATION):
        found.append(f"local lease {lease} is not inside its reservation {res} of its host")
    # Quota use as granting.quota_use counts it.
    central: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    local: dict[tuple[int, int], tuple[int, int]] = {}
    for tenant_id, host_id, is_central, nbytes, count in conn.execute(_LIVE_USE):
        if is_central:
            central[tenant_id][0] += int(nbytes)
            central[tenant_id][1] += int(count)
        else:
            local[(tenant_id, host_id)] = (int(nbytes), int(count))
    budgets = {(t, h): (int(b), int(n)) for t, h, b, n in conn.execute(_BUDGETS)}
    cut_at = dict(tuple(r) for r in conn.execute(_CUT_AT))
    granted_since: dict[int, list[str]] = defaultdict(list)
    for tenant_id, lease_id, at, is_central in conn.execute(_GRANTED_SINCE):
        where = "central" if is_central else "local"
        granted_since[tenant_id].append(f"{lease_id} ({where}, {at.isoformat()})")
    for tenant_id, name, quota_bytes, quota_leases in conn.execute(_QUOTAS):
        pairs = {k for k in (*local, *budgets) if k[0] == tenant_id}
        use = [central[tenant_id][i] for i in (0, 1)]
        for key in pairs:
            for i in (0, 1):
                use[i] += max(local.get(key, (0, 0))[i], budgets.get(key, (0, 0))[i])
        delegated = [sum(v[i] for k, v in budgets.items() if k[0] == tenant_id) for i in (0, 1)]
        # Over a quota cut below what it held, a tenant is within the rules while no
        # lease of it was granted since and its budgets were clawed back to fit (they and
        # its central leases within the new quota): its holdings can only come down.
        found_by_cut = (
            tenant_id in cut_at
            and not granted_since[tenant_id]
            and delegated[0] <= max(0, quota_bytes - central[tenant_id][0])
            and delegated[1] <= max(0, quota_leases - central[tenant_id][1])
        )
        if (use[0] > quota_bytes or use[1] > quota_leases) and not found_by_cut:
            found.append(
                f"tenant {name}: quota use {use[0]} bytes / {use[1]} leases over its quota "
                f"{quota_bytes} / {quota_leases} (central {central[tenant_id]}, local "
                f"{ {k[1]: v for k, v in local.items() if k[0] == tenant_id} }, budgets "
                f"{ {k[1]: v for k, v in budgets.items() if k[0] == tenant_id} }; quota "
                f"changed at {cut_at.get(tenant_id)}, live leases granted since "
                f"{granted_since[tenant_id][:5]})"
            )
    return found


def sample(engine: Engine) -> list[str]:
    """One consistent snapshot of the ledger, checked."""
    with engine.connect() as conn:
        snap = conn.execution_options(isolation_level="REPEATABLE READ")
        with snap.begin():
            return violations(snap)


@dataclass
class Sampler:
    """Samples the ledger every SAMPLE_EVERY_S on a thread of its own until stopped."""

    engine: Engine
    samples: int = 0
    broken: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ledger-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                found = sample(self.engine)
            except Exception as exc:  # a sampler that dies must fail the test, not hang it
                self.errors.append(repr(exc))
                return
            self.samples += 1
            self.broken.extend((time.monotonic() - t0, v) for v in found)
            self._stop.wait(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


@dataclass
class Pool:
    work: Path
    database_url: str
    urls: list[str]
    admin: PooldClient
    socks: dict[str, Path]
    devices: dict[str, str]  # host -> its emulated device's uid
    poolds: list[procs.Child]
    agents: dict[str, procs.Child]

    def poolctl(self, *argv: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "POOLD_URL": self.urls[0],
            "POOLD_TOKEN_FILE": str(self.work / "poold-1" / "admin.token"),
            "COLUMNS": "250",
        }
        return subprocess.run(
            [sys.executable, "-m", "cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    def revoked_by_agents(self) -> set[str]:
        """Lease ids an agent's log says it tore down as revoked."""
        found: set[str] = set()
        for agent in self.agents.values():
            text_ = agent.log_path.read_text(errors="replace")
            found.update(m.group(1) for m in _AGENT_REVOKED.finditer(text_))
        return found

    def logs(self) -> str:
        return "\n".join(
            f"--- {c.name} {c.log_path.name}\n{c.log_tail(15)}"
            for c in [*self.poolds, *self.agents.values()]
        )


@pytest.fixture
def pool(pg_server: pg.PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    # The agents inherit the environment: delegation on, the default refill floor.
    monkeypatch.setenv("POOL_AGENT_DELEGATION", "true")
    name = conftest.new_pg_database(pg_server, None)
    database_url = pg_server.url(name)
    env = {**POOLD_TEST_ENV, "POOLD_PRESSURE_WATERMARK": str(PRESSURE_WATERMARK)}
    children: list[procs.Child] = []
    run_dir = Path(tempfile.mkdtemp(prefix="poold-cc-"))
    try:
        poolds, urls = [], []
        for i in (1, 2):  # one after the other: the first migrates the ledger
            port = procs.free_port()
            poolds.append(
                procs.start_poold(tmp_path / f"poold-{i}", port, database_url=database_url, env=env)
            )
            children.append(poolds[-1])
            urls.append(f"http://127.0.0.1:{port}")
        admin = PooldClient(urls[0], (tmp_path / "poold-1" / "admin.token").read_text().strip())
        for tenant, (quota_bytes, quota_leases) in TENANTS.items():
            admin.create_tenant(
                TenantSpec(
                    name=tenant,
                    quota_bytes=quota_bytes,
                    quota_leases=quota_leases,
                    allowed_uids=[os.getuid()],
                )
            )
        socks: dict[str, Path] = {}
        agents: dict[str, procs.Child] = {}
        for i, host in enumerate(HOSTS):
            cred = tmp_path / f"{host}.credential"
            cred.write_text(admin.add_host(host).credential)
            socks[host] = run_dir / f"{host}.sock"
            agents[host] = procs.start_agent(
                tmp_path,
                host=host,
                # Half the hosts prefer each poold: both serve agents all along.
                poold_url=urls if i % 2 == 0 else urls[::-1],
                credential_file=cred,
                socket_path=socks[host],
                emulated_capacity_bytes=DEVICE_BYTES,
                # The default interval: drains, cuts and pressure reach the agents as
                # news (poold/ledger/news.py) without waiting for it.
                heartbeat_interval_s=1.0,
            )
            children.append(agents[host])
        devices = _devices_by_host(admin, timeout_s=15)
        yield Pool(tmp_path, database_url, urls, admin, socks, devices, poolds, agents)
        admin.close()
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        conftest.drop_pg_database(pg_server, name)


def _devices_by_host(admin: PooldClient, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {d.hosts[0]: d.uid for d in admin.status().devices if len(d.hosts) == 1}
        if set(HOSTS) <= set(found) or time.monotonic() > deadline:
            assert set(HOSTS) <= set(found), found
            return found
        time.sleep(0.1)


def _start_tenant(
    pool: Pool, role: Role, until: float, seed: int, **extra: Any
) -> subprocess.Popen[str]:
    args = {
        "sock": str(pool.socks[role.host]),
        "tenant": role.tenant,
        "sizes": list(role.sizes),
        "hold": role.hold,
        "until": until,
        "seed": seed,
        "pause_s": 0.03,
        **extra,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.deleg_tenant", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _history(engine: Engine, lease_ids: set[str]) -> dict[str, list[str]]:
    """The kinds of each lease's events, in order."""
    out: dict[str, list[str]] = {i: [] for i in lease_ids}
    for lease_id, kind in _query(engine, "SELECT lease_id, kind FROM events ORDER BY id"):
        if lease_id in out:
            out[lease_id].append(kind)
    return out


def _query(engine: Engine, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params)]


@pytest.mark.postgres
@pytest.mark.slow  # about 100 s: 20 processes for a 24 s run, and the checks after it
def test_four_agents_two_poold_drain_cut_pressure_no_overlap_no_quota_excess(
    pool: Pool, ledger_engine: Engine
) -> None:
    engine = ledger_engine
    sampler = Sampler(engine)
    sampler.start()
    tenants: list[tuple[Role, subprocess.Popen[str]]] = []
    outputs: list[tuple[Role, int, str, str]] = []
    try:
        t0 = time.time()
        until = t0 + RUN_S
        tenants += [
            (role, _start_tenant(pool, role, until, seed)) for seed, role in enumerate(ROLES)
        ]
        time.sleep(max(0.0, t0 + DRAIN_AT_S - time.time()))
        drained_host = HOSTS[3]
        drained = pool.poolctl("devices", "drain", pool.devices[drained_host], "--deadline-s", "3")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        drain_done = time.time()  # committed: poolctl has its answer
        time.sleep(max(0.0, t0 + CUT_AT_S - time.time()))
        # Cut while the tenant's budgets hold more than the new quota (a clawback).
        cut_deadline = time.monotonic() + 5
        while True:
            delegated_before_cut = tuple(
                int(x)
                for x in _query(
                    engine,
                    "SELECT coalesce(sum(b.bytes), 0), coalesce(sum(b.leases), 0) "
                    "FROM budgets b JOIN tenants t ON t.id = b.tenant_id WHERE t.name = 'cut'",
                )[0]
            )
            over_cut = delegated_before_cut[0] > CUT_TO[0] or delegated_before_cut[1] > CUT_TO[1]
            if over_cut or time.monotonic() > cut_deadline:
                break
            time.sleep(0.05)
        pool.admin.update_tenant("cut", TenantUpdate(quota_bytes=CUT_TO[0], quota_leases=CUT_TO[1]))
        cut_done = time.time()
        time.sleep(max(0.0, t0 + PRESSURE_AT_S - time.time()))
        pressed_host = HOSTS[2]
        dev = pool.admin.show_device(pool.devices[pressed_host])
        big = dev.largest_free_bytes - 32 * MiB
        pressure = _start_tenant(
            pool,
            Role(pressed_host, "press", (big, big // 2), 1),
            until + PRESSURE_EXTRA_S,
            99,
            mode="pressure",
        )
        tenants.append((Role(pressed_host, "press", (big,), 1), pressure))
        for role, proc in tenants:
            out, err = proc.communicate(timeout=RUN_S + PRESSURE_EXTRA_S + 90)
            outputs.append((role, proc.returncode, out, err))
    except BaseException:
        sampler.stop()
        raise
    finally:
        for _, proc in tenants:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(r, rc, err[-3000:]) for r, rc, _, err in outputs if rc != 0]

    lines = [json.loads(line) for _, _, out, _ in outputs for line in out.splitlines()]
    grants = {e["id"]: e for e in lines if e["ev"] == "grant"}
    refused = Counter(e["code"] for e in lines if e["ev"] == "refused")
    # Leases a tenant lost before releasing them: a renewal refused, or told `lost`.
    lost = {e["id"] for e in lines if e["ev"] in ("over", "lost")}
    # Released by a tenant that still held them: each must end `released`, by that release.
    released = {e["id"] for e in lines if e["ev"] == "release" and e["held"]} - lost
    shrunk = [e for e in lines if e["ev"] == "shrunk"]
    pressed = [e for e in lines if e["ev"] == "pressure_lease"]
    drained_dev = pool.devices[drained_host]

    # Every lease a tenant was granted reaches the ledger once the agents have committed
    # (the lag is printed below), and every one ends: nothing leaked, nothing live.
    # A central grant whose reply a loaded agent gave up on stays `granted` until the
    # agent's reconciliation or, at the latest, the reaper's activation deadline (30 s)
    # aborts it: such leases are given that long.
    start = time.monotonic()
    while True:
        rows = {
            r[0]: r[1:]
            for r in _query(engine, "SELECT id, state, reservation_id, host_id FROM leases")
        }
        missing = set(grants) - set(rows)
        live = [i for i, (state, _, _) in rows.items() if state in LIVE_STATE_VALUES]
        only_granted = all(rows[i][0] == "granted" for i in live)
        waited = time.monotonic() - start
        if (not missing and not live) or waited > (45 if only_granted and not missing else 20):
            break
        time.sleep(0.2)
    sampler.stop()
    final = sample(engine)
    history = _history(engine, set(grants))
    # Pressure asks unused reserved bytes back first (reservation.recall), then leases.
    (recalls,) = _query(
        engine,
        "SELECT count(*) FROM events WHERE kind = 'reservation.recall' AND device_id = "
        "(SELECT id FROM devices WHERE uid = :uid)",
        uid=pool.devices[pressed_host],
    )[0]
    local = sum(1 for i in grants if i in rows and rows[i][1] is not None)
    # How far behind its grant each local lease reached the ledger (the issue: ~1 s).
    behind = sorted(
        float(x)
        for (x,) in _query(
            engine,
            "SELECT extract(epoch FROM e.at - l.granted_at) FROM leases l JOIN events e "
            "ON e.lease_id = l.id AND e.kind = 'lease.grant' WHERE l.reservation_id IS NOT NULL",
        )
    )
    central = sum(1 for i in grants if i in rows and rows[i][1] is None)

    revoked = {i for i, events in history.items() if "lease.revoke" in events}
    # The one race still open (docs/design-changes.md "Local grants poold has not heard
    # of yet", still open): a local grant of the cut tenant made before the cut, refused
    # budget_exceeded at commit because poold's lagging view of its host's use (releases
    # still queued) and the other host's unspent budget fill the new quota. Counted by
    # that signature only; the single-agent reproduction below passes.
    lost_to_cut = {
        i for i in missing if grants[i]["tenant"] == "cut" and grants[i]["t"] <= cut_done + 2.0
    }
    print(
        f"\n{len(grants)} leases granted to {len(tenants)} tenant processes on "
        f"{len(HOSTS)} agents and 2 poold: {local} local, {central} central; refused "
        f"{dict(refused)}; lost by tenants {len(lost)} (revoked by poold {len(lost & revoked)}"
        f"; known race: cut {len(lost_to_cut)}); "
        f"pressure lease {[e['length'] for e in pressed]} shrunk {len(shrunk)} times, "
        f"reservations recalled {recalls}; "
        f"local grants committed behind by p50 {_pct(behind, 0.5):.2f} s, p99 "
        f"{_pct(behind, 0.99):.2f} s, max {_pct(behind, 1.0):.2f} s; "
        f"ledger samples {sampler.samples} in {RUN_S:.0f} s; budgets of 'cut' before its "
        f"cut {delegated_before_cut} -> quota {CUT_TO}"
    )
    for role, _, out, _ in outputs:
        summary = [json.loads(x) for x in out.splitlines() if '"summary"' in x]
        print(f"  {role.tenant}@{role.host}: {summary[0]['counts'] if summary else 'no summary'}")
    assert not failed, failed
    assert not sampler.errors, sampler.errors
    assert not sampler.broken, sampler.broken[:20]
    assert not final, final
    unknown_missing = sorted(missing - lost_to_cut)
    assert not unknown_missing, (
        [grants[i] for i in unknown_missing[:10]],
        _query(  # what moved the budgets (spent by central grants, clawed back)
            engine,
            "SELECT e.at, t.name, e.host_id, e.kind, e.detail FROM events e "
            "JOIN tenants t ON t.id = e.tenant_id WHERE e.kind LIKE 'budget.%' ORDER BY e.id",
        )[-20:],
    )
    assert not live, (live[:10], [rows[i] for i in live[:10]])
    assert sampler.samples >= RUN_S / SAMPLE_EVERY_S / 4, sampler.samples
    # Nothing but the drain (and pressure not given back in time) takes a lease away.
    unexplained = lost - revoked - lost_to_cut
    # Nor does an agent tear down a lease poold never revoked (a heartbeat before its
    # commit), but for the cut's race: a local grant refused at commit is taken back.
    torn_down = (pool.revoked_by_agents() & set(grants)) - revoked - lost_to_cut
    assert not torn_down, [(i, rows.get(i), history.get(i)) for i in sorted(torn_down)[:10]]
    assert not unexplained, [(i, rows.get(i), history.get(i)) for i in sorted(unexplained)]
    not_released = {i for i in released - revoked - lost_to_cut if rows[i][0] != "released"}
    assert not not_released, [(i, rows[i], history[i]) for i in sorted(not_released)[:10]]
    pressure_ids = {e["id"] for e in pressed}
    revoked_elsewhere = {i for i in revoked - pressure_ids if grants[i]["device"] != drained_dev}
    assert not revoked_elsewhere, [(i, history[i]) for i in sorted(revoked_elsewhere)]

    # The run did what it says: grants both ways, quota pushed against, the cut below
    # what was delegated, the drain and the pressure felt.
    assert local > 0 and central > 0, (local, central)
    assert refused["quota_exceeded"] > 0, refused
    assert over_cut, delegated_before_cut
    assert pressed, "the pressure lease was never granted"
    assert shrunk, "pressure never asked the big lease back"
    after_drain = [
        g
        for g in grants.values()
        if g["device"] == drained_dev and g["t"] > drain_done + 2.0  # the agent has heard
    ]
    assert not after_drain, after_drain[:5]
    assert _query(
        engine,
        "SELECT count(*) FROM reservations WHERE device_id = "
        "(SELECT id FROM devices WHERE uid = :uid) AND state = 'held'",
        uid=drained_dev,
    ) == [(0,)]

    audit = pool.poolctl("audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.fixture
def ledger_engine(pool: Pool) -> Iterator[Engine]:
    """An engine on the run's ledger, disposed however the test ends: a failed run kept
    its pooled connections alive in the traceback, and their collection later failed an
    unrelated test with psycopg's ResourceWarning."""
    engine = create_engine(pool.database_url)
    try:
        yield engine
    finally:
        engine.dispose()


# --- minimal reproductions of what the run above found -----------------------------------
#
# One poold (SQLite: neither is about the backend), one agent with delegation on behind a
# fault proxy (tests/agent/faultproxy.py), so that a local grant can be held back from
# poold for as long as the test wants: what a loaded poold (2 s timeouts) or a flush
# racing a heartbeat does to it for a few hundred milliseconds in the run above.

RACE_HOST = "race-host"
OTHER_HOST = "race-other"
RACE_TENANT = "solo"


@dataclass
class Relay:
    admin: PooldClient
    proxy: FaultProxy
    sock: Path
    database_url: str
    device_uid: str
    # A second host's agent, straight to poold (no proxy): started on demand.
    other_sock: Path | None = None

    def cut_off(self, paths: frozenset[str] | None = None) -> None:
        """Answer 503 to the agent's requests on ``paths`` (None: all of them)."""
        self.proxy.rule = lambda seen: 503 if paths is None or seen.path in paths else "pass"

    def reconnect(self) -> None:
        self.proxy.rule = lambda _seen: "pass"

    def lease_row(self, lease_id: str) -> tuple[Any, ...] | None:
        engine = create_engine(self.database_url)
        try:
            rows = _query(
                engine, "SELECT state, reservation_id FROM leases WHERE id = :id", id=lease_id
            )
        finally:
            engine.dispose()
        return rows[0] if rows else None


@pytest.fixture
def relay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Relay]:
    monkeypatch.setenv("POOL_AGENT_DELEGATION", "true")
    state = tmp_path / "poold"
    port = procs.free_port()
    poold = procs.start_poold(state, port, env=POOLD_TEST_ENV)
    children = [poold]
    run_dir = Path(tempfile.mkdtemp(prefix="poold-race-"))
    try:
        admin = procs.admin_client(state, port)
        admin.create_tenant(
            TenantSpec(name=RACE_TENANT, quota_bytes=1024 * MiB, allowed_uids=[os.getuid()])
        )
        cred = tmp_path / "cred"
        cred.write_text(admin.add_host(RACE_HOST).credential)
        with FaultProxy(port) as proxy:
            sock = run_dir / "agent.sock"
            children.append(
                procs.start_agent(
                    tmp_path,
                    host=RACE_HOST,
                    poold_url=proxy.url,
                    credential_file=cred,
                    socket_path=sock,
                    emulated_capacity_bytes=DEVICE_BYTES,
                    heartbeat_interval_s=0.2,
                    extra=["--poold-timeout", "2"],
                )
            )
            (uid,) = _devices_by_host_named(admin, RACE_HOST)
            other = run_dir / "other.sock"
            cred2 = tmp_path / "cred2"
            cred2.write_text(admin.add_host(OTHER_HOST).credential)
            children.append(
                procs.start_agent(
                    tmp_path,
                    host=OTHER_HOST,
                    poold_url=f"http://127.0.0.1:{port}",
                    credential_file=cred2,
                    socket_path=other,
                    emulated_capacity_bytes=DEVICE_BYTES,
                    heartbeat_interval_s=0.2,
                )
            )
            yield Relay(admin, proxy, sock, f"sqlite:///{state / 'ledger.db'}", uid, other)
        admin.close()
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _devices_by_host_named(admin: PooldClient, host: str) -> list[str]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = [d.uid for d in admin.status().devices if d.hosts == [host]]
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"host {host} never reported a device")


def _local_lease(relay: Relay, client: PoolClient) -> Lease:
    """A lease granted inside the delegation (the first ones are central: they make the
    demand the agent's refill asks poold for)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        lease = client.lease(2 * MiB, tenant=RACE_TENANT, ttl_s=60, renew=False)
        time.sleep(0.6)  # committed within the outbox's 250 ms
        row = relay.lease_row(lease.lease_id)
        if row is not None and row[1] is not None:
            return lease
        lease.release()
    raise AssertionError("the agent never granted a lease locally")


def test_a_heartbeat_before_the_commit_does_not_revoke_a_local_lease(relay: Relay) -> None:
    with PoolClient(relay.sock, timeout_s=10) as client:
        _local_lease(relay, client).release()
        # Lease ops (the outbox) fail for a second; heartbeats, which report every held
        # lease, go through.
        relay.cut_off(frozenset({"/v1/agent/ops"}))
        lost: list[str] = []
        lease = client.lease(
            2 * MiB,
            tenant=RACE_TENANT,
            ttl_s=60,
            renew=False,
            on_lost=lambda x: lost.append(x.lost_reason or ""),
        )
        time.sleep(1.0)
        relay.reconnect()
        time.sleep(1.0)
        row = relay.lease_row(lease.lease_id)
        assert row is not None and row[1] is not None  # it was local, and is committed
        assert not lost, lost
        client.renew(lease.lease_id, ttl_s=60)
        lease.release()


def test_a_drain_keeps_a_reservation_whose_local_lease_is_not_committed(relay: Relay) -> None:
    with PoolClient(relay.sock, timeout_s=10) as client:
        _local_lease(relay, client).release()
        time.sleep(0.6)  # its release applied: no committed lease left in the reservation
        relay.cut_off()  # the agent cannot reach poold: it grants alone, as designed
        lease = client.lease(2 * MiB, tenant=RACE_TENANT, ttl_s=60, renew=False)
        relay.admin.drain_device(relay.device_uid, deadline_s=60)
        relay.reconnect()
        deadline = time.monotonic() + 5
        while relay.lease_row(lease.lease_id) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert relay.lease_row(lease.lease_id) is not None, "granted, never in the ledger"
        lease.release()


def test_a_quota_cut_spares_local_grants_not_yet_committed(relay: Relay) -> None:
    assert relay.other_sock is not None
    with (
        PoolClient(relay.sock, timeout_s=10) as client,
        PoolClient(relay.other_sock, timeout_s=10) as other,
    ):
        _local_lease(relay, client).release()
        kept = _local_lease(relay, other)  # the other host: a budget, one lease spent
        time.sleep(0.6)
        relay.cut_off()
        lease = client.lease(2 * MiB, tenant=RACE_TENANT, ttl_s=60, renew=False)
        # Above what the tenant holds (2 leases, 4 MiB), below its two budgets.
        relay.admin.update_tenant(RACE_TENANT, TenantUpdate(quota_bytes=8 * MiB, quota_leases=4))
        relay.reconnect()
        deadline = time.monotonic() + 5
        while relay.lease_row(lease.lease_id) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert relay.lease_row(lease.lease_id) is not None, "granted, never in the ledger"
        lease.release()
        kept.release()
