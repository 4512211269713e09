"""May poold record the lease an agent granted alone inside its reservation, and
recording it (`commit`): the `local_grant` op of an agent's outbox.

Its own module because the checks are their own question: an ordinary op moves a lease
poold already holds from one state to the next (poold/ledger/leases.py), while a local
grant arrives as a lease poold has never seen, made within a delegation
(poold/ledger/delegation.py) whose reservation, epoch block and budget it must fit.
`op_batches.apply_ops` dispatches to it, so it runs in the batch's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, func, select, text

from poold.errors import (
    BadRequest,
    BudgetExceeded,
    InvalidSize,
    LeaseOverlap,
    LocalGrantMismatch,
    NotOwner,
    OutsideReservation,
    PoolError,
    UnknownReservation,
)
from poold.lease_states import LIVE_STATES_SQL, LeaseState
from poold.ledger import budgets, held_lease, tenants, transitions, write_behind
from poold.ledger.db import Prepared, PreparedIn
from poold.ledger.granting import INSERT_LEASE, quota_use
from poold.ledger.held_lease import Held
from poold.ledger.models import Budget, Device, Lease, Reservation, Tenant
from poold.ledger.transitions import event_row
from poold.ledger.types import check_ints_fit
from poold.wire.agent import LeaseOp, LeaseOpResult
from poold.wire.delegation import EPOCH_BLOCK, LocalGrant

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")


class _Recorded(NamedTuple):
    """A local grant's row as `_LOCAL_GRANT_AS_RECORDED` reads it (`_RECORDED_COLUMNS`)."""

    host_id: int
    reservation_id: str | None
    tenant_id: int
    offset_bytes: int
    length_bytes: int
    epoch: int
    state: str


_RESERVATION = Prepared(
    select(
        Reservation.id,
        Reservation.host_id,
        Reservation.device_id,
        Reservation.offset_bytes,
        Reservation.length_bytes,
        Reservation.epoch_base,
        Reservation.expires_at,
        Device.alignment_bytes,
    )
    .join(Device, Device.id == Reservation.device_id)
    .where(Reservation.id == bindparam("reservation_id"))
)
# What a replayed local grant is compared on (`_Recorded` below, in this order).
_RECORDED_COLUMNS = (
    Lease.host_id,
    Lease.reservation_id,
    Lease.tenant_id,
    Lease.offset_bytes,
    Lease.length_bytes,
    Lease.epoch,
    Lease.state,
)
_LOCAL_GRANT_AS_RECORDED = Prepared(
    select(*_RECORDED_COLUMNS).where(Lease.id == bindparam("lease_id"))
)
# The same, for every local grant of a batch at once.
_LOCAL_GRANTS_AS_RECORDED = PreparedIn(
    lambda member: select(Lease.id, *_RECORDED_COLUMNS).where(member(Lease.id, "lease_ids"))
)
_OVERLAPPING = Prepared(
    select(Lease.id)
    .where(
        Lease.device_id == bindparam("device_id"),
        _LIVE_SQL,
        Lease.offset_bytes < bindparam("end"),
        Lease.offset_bytes + Lease.length_bytes > bindparam("offset"),
    )
    .limit(1)
)
# Every grant tenant's of a batch at once.
_BUDGETS_OF = PreparedIn(
    lambda member: select(Budget.tenant_id, Budget.bytes, Budget.leases).where(
        member(Budget.tenant_id, "tenant_ids"), Budget.host_id == bindparam("host_id")
    )
)
_LOCAL_USES = PreparedIn(
    lambda member: (
        select(
            Lease.tenant_id,
            func.coalesce(func.sum(Lease.length_bytes), 0),
            func.count(Lease.id),
        )
        .where(
            member(Lease.tenant_id, "tenant_ids"),
            Lease.host_id == bindparam("host_id"),
            Lease.reservation_id.is_not(None),
            _LIVE_SQL,
        )
        .group_by(Lease.tenant_id)
    )
)


