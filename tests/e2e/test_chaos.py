"""Chaos: kill -9 poold, the agent or a tenant mid-lifecycle; one audit puts everything right.

Each trial runs a real tenant process that leases, touches, renews and releases
a few leases through the agent, printing a marker before each step. At a
random step (grant, activate, renew, release), after a random delay of a few
milliseconds, one of poold, the agent or the tenant gets SIGKILL. What was
killed is restarted, the tenant runs to its end (or is dead), the lifecycle
clocks run, and one `poolctl audit --reclaim --json` must find no invariant
violated (exit code != 2); after that the ledger must lease zero bytes beyond
those of a bystander tenant that lives through every trial (its lease must stay
active and its memory intact however the others die), and the agent must hold
exactly that lease's memory.

"scrub" is not a kill point: the emulated backend hands out fresh memfd pages
and never scrubs. Leases that lose their memory with a crash (an agent killed
after a release it had not yet forwarded, a poold killed after committing a
grant it never answered) have no holder renewing them: they end by their
short ttl, so tenants lease with a ttl of a few seconds.

Reproduce a run with ``POOLD_CHAOS_SEED=<seed>`` (printed); trial N draws from
seed + N, so ``POOLD_CHAOS_SEED=<a failure message's seed> POOLD_CHAOS_TRIALS=1``
replays one trial's choices (timing on a loaded machine is never exact).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from agent.client import PoolClient
from poold.api.client import PooldClient
from poold.errors import PooldUnreachable
from tests.e2e.conftest import Cluster, _start

pytestmark = pytest.mark.slow

MiB = 1 << 20
TRIALS = int(os.environ.get("POOLD_CHAOS_TRIALS", "50"))
TTL_S = 2
PHASES = ("grant", "activate", "renew", "release")
VICTIMS = ("poold", "agent", "tenant")
# On top of the cluster fixture's fast reaper (0.2 s) and grace (1 s): a host is out
# of contact after 2 s of silence (default 10 s), so the hold a restarted poold puts on
# every active lease (the outage rule) ends in 2 s; and grants never activated abort
# after 2 s. Both only shorten how long a crash's leftovers wait; neither is skipped.
CHAOS_ENV = {"POOLD_HOST_SILENT_AFTER_S": "2", "POOLD_ACTIVATION_DEADLINE_S": "2"}
HOLDER_CHECK_S = 1.0  # the agent's holder watch interval
GRACE_S = 1.0  # POOLD_EXPIRY_GRACE_S in the cluster fixture
# The longest a crash's leftover may legitimately live: hold + ttl + a heartbeat + grace
# + a reaper pass, doubled for a loaded 2-core machine.
SETTLE_DEADLINE_S = 2 * (2 + TTL_S + 0.2 + GRACE_S + 0.2) + 5

TENANT = textwrap.dedent("""
    import mmap, os, random, sys, time
    from agent.client import PoolClient

    sock, seed, tenant = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)

    def mark(*words):
        print(*words, flush=True)

    client = PoolClient(sock, timeout_s=5)
    held = []
    for _ in range(rng.randint(2, 4)):
        size = rng.choice([1, 2, 4, 8]) << 20
        mark("grant", size)
        try:
            lease = client.lease(size, ttl_s=%(ttl)d, tenant=tenant, renew=False)
        except Exception as err:
            mark("refused", getattr(err, "code", type(err).__name__))
            continue
        mark("granted", lease.lease_id, lease.length_bytes)
        mark("activate", lease.lease_id)
        mm = lease.mmap()
        for offset in range(0, lease.length_bytes, mmap.PAGESIZE):
            mm[offset] = 0x5A
        mm.close()
        held.append(lease)
    for _ in range(2):
        for lease in held:
            mark("renew", lease.lease_id)
            try:
                client.renew(lease.lease_id)
            except Exception as err:
                mark("renew_failed", lease.lease_id, getattr(err, "code", type(err).__name__))
    for lease in held:
        mark("release", lease.lease_id)
        try:
            lease.release()
        except Exception as err:
            mark("release_failed", lease.lease_id, getattr(err, "code", type(err).__name__))
    mark("done")
    os._exit(0)  # no client.close(): leases it could not release stay for the lifecycle
