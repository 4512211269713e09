"""Which of the agent's queued lease ops go to poold next, and which renewals?

The agent queues what happens to its leases (releases, scrubs, shrinks, the commits of
leases it granted inside its delegation) and the renewals its tenants asked for; the
link (agent/link.py) sends the ops in batches or riding on a central grant, and the
renewals with a heartbeat. This is that queue and its order, apart from the sending:

* each lease's ops reach poold in the order they were queued: while one of its ops is
  on its way (in a flush, riding on a grant) or in a failed batch, its later ops wait;
* a tenant's local ops go one request at a time, in order, because a local grant may
  spend the budget a release queued before it freed (agent/local_leases.py);
* a batch poold did not take is first in line again, unchanged, under the request id it
  was first sent with, so that a retry whose first reply was lost gets the first answer;
* a renewal is replaced by a later one of its lease, and dropped by an op of it.

Thread-safe (one lock, never held across I/O).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from poold.wire.agent import AgentOps, LeaseOp

# Ops per batch (the wire allows 100 000): an outbox grown over a long outage goes in
# pieces, each its own request with its own id.
MAX_BATCH_OPS = 10_000

# The local tenant of a lease id, or None for a lease granted centrally.
TenantOf = Callable[[str], str | None]


def new_request_id() -> str:
    """A fresh name for one grant or op batch (poold answers a repeat with the first answer)."""
    return str(uuid.uuid4())


class OpQueue:
    """The queued ops and renewals of one agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Batches poold did not take, oldest first, each under its first request id;
        # then the ops not in a batch yet.
        self._batches: list[AgentOps] = []
        self._ops: list[LeaseOp] = []
        # Ops on their way (in a flush or riding on a grant), by lease.
        self._in_flight: Counter[str] = Counter()
        self._renewals: dict[str, int] = {}

    # --- ops ------------------------------------------------------------------
    def add(self, op: LeaseOp) -> int:
        """Queue ``op`` (its lease's queued renewal goes: the op ends or changes the
        lease); how many ops are queued outside batches now."""
        with self._lock:
            self._ops.append(op)
            self._renewals.pop(op.lease_id, None)
            return len(self._ops)

    def take(self, tenant_of: TenantOf | None, *, for_tenant: str | None = None) -> list[LeaseOp]:
        """The queued ops that may go now, marked on their way; ``for_tenant``: none of a
        local lease of another tenant ("": of any tenant).

        An op of a lease with an op on its way or in a failed batch stays queued, and so
        does every later op of that lease; so does every later op of the same tenant's
        local leases.
        """
        with self._lock:
            return self._take(tenant_of, for_tenant)

    def _take(self, tenant_of: TenantOf | None, for_tenant: str | None) -> list[LeaseOp]:
        blocked = set(self._in_flight)
        for batch in self._batches:
            blocked.update(op.lease_id for op in batch.ops)
        chained: set[str] = set()  # tenants with a local op on its way or kept back
        if tenant_of is not None:
            for lease_id in blocked:
                owner = tenant_of(lease_id)
                if owner is not None:
                    chained.add(owner)
        only = for_tenant is not None
        tenant = for_tenant or None  # "": a local lease of any tenant stays
        taken: list[LeaseOp] = []
        kept: list[LeaseOp] = []
        for op in self._ops:
            owner = tenant_of(op.lease_id) if tenant_of is not None else None
            if (
                op.lease_id in blocked
                or len(taken) >= MAX_BATCH_OPS
                or (owner is not None and (owner in chained or (only and owner != tenant)))
            ):
                blocked.add(op.lease_id)
                if owner is not None:
                    chained.add(owner)
                kept.append(op)
            else:
                taken.append(op)
        self._ops = kept
        self._in_flight.update(op.lease_id for op in taken)
        return taken

    def next_batch(
        self, tenant_of: TenantOf | None, *, fresh: bool
    ) -> tuple[AgentOps, bool] | None:
        """The next batch to send, marked on its way, and whether it is new: a failed one
        first, else (when ``fresh``) the queued ops that may go now, under a new request
        id; None when there is nothing (or only ops waiting for an earlier op of theirs)."""
        with self._lock:
            if self._batches:
                batch = self._batches.pop(0)
                self._in_flight.update(op.lease_id for op in batch.ops)
                return batch, False
            ops = self._take(tenant_of, None) if fresh else []
            return (AgentOps(ops=ops, request_id=new_request_id()), True) if ops else None

    def put_back(self, batch: AgentOps) -> None:
        """A batch poold did not take (or whose answer was lost): first in line again,
        unchanged (its ops stay on their way until :meth:`delivered`)."""
        with self._lock:
            self._batches.insert(0, batch)

    def delivered(self, ops: Iterable[LeaseOp]) -> None:
        """These ops are no longer on their way (answered, or dropped as malformed)."""
        with self._lock:
            self._settle(ops)

    def _settle(self, ops: Iterable[LeaseOp]) -> None:
        self._in_flight.subtract(op.lease_id for op in ops)
        self._in_flight = +self._in_flight  # drop the zeros

    def any_queued_of(self, lease_ids: set[str]) -> bool:
        """Whether an op of one of these leases waits in the queue (outside batches)."""
        with self._lock:
            return any(op.lease_id in lease_ids for op in self._ops)

    def queued(self) -> list[LeaseOp]:
        """The ops queued outside batches, in order (a copy)."""
        with self._lock:
            return list(self._ops)

    def queued_count(self) -> int:
        with self._lock:
            return len(self._ops)

    def lease_ids(self) -> set[str]:
        """Leases with an op queued, in a failed batch, or on its way."""
        with self._lock:
            ids = set(self._in_flight) | {op.lease_id for op in self._ops}
            for batch in self._batches:
                ids.update(op.lease_id for op in batch.ops)
        return ids

    def size(self) -> int:
        """Ops queued or in failed batches (not those on their way)."""
        with self._lock:
            return len(self._ops) + sum(len(b.ops) for b in self._batches)

    # --- renewals -------------------------------------------------------------
    def renew_later(self, lease_id: str, ttl_s: int) -> None:
        with self._lock:
            self._renewals[lease_id] = ttl_s

    def take_renewals(self) -> dict[str, int]:
        """Every queued renewal, for one heartbeat."""
        with self._lock:
            renewals, self._renewals = self._renewals, {}
        return renewals

    def keep_renewals(self, renewals: Mapping[str, int]) -> None:
        """Renewals a heartbeat did not deliver, queued again; a newer one of the same
        lease, queued meanwhile, wins."""
        with self._lock:
            for lease_id, ttl_s in renewals.items():
                self._renewals.setdefault(lease_id, ttl_s)

    def renewal_count(self) -> int:
        with self._lock:
            return len(self._renewals)