@dataclass
class BatchReads:
    """What the local grants of one op batch read once, in its transaction, instead of
    once per grant: the batch's statements are most of poold's CPU per local lease.

    Sound because nothing the batch does changes them but its own grants, which update
    them here: reservations are not written by op batches; every budget change swaps
    the tenant's generation, and the batch swaps each of its tenants' generations from
    the one it read, before it commits (`swap_tenants`): a change committed since fails
    the swap and reruns the batch with fresh reads; a batch's grants go after its other
    ops (`op_batches.apply_ops`), so the local use read at its first grant already counts
    the batch's releases.

    On PostgreSQL the batch takes its row locks first, in the ledger's one order
    (`_lock_rows`): the leases its ops act on (by id, as the reaper's hold), then the
    tenants it grants to (by name, as a delegation sets budgets; a central grant locks
    device, then tenant). Swapping each tenant at its first grant and bumping the
    devices last (as batches once did) locked them in lease id order, so two
    hosts' batches, or a batch and a central grant, each held a row the other wanted: a
    deadlock PostgreSQL breaks only after its deadlock_timeout, every lock held
    meanwhile. Swapping them all at the end instead, unlocked until then, let the
    central grants' swaps make a long batch lose its own swap again and again. Held
    from the start, the swaps at the end cannot fail."""

    tenants: dict[tuple[str | None, int, tuple[int, ...]], Any] = field(default_factory=dict)
    # The rows of the tenants its grants name, read (on PostgreSQL: locked) in one
    # statement; a name no tenant has maps to None. None: not read (one by one).
    named: dict[str, Any] | None = None
    reservations: dict[str, Any] = field(default_factory=dict)
    budgets: dict[int, Any] = field(default_factory=dict)  # by tenant id; None: no row
    spent: dict[int, list[int]] = field(default_factory=dict)  # tenant id -> [bytes, leases]
    # Tenants the batch granted to: id -> the generation it read, swapped at its end.
    to_swap: dict[int, int] = field(default_factory=dict)
    # Its local grants' rows as already recorded (a replay), read in one statement for
    # the whole batch and kept in step with what the batch inserts; None: one by one.
    recorded: dict[str, Any] | None = None
    # The leases this batch inserted, as an op on them reads one (held_lease.read):
    # a release that rides in the same batch as its grant needs no read of its own.
    inserted: dict[str, Held] = field(default_factory=dict)
    # The leases its other ops act on (releases, shrinks...), read in one statement for
    # the whole batch. Each row is taken by the first op on its lease: nothing before it
    # in the batch writes that lease, and a second op on it reads it again.
    held: dict[str, Held] = field(default_factory=dict)
    # PostgreSQL's exclusion constraint (ex_leases_no_overlap, over the same live states)
    # refuses an overlapping insert by itself: the batch's first attempt leaves the
    # overlap check to it, and a batch it refused runs again checking each grant, which
    # refuses the overlapping one alone (`op_batches.apply_ops`). SQLite has no such
    # constraint: every grant is checked.
    overlap_by_constraint: bool = False

    @classmethod
    def for_batch(
        cls,
        conn: Connection,
        ops: Sequence[LeaseOp],
        host_name: str,
        *,
        first_attempt: bool = False,
    ) -> BatchReads:
        """The reads (and on PostgreSQL the row locks) of one op batch, its local grants'
        recorded rows read at once when it has several (one grant: one keyed read,
        cheaper than an IN)."""
        postgres = conn.dialect.name == "postgresql"
        reads = cls(overlap_by_constraint=first_attempt and postgres)
        others = {op.lease_id for op in ops if op.grant is None}
        if postgres and others:
            reads.held = held_lease.lock(conn, list(others))  # in id order
        elif len(others) > 1:
            reads.held = held_lease.read_many(conn, list(others))
        grants = sorted({op.lease_id for op in ops if op.grant is not None})
        if len(grants) > 1:
            reads.recorded = {}
            for chunk in transitions.chunks(grants):
                for row in _LOCAL_GRANTS_AS_RECORDED.rows(conn, {"lease_ids": list(chunk)}):
                    reads.recorded[row.id] = row
        if postgres:  # SQLite runs one writer at a time: nothing to order
            reads._lock_rows(conn, ops, host_name)
        else:
            reads._read_named(conn, _named(ops), lock=False)
        return reads

    def _read_named(self, conn: Connection, names: set[str], *, lock: bool) -> None:
        found = tenants.by_names(conn, names, lock=lock)
        self.named = {name: found.get(name) for name in names}

    def _lock_rows(self, conn: Connection, ops: Sequence[LeaseOp], host_name: str) -> None:
        """After the leases: the tenants its grants are for, by name (see the class
        docstring); a tenant changed since this batch resolved it reruns the batch. No
        device: freeing bytes moves no device generation (poold/ledger/transitions.py),
        and a local grant writes none."""
        by_ids: dict[int, Any] = {}  # grants that name no tenant: resolved by uid, unlocked
        for op in ops:
            if op.grant is None or op.grant.tenant is not None:
                continue
            try:
                tenant = self.tenant(conn, op.grant, host_name)
            except PoolError:
                continue  # refused in its turn
            by_ids[tenant.id] = tenant
        # Every tenant it grants to in one locking read, in name order: the named ones'
        # rows are read under their locks; one resolved by uid before must be unchanged.
        self._read_named(conn, _named(ops) | {t.name for t in by_ids.values()}, lock=True)
        named = self.named or {}
        for tenant in by_ids.values():
            now = named.get(tenant.name)
            if now is None or int(now.generation) != int(tenant.generation):
                raise transitions.LostRace("tenants")

    def swap_tenants(self, conn: Connection) -> None:
        """Swap the generation of every tenant the batch granted to (held since
        `_lock_rows` on PostgreSQL); a swap that fails (a budget or quota changed since the
        batch read it) reruns the batch."""
        transitions.swap_all_or_rerun(conn, Tenant, self.to_swap)

    def as_recorded(self, conn: Connection, lease_id: str) -> Any:
        if self.recorded is None:
            write_behind.flush(conn)  # a grant sent twice in the batch, a release before it
            return _LOCAL_GRANT_AS_RECORDED.one_or_none(conn, {"lease_id": lease_id})
        return self.recorded.get(lease_id)

    def tenant(self, conn: Connection, grant: LocalGrant, host_name: str) -> Any:
        if grant.tenant is not None and self.named is not None and grant.tenant in self.named:
            return tenants.check_named(
                self.named[grant.tenant], grant.tenant, grant.uid, grant.gids, host_name
            )
        key = (grant.tenant, grant.uid, tuple(grant.gids))
        if key not in self.tenants:
            self.tenants[key] = tenants.resolve(
                conn, grant.tenant, grant.uid, grant.gids, host_name
            )
        return self.tenants[key]

    def local_use_fell(self, lease: Held, nbytes: int, leases: int) -> None:
        """A local lease of the batch's host stopped counting, or shrank, within the batch:
        its tenant's local use, if the batch has read it, says so. A release of a lease
        granted earlier in the same batch comes after that grant read the use (grants go
        last, `op_batches.apply_ops`): without this, a later grant of the tenant in the batch
        was refused its budget by a lease already released."""
        spent = self.spent.get(lease.tenant_id)
        if spent is not None and lease.reservation_id is not None:
            spent[0] -= nbytes
            spent[1] -= leases

    def reservation(self, conn: Connection, reservation_id: str) -> Any:
        if reservation_id not in self.reservations:
            self.reservations[reservation_id] = _RESERVATION.one_or_none(
                conn, {"reservation_id": reservation_id}
            )
        return self.reservations[reservation_id]

    def budget_and_spent(
        self, conn: Connection, tenant_id: int, host_id: int
    ) -> tuple[Any, list[int]]:
        """The tenant's budget row on this host (None: none) and its local use there,
        kept up to date by the batch's grants. Read at the batch's first grant for every
        tenant it grants to, in one statement each: its other ops have gone before
        (`op_batches.apply_ops`), and what goes between one tenant's first grant and another's
        acts on leases the batch granted, never on the other tenant's use."""
        if tenant_id not in self.spent:
            write_behind.flush(conn)  # the batch's releases before its grants' use
            ids = {tenant_id} | {t.id for t in self.tenants.values()}
            ids |= {t.id for t in (self.named or {}).values() if t is not None}
            ids -= set(self.spent)
            params = {"tenant_ids": sorted(ids), "host_id": host_id}
            found = {row.tenant_id: row for row in _BUDGETS_OF.rows(conn, params)}
            uses = {int(t): (int(b), int(n)) for t, b, n in _LOCAL_USES.rows(conn, params)}
            for i in ids:
                self.budgets[i] = found.get(i)
                self.spent[i] = list(uses.get(i, (0, 0)))
        return self.budgets[tenant_id], self.spent[tenant_id]