""") % {"ttl": TTL_S}


# A tenant that lives through every trial: one lease, renewed in the background, its
# memory checked every 50 ms. Its ttl outlasts an agent restart (a tenant's renewals
# reach poold only through a running agent). It exits 3 if the lease is ever lost or
# its memory changes, and releases its lease when its stdin closes.
BYSTANDER = textwrap.dedent("""
    import os, sys, threading, time
    from agent.client import PoolClient

    def lost(lease):
        print("lost", lease.lease_id, flush=True)
        os._exit(3)

    client = PoolClient(sys.argv[1], timeout_s=5)
    lease = client.lease(4 << 20, ttl_s=8, tenant="alpha", on_lost=lost)
    mm = lease.mmap()
    mm[:8] = b"bystand!"
    print(lease.lease_id, lease.length_bytes, flush=True)

    def watch():
        while True:
            if mm[:8] != b"bystand!":
                print("corrupt", flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    sys.stdin.read()
    mm.close()
    lease.release()
    client.close()
""")


@dataclass
class Bystander:
    proc: subprocess.Popen[str]
    lease_id: str
    length_bytes: int


@dataclass
class Trial:
    number: int
    seed: int
    victim: str
    phase: str
    occurrence: int
    delay_s: float

    @classmethod
    def draw(cls, number: int, seed: int) -> Trial:
        rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not a secret
        return cls(
            number=number,
            seed=seed,
            victim=rng.choice(VICTIMS),
            phase=rng.choice(PHASES),
            occurrence=rng.randint(1, 3),
            # Most operations take a few ms: half the kills land within 3 ms of the
            # marker (inside the step), the rest up to 20 ms on (the steps after it).
            delay_s=rng.uniform(0, 0.003) if rng.random() < 0.5 else rng.uniform(0, 0.02),
        )

    def __str__(self) -> str:
        return (
            f"trial {self.number} (seed {self.seed}): kill -9 {self.victim} "
            f"{self.delay_s * 1000:.0f} ms into {self.phase} #{self.occurrence}"
        )


@pytest.fixture(scope="module")
def chaos_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for every trial (a fresh one each would cost seconds per trial)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CHAOS_ENV.items():
            mp.setenv(key, value)  # poold inherits them, on every restart too
        yield from _start(tmp_path_factory.mktemp("chaos"), None)


@pytest.fixture(scope="module")
def base_seed() -> int:
    seed = int(os.environ.get("POOLD_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nchaos: POOLD_CHAOS_SEED={seed}, {TRIALS} trials")
    return seed


def retry(fn: Any, timeout_s: float = 15.0) -> Any:
    """`fn()`, retried while poold is unreachable (it may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except PooldUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_tenant_and_kill(c: Cluster, trial: Trial) -> tuple[subprocess.Popen[str], list[str]]:
    """Start the tenant; SIGKILL the victim at the trial's point; the lines seen until then."""
    tenant = subprocess.Popen(
        [sys.executable, "-c", TENANT, str(c.socket_path), str(trial.seed), "alpha"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert tenant.stdout is not None
    seen: list[str] = []
    hits = 0
    for line in tenant.stdout:
        seen.append(line.strip())
        if line.split()[0] == trial.phase:
            hits += 1
            if hits == trial.occurrence:
                break
    # Fewer steps of that phase than drawn (or none: every grant refused): kill at the end.
    time.sleep(trial.delay_s)
    if trial.victim == "tenant":
        tenant.send_signal(signal.SIGKILL)
    elif trial.victim == "agent":
        c.agent.kill()
    else:
        c.poold.kill()
    return tenant, seen


def restart(c: Cluster, victim: str) -> None:
    if victim == "agent":
        c.restart_agent(kill=True)
    elif victim == "poold":
        c.restart_poold(kill=True)


def audit_cli(c: Cluster) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "audit", "--reclaim", "--json"],
        env=c.poolctl_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        report = json.loads(out.stdout)
    except ValueError:
        report = {"stdout": out.stdout, "stderr": out.stderr}
    return out.returncode, report


def live_leases(c: Cluster) -> list[tuple[Any, ...]]:
    """The ledger's live leases, for a failure message."""
    engine = create_engine(c.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, state, length_bytes, granted_at, expires_at FROM leases"
                    " WHERE state NOT IN ('released', 'reclaimed', 'aborted')"
                )
            )
            return [tuple(r) for r in rows]
    finally:
        engine.dispose()


def lease_paths(c: Cluster, known: set[str]) -> tuple[set[str], Counter[str]]:
    """Every lease id in the ledger, and how each lease not in `known` ended (its events)."""
    events: dict[str, list[str]] = {}
    engine = create_engine(c.database_url)
    try:
        with engine.connect() as conn:
            ids = {r[0] for r in conn.execute(text("SELECT id FROM leases"))}
            for lease_id, kind in conn.execute(
                text("SELECT lease_id, kind FROM events WHERE lease_id IS NOT NULL ORDER BY id")
            ):
                if lease_id not in known:
                    events.setdefault(lease_id, []).append(kind.removeprefix("lease."))
    finally:
        engine.dispose()
    skip = {"grant", "activate", "renew"}
    return ids, Counter(">".join(k for k in kinds if k not in skip) for kinds in events.values())


def wait_leased(admin: PooldClient, want_bytes: int, timeout_s: float) -> int:
    """Poll poold's leased bytes until they are `want_bytes` (or time is up); the last value."""
    deadline = time.monotonic() + timeout_s
    leased = retry(lambda: admin.status().leased_bytes)
    while leased != want_bytes and time.monotonic() < deadline:
        time.sleep(0.1)
        leased = retry(lambda: admin.status().leased_bytes)
    return int(leased)


def agent_bytes_held(c: Cluster, want_bytes: int, timeout_s: float = 5.0) -> int:
    """The agent's own count of leased memory (its journal of live leases), polled."""
    deadline = time.monotonic() + timeout_s
    with PoolClient(c.socket_path, timeout_s=5) as client:
        held = client.stats().bytes_held
        while held != want_bytes and time.monotonic() < deadline:
            time.sleep(0.1)
            held = client.stats().bytes_held
    return held


@pytest.fixture
def bystander(chaos_cluster: Cluster) -> Iterator[Bystander]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BYSTANDER, str(chaos_cluster.socket_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    lease_id, length = proc.stdout.readline().split()
    try:
        yield Bystander(proc, lease_id, int(length))
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def test_chaos_trials(chaos_cluster: Cluster, base_seed: int, bystander: Bystander) -> None:
    c = chaos_cluster
    kept = bystander.length_bytes
    started = time.monotonic()
    outcomes: Counter[str] = Counter()
    audit_codes: Counter[int] = Counter()
    endings: Counter[str] = Counter()
    known, _ = lease_paths(c, set())
    for number in range(TRIALS):
        trial = Trial.draw(number, base_seed + number)
        tenant, seen = run_tenant_and_kill(c, trial)
        at_kill = seen[-1] if seen else "-"
        restart(c, trial.victim)
        try:
            tenant.wait(timeout=60)
        finally:
            if tenant.poll() is None:
                tenant.kill()
                tenant.wait()
        assert tenant.stdout is not None
        seen += [line.strip() for line in tenant.stdout]
        tenant.stdout.close()
        # Every holder is gone: let the agent's holder check orphan what it held, and
        # the grace pass, then audit once.
        time.sleep(HOLDER_CHECK_S + GRACE_S + 0.5)
        code, report = audit_cli(c)
        audit_codes[code] += 1
        assert code in (0, 1), f"{trial}: audit exit {code}: {report}\ntenant: {seen}"
        assert not report.get("violations"), f"{trial}: {report['violations']}"
        after_audit = retry(lambda: c.admin.status().leased_bytes) - kept
        t_audit = time.monotonic()
        # Zero leaked bytes: what is still leased is exactly the live bystander's lease.
        leased = wait_leased(c.admin, kept, SETTLE_DEADLINE_S)
        assert leased == kept, (
            f"{trial}: {leased - kept} bytes leaked {SETTLE_DEADLINE_S:.0f}s after the audit\n"
            f"live leases: {live_leases(c)}\ntenant: {seen}\n"
            f"poold log:\n{c.poold.log_tail()}\nagent log:\n{c.agent.log_tail()}"
        )
        assert c.poold.alive() and c.agent.alive(), f"{trial}: a component died"
        # The agent holds no memory for leases that ended (nor forgot the live one).
        assert agent_bytes_held(c, kept) == kept, f"{trial}: agent holds stale leases"
        # The crash never touched a holder that stayed alive.
        assert bystander.proc.poll() is None, f"{trial}: bystander lost its lease"
        assert retry(lambda: c.admin.show_lease(bystander.lease_id)).state == "active", str(trial)
        outcomes[f"{trial.victim}@{trial.phase}"] += 1
        known, paths = lease_paths(c, known)
        endings.update(paths)
        print(
            f"{trial}: ok; tenant at kill: {at_kill!r}; leases ended by {dict(paths)}; "
            f"audit exit {code} reclaimed "
            f"{report.get('reclaimed')}; {after_audit} bytes left after it, zero in "
            f"{time.monotonic() - t_audit:.1f}s; t={time.monotonic() - started:.0f}s"
        )
    print(f"chaos: seed {base_seed}, {TRIALS} trials in {time.monotonic() - started:.0f}s")
    print(f"chaos: kills {dict(sorted(outcomes.items()))}; audit exits {dict(audit_codes)}")
    print(f"chaos: how the trials' leases ended: {dict(endings.most_common())}")
    assert sum(outcomes.values()) == TRIALS
    assert bystander.proc.stdin is not None
    bystander.proc.stdin.close()  # it releases its lease and exits
    assert bystander.proc.wait(timeout=30) == 0
    assert wait_leased(c.admin, 0, 10) == 0
    assert agent_bytes_held(c, 0) == 0
