"""What may this agent grant alone? The host's delegation: reservations and budgets.

poold reserves extents of devices this host reaches and splits tenants' quotas into
per-host budgets (poold/wire/delegation.py, DESIGN.md "Delegated capacity"); the agent
places leases inside them with the same pure code poold uses (poold/placement.py,
poold/extents.py), under the same media, tier and health rules, and checks the tenant's
budget exactly where poold would check its quota. A lease that does not fit takes the
central path (a grant in poold), which stays correct on its own.

Every reply of poold is the host's whole delegation: :meth:`DelegatedCapacity.replace`
swaps it in, never merges. Local leases stay where they are; one whose reservation poold
no longer lists is kept, flagged, and reported (its bytes still count).

A local lease occupies its extent from the grant until the op that frees it (release,
abort, unmapped, scrubbed) has been *delivered* to poold (:meth:`delivered`), not merely
queued: poold applies a batch in lease-id order, so a new lease placed on a range whose
release poold has not applied yet would overlap it there.

:class:`DelegatedCapacity` is pure but for one lock: no I/O, tested without poold.
:class:`LocalGrants` is its edge: it journals each grant (agent/journal.py GrantLog)
before the fd leaves, queues its ``local_grant`` op in the outbox, and asks poold for
refills off the request path (agent/link.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from agent.held import HeldLease, HeldLeases, memfd_inode
from agent.journal import Entry as JournalEntry
from agent.journal import Journal
from agent.link import PooldLink
from poold import placement
from poold.errors import DelegationExpired, PoolError
from poold.extents import Extent
from poold.lease_states import LeaseState
from poold.wire.agent import GrantRequest, LeaseOp
from poold.wire.common import LeaseOut
from poold.wire.delegation import (
    EPOCH_BLOCK,
    Budget,
    BudgetWant,
    Delegation,
    DelegationRequest,
    LocalGrant,
    Reservation,
    ReserveWant,
)

log = logging.getLogger("pool_agent.delegation")

# Media whose contents survive a power loss: a local grant on them is fsynced before the
# fd leaves (agent/journal.py GrantLog). Everything else (DRAM, CXL DRAM, emulated) loses
# its contents, and its tenants, with the host, so a grant lost with the page cache names
# memory no one holds any more.
PERSISTENT_MEDIA = frozenset({"pmem", "nvdimm", "optane", "persistent"})

# Ops after whose delivery poold counts a lease's range free again.
FREEING_OPS = frozenset({"release", "abort", "unmapped", "scrubbed"})


@dataclass
class LocalLease:
    """A lease this agent granted inside a reservation: the extent it occupies."""

    lease_id: str
    reservation_id: str
    tenant: str
    offset_bytes: int
    length_bytes: int
    epoch: int
    # poold's last delegation does not list its reservation (flagged, reported).
    stray: bool = False


@dataclass(frozen=True)
class LocalPlan:
    """A local grant decided: the lease as the service holds it, and what poold is told."""

    lease: LeaseOut
    grant: LocalGrant
    persistent: bool


@dataclass
class _Held:
    """A reservation as held now, with its deadline on this host's monotonic clock."""

    reservation: Reservation
    deadline: float
    epochs_used: int = 0  # epochs taken from the block: the next is epoch_base + this


@dataclass
class _Budget:
    budget: Budget
    deadline: float


@dataclass(frozen=True)
class RefillPolicy:
    """How much the agent asks to hold: headroom for ``horizon_intervals`` of recent
    demand (an EWMA of bytes and leases granted per interval), at least ``min_*``, at most
    ``max_reserve_bytes``; below half of that it asks for more, above twice it gives back."""

    min_reserve_bytes: int = 64 << 20
    max_reserve_bytes: int = 4 << 30
    min_budget_leases: int = 16
    horizon_intervals: float = 4.0
    alpha: float = 0.3
    low_fraction: float = 0.5
    high_factor: float = 2.0


@dataclass
class _Demand:
    """What was granted on this host lately (local and central), per tenant and media."""

    bytes_now: dict[tuple[str, str], int] = field(default_factory=dict)
    leases_now: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes_ewma: dict[tuple[str, str], float] = field(default_factory=dict)
    leases_ewma: dict[tuple[str, str], float] = field(default_factory=dict)