def _named(ops: Sequence[LeaseOp]) -> set[str]:
    """The tenants a batch's local grants name."""
    return {op.grant.tenant for op in ops if op.grant is not None and op.grant.tenant is not None}


def commit(
    conn: Connection,
    host_id: int,
    host_name: str,
    grant: LocalGrant,
    now: datetime,
    actor: str,
    batch: BatchReads | None = None,
) -> LeaseOpResult:
    """Record a lease the host's agent granted alone inside its reservation (an ordinary
    active lease from then on), or refuse it with a code; idempotent by lease id.

    Checked before anything is written: the reservation is this host's, the extent lies
    in it (aligned) and its epoch in its block, no live lease overlaps it, the process
    may act for the tenant there, and the tenant's budget on this host covers it. The
    tenant's generation is swapped (by the caller, `BatchReads.swap_tenants`, before it
    commits), so a clawback that read the budget's use before this commits reads again
    (no quota excess between them).
    """
    batch = BatchReads() if batch is None else batch
    recorded = batch.as_recorded(conn, grant.lease_id)
    tenant = batch.tenant(conn, grant, host_name)
    if recorded is not None:
        same = (
            recorded.host_id == host_id
            and recorded.reservation_id == grant.reservation_id
            and recorded.tenant_id == tenant.id
            and recorded.offset_bytes == grant.offset_bytes
            and recorded.length_bytes == grant.length_bytes
            and recorded.epoch == grant.epoch
        )
        if not same:
            raise LocalGrantMismatch(
                f"lease {grant.lease_id} is already recorded with other fields",
                lease_id=grant.lease_id,
            )
        return LeaseOpResult(lease_id=grant.lease_id, state=recorded.state)  # a replay
    res = batch.reservation(conn, grant.reservation_id)
    if res is None:
        raise UnknownReservation(
            f"no reservation {grant.reservation_id!r}", reservation_id=grant.reservation_id
        )
    if res.host_id != host_id:
        raise NotOwner(
            f"reservation {res.id} is not held by host {host_name!r}", reservation_id=res.id
        )
    end_bytes = grant.offset_bytes + grant.length_bytes
    if (
        grant.offset_bytes < res.offset_bytes
        or end_bytes > res.offset_bytes + res.length_bytes
        or not res.epoch_base <= grant.epoch < res.epoch_base + EPOCH_BLOCK
    ):
        raise OutsideReservation(
            f"lease {grant.lease_id} [{grant.offset_bytes}, {end_bytes}) epoch {grant.epoch} "
            f"is outside reservation {res.id} [{res.offset_bytes}, "
            f"{res.offset_bytes + res.length_bytes}) epochs {res.epoch_base}+{EPOCH_BLOCK}",
            lease_id=grant.lease_id,
            reservation_id=res.id,
        )
    if grant.offset_bytes % res.alignment_bytes or grant.length_bytes % res.alignment_bytes:
        raise InvalidSize(
            f"lease {grant.lease_id} is not aligned to its device's {res.alignment_bytes} bytes",
            lease_id=grant.lease_id,
            alignment_bytes=res.alignment_bytes,
        )
    if grant.granted_at > res.expires_at:
        raise OutsideReservation(
            f"lease {grant.lease_id} was granted after reservation {res.id} expired",
            lease_id=grant.lease_id,
            reservation_id=res.id,
        )

    def refuse_if_overlapping() -> None:
        write_behind.flush(conn)  # the batch's own leases count
        other = _OVERLAPPING.scalar(
            conn, {"device_id": res.device_id, "offset": grant.offset_bytes, "end": end_bytes}
        )
        if other == grant.lease_id:
            # This very grant, committed by a concurrent batch (the agent resent it through
            # another poold) after this one found it unrecorded: the rerun answers it as
            # the replay it is.
            raise transitions.LostRace("leases")
        if other is not None:
            raise LeaseOverlap(
                f"lease {grant.lease_id} overlaps live lease {other}",
                lease_id=grant.lease_id,
                other_lease_id=other,
            )

    if not batch.overlap_by_constraint:
        refuse_if_overlapping()
    try:
        if grant.requested_bytes > grant.length_bytes:
            raise BadRequest(
                f"lease {grant.lease_id} requested more bytes than it holds",
                lease_id=grant.lease_id,
            )
        check_ints_fit(Lease.__table__, {"holder_uid": grant.uid, "holder_pid": grant.pid})
        budget, spent = batch.budget_and_spent(conn, tenant.id, host_id)
        spent_bytes, spent_leases = spent
        past = budget is not None and (
            spent_leases + 1 > budget.leases or spent_bytes + grant.length_bytes > budget.bytes
        )
        if past:
            write_behind.flush(conn)  # the quota read below counts the batch's writes
        # The budget is a mechanism, the quota the invariant: a grant its agent made before
        # hearing its budget was lowered (a quota cut, a central grant of this host, a fair
        # share) is kept when the quota has room for it (budgets.fit_local_grant). No budget
        # row at all: the agent never held one here, or asked it back having capped its view.
        if budget is None or (
            past
            and not budgets.fit_local_grant(
                conn,
                tenant_id=tenant.id,
                host_id=host_id,
                use=quota_use(conn, tenant.id),
                quota_bytes=tenant.quota_bytes,
                quota_leases=tenant.quota_leases,
                length_bytes=grant.length_bytes,
                lease_id=grant.lease_id,
                actor=actor,
            )
        ):
            raise BudgetExceeded(
                f"tenant {tenant.name!r} on host {host_name!r} would hold "
                f"{spent_bytes + grant.length_bytes} bytes in {spent_leases + 1} local leases; "
                f"its budget there is "
                + ("none" if budget is None else f"{budget.bytes} bytes, {budget.leases} leases"),
                tenant=tenant.name,
                budget_bytes=0 if budget is None else budget.bytes,
                budget_leases=0 if budget is None else budget.leases,
            )
    except PoolError:
        # An overlap is the refusal an overlapping grant gets on either backend, as if
        # it had been checked first.
        if batch.overlap_by_constraint:
            refuse_if_overlapping()
        raise
    batch.to_swap.setdefault(tenant.id, int(tenant.generation))
    expires_at = grant.granted_at + timedelta(seconds=grant.ttl_s)
    row = {
        "id": grant.lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": res.device_id,
        "offset_bytes": grant.offset_bytes,
        "length_bytes": grant.length_bytes,
        "requested_bytes": grant.requested_bytes,
        "state": LeaseState.ACTIVE.value,
        "ttl_s": grant.ttl_s,
        "epoch": grant.epoch,
        "granted_at": grant.granted_at,
        "activated_at": grant.granted_at,
        "expires_at": expires_at,
        "ended_at": None,
        "holder_uid": grant.uid,
        "holder_gid": grant.gids[0] if grant.gids else None,
        "holder_pid": grant.pid,
        "labels": dict(grant.labels),
        "exclusive_bytes": 0,
        "replica_bytes": 0,
        "reported_at": None,
        "reservation_id": res.id,
    }
    behind = write_behind.held(conn)
    if behind is not None:
        behind.insert(conn, row)  # written at the batch's end, with its others
    else:
        INSERT_LEASE.write(conn, row)
    if batch.recorded is not None:
        batch.recorded[grant.lease_id] = _Recorded(
            host_id,
            res.id,
            tenant.id,
            grant.offset_bytes,
            grant.length_bytes,
            grant.epoch,
            LeaseState.ACTIVE.value,
        )
    batch.inserted[grant.lease_id] = Held(
        id=grant.lease_id,
        state=LeaseState.ACTIVE.value,
        host_id=host_id,
        tenant_id=tenant.id,
        device_id=res.device_id,
        expires_at=expires_at,
        ttl_s=grant.ttl_s,
        offset_bytes=grant.offset_bytes,
        length_bytes=grant.length_bytes,
        reservation_id=res.id,
    )
    common: dict[str, Any] = {
        "at": now,
        "actor": actor,
        "lease_id": grant.lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": res.device_id,
    }
    transitions.record(
        conn,
        event_row(
            **common,
            kind="lease.grant",
            to_state="granted",
            detail={
                "offset_bytes": grant.offset_bytes,
                "length_bytes": grant.length_bytes,
                "epoch": grant.epoch,
                "uid": grant.uid,
                "pid": grant.pid,
                "reservation_id": res.id,
                "granted_at": grant.granted_at.isoformat(),
            },
        ),
        event_row(**common, kind="lease.activate", from_state="granted", to_state="active"),
    )
    spent[0] += grant.length_bytes
    spent[1] += 1
    return LeaseOpResult(lease_id=grant.lease_id, state=LeaseState.ACTIVE.value)
