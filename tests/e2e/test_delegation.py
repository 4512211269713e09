"""Delegated capacity end to end (issue 12): real `poold serve` and `pool-agent serve`.

The agent grants inside the reservations and budgets poold delegated to it while poold
is down, journals each grant, and commits them when poold is back; past the
reservations' TTL it refuses with `delegation_expired`.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.client import Lease, PoolClient
from poold import procs
from poold.api.client import PooldClient
from poold.errors import PoolError
from poold.wire.admin import TenantSpec
from tests.e2e.conftest import query_ledger

MiB = 1 << 20
LEASE = 2 * MiB
TENANT = "delta"


@dataclass
class Pool:
    work: Path
    state_dir: Path
    port: int
    database_url: str
    poold: procs.Child
    agent: procs.Child
    sock: Path
    admin: PooldClient
    poold_env: dict[str, str]
    agent_args: dict[str, Any]

    def start_poold(self) -> None:
        self.poold = procs.start_poold(self.state_dir, self.port, env=self.poold_env)

    def kill_agent_and_restart(self) -> None:
        self.agent.kill()
        self.agent = procs.start_agent(self.work, **self.agent_args)

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        return query_ledger(self.database_url, sql)


def _pool(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    ttl_s: float = 600.0,
    quota_bytes: int = 2048 * MiB,
    quota_leases: int = 1000,
    capacity_bytes: int = 4096 * MiB,
    min_reserve: str = "512MiB",
    min_leases: int = 300,
) -> Iterator[Pool]:
    # Room for 200 leases ahead of any demand (the agent inherits the environment).
    monkeypatch.setenv("POOL_AGENT_DELEGATION", "true")
    monkeypatch.setenv("POOL_AGENT_DELEGATION_MIN_RESERVE_BYTES", min_reserve)
    monkeypatch.setenv("POOL_AGENT_DELEGATION_MIN_BUDGET_LEASES", str(min_leases))
    state = tmp_path / "poold"
    port = procs.free_port()
    env = {
        "POOLD_REAP_INTERVAL_S": "0.2",
        "POOLD_EXPIRY_GRACE_S": "1",
        "POOLD_RESERVATION_TTL_S": str(ttl_s),
    }
    poold = procs.start_poold(state, port, env=env)
    children = [poold]
    run_dir = Path(tempfile.mkdtemp(prefix="poold-deleg-"))
    try:
        admin = procs.admin_client(state, port)
        cred = tmp_path / "cred"
        cred.write_text(admin.add_host("deleg-host").credential)
        admin.create_tenant(
            TenantSpec(
                name=TENANT,
                quota_bytes=quota_bytes,
                quota_leases=quota_leases,
                allowed_uids=[os.getuid()],
            )
        )
        args: dict[str, Any] = {
            "host": "deleg-host",
            "poold_url": f"http://127.0.0.1:{port}",
            "credential_file": cred,
            "socket_path": run_dir / "agent.sock",
            # memfds are lazy: a big emulated device costs nothing, and its 25 % cap
            # leaves room for a 512 MiB reservation.
            "emulated_capacity_bytes": capacity_bytes,
            "heartbeat_interval_s": 0.2,
        }
        agent = procs.start_agent(tmp_path, **args)
        children.append(agent)
        pool = Pool(
            tmp_path,
            state,
            port,
            f"sqlite:///{state / 'ledger.db'}",
            poold,
            agent,
            run_dir / "agent.sock",
            admin,
            env,
            args,
        )
        yield pool
        children[:] = [pool.poold, pool.agent]
        admin.close()
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    yield from _pool(tmp_path, monkeypatch)


@pytest.fixture
def short_ttl_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    yield from _pool(tmp_path, monkeypatch, ttl_s=3.0)


def _delegated(pool: Pool, client: PoolClient, timeout_s: float = 15) -> None:
    """Lease until one is granted inside the delegation (the first, central, one makes
    the demand the agent's refill asks poold for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lease = client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
        lease.release()
        time.sleep(0.5)  # a local grant is committed within LOCAL_FLUSH_S (0.25 s)
        local = pool.query(f"SELECT reservation_id FROM leases WHERE id = '{lease.lease_id}'")
        if local and local[0][0] is not None:
            budgets = pool.query("SELECT leases FROM budgets")
            if budgets and budgets[0][0] >= 250:
                return
    raise AssertionError("the agent never held a delegation big enough")


def _wait_committed(
    pool: Pool, ids: set[str], timeout_s: float, *, local_only: bool = True
) -> float:
    """Seconds until every lease in ``ids`` is in the ledger, released (and, unless
    ``local_only`` is False, granted locally: inside a reservation)."""
    where = " WHERE reservation_id IS NOT NULL" if local_only else ""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        rows = pool.query("SELECT id, state FROM leases" + where)
        done = {r[0] for r in rows if r[1] == "released"}
        if ids <= done:
            return time.monotonic() - t0
        time.sleep(0.05)
    states = dict(rows)
    missing = collections.Counter(states.get(i, "not in the ledger") for i in ids - done)
    raise AssertionError(
        f"{len(ids - done)} of {len(ids)} local leases not committed released: {dict(missing)}"
    )


def _events_of(pool: Pool, ids: set[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {i: [] for i in ids}
    for lease_id, kind in pool.query("SELECT lease_id, kind FROM events ORDER BY id"):
        if lease_id in out:
            out[lease_id].append(kind)
    return out


def _poolctl(pool: Pool, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "POOLD_URL": f"http://127.0.0.1:{pool.port}",
        "POOLD_TOKEN_FILE": str(pool.state_dir / "admin.token"),
        "COLUMNS": "250",
    }
    return subprocess.run(
        [sys.executable, "-m", "cli", *argv], env=env, capture_output=True, text=True, timeout=60
    )


def _cycle(client: PoolClient, n: int) -> list[Lease]:
    """Grant ``n`` leases that fit the delegation, renew each, release each."""
    leases = [client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False) for _ in range(n)]
    for lease in leases:
        client.renew(lease.lease_id, ttl_s=120)
    for lease in leases:
        lease.release()
    return leases


def test_poold_down_200_local_leases_committed_on_return(pool: Pool) -> None:
    with PoolClient(pool.sock, timeout_s=10) as client:
        _delegated(pool, client)
        pool.poold.kill()
        t0 = time.perf_counter()
        leases = _cycle(client, 200)
        elapsed = time.perf_counter() - t0
        ids = {lease.lease_id for lease in leases}
        assert len(ids) == 200
        pool.start_poold()
        took = _wait_committed(pool, ids, timeout_s=2.0 + 3.0)  # poold's start, then 2 s
    print(f"200 local lease+renew+release with poold down: {elapsed:.2f} s; committed {took:.2f} s")
    events = _events_of(pool, ids)
    for lease_id, kinds in events.items():
        assert kinds[:2] == ["lease.grant", "lease.activate"], (lease_id, kinds)
        assert kinds.count("lease.grant") == 1
        assert kinds[-1] == "lease.release", (lease_id, kinds)
    # Inside the host's reservation; and no two of the 200 share bytes (poold was down,
    # so no release was applied and no extent freed for another while they were granted).
    rows = [
        r[1:]
        for r in pool.query(
            "SELECT l.id, l.offset_bytes, l.length_bytes, r.offset_bytes, r.length_bytes "
            "FROM leases l JOIN reservations r ON r.id = l.reservation_id"
        )
        if r[0] in ids
    ]
    assert len(rows) == 200
    spans = sorted((r[0], r[0] + r[1]) for r in rows)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    assert all(r[2] <= r[0] and r[0] + r[1] <= r[2] + r[3] for r in rows)
    shown = _poolctl(pool, "leases", "list")
    assert shown.returncode == 0, shown.stderr
    assert "deleg-host:" in shown.stdout, shown.stdout[:2000]
    audit = _poolctl(pool, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_agent_killed_mid_way_journal_readopts(pool: Pool) -> None:
    with PoolClient(pool.sock, timeout_s=10) as client:
        _delegated(pool, client)
        pool.poold.kill()
        first = _cycle(client, 100)
        held = [client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False) for _ in range(20)]
        # -9 with 20 held (their holder, this process, is alive) and 100 ended, none of
        # them committed: the journal is all there is.
        pool.kill_agent_and_restart()
        listed = {lease.lease_id for lease in client.list()}
        assert {lease.lease_id for lease in held} <= listed
        second = _cycle(client, 80)
        for lease in held:
            lease.release()
        ids = {lease.lease_id for lease in first + held + second}
        assert len(ids) == 200
        pool.start_poold()
        _wait_committed(pool, ids, timeout_s=5.0)
    events = _events_of(pool, ids)
    for lease_id, kinds in events.items():
        assert kinds.count("lease.grant") == 1, (lease_id, kinds)  # nothing doubled
        assert kinds.count("lease.release") == 1, (lease_id, kinds)
    assert pool.query("SELECT count(*) FROM leases WHERE state <> 'released'") == [(0,)]
    audit = _poolctl(pool, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.fixture
def small_device_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """A 256 MiB device: its 25 % cap keeps the host's reservations at 64 MiB at most."""
    yield from _pool(tmp_path, monkeypatch, capacity_bytes=256 * MiB, min_reserve="16MiB")


def test_poold_down_a_tenant_churning_past_its_reservations_keeps_leasing(
    small_device_pool: Pool,
) -> None:
    """A released local lease's bytes wait for poold to apply the release; with poold
    down, the same tenant's next lease of that length takes them (its release reaches
    poold first), so an engine churning leases through an outage is not refused once it
    has released its reservations' worth. Also across a kill -9 of the agent."""
    pool = small_device_pool
    with PoolClient(pool.sock, timeout_s=10) as client:
        _delegated(pool, client)
        reserved = sum(r[0] for r in pool.query("SELECT length_bytes FROM reservations"))
        pool.poold.kill()
        rounds = 2 * reserved // LEASE + 10  # twice what the reservations hold, and more
        ids: list[str] = []
        for _ in range(rounds):
            lease = client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
            ids.append(lease.lease_id)
            lease.release()
        pool.kill_agent_and_restart()  # the journal restores what poold has not heard
        for _ in range(rounds):
            lease = client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
            ids.append(lease.lease_id)
            lease.release()
        assert len(set(ids)) == 2 * rounds
        pool.start_poold()
        _wait_committed(pool, set(ids), timeout_s=10.0)
    events = _events_of(pool, set(ids))
    for lease_id, kinds in events.items():
        assert kinds[:2] == ["lease.grant", "lease.activate"], (lease_id, kinds)
        assert kinds.count("lease.release") == 1, (lease_id, kinds)
    # The same bytes, one lease after another, in the order they were granted.
    rows = pool.query(
        "SELECT id, reservation_id, offset_bytes, epoch FROM leases WHERE reservation_id "
        "IS NOT NULL"
    )
    by_id = {r[0]: r[1:] for r in rows}
    place = collections.defaultdict(list)
    for lease_id in ids:
        reservation_id, offset, epoch = by_id[lease_id]
        place[(reservation_id, offset)].append(epoch)
    assert max(len(epochs) for epochs in place.values()) > 1  # bytes were taken again
    for epochs in place.values():
        assert epochs == sorted(set(epochs)), epochs  # epochs rise per byte range
    audit = _poolctl(pool, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_reservation_ttl_passes_with_poold_down(short_ttl_pool: Pool) -> None:
    pool = short_ttl_pool
    with PoolClient(pool.sock, timeout_s=10) as client:
        _delegated(pool, client)
        kept = client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
        pool.poold.kill()
        client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False).release()  # still local
        time.sleep(3.5)  # the reservation's TTL (3 s) passes unrenewed
        with pytest.raises(PoolError) as refused:
            client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
        assert refused.value.code == "delegation_expired"
        pool.start_poold()
        # The lease granted inside it is reported: the ledger has it, in its reservation.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            rows = pool.query(
                f"SELECT state, reservation_id FROM leases WHERE id = '{kept.lease_id}'"
            )
            if rows:
                break
            time.sleep(0.05)
        assert rows and rows[0][0] == "active" and rows[0][1] is not None, rows
        kept.release()
        # It outlived its reservation's TTL, so poold kept that reservation (returning,
        # no new lease) until the lease ended; then it goes.
        _wait_committed(pool, {kept.lease_id}, timeout_s=5.0)
        assert _poolctl(pool, "audit").returncode == 0


# --- the central path beside the delegation ---------------------------------------------

QUOTA = 96 * MiB


@pytest.fixture
def small_quota_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """A tenant whose whole quota (96 MiB, 40 leases) the agent's budget holds, on a
    192 MiB device whose 25 % cap keeps the first reservation at 48 MiB."""
    yield from _pool(
        tmp_path,
        monkeypatch,
        quota_bytes=QUOTA,
        quota_leases=40,
        capacity_bytes=192 * MiB,
        min_reserve="96MiB",
        min_leases=40,
    )


def _central(pool: Pool, lease_id: str) -> bool:
    """The ledger has the lease, granted centrally (a local one lands within ~1 s)."""
    rows = pool.query(f"SELECT reservation_id FROM leases WHERE id = '{lease_id}'")
    return rows == [(None,)]


def _quota_use(pool: Pool) -> int:
    """The tenant's quota use as poold counts it: central leases, and per host the larger
    of its budget and its local leases (granting.quota_use)."""
    [(central, local)] = pool.query(
        "SELECT coalesce(sum(CASE WHEN reservation_id IS NULL THEN length_bytes END), 0), "
        "coalesce(sum(CASE WHEN reservation_id IS NOT NULL THEN length_bytes END), 0) "
        "FROM leases WHERE state NOT IN ('released', 'reclaimed', 'aborted', 'expired')"
    )
    budget = pool.query("SELECT coalesce(sum(bytes), 0) FROM budgets")[0][0]
    return int(central) + max(int(budget), int(local))


def _lease_until(client: PoolClient, ready: Callable[[], bool], *, pause_s: float) -> None:
    """Lease and release one lease at a time, up to 15 s, until ``ready`` (the first lease
    is central: the demand makes the agent ask for a reservation and a budget)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False).release()
        time.sleep(pause_s)
        if ready():
            return


def test_a_budget_holding_the_whole_quota_leaves_its_host_central_grants(
    small_quota_pool: Pool,
) -> None:
    """Local grants and central ones (bigger than any reservation) at once, while the
    budget holds the whole quota: the first central grant is paid from the budget, the
    second is refused by the quota, no local lease is refused when it reaches poold, and
    the quota use sampled all along never passes the quota."""
    pool = small_quota_pool
    with PoolClient(pool.sock, timeout_s=10) as client:
        _lease_until(
            client,
            lambda: (
                bool(budget := pool.query("SELECT bytes, leases FROM budgets"))
                and budget[0][0] >= QUOTA - LEASE
                and pool.query("SELECT count(*) FROM reservations") != [(0,)]
            ),
            pause_s=0.5,
        )
        # All of the quota (less the first, central, lease live when it was set): no room
        # for any other central grant of the tenant but what this budget gives up.
        [(budget_bytes, budget_leases)] = pool.query("SELECT bytes, leases FROM budgets")
        assert budget_bytes >= QUOTA - LEASE and budget_leases >= 39
        # (so a 50 MiB lease fits no reservation: it takes the central path)
        [(largest,)] = pool.query("SELECT max(length_bytes) FROM reservations")
        assert largest <= 48 * MiB

    over: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            used = _quota_use(pool)
            if used > QUOTA:
                over.append(used)
            time.sleep(0.01)

    granted: list[Lease] = []
    refused: list[str] = []
    lock = threading.Lock()
    done = threading.Barrier(2)

    def take(size: int, n: int) -> None:
        with PoolClient(pool.sock, timeout_s=30) as own:
            mine: list[Lease] = []
            for _ in range(n):
                try:
                    lease = own.lease(size, tenant=TENANT, ttl_s=60, renew=False)
                except PoolError as err:
                    with lock:
                        refused.append(err.code)
                    continue
                mine.append(lease)
            with lock:
                granted.extend(mine)
            done.wait(timeout=60)  # everything granted is held at once, then released
            time.sleep(1.0)
            for lease in mine:
                lease.release()

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [
        threading.Thread(target=take, args=(LEASE, 20)),
        threading.Thread(target=take, args=(50 * MiB, 2)),
    ]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    finally:
        stop.set()
        sampler.join()
    assert over == [], over
    # The second central grant: no quota left (or, first, no room: refills reserved it).
    assert len(refused) == 1 and refused[0] in ("quota_exceeded", "no_capacity"), refused
    assert sum(x.length_bytes for x in granted) <= QUOTA
    central = {x.lease_id for x in granted if x.length_bytes == 50 * MiB}
    small = {x.lease_id for x in granted} - central
    assert len(central) == 1 and len(small) == 20
    [(spent,)] = pool.query("SELECT count(*) FROM events WHERE kind = 'budget.spend'")
    assert spent >= 1
    # poold has every small lease, none refused on arrival: most were granted locally;
    # those asked once the central grant had spent the budget (the agent lowers its view
    # first) went central, each spending the budget in turn (budget.spend).
    _wait_committed(pool, small, timeout_s=10.0, local_only=False)
    [(local,)] = pool.query(
        f"SELECT count(*) FROM leases WHERE reservation_id IS NOT NULL AND length_bytes = {LEASE}"
    )
    assert local >= 1
    audit = _poolctl(pool, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_a_lease_bigger_than_what_reservations_leave_is_granted_from_them_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's free bytes are in this host's reservations, which no local lease uses:
    a central grant refused no_capacity makes the agent give them back and ask once more,
    so the tenant gets its lease without waiting (poold's pressure asks other hosts'
    reservations back for a request that waits: tests/poold/ledger/test_delegation_pressure.py)."""
    for pool in _pool(
        tmp_path, monkeypatch, capacity_bytes=128 * MiB, min_reserve="32MiB", min_leases=16
    ):
        with PoolClient(pool.sock, timeout_s=10) as client:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False).release()
                time.sleep(0.5)
                reserved = pool.query("SELECT coalesce(sum(length_bytes), 0) FROM reservations")
                if reserved[0][0] >= 24 * MiB:
                    break
            [(reserved_bytes,)] = pool.query("SELECT sum(length_bytes) FROM reservations")
            # Fill what is not reserved with one central lease but 8 MiB: bigger than any
            # reservation, and it never reports, so pressure cannot ask it.
            fill = 128 * MiB - int(reserved_bytes) - 8 * MiB
            filler = client.lease(fill, tenant=TENANT, ttl_s=120, renew=True)
            assert _central(pool, filler.lease_id)
            # A tenant with no budget here asks 24 MiB: not local (no budget), and 8 MiB
            # free beside the reservations. Granted at once, in the bytes given back.
            pool.admin.create_tenant(
                TenantSpec(
                    name="other",
                    quota_bytes=1024 * MiB,
                    quota_leases=100,
                    allowed_uids=[os.getuid()],
                )
            )
            t0 = time.monotonic()
            with PoolClient(pool.sock, timeout_s=40) as asking:
                served = asking.lease(24 * MiB, tenant="other", ttl_s=60, renew=False)
                took = time.monotonic() - t0
                assert _central(pool, served.lease_id)
                kinds = [k for (k,) in pool.query("SELECT kind FROM events ORDER BY id")]
                assert "reservation.return" in kinds
                assert pool.query(
                    f"SELECT length_bytes FROM leases WHERE id = '{filler.lease_id}'"
                ) == [(filler.length_bytes,)]  # no lease was asked to shrink
                served.release()
            print(f"a 24 MiB request served from given-back reservations in {took:.2f} s")
            filler.release()
        audit = _poolctl(pool, "audit")
        assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.fixture
def count_quota_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """A tenant held by its lease count (40), whose budget holds all of it, on a device
    with room in its reservations to spare."""
    yield from _pool(
        tmp_path,
        monkeypatch,
        quota_bytes=1024 * MiB,
        quota_leases=40,
        capacity_bytes=2048 * MiB,
        min_reserve="256MiB",
        min_leases=40,
    )


def test_at_its_quota_a_tenant_releasing_one_lease_gets_the_next_locally(
    count_quota_pool: Pool,
) -> None:
    """A released local lease's budget is spent again at once (before poold has applied
    the release): the next lease is granted locally, reaches poold after the release,
    and is never refused there; at the quota, release-then-lease never fails."""
    pool = count_quota_pool
    with PoolClient(pool.sock, timeout_s=10) as client:
        _lease_until(
            client,
            lambda: bool(budget := pool.query("SELECT leases FROM budgets")) and budget[0][0] >= 39,
            pause_s=0.3,
        )
        assert pool.query("SELECT leases FROM budgets")[0][0] >= 39
        held: list[Lease] = []
        refused: list[str] = []
        while len(held) < 41:
            try:
                held.append(client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False))
            except PoolError as err:
                refused.append(err.code)
                break
        assert refused == ["quota_exceeded"] and len(held) == 40, (refused, len(held))
        cycled: list[str] = []
        for _ in range(30):
            held.pop(0).release()
            lease = client.lease(LEASE, tenant=TENANT, ttl_s=60, renew=False)
            held.append(lease)
            cycled.append(lease.lease_id)
        ids = {x.lease_id for x in held}
        for lease in held:
            lease.release()
    _wait_committed(pool, set(cycled) | ids, timeout_s=10.0, local_only=False)
    rows = pool.query(
        "SELECT id FROM leases WHERE reservation_id IS NOT NULL AND id IN ("
        + ",".join(f"'{i}'" for i in cycled)
        + ")"
    )
    assert len(rows) >= 25, f"only {len(rows)} of 30 cycled leases were granted locally"
    # None of them was refused on arrival (a refused local lease ends 'lost', not released).
    [(lost,)] = pool.query("SELECT count(*) FROM events WHERE kind = 'lease.lost'")
    assert lost == 0
    audit = _poolctl(pool, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