class DelegatedCapacity:
    """The host's reservations, budgets and local leases (thread-safe, one lock)."""

    def __init__(
        self,
        host: str,
        *,
        policy: RefillPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.host = host
        self.policy = policy or RefillPolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._reservations: dict[str, _Held] = {}
        self._budgets: dict[str, _Budget] = {}
        self._leases: dict[str, LocalLease] = {}
        # Epochs granted before a restart (journal), by reservation: max epoch seen.
        self._epoch_seen: dict[str, int] = {}
        self._demand = _Demand()
        # Set by the service: whether this host has real far memory (placement never
        # picks emulated memory then unless asked by name; poold sees all its devices).
        self.host_has_real: Callable[[], bool] = lambda: False
        self.replaced_at: float | None = None

    # --- what poold says is held ----------------------------------------------------
    def replace(self, delegation: Delegation, *, received_at: float | None = None) -> list[str]:
        """Hold ``delegation`` instead of whatever was held (the whole of it, always).

        TTLs are read against poold's ``server_time`` and kept on the local monotonic
        clock, so clock skew between the hosts does not shorten or lengthen them. Returns
        the local leases whose reservation poold no longer lists (kept, flagged).
        """
        now = self._clock() if received_at is None else received_at
        with self._lock:
            held: dict[str, _Held] = {}
            for res in delegation.reservations:
                ttl = (res.expires_at - delegation.server_time).total_seconds()
                old = self._reservations.get(res.id)
                used = 0
                if old is not None and old.reservation.epoch_base == res.epoch_base:
                    used = old.epochs_used
                seen = self._epoch_seen.get(res.id)
                if seen is not None and seen >= res.epoch_base:
                    used = max(used, seen - res.epoch_base + 1)
                held[res.id] = _Held(res, now + ttl, used)
            self._reservations = held
            self._budgets = {
                b.tenant: _Budget(b, now + (b.expires_at - delegation.server_time).total_seconds())
                for b in delegation.budgets
            }
            stray: list[str] = []
            for lease in self._leases.values():
                was = lease.stray
                lease.stray = lease.reservation_id not in held or not _inside(
                    held[lease.reservation_id].reservation, lease
                )
                if lease.stray:
                    stray.append(lease.lease_id)
                    if not was:
                        log.warning(
                            "local lease %s lies in reservation %s, which poold no longer "
                            "lists: kept and reported",
                            lease.lease_id,
                            lease.reservation_id,
                        )
            self.replaced_at = now
        return stray

    def restore(self, grants: Iterable[LocalGrant]) -> None:
        """After a restart: the journal's local leases occupy their extents again, and the
        epochs they took are not given out twice (call before serving)."""
        with self._lock:
            for grant in grants:
                self._leases[grant.lease_id] = LocalLease(
                    grant.lease_id,
                    grant.reservation_id,
                    grant.tenant,
                    grant.offset_bytes,
                    grant.length_bytes,
                    grant.epoch,
                )
                seen = self._epoch_seen.get(grant.reservation_id, 0)
                self._epoch_seen[grant.reservation_id] = max(seen, grant.epoch)

    def note_epoch(self, reservation_id: str, epoch: int) -> None:
        """An epoch the journal says was granted (of a lease since ended): never again."""
        with self._lock:
            seen = self._epoch_seen.get(reservation_id, 0)
            self._epoch_seen[reservation_id] = max(seen, epoch)
            held = self._reservations.get(reservation_id)
            if held is not None and epoch >= held.reservation.epoch_base:
                held.epochs_used = max(held.epochs_used, epoch - held.reservation.epoch_base + 1)

    # --- reading ----------------------------------------------------------------------
    def holds_any(self) -> bool:
        """Whether any reservation is held (expired or not): the fast test of the path."""
        return bool(self._reservations)

    def is_local(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def local_leases(self) -> list[LocalLease]:
        with self._lock:
            return [LocalLease(**vars(lease)) for lease in self._leases.values()]

    def stray_ids(self) -> list[str]:
        with self._lock:
            return sorted(lease.lease_id for lease in self._leases.values() if lease.stray)

    def reservations(self) -> list[Reservation]:
        with self._lock:
            return [h.reservation for h in self._reservations.values()]

    def budgets(self) -> list[Budget]:
        with self._lock:
            return [b.budget for b in self._budgets.values()]

    def expires_in(self, now: float | None = None) -> float | None:
        """Seconds until the last held reservation expires (None: nothing held)."""
        now = self._clock() if now is None else now
        with self._lock:
            if not self._reservations:
                return None
            return max(h.deadline for h in self._reservations.values()) - now

    def free_reserved_bytes(self) -> int:
        """Bytes of unexpired reservations no local lease occupies."""
        now = self._clock()
        with self._lock:
            return sum(
                self._free_in(h)
                for h in self._reservations.values()
                if h.deadline > now and h.epochs_used < EPOCH_BLOCK
            )

    def budget_used(self, tenant: str) -> tuple[int, int]:
        """(bytes, leases) of the tenant's local leases (what its budget is spent on)."""
        with self._lock:
            return self._used_by(tenant)

    def _used_by(self, tenant: str) -> tuple[int, int]:
        mine = [lease for lease in self._leases.values() if lease.tenant == tenant]
        return sum(lease.length_bytes for lease in mine), len(mine)

    def _occupied(self, res: Reservation) -> list[Extent]:
        return [
            Extent(lease.offset_bytes, lease.length_bytes)
            for lease in self._leases.values()
            if lease.reservation_id == res.id
        ]

    def _free_in(self, held: _Held) -> int:
        res = held.reservation
        return res.length_bytes - sum(e.length for e in self._occupied(res))

    # --- granting -------------------------------------------------------------------
    def grant_locally(
        self, req: GrantRequest, *, now: float | None = None, wall: datetime | None = None
    ) -> LocalPlan | None:
        """Place ``req`` inside the delegation and take it from the tenant's budget.

        None when it does not fit what is held (no budget for a tenant the caller may act
        for, the budget spent, no reservation with room for the media asked): the
        central path decides then, with poold's full view. Raises ``delegation_expired``
        when it would fit but the reservations or the budget are past their TTL (poold
        has not renewed them); the caller still tries poold, which may answer.
        """
        now = self._clock() if now is None else now
        with self._lock:
            if not self._reservations:
                return None
            entry = self._resolve(req)
            if entry is None:
                return None
            budget = entry.budget
            used_bytes, used_leases = self._used_by(budget.tenant)
            if used_leases + 1 > budget.leases:
                return None
            usable = [h for h in self._reservations.values() if h.epochs_used < EPOCH_BLOCK]
            if self.host_has_real() and req.media is None:
                # As poold's placement: no silent DRAM for a far-memory request, however
                # the delegation happens to be made up.
                usable = [
                    h
                    for h in usable
                    if h.reservation.media != placement.EMULATED
                    and h.reservation.kind != placement.EMULATED
                ]
            live = [h for h in usable if h.deadline > now]
            choice = self._place(req, budget, live)
            if choice is None:
                expired = [h for h in usable if h.deadline <= now]
                if expired and self._place(req, budget, expired) is not None:
                    raise _expired(req, "reservations")
                return None
            held, extent = choice
            if used_bytes + extent.length > budget.bytes:
                return None
            if entry.deadline <= now:
                raise _expired(req, f"budget of tenant {budget.tenant!r}")
            res = held.reservation
            epoch = res.epoch_base + held.epochs_used
            held.epochs_used += 1
            lease_id = str(uuid.uuid4())
            self._leases[lease_id] = LocalLease(
                lease_id, res.id, budget.tenant, extent.offset, extent.length, epoch
            )
            self._note_demand(budget.tenant, res.media, extent.length)
        wall = datetime.now(UTC) if wall is None else wall
        # Built without validation: every value comes from validated models or from here.
        lease = LeaseOut.model_construct(
            id=lease_id,
            tenant=budget.tenant,
            host=self.host,
            device_uid=res.device_uid,
            device_kind=res.kind,
            media=res.media,
            offset_bytes=extent.offset,
            length_bytes=extent.length,
            requested_bytes=req.size_bytes,
            alignment_bytes=res.alignment_bytes,
            state=LeaseState.ACTIVE,
            epoch=epoch,
            ttl_s=req.ttl_s,
            granted_at=wall,
            activated_at=wall,
            expires_at=wall + timedelta(seconds=req.ttl_s),
            ended_at=None,
            numa_node=res.numa_node,
            local_name=res.local_name,
            holder_uid=req.uid,
            holder_pid=req.pid,
            labels=dict(req.labels),
            exclusive_bytes=0,
            replica_bytes=0,
            reservation_id=res.id,
        )
        grant = LocalGrant.model_construct(
            lease_id=lease_id,
            reservation_id=res.id,
            tenant=budget.tenant,
            offset_bytes=extent.offset,
            length_bytes=extent.length,
            requested_bytes=req.size_bytes,
            epoch=epoch,
            ttl_s=req.ttl_s,
            granted_at=wall,
            uid=req.uid,
            gids=list(req.gids),
            pid=req.pid,
            labels=dict(req.labels),
        )
        return LocalPlan(lease, grant, res.media in PERSISTENT_MEDIA)

    def _resolve(self, req: GrantRequest) -> _Budget | None:
        """The budget of the tenant the caller may act for, as poold resolves tenants
        (poold/ledger/tenants.py resolve): the one named, if the caller's uid or a gid is
        allowed; unnamed, the only budget whose tenant the ids map to. Anything else (no
        such budget, not allowed, several) is poold's to answer, with its full view."""
        if req.tenant is not None:
            entry = self._budgets.get(req.tenant)
            if entry is None or not _may_act(entry.budget, req.uid, req.gids):
                return None
            return entry
        matches = [b for b in self._budgets.values() if _may_act(b.budget, req.uid, req.gids)]
        return matches[0] if len(matches) == 1 else None

    def _place(
        self, req: GrantRequest, budget: Budget, held: list[_Held]
    ) -> tuple[_Held, Extent] | None:
        """poold's placement over the reservations, each a candidate device whose bytes
        outside the reservation (and under local leases) are used."""
        if not held:
            return None
        candidates = []
        for index, h in enumerate(held):
            res = h.reservation
            used = [Extent(0, res.offset_bytes), *self._occupied(res)]
            candidates.append(
                placement.Candidate(
                    device_id=index,
                    kind=res.kind,
                    media=res.media,
                    state="online",
                    health=res.health,
                    capacity_bytes=res.offset_bytes + res.length_bytes,
                    alignment_bytes=res.alignment_bytes,
                    used=tuple(used),
                    read_latency_ns=res.read_latency_ns,
                    distance=res.distance,
                )
            )
        choice = placement.place(
            placement.Request(
                size_bytes=req.size_bytes,
                media=req.media,
                allowed_media=frozenset(budget.allowed_media),
            ),
            candidates,
        )
        if isinstance(choice, placement.Refusal):
            return None
        return held[choice.candidate.device_id], choice.extent

    def abandon(self, lease_id: str) -> None:
        """A local grant whose memory could not be made: its extent is free again (its
        epoch stays spent), and poold never hears of it."""
        with self._lock:
            self._leases.pop(lease_id, None)

    def delivered(self, lease_id: str, op: str, length_bytes: int | None = None) -> None:
        """poold applied ``op`` of a local lease: a freeing op frees its extent; a shrink
        frees its tail."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            if op in FREEING_OPS:
                del self._leases[lease_id]
            elif op == "shrink" and length_bytes is not None:
                lease.length_bytes = min(lease.length_bytes, length_bytes)

    # --- refill and give-back ----------------------------------------------------------
    def note_demand(self, tenant: str, media: str, length_bytes: int) -> None:
        """A lease granted on this host (centrally too): what the next refill sizes from."""
        with self._lock:
            self._note_demand(tenant, media, length_bytes)

    def _note_demand(self, tenant: str, media: str, length_bytes: int) -> None:
        key = (tenant, media)
        d = self._demand
        d.bytes_now[key] = d.bytes_now.get(key, 0) + length_bytes
        d.leases_now[key] = d.leases_now.get(key, 0) + 1

    def wants(self, now: float | None = None) -> DelegationRequest | None:
        """Close one demand interval and say what to ask poold for (None: nothing).

        Reservations: per media class, headroom for the recent demand; below the low
        watermark of free reserved bytes ask for the difference, above the high one give
        back whole reservations no local lease lies in. Budgets: per tenant, what its
        local leases hold plus the same headroom (totals: poold caps them). TTLs are not
        this step's: each heartbeat renews what is held."""
        now = self._clock() if now is None else now
        p = self.policy
        with self._lock:
            d = self._demand
            keys = set(d.bytes_ewma) | set(d.bytes_now)
            for key in keys:
                d.bytes_ewma[key] = p.alpha * d.bytes_now.get(key, 0) + (1 - p.alpha) * (
                    d.bytes_ewma.get(key, 0.0)
                )
                d.leases_ewma[key] = p.alpha * d.leases_now.get(key, 0) + (1 - p.alpha) * (
                    d.leases_ewma.get(key, 0.0)
                )
            d.bytes_now.clear()
            d.leases_now.clear()
            by_media: dict[str, float] = {}
            by_tenant: dict[str, tuple[float, float]] = {}
            for (tenant, media), rate in d.bytes_ewma.items():
                by_media[media] = by_media.get(media, 0.0) + rate
                b, n = by_tenant.get(tenant, (0.0, 0.0))
                by_tenant[tenant] = (b + rate, n + d.leases_ewma.get((tenant, media), 0.0))
            reserve: list[ReserveWant] = []
            give_back: list[str] = []
            for media, rate in sorted(by_media.items()):
                target = int(
                    min(p.max_reserve_bytes, max(p.min_reserve_bytes, rate * p.horizon_intervals))
                )
                mine = [
                    h
                    for h in self._reservations.values()
                    if h.reservation.media == media
                    and h.deadline > now
                    and h.epochs_used < EPOCH_BLOCK
                ]
                free = sum(self._free_in(h) for h in mine)
                if free < target * p.low_fraction:
                    reserve.append(ReserveWant(bytes=target - free, media=media))
                elif free > target * p.high_factor:
                    for h in sorted(mine, key=lambda h: h.reservation.length_bytes):
                        size = h.reservation.length_bytes
                        if self._occupied(h.reservation) or free - size < target:
                            continue
                        give_back.append(h.reservation.id)
                        free -= size
            spent = [
                h.reservation.id
                for h in self._reservations.values()
                if h.epochs_used >= EPOCH_BLOCK and not self._occupied(h.reservation)
            ]
            give_back.extend(spent)
            budgets: list[BudgetWant] = []
            for tenant, (rate, leases_rate) in sorted(by_tenant.items()):
                used_bytes, used_leases = self._used_by(tenant)
                head_bytes = int(
                    min(p.max_reserve_bytes, max(p.min_reserve_bytes, rate * p.horizon_intervals))
                )
                head_leases = int(max(p.min_budget_leases, leases_rate * p.horizon_intervals))
                entry = self._budgets.get(tenant)
                held_bytes = entry.budget.bytes if entry is not None else 0
                held_leases = entry.budget.leases if entry is not None else 0
                free_bytes = held_bytes - used_bytes
                free_leases = held_leases - used_leases
                low = (
                    entry is None
                    or free_bytes < head_bytes * p.low_fraction
                    or free_leases < head_leases * p.low_fraction
                )
                high = free_bytes > head_bytes * p.high_factor
                if low or high:
                    budgets.append(
                        BudgetWant(
                            tenant=tenant,
                            bytes=used_bytes + head_bytes,
                            leases=used_leases + head_leases,
                        )
                    )
        if not (reserve or give_back or budgets):
            return None
        return DelegationRequest(reserve=reserve, give_back=give_back, budgets=budgets)


def _inside(res: Reservation, lease: LocalLease) -> bool:
    return (
        res.offset_bytes <= lease.offset_bytes
        and lease.offset_bytes + lease.length_bytes <= res.offset_bytes + res.length_bytes
    )


def _may_act(budget: Budget, uid: int, gids: Iterable[int]) -> bool:
    """poold/ledger/tenants.py may_act, over a budget (its host is this one)."""
    return uid in budget.allowed_uids or any(g in budget.allowed_gids for g in gids)


def _expired(req: GrantRequest, what: str) -> DelegationExpired:
    return DelegationExpired(
        f"the {what} this agent holds would fit {req.size_bytes} bytes, but their TTL "
        "passed without poold renewing them (is poold down?)",
        size_bytes=req.size_bytes,
    )


# --- the agent's edge: journal, outbox, poold ---------------------------------------------


class LocalGrants:
    """The local grants of one agent: :class:`DelegatedCapacity` bound to the journal
    (agent/journal.py GrantLog), the outbox and poold's ``delegate`` route (agent/link.py).

    What the link asks of it is :class:`agent.link.LocalOps`; the service asks
    :meth:`grant`, :meth:`commit` and :meth:`restore`.
    """

    # After poold said it has no delegation route (an older poold), ask again this late.
    NO_ROUTE_RETRY_S = 60.0

    def __init__(self, capacity: DelegatedCapacity, link: PooldLink, held: HeldLeases) -> None:
        self.capacity = capacity
        self.link = link
        self.held = held
        self._lock = threading.Lock()
        self._plans: dict[str, LocalPlan] = {}  # granted, memory being made
        self._uncommitted: set[str] = set()  # journalled, local_grant not yet applied
        self._seq_of: dict[int, tuple[LeaseOp, int]] = {}  # id(op) -> (op, journal seq)
        self._asked = False
        self._no_route_until = 0.0
        self.enabled = True
        link.local = self
        link.on_delegation = self.replace

    @property
    def journal(self) -> Journal | None:
        return self.held.journal

    # --- the request path ---------------------------------------------------------
    def grant(self, req: GrantRequest) -> LeaseOut | None:
        """A local grant for ``req`` (memory not made yet), or None: the central path."""
        if not self.enabled or not self.capacity.holds_any():
            return None
        plan = self.capacity.grant_locally(req)
        if plan is None:
            return None
        with self._lock:
            self._plans[plan.lease.id] = plan
        if self.capacity.free_reserved_bytes() < self.capacity.policy.min_reserve_bytes:
            self.link.wake_delegation()  # refill off the request path
        return plan.lease

    def is_pending(self, lease_id: str) -> bool:
        return lease_id in self._plans

    def commit(self, held: HeldLease) -> None:
        """Journal a local lease (before its fd leaves) and queue its ``local_grant``."""
        with self._lock:
            plan = self._plans.pop(held.lease.id)
        grant = plan.grant
        op = LeaseOp.model_construct(
            lease_id=grant.lease_id,
            op="local_grant",
            reason="",
            length_bytes=None,
            grant=grant,
        )
        journal = self.journal
        if journal is not None:
            if held.inode is None and held.memory is not None:
                held.inode = memfd_inode(held.memory)
            seq = journal.add_local(
                journal_entry(held),
                grant.model_dump_json(),
                grant.reservation_id,
                grant.epoch,
                plan.persistent,
            )
            with self._lock:
                self._seq_of[id(op)] = (op, seq)
        with self._lock:
            self._uncommitted.add(grant.lease_id)
        self.link.enqueue(op)

    def abandon(self, lease_id: str) -> bool:
        with self._lock:
            plan = self._plans.pop(lease_id, None)
        if plan is None:
            return False
        self.capacity.abandon(lease_id)
        return True

    # --- what the link tells ------------------------------------------------------
    def is_local(self, lease_id: str) -> bool:
        return self.capacity.is_local(lease_id)

    def on_enqueue(self, op: LeaseOp) -> None:
        journal = self.journal
        if journal is None or op.op == "local_grant" or id(op) in self._seq_of:
            return
        seq = journal.local.op(op.lease_id, op.model_dump_json())
        with self._lock:
            self._seq_of[id(op)] = (op, seq)

    def on_delivered(self, ops: list[LeaseOp]) -> None:
        seqs: list[int] = []
        with self._lock:
            for op in ops:
                known = self._seq_of.pop(id(op), None)
                if known is not None and known[0] is op:
                    seqs.append(known[1])
                if op.op == "local_grant":
                    self._uncommitted.discard(op.lease_id)
        for op in ops:
            self.capacity.delivered(op.lease_id, op.op, op.length_bytes)
        journal = self.journal
        if journal is not None and seqs:
            journal.local.acked(seqs)

    def uncommitted(self, lease_id: str) -> bool:
        return lease_id in self._uncommitted

    def uncommitted_count(self) -> int:
        with self._lock:
            return len(self._uncommitted)

    # --- poold's side -----------------------------------------------------------------
    def replace(self, delegation: Delegation) -> None:
        """poold's whole delegation now (a heartbeat or ``delegate`` reply)."""
        self.capacity.replace(delegation)
        journal = self.journal
        if journal is not None:
            journal.local.delegation(delegation.model_dump_json(), time.time())

    def step(self) -> None:
        """Refill or give back off the request path: ask poold once at start (what is held
        already), then whenever demand says so."""
        now = time.monotonic()
        if not self.enabled or now < self._no_route_until:
            return
        want = self.capacity.wants()
        if want is None:
            if self._asked:
                return
            want = DelegationRequest()
        try:
            delegation = self.link.delegate(want)
        except PoolError as err:
            if err.http_status in (404, 405) or err.code == "internal":
                if not self._asked or now >= self._no_route_until:
                    log.info("poold grants no delegation (%s); every lease is central", err)
                self._no_route_until = now + self.NO_ROUTE_RETRY_S
                self._asked = True
                return
            raise
        self._asked = True
        self.replace(delegation)

    # --- restart ----------------------------------------------------------------------
    def restore(self) -> int:
        """After a restart, before adoption: the journal's local leases occupy their
        extents, their epochs stay spent, the last delegation is held again (its TTL
        counted from when it came), and every op poold had not applied is queued again,
        in order (a repeat of one it did apply is answered idempotently). Returns how
        many ops were queued again."""
        journal = self.journal
        if journal is None:
            return 0
        state = journal.local.state
        grants = [LocalGrant.model_validate_json(g) for g in state.grants.values()]
        if state.delegation is not None:
            text, wall = state.delegation
            age = max(0.0, time.time() - wall)
            try:
                self.capacity.replace(
                    Delegation.model_validate_json(text), received_at=time.monotonic() - age
                )
            except ValueError:
                log.warning("the journalled delegation does not parse; waiting for poold's")
        self.capacity.restore(grants)
        for reservation_id, epoch in state.epochs.items():
            self.capacity.note_epoch(reservation_id, epoch)
        replayed = 0
        for seq, text in list(state.pending):
            op = LeaseOp.model_validate_json(text)
            with self._lock:
                self._seq_of[id(op)] = (op, seq)
                if op.op == "local_grant":
                    self._uncommitted.add(op.lease_id)
            self.link.enqueue(op)
            replayed += 1
        if replayed:
            log.info("journal: %d op(s) of local leases queued again for poold", replayed)
        return replayed


def journal_entry(held: HeldLease) -> JournalEntry:
    """The journal entry of a held lease (as agent/held.py HeldLeases.record writes)."""
    lease = held.lease
    return JournalEntry(
        lease_id=lease.id,
        device_uid=lease.device_uid,
        backend=held.memory.backend if held.memory is not None else lease.device_kind,
        offset_bytes=lease.offset_bytes,
        length_bytes=lease.length_bytes,
        epoch=lease.epoch,
        holder_pid=held.holder_pid,
        holder_uid=held.holder_uid,
        holder_start=held.holder.start_time if held.holder else None,
        ttl_s=held.ttl_s,
        sub_device=held.sub_device,
        region_id=held.region_id,
        lease_json=lease.model_dump_json(),
        st_dev=held.inode.dev if held.inode is not None else None,
        st_ino=held.inode.ino if held.inode is not None else None,
    )
