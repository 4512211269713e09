"""One tenant process for tests/e2e/test_delegation_concurrency.py: leases, renews and
releases through its agent's socket until a wall-clock deadline, and says what it saw.

Run as ``python -m tests.e2e.deleg_tenant '<json args>'`` (see :class:`Args`). Every
line on stdout is a JSON object: ``{"ev": "grant", ...}`` per lease granted (what the
ledger must have in the end), ``{"ev": "refused", "code": ...}`` per request refused with
a code a tenant must expect under quota cuts, drains and pressure, and a last
``{"ev": "summary", ...}``. Anything else (an unexpected code, ``internal``, a traceback)
ends the process with a non-zero status: the test fails on it.
"""

from __future__ import annotations

import json
import queue
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.client import Lease, PoolClient
from poold.errors import PoolError

# What a grant may be refused with while capacity moves under it: a quota (cut, or
# pushed against, or held whole by another host's budget: the known gap of issue 12),
# no room (a draining device, pressure, reservations), the delegation's TTL.
LEASE_REFUSALS = frozenset({"quota_exceeded", "no_capacity", "delegation_expired"})
# A renewal of a lease that is over: poold revoked (a drain) or reclaimed it. The test
# checks the ledger ended each such lease itself.
OVER = frozenset({"lease_not_active", "unknown_lease"})


@dataclass
class Args:
    sock: str
    tenant: str
    sizes: list[int]
    hold: int  # leases held at most at once
    until: float  # time.time() to stop at
    seed: int
    ttl_s: int = 30
    # "cycle": lease/renew/release at random. "pressure": hold one big shrinkable lease
    # that reports replicas, and give back what poold's pressure asks.
    mode: str = "cycle"
    pause_s: float = 0.01


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class Tenant:
    def __init__(self, args: Args, client: PoolClient) -> None:
        self.args = args
        self.client = client
        self.rng = random.Random(args.seed)  # noqa: S311 - a reproducible mix, not a secret
        self.held: list[Lease] = []
        self.counts: dict[str, int] = {}
        # Filled on the client's event thread; acted on here (calls on that thread
        # would wait for replies it reads).
        self.revoked: set[str] = set()
        self.shrinks: queue.SimpleQueue[tuple[Lease, int]] = queue.SimpleQueue()

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def on_revoke(self, lease: Lease, _deadline_at: datetime) -> None:
        self.revoked.add(lease.lease_id)

    def on_lost(self, lease: Lease) -> None:
        self.revoked.add(lease.lease_id)
        emit(ev="lost", id=lease.lease_id, reason=lease.lost_reason)

    def on_shrink(self, lease: Lease, target_bytes: int, _deadline_at: datetime) -> None:
        self.shrinks.put((lease, target_bytes))

    def lease(self, size: int, **extra: Any) -> Lease | None:
        try:
            lease = self.client.lease(
                size,
                tenant=self.args.tenant,
                ttl_s=self.args.ttl_s,
                renew=False,
                on_revoke=self.on_revoke,
                on_lost=self.on_lost,
                on_shrink=self.on_shrink,
                **extra,
            )
        except PoolError as err:
            if err.code not in LEASE_REFUSALS:
                raise
            self.count(f"refused:{err.code}")
            emit(ev="refused", code=err.code)
            return None
        self.count("granted")
        emit(
            ev="grant",
            id=lease.lease_id,
            tenant=self.args.tenant,
            device=lease.device_uid,
            offset=lease.offset_bytes,
            length=lease.length_bytes,
            t=time.time(),
        )
        return lease

    def end(self, lease: Lease) -> None:
        """Release ``lease``; says whether it was still held (ended by this process) or
        was over already (revoked, lost)."""
        self.held.remove(lease)
        over = lease.lost or lease.lease_id in self.revoked
        lease.release()
        self.count("released")
        emit(ev="release", id=lease.lease_id, held=not over)

    def renew(self, lease: Lease) -> None:
        try:
            lease.renew(self.args.ttl_s)
        except PoolError as err:
            if err.code not in OVER:
                raise
            self.count(f"over:{err.code}")
            self.revoked.add(lease.lease_id)
            emit(ev="over", id=lease.lease_id, code=err.code)
            self.end(lease)
            return
        self.count("renewed")

    def cycle(self) -> None:
        a = self.args
        while time.time() < a.until:
            for over in [x for x in self.held if x.lease_id in self.revoked or x.lost]:
                self.count("revoked")
                self.end(over)
            roll = self.rng.random()
            if len(self.held) < a.hold and (roll < 0.55 or not self.held):
                granted = self.lease(self.rng.choice(a.sizes))
                if granted is not None:
                    self.held.append(granted)
            elif roll < 0.8:
                self.renew(self.rng.choice(self.held))
            else:
                self.end(self.held[0])
            time.sleep(self.rng.uniform(0, a.pause_s))

    def pressure(self) -> None:
        """Hold a big lease that reports its bytes as replicas: the device falls under
        poold's watermark and poold asks it back; give back what is asked each time, and
        stop 2 s after the first (or at the deadline)."""
        a = self.args
        size = a.sizes[0]
        lease = None
        while lease is None and time.time() < a.until and size >= a.sizes[-1]:
            lease = self.lease(size, shrinkable=True)
            size -= 16 << 20
        if lease is None:
            return
        self.held.append(lease)
        emit(ev="pressure_lease", id=lease.lease_id, length=lease.length_bytes)
        lease.report(
            used_bytes=lease.length_bytes, exclusive_bytes=0, replica_bytes=lease.length_bytes
        )
        first_shrink_at: float | None = None
        while time.time() < a.until and not (lease.lost or lease.lease_id in self.revoked):
            if first_shrink_at is not None and time.time() > first_shrink_at + 2.0:
                break  # asked and answered: the point is made
            try:
                asked, target = self.shrinks.get(timeout=0.2)
            except queue.Empty:
                lease.renew(a.ttl_s)
                continue
            if asked is not lease:
                continue
            # Whole alignment units, at least the target: a shrink rounds up to them.
            align = lease.alignment_bytes
            keep = max(align, (lease.length_bytes - target) // align * align)
            new_length = lease.shrink(keep)
            self.count("shrunk")
            first_shrink_at = first_shrink_at or time.time()
            emit(ev="shrunk", id=lease.lease_id, target=target, length=new_length)
            lease.report(used_bytes=new_length, exclusive_bytes=0, replica_bytes=new_length)


def main(argv: list[str]) -> int:
    args = Args(**json.loads(argv[1]))
    with PoolClient(args.sock, timeout_s=30) as client:
        tenant = Tenant(args, client)
        if args.mode == "pressure":
            tenant.pressure()
        else:
            tenant.cycle()
        for lease in list(tenant.held):
            tenant.end(lease)
    emit(ev="summary", tenant=args.tenant, counts=tenant.counts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
