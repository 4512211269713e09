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

:class:`DelegatedCapacity` is pure but for one lock: no I/O, tested without poold. Its
edge (journal, outbox, poold's ``delegate`` route) is agent/local_grants.py
:class:`~agent.local_grants.LocalGrants`; how much to ask poold for is agent/refill.py's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from agent.local_leases import LocalLease, LocalLeases
from agent.refill import (
    Demand,
    HeldReservation,
    RefillPolicy,
    budget_ask_moves,
    budget_want,
    reservation_want,
)
from poold import placement
from poold.errors import DelegationExpired
from poold.extents import Extent, align_up
from poold.lease_states import LeaseState
from poold.wire.agent import BudgetSpent, GrantRequest
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
from poold.wire.trusted import trusted

log = logging.getLogger("pool_agent.delegation")


def _wanted(req: GrantRequest, budget: Budget) -> placement.Request:
    """What placement is asked for ``req`` under ``budget``'s allowed media."""
    return placement.Request(
        size_bytes=req.size_bytes, media=req.media, allowed_media=frozenset(budget.allowed_media)
    )


def new_lease_id() -> str:
    """A random (version 4) UUID as text, as ``str(uuid.uuid4())`` makes it at a third of
    the cost (its UUID object is pure Python; one is made per local lease)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# Media whose contents survive a power loss: a local grant on them is fsynced before the
# fd leaves (agent/journal.py GrantLog). Everything else (DRAM, CXL DRAM, emulated) loses
# its contents, and its tenants, with the host, so a grant lost with the page cache names
# memory no one holds any more.
PERSISTENT_MEDIA = frozenset({"pmem", "nvdimm", "optane", "persistent"})

# Ops after whose delivery poold counts a lease's range free again.
FREEING_OPS = frozenset({"release", "abort", "unmapped", "scrubbed"})


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
    # The placement candidate last made of it: made again only when its index or its
    # free extents changed (a frozen dataclass of 14 fields made per request was 5 % of
    # the agent's time serving lease+release).
    candidate: placement.Candidate | None = None


@dataclass
class _Budget:
    budget: Budget
    deadline: float


# A central grant whose outcome is unknown (no answer) may still commit while poold
# retries it under the same request id: its debit lasts this much longer.
UNKNOWN_OUTCOME_S = 60.0
# After poold asks a reservation back (pressure), no refill of that media for this long:
# the bytes are for whoever waits for them, not for this host's headroom again.
RECALL_COOLDOWN_S = 30.0


@dataclass(eq=False)
class _Limit:
    """A lowering of the agent's own view of a tenant's budget, on top of what poold's
    last delegation says: a debit (a central grant in flight, which poold may pay from
    this host's budget) or a cap (a smaller budget asked for, not yet answered).

    It holds until a delegation arrives whose request left this agent after
    ``settled_at``: poold answered that request after the grant (or the ask) committed,
    since the commit came before its reply, so its budget already says it. A reply to
    an earlier request may have left poold before the commit: it must not raise the
    view again (local monotonic times only; poold's clocks play no part)."""

    tenant: str
    bytes: int
    leases: int
    cap: bool = False
    settled_at: float | None = None  # None: its request is still on its way
    # A debit: the tenant's local use here (bytes, leases; uncommitted grants included)
    # when it was taken, which the central request tells poold (GrantRequest.local_use).
    local_use: tuple[int, int] = (0, 0)


# Why a lease request took the path it did (``DelegatedCapacity.paths``): granted inside
# the delegation, or sent to poold and why. A fixed set, so the metric's labels are bounded.
LOCAL: Final = "local"
CENTRAL_REASONS: Final = (
    "disabled",  # delegation is off on this agent
    "no_reservation",  # none held (not yet delegated, or all given back)
    "no_budget",  # no budget for a tenant the caller may act for (or several match)
    "budget_leases",  # the tenant's budget here has no lease left
    "budget_bytes",  # ... or too few bytes for the extent placed
    "no_room",  # no held reservation of an allowed media has room for it
    "expired",  # it would fit, but the reservations or the budget are past their TTL
)


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
        self._leases = LocalLeases()
        # Epochs granted before a restart (journal), by reservation: max epoch seen.
        self._epoch_seen: dict[str, int] = {}
        self._demand = Demand()
        # Set by the service: whether this host has real far memory (placement never
        # picks emulated memory then unless asked by name; poold sees all its devices).
        self.host_has_real: Callable[[], bool] = lambda: False
        self.replaced_at: float | None = None
        self._limits: list[_Limit] = []
        # When the request of the last delegation taken left (a stale reply is ignored).
        self._applied_sent_at: float | None = None
        # Reservations poold stopped listing with no local lease inside: given back (so
        # that one it asked back under pressure goes at once), and those still busy.
        self._withdrawn: set[str] = set()
        self._withdrawn_busy: dict[str, str] = {}  # reservation id -> media
        self._recalled_at: dict[str, float] = {}  # media -> when one went
        # Reservations a pending request gives back: no local lease goes there meanwhile.
        self._giving: set[str] = set()
        self._asking: list[_Limit] = []  # caps of the request on its way
        # Lease requests by path: LOCAL or a CENTRAL_REASONS entry (agent/metrics.py).
        self._paths: dict[str, int] = dict.fromkeys((LOCAL, *CENTRAL_REASONS), 0)
        self._asked_give: set[str] = set()  # what it gives back
        # Idle reservations a central grant refused no_capacity wants back (`recall_idle`).
        self._recall: set[str] = set()
        self._gone: dict[str, float] = {}  # given back: reservation id -> settled at
        # Bytes central grants were refused (quota) per tenant this interval: demand too.
        self._refused: dict[str, int] = {}
        self._last_demand: dict[str, float] = {}  # tenant -> when it last leased here
        # Larger budgets asked of poold: tenant -> (when, poold's budget then); one it
        # answered leaving that budget as it was is not asked again for a while.
        self._raised: dict[str, tuple[float, tuple[int, int]]] = {}
        self._raising: dict[str, tuple[float, tuple[int, int]]] = {}  # on its way

    # --- what poold says is held ----------------------------------------------------
    def replace(
        self,
        delegation: Delegation,
        *,
        received_at: float | None = None,
        sent_at: float | None = None,
    ) -> list[str]:
        """Hold ``delegation`` instead of whatever was held (the whole of it, always).

        TTLs are read against poold's ``server_time`` and kept on the local monotonic
        clock, so clock skew between the hosts does not shorten or lengthen them. Returns
        the local leases whose reservation poold no longer lists (kept, flagged).

        ``sent_at`` is when the request it answers left this agent (monotonic). A reply
        to a request older than the last one taken is dropped whole: it may have left
        poold before a give-back or a central grant that the newer one already says.
        """
        now = self._clock() if received_at is None else received_at
        with self._lock:
            if sent_at is not None:
                if self._applied_sent_at is not None and sent_at < self._applied_sent_at:
                    return sorted(x.lease_id for x in self._leases if x.stray)
                self._applied_sent_at = sent_at
                self._limits = [
                    x for x in self._limits if x.settled_at is None or x.settled_at >= sent_at
                ]
                self._gone = {r: t for r, t in self._gone.items() if t >= sent_at}
            previous = self._reservations
            held: dict[str, _Held] = {}
            for res in delegation.reservations:
                if res.id in self._gone:
                    continue  # given back: this reply left poold before it knew
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
            for rid, old in previous.items():
                if rid in held or rid in self._gone or rid in self._giving:
                    continue  # still held, or this agent gave it back
                if self._leases.any_in(rid):
                    self._withdrawn_busy[rid] = old.reservation.media
                else:
                    self._withdrawn.add(rid)
                self._recalled_at[old.reservation.media] = now
            self._giving &= set(held)
            self._budgets = {
                b.tenant: _Budget(b, now + (b.expires_at - delegation.server_time).total_seconds())
                for b in delegation.budgets
            }
            stray: list[str] = []
            for lease in self._leases:
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
                self._leases.add(
                    LocalLease(
                        grant.lease_id,
                        grant.reservation_id,
                        grant.tenant,
                        grant.offset_bytes,
                        grant.length_bytes,
                        grant.epoch,
                    ),
                    restored=True,
                )
                self._epoch_spent(grant.reservation_id, grant.epoch)

    def note_epoch(self, reservation_id: str, epoch: int) -> None:
        """An epoch the journal says was granted (of a lease since ended): never again."""
        with self._lock:
            self._epoch_spent(reservation_id, epoch)

    def _epoch_spent(self, reservation_id: str, epoch: int) -> None:
        """(Under the lock.) Whether the reservation is held yet or not: the journalled
        delegation is held again before its leases are restored."""
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

    def tenant_of(self, lease_id: str) -> str | None:
        """The tenant of a local lease (None: not one)."""
        lease = self._leases.get(lease_id)
        return None if lease is None else lease.tenant

    def local_leases(self) -> list[LocalLease]:
        with self._lock:
            return [LocalLease(**vars(lease)) for lease in self._leases]

    def stray_ids(self) -> list[str]:
        with self._lock:
            return sorted(lease.lease_id for lease in self._leases if lease.stray)

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

    def reserved_bytes(self) -> int:
        """Bytes of the unexpired reservations held, leased locally or not."""
        now = self._clock()
        with self._lock:
            return sum(
                h.reservation.length_bytes for h in self._reservations.values() if h.deadline > now
            )

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
            return self._leases.used_by(tenant)

    def _free_in(self, held: _Held) -> int:
        res = held.reservation
        return res.length_bytes - self._leases.used_in(res.id)

    def recall_idle(
        self, media: str | None, size_bytes: int, free_by_device: Mapping[str, int]
    ) -> bool:
        """A central grant of ``size_bytes`` (of ``media``; None: any) found no room on
        this host's devices (no_capacity; ``free_by_device``: what poold's refusal says
        is free, by device uid): the reservations here with no local lease in them, on a
        device where they and its free bytes would hold the lease, go back at the next
        delegation step, and their media is not reserved again for a while
        (``RECALL_COOLDOWN_S``). So a lease is not refused for bytes this host parked for
        leases it has not granted, and one that could not fit anyway (larger than a
        device) gives nothing back. False: none to give back (the refusal stands)."""
        with self._lock:
            idle: dict[str, list[tuple[str, int]]] = {}
            coming: dict[str, int] = {}  # bytes already going back (a recall, a give-back)
            far = media is None and self.host_has_real()
            for rid, h in self._reservations.items():
                res = h.reservation
                if media is not None and res.media != media:
                    continue
                if far and placement.EMULATED in (res.media, res.kind):
                    continue  # as placement: no silent DRAM for a far-memory request
                if rid in self._recall or rid in self._giving:
                    coming[res.device_uid] = coming.get(res.device_uid, 0) + res.length_bytes
                elif self._idle(rid):
                    idle.setdefault(res.device_uid, []).append((rid, res.length_bytes))
            helps = {
                device
                for device in set(idle) | set(coming)
                if free_by_device.get(device, 0)
                + sum(n for _, n in idle.get(device, ()))
                + coming.get(device, 0)
                >= size_bytes
            }
            self._recall |= {rid for device in helps for rid, _ in idle.get(device, ())}
            # True too when bytes already going back would do: this request waits for
            # the same step instead of being refused meanwhile.
            return bool(helps)

    def _idle(self, rid: str) -> bool:
        """May the reservation go back now: no local lease in it, not already going or
        gone (under the lock)."""
        return not (self._leases.any_in(rid) or rid in self._giving or rid in self._gone)

    def forget_recall(self) -> None:
        """The recall's step did not come in time: nothing goes back for it later."""
        with self._lock:
            self._recall.clear()

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
                return self._central("no_reservation")
            entry = self._resolve(req)
            if entry is None:
                return self._central("no_budget")
            budget = entry.budget
            used_bytes, used_leases = self._leases.used_by(budget.tenant)
            view_bytes, view_leases = self._view(budget)
            if used_leases + 1 > view_leases:
                return self._central("budget_leases")
            usable = [
                h
                for h in self._reservations.values()
                if h.epochs_used < EPOCH_BLOCK
                # Going back, or gone (between poold's answer and the reply's replace).
                and h.reservation.id not in self._giving
                and h.reservation.id not in self._gone
            ]
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
            reused: str | None = None  # the released lease whose extent this one takes
            if choice is None:
                found = self._reuse(req, budget, live)
                if found is None:
                    expired = [h for h in usable if h.deadline <= now]
                    if expired and self._place(req, budget, expired) is not None:
                        self._paths["expired"] += 1
                        raise _expired(req, "reservations")
                    return self._central("no_room")
                choice, reused = found
            held, extent = choice
            if used_bytes + extent.length > view_bytes:
                return self._central("budget_bytes")
            if entry.deadline <= now:
                self._paths["expired"] += 1
                raise _expired(req, f"budget of tenant {budget.tenant!r}")
            self._paths[LOCAL] += 1
            res = held.reservation
            epoch = res.epoch_base + held.epochs_used
            held.epochs_used += 1
            lease_id = new_lease_id()
            # A lease taking a released one's bytes leaves it listed until poold applies
            # its release: its tenant stays known (tenant_of), so the queue still holds the
            # tenant's later ops (this lease's commit among them) behind that release.
            self._leases.add(
                LocalLease(lease_id, res.id, budget.tenant, extent.offset, extent.length, epoch),
                taking=reused,
            )
            self._note_demand(budget.tenant, res.media, extent.length)
        wall = datetime.now(UTC) if wall is None else wall
        # Built without validation: every value comes from validated models or from here.
        lease = trusted(
            LeaseOut,
            {
                "id": lease_id,
                "tenant": budget.tenant,
                "host": self.host,
                "device_uid": res.device_uid,
                "device_kind": res.kind,
                "media": res.media,
                "offset_bytes": extent.offset,
                "length_bytes": extent.length,
                "requested_bytes": req.size_bytes,
                "alignment_bytes": res.alignment_bytes,
                "state": LeaseState.ACTIVE,
                "epoch": epoch,
                "ttl_s": req.ttl_s,
                "granted_at": wall,
                "activated_at": wall,
                "expires_at": wall + timedelta(seconds=req.ttl_s),
                "ended_at": None,
                "numa_node": res.numa_node,
                "local_name": res.local_name,
                "holder_uid": req.uid,
                "holder_pid": req.pid,
                "labels": dict(req.labels),
                "exclusive_bytes": 0,
                "replica_bytes": 0,
                "reservation_id": res.id,
            },
        )
        grant = trusted(
            LocalGrant,
            {
                "lease_id": lease_id,
                "reservation_id": res.id,
                "tenant": budget.tenant,
                "offset_bytes": extent.offset,
                "length_bytes": extent.length,
                "requested_bytes": req.size_bytes,
                "epoch": epoch,
                "ttl_s": req.ttl_s,
                "granted_at": wall,
                "uid": req.uid,
                "gids": list(req.gids),
                "pid": req.pid,
                "labels": dict(req.labels),
            },
        )
        return LocalPlan(lease, grant, res.media in PERSISTENT_MEDIA)

    def _central(self, reason: str) -> LocalPlan | None:
        """Count a request the delegation leaves to poold (under the lock): None, the
        central path."""
        self._paths[reason] += 1
        return None

    def note_central(self, reason: str) -> None:
        """A request that never reached the delegation went to poold (``disabled``...)."""
        with self._lock:
            self._paths[reason] += 1

    def paths(self) -> dict[str, int]:
        """Lease requests so far by path: LOCAL, or why poold was asked instead."""
        with self._lock:
            return dict(self._paths)

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
            end = res.offset_bytes + res.length_bytes
            free = self._leases.holes(res.id, res.offset_bytes, end)
            made = h.candidate
            # The reservation is fixed for the _Held; its free extents are kept by
            # LocalLeases (updated in place at a grant, made anew when a lease leaves).
            if made is None or made.free is not free or made.device_id != index:
                made = h.candidate = placement.Candidate(
                    device_id=index,
                    kind=res.kind,
                    media=res.media,
                    state="online",
                    health=res.health,
                    capacity_bytes=end,
                    alignment_bytes=res.alignment_bytes,
                    free=free,
                    read_latency_ns=res.read_latency_ns,
                    distance=res.distance,
                )
            candidates.append(made)
        choice = placement.place(_wanted(req, budget), candidates)
        if isinstance(choice, placement.Refusal):
            return None
        return held[choice.candidate.device_id], choice.extent

    def _reuse(
        self, req: GrantRequest, budget: Budget, held: list[_Held]
    ) -> tuple[tuple[_Held, Extent], str] | None:
        """No reservation has room: the extent of one of this tenant's own leases whose
        release is queued for poold and not yet applied, if it is exactly as long as this
        request's lease would be and may hold it (media, health). Such an extent waits
        for poold (LocalLeases.release) because another tenant's grant could reach poold
        ahead of the release, riding on a central grant; this tenant's own ops reach poold
        one request at a time in the order they were queued (agent/op_queue.py), and
        poold applies a batch's releases before its grants, so its release is applied
        before the grant that takes its bytes. Without it, a tenant churning leases
        through a poold outage was refused once it had released its reservations' worth.
        The placement and the released lease's id, or None."""
        by_id = {h.reservation.id: h for h in held}
        wanted = _wanted(req, budget)
        for lease in self._leases.released_of(budget.tenant):
            h = by_id.get(lease.reservation_id)
            # _place, just run over ``held``, made each one's candidate.
            if h is None or h.candidate is None:
                continue
            step = max(h.reservation.alignment_bytes, 1)
            if lease.length_bytes != align_up(req.size_bytes, step):
                continue
            if not self._leases.taken_only_by_releases(lease):
                continue  # a lease that took its bytes before a restart still holds them
            if not placement.eligible(wanted, [h.candidate]):
                continue
            return (h, Extent(lease.offset_bytes, lease.length_bytes)), lease.lease_id
        return None

    def abandon(self, lease_id: str) -> None:
        """A local grant whose memory could not be made: its extent is free again (its
        epoch stays spent), and poold never hears of it."""
        with self._lock:
            lease = self._leases.pop(lease_id)
            if lease is not None:
                self._freed_in(lease.reservation_id)

    def _freed_in(self, reservation_id: str) -> None:
        """A local lease left a reservation poold no longer lists: give it back if empty."""
        if reservation_id in self._withdrawn_busy and not self._leases.any_in(reservation_id):
            del self._withdrawn_busy[reservation_id]
            self._withdrawn.add(reservation_id)

    # --- the agent's own view of a budget --------------------------------------------
    def _view(self, budget: Budget) -> tuple[int, int]:
        """What the agent may spend of ``budget``: poold's figure, lowered by the caps
        and debits that poold's last delegation may not say yet (`_Limit`)."""
        nbytes, nleases = budget.bytes, budget.leases
        for x in self._limits:
            if x.tenant != budget.tenant:
                continue
            if x.cap:
                nbytes, nleases = min(nbytes, x.bytes), min(nleases, x.leases)
        for x in self._limits:
            if x.tenant == budget.tenant and not x.cap:
                nbytes, nleases = nbytes - x.bytes, nleases - x.leases
        return nbytes, nleases

    def has_withdrawn(self) -> bool:
        """Reservations poold stopped listing wait to be given back."""
        with self._lock:
            return bool(self._withdrawn)

    def budget_view(self, tenant: str) -> tuple[int, int] | None:
        """(bytes, leases) the agent may spend of the tenant's budget now (None: none)."""
        with self._lock:
            entry = self._budgets.get(tenant)
            return None if entry is None else self._view(entry.budget)

    def debit(self, req: GrantRequest, alignment_bytes: int) -> _Limit | None:
        """A central grant of ``req`` is about to leave: lower the view of the caller's
        tenant's budget by it first (rounded up to ``alignment_bytes``, the most any
        device here asks), since poold may pay the grant from this host's budget
        (poold/ledger/delegation.py spend_for_central). None: no tenant to lower it for.

        Taken for a tenant named in the request even while no budget of it is held: a
        delegation on its way may bring one that poold's grant then spends (a delegate
        and a grant of one host take turns in poold, so its reply can leave before the
        grant spends what it lists); the debit holds the view of that budget down until
        a later delegation says the spend, and the request tells poold the local use.
        An unnamed request with no budget held names no tenant to debit."""
        with self._lock:
            entry = self._resolve(req)
            tenant = entry.budget.tenant if entry is not None else req.tenant
            if tenant is None:
                return None
            size = -(-req.size_bytes // max(1, alignment_bytes)) * max(1, alignment_bytes)
            # Read with the debit under one lock: every local grant after it fits the
            # lowered view, every one before it is in this count. Its released leases
            # too, until poold has applied their release: a commit still queued must
            # find the budget poold leaves here (the link takes out those whose release
            # rides on this grant, applied before it: `released_among`).
            limit = _Limit(tenant, size, 1, local_use=self._leases.listed_of(tenant))
            self._limits.append(limit)
            return limit

    def settle(
        self,
        limit: _Limit,
        length_bytes: int | None,
        *,
        known: bool,
        spent: BudgetSpent | None = None,
    ) -> None:
        """The central grant of ``limit`` came back (``known``: with a verdict; its lease's
        length if granted): later delegations may say it. ``spent``: what poold says the
        grant took from this host's budget (GrantReply.budget_spent): the debit becomes
        exactly that, so a grant that spent nothing leaves the view as it was at once
        instead of lowered until the next delegation (at its quota, a tenant's every
        release-then-lease went central for that second, each spending the budget)."""
        now = self._clock()
        with self._lock:
            if spent is not None:
                limit.bytes, limit.leases = spent.bytes, spent.leases
            elif length_bytes is not None:
                limit.bytes = max(limit.bytes, length_bytes)
            limit.settled_at = now if known else now + UNKNOWN_OUTCOME_S

    def drop(self, limit: _Limit) -> None:
        """The central grant of ``limit`` never left: nothing to wait for."""
        with self._lock:
            if limit in self._limits:
                self._limits.remove(limit)

    def note_refused(self, tenant: str, size_bytes: int) -> None:
        """poold refused a central grant of the tenant (quota): demand the refill sees, so
        this host asks a budget and counts as one of the tenant's hosts (fair share)."""
        with self._lock:
            self._refused[tenant] = self._refused.get(tenant, 0) + size_bytes
            self._last_demand[tenant] = self._clock()

    def asked(self, sent_at: float, *, ok: bool) -> list[str]:
        """The request of the last :meth:`wants` came back (``ok``) or failed: its caps
        hold until a later reply, its give-backs are done (or usable again). Returns the
        reservations given back."""
        now = self._clock()
        settled = now if ok else now + UNKNOWN_OUTCOME_S
        with self._lock:
            for x in self._asking:
                x.settled_at = settled
            self._asking = []
            if ok:  # failed: no answer to hold off for
                self._raised.update(self._raising)
            self._raising = {}
            # Given back (or maybe, without an answer): a reply to a request that left
            # before this one came back may still list them; they take no lease here
            # until a later reply (as `_Limit`).
            for rid in self._asked_give:
                self._gone[rid] = settled
            given = sorted(self._asked_give) if ok else []
            if ok:
                self._withdrawn -= self._asked_give
            self._asked_give = set()
            self._giving = set()
            return given

    def released_among(self, tenant: str, lease_ids: Iterable[str]) -> tuple[int, int]:
        """(bytes, leases) of the tenant's listed local leases among ``lease_ids`` whose
        release is queued (the releases riding on a central grant)."""
        nbytes = nleases = 0
        with self._lock:
            for lease_id in set(lease_ids):
                lease = self._leases.get(lease_id)
                if lease is not None and lease.released and lease.tenant == tenant:
                    nbytes += lease.length_bytes
                    nleases += 1
        return nbytes, nleases

    def released(self, lease_id: str) -> None:
        """A local lease's release is in the outbox: its tenant's budget is free of it
        (its extent is not, until poold applies the release: :meth:`delivered`)."""
        with self._lock:
            self._leases.release(lease_id)

    def delivered(self, lease_id: str, op: str, length_bytes: int | None = None) -> None:
        """poold applied ``op`` of a local lease: a freeing op frees its extent; a shrink
        frees its tail."""
        self.delivered_all([(lease_id, op, length_bytes)])

    def delivered_all(self, ops: Iterable[tuple[str, str, int | None]]) -> None:
        """:meth:`delivered` for each (lease id, op, length) of a batch, in its order,
        under one taking of the lock (a batch is hundreds of ops)."""
        with self._lock:
            for lease_id, op, length_bytes in ops:
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                if op in FREEING_OPS:
                    self._leases.pop(lease_id)
                    self._freed_in(lease.reservation_id)
                elif op == "shrink" and length_bytes is not None:
                    self._leases.shrink(lease_id, length_bytes)

    # --- refill and give-back ----------------------------------------------------------
    def note_demand(self, tenant: str, media: str, length_bytes: int) -> None:
        """A lease granted on this host (centrally too): what the next refill sizes from."""
        with self._lock:
            self._note_demand(tenant, media, length_bytes)

    def _note_demand(self, tenant: str, media: str, length_bytes: int) -> None:
        self._last_demand[tenant] = self._clock()
        self._demand.note(tenant, media, length_bytes)

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
            by_media, by_tenant = self._demand.close_interval(p.alpha)
            for tenant, refused in self._refused.items():
                b, n = by_tenant.get(tenant, (0.0, 0.0))
                by_tenant[tenant] = (b + refused, n + 1)
            self._refused.clear()
            reserve: list[ReserveWant] = []
            give_back: list[str] = sorted(self._withdrawn)
            for rid in sorted(self._recall):
                h = self._reservations.get(rid)
                if h is None or not self._idle(rid):
                    continue  # gone, or a local lease went there since
                give_back.append(rid)
                self._giving.add(rid)
                self._recalled_at[h.reservation.media] = now  # not reserved again at once
            self._recall.clear()
            for media, rate in sorted(by_media.items()):
                if now - self._recalled_at.get(media, -RECALL_COOLDOWN_S) < RECALL_COOLDOWN_S:
                    continue  # poold asked one back lately: leave the bytes to others
                mine = [
                    HeldReservation(
                        h.reservation.id,
                        h.reservation.length_bytes,
                        self._free_in(h),
                        self._leases.any_in(h.reservation.id),
                    )
                    for h in self._reservations.values()
                    if h.reservation.media == media
                    and h.deadline > now
                    and h.epochs_used < EPOCH_BLOCK
                ]
                more_bytes, given = reservation_want(p, rate, mine)
                if more_bytes is not None:
                    reserve.append(ReserveWant(bytes=more_bytes, media=media))
                give_back.extend(given)
                self._giving.update(given)
            spent = [
                h.reservation.id
                for h in self._reservations.values()
                if h.epochs_used >= EPOCH_BLOCK and not self._leases.any_in(h.reservation.id)
            ]
            give_back.extend(spent)
            self._giving.update(spent)
            budgets: list[BudgetWant] = []
            for tenant, rates in sorted(by_tenant.items()):
                used_bytes, used_leases = self._leases.used_by(tenant)
                # Its leases poold has yet to hear the end of: an ask below them, applied
                # before the outbox delivers their commits, would have poold refuse those
                # (a lease its tenant was granted, used and released lost from the ledger).
                listed = self._leases.listed_of(tenant)
                idle = now - self._last_demand.get(tenant, now)
                if idle > p.idle_budget_s and not listed[1]:
                    # No lease of it here for long: its budget goes back to the quota
                    # (other hosts' fair shares grow), and its next lease starts central.
                    budgets.append(BudgetWant(tenant=tenant, bytes=0, leases=0))
                    cap = _Limit(tenant, 0, 0, cap=True)  # nothing granted meanwhile
                    self._limits.append(cap)
                    self._asking.append(cap)
                    self._demand.forget(tenant)
                    self._last_demand.pop(tenant, None)
                    continue
                entry = self._budgets.get(tenant)
                held = None if entry is None else self._view(entry.budget)
                share = None
                if entry is not None and entry.budget.share_bytes is not None:
                    share = (entry.budget.share_bytes, entry.budget.share_leases or 0)
                want = budget_want(p, rates, (used_bytes, used_leases), held, share, listed)
                raw = (0, 0) if entry is None else (entry.budget.bytes, entry.budget.leases)
                if want is not None and not budget_ask_moves(
                    p, want, raw, self._raised.get(tenant), now
                ):
                    want = None
                if want is not None:
                    if want[0] >= raw[0] and want[1] >= raw[1]:  # for more: remembered
                        self._raising[tenant] = (now, raw)
                    want_bytes, want_leases = want
                    budgets.append(BudgetWant(tenant=tenant, bytes=want_bytes, leases=want_leases))
                    held_bytes, held_leases = (0, 0) if held is None else held
                    if want_bytes < held_bytes or want_leases < held_leases:
                        # poold sets a smaller budget as asked: spend no more meanwhile.
                        cap = _Limit(tenant, want_bytes, want_leases, cap=True)
                        self._limits.append(cap)
                        self._asking.append(cap)
            self._asked_give = set(give_back)
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
