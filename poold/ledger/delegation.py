"""What is delegated to which host: its reservations of device extents and its tenants'
budgets, which its agent spends alone (DESIGN.md "Delegated capacity"). This module
answers what a host holds and how its agent's refill changes it.

* `delegate` (`POST /v1/agent/delegation`): give back reservations, reserve more, set
  budgets, in one transaction; idempotent by request id; the reply is the host's whole
  delegation. Reservations are placed with the pure placement/extent code grants use,
  on devices the host reaches, around every lease, reservation, reserved and
  quarantined range, under the device-generation swap, which moves the device's
  generation past an epoch block (`EPOCH_BLOCK`): the reservation's local leases take
  epochs from that block, every later grant of those bytes a larger one.
* `host_delegation`: what the host holds now (its heartbeat reply and `delegate`'s).
* How big a budget may be (set on request, fair shares, a quota cut's `claw_back`):
  poold/ledger/budget_sizing.py. How long a reservation or budget lives (renewed by
  each heartbeat, returned on a drain, recalled under pressure, reaped at its TTL):
  poold/ledger/delegation_renewal.py.

Reservation states: "held" (renewed, takes local grants), "returning" (its TTL passed,
its device or host drains, or `audit --reclaim` found its host down: it takes no new
lease and goes when its agent gives it back, or once its TTL has passed with no live
lease in it; a local grant its agent made before it heard is still committed into it)
and "recalled" (asked back under pressure, `delegation_renewal.recall`: goes when its
agent gives it back, or at its TTL).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy import Connection, and_, bindparam, delete, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from poold import extents, placement
from poold.errors import (
    NotOwner,
    ReservationInUse,
    UnknownDevice,
    UnknownReservation,
)
from poold.lease_states import LIVE_STATES_SQL
from poold.ledger import agent_requests, budget_sizing, granting, hosts, transitions
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Ledger, Prepared
from poold.ledger.models import (
    Budget,
    Device,
    DevicePath,
    Event,
    Host,
    Lease,
    Reservation,
    Tenant,
)
from poold.ledger.transitions import event_row
from poold.ledger.types import utcnow
from poold.wire.delegation import EPOCH_BLOCK, Delegation, DelegationRequest
from poold.wire.delegation import Budget as BudgetOut
from poold.wire.delegation import Reservation as ReservationOut

HELD = "held"
RETURNING = "returning"
# Asked back under pressure (poold/pressure.py): no lease inside as poold knows, takes no
# new lease once its agent has the reply that omits it, and goes when the agent gives it
# back (or its TTL passes: it is not renewed). Not dropped at once: the agent may have
# granted inside it a lease whose local_grant is still on its way.
RECALLED = "recalled"
# agent_requests kind of a remembered `delegate` answer.
REQUEST_KIND = "delegation"


@dataclasses.dataclass(frozen=True)
class DelegationPolicy:
    """How much poold delegates, and for how long."""

    # A reservation or budget the host's heartbeat stops renewing (poold down: the agent
    # keeps granting inside it) lives this long.
    ttl_s: float = 600.0
    # One request reserves at most this share of a device's free bytes (so that one
    # host cannot strand the pool).
    cap_fraction: float = 0.25
    # Never reserve into this share of a device's capacity (the pressure watermark's
    # default): a reservation that would put the device under pressure would only be
    # asked back by the next heartbeat.
    keep_free_fraction: float = 0.05


DEFAULT_POLICY = DelegationPolicy()

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")


# --- the host's whole delegation ---------------------------------------------------------


# What `host_delegation` reads, built once (every delegate call and heartbeat reply with
# a delegation reads them).
_HELD_RESERVATIONS = Prepared(
    select(
        Reservation.id,
        Reservation.offset_bytes,
        Reservation.length_bytes,
        Reservation.epoch_base,
        Reservation.expires_at,
        Device.uid,
        Device.kind,
        Device.media,
        Device.health,
        Device.alignment_bytes,
        DevicePath.local_name,
        DevicePath.numa_node,
        DevicePath.read_latency_ns,
        DevicePath.distance,
    )
    .join(Device, Device.id == Reservation.device_id)
    .outerjoin(
        DevicePath,
        and_(
            DevicePath.device_id == Reservation.device_id,
            DevicePath.host_id == Reservation.host_id,
        ),
    )
    .where(Reservation.host_id == bindparam("host_id"), Reservation.state == HELD)
    .order_by(Device.uid, Reservation.offset_bytes)
)
_HOST_BUDGETS = Prepared(
    select(
        Tenant.id,
        Tenant.name,
        Tenant.quota_bytes,
        Tenant.quota_leases,
        Budget.bytes,
        Budget.leases,
        Budget.expires_at,
        Tenant.allowed_uids,
        Tenant.allowed_gids,
        Tenant.allowed_media,
        Tenant.central_room_bytes,
        Tenant.central_room_until,
    )
    .join(Tenant, Tenant.id == Budget.tenant_id)
    .where(Budget.host_id == bindparam("host_id"))
    .order_by(Tenant.name)
)


def host_delegation(
    conn: Connection, host_id: int, now: datetime, uses: Mapping[int, QuotaUse] | None = None
) -> Delegation:
    """What the host holds now: its held reservations and its budgets (``uses``: quota
    use of some tenants as this transaction left it, not read again)."""
    params = {"host_id": host_id}
    reservations = [
        ReservationOut(
            id=r.id,
            device_uid=r.uid,
            kind=r.kind,
            media=r.media,
            health=r.health,
            alignment_bytes=r.alignment_bytes,
            offset_bytes=r.offset_bytes,
            length_bytes=r.length_bytes,
            epoch_base=r.epoch_base,
            expires_at=r.expires_at,
            local_name=r.local_name or "",
            numa_node=r.numa_node,
            read_latency_ns=r.read_latency_ns,
            distance=r.distance,
        )
        for r in _HELD_RESERVATIONS.rows(conn, params)
    ]
    rows = _HOST_BUDGETS.rows(conn, params)
    shares = budget_sizing.shares(conn, host_id, rows, now, uses)
    budgets = [
        BudgetOut(
            tenant=b.name,
            bytes=b.bytes,
            leases=b.leases,
            allowed_uids=list(b.allowed_uids or []),
            allowed_gids=list(b.allowed_gids or []),
            allowed_media=list(b.allowed_media or []),
            expires_at=b.expires_at,
            share_bytes=shares[b.id][0] if b.id in shares else None,
            share_leases=shares[b.id][1] if b.id in shares else None,
        )
        for b in rows
        # A zero budget only says that this host wants some (`budget_sizing.fair_share`):
        # nothing to spend.
        if b.bytes or b.leases
    ]
    return Delegation(server_time=now, reservations=reservations, budgets=budgets)


def has_any(conn: Connection, host_id: int) -> bool:
    """Does the host hold a reservation or a budget (its heartbeat reply then says what)?"""
    for model in (Reservation, Budget):
        if conn.execute(select(model.id).where(model.host_id == host_id).limit(1)).first():
            return True
    return False


# --- delegate: the agent's refill and give-back --------------------------------------------


def delegate(
    ledger: Ledger,
    host_name: str,
    req: DelegationRequest,
    actor: str,
    policy: DelegationPolicy = DEFAULT_POLICY,
) -> Delegation:
    """Give back, reserve and set budgets for a host in one transaction; its delegation."""
    request_id = req.request_id

    def attempt() -> Delegation:
        try:
            with ledger.write_conn() as conn:
                host_id = hosts.host_id(ledger, conn, host_name)
                if request_id is not None:
                    stored = agent_requests.recall(conn, host_id, request_id, REQUEST_KIND)
                    if stored is not None:
                        return Delegation.model_validate(stored)
                out = _delegate_once(conn, host_id, host_name, req, actor, policy)
                if request_id is not None:
                    agent_requests.remember(
                        conn, host_id, request_id, REQUEST_KIND, out.model_dump(mode="json")
                    )
                return out
        except IntegrityError as exc:
            # A racing reservation of the same bytes met PostgreSQL's exclusion
            # constraint, or a racing retry of the same request id committed first.
            words = str(exc.orig)
            if (
                "ex_reservations_no_overlap" not in words
                and "uq_budgets_tenant_host" not in words
                and "budgets.tenant_id" not in words
                and not agent_requests.is_duplicate(exc)
            ):
                raise
            raise transitions.LostRace("constraint") from exc

    # As grants: one poold's requests for one host take turns (poold/ledger/leases.py).
    with ledger.host_lock(host_name):
        return transitions.retrying(attempt, what=f"delegation to {host_name}")


def _delegate_once(
    conn: Connection,
    host_id: int,
    host_name: str,
    req: DelegationRequest,
    actor: str,
    policy: DelegationPolicy,
) -> Delegation:
    now = utcnow()
    expires_at = now + timedelta(seconds=policy.ttl_s)
    if req.give_back:
        _give_back(conn, host_id, host_name, req.give_back, actor, now)
    status, host_generation = conn.execute(
        select(Host.status, Host.generation).where(Host.id == host_id)
    ).one()
    if req.reserve and status != "draining":
        # The host first, as a grant swaps it: a drain committing meanwhile is noticed.
        transitions.swap_or_rerun(conn, Host, host_id, int(host_generation))
        _reserve(conn, host_id, host_name, req, actor, now, expires_at, policy)
    uses = budget_sizing.set_budgets(
        conn,
        host_id,
        host_name,
        [budget_sizing.Want(w.tenant, w.bytes, w.leases) for w in req.budgets],
        now,
        expires_at,
    )
    return host_delegation(conn, host_id, now, uses)


def _give_back(
    conn: Connection,
    host_id: int,
    host_name: str,
    ids: Sequence[str],
    actor: str,
    now: datetime,
) -> None:
    rows = {
        r.id: r
        for r in conn.execute(
            select(Reservation.id, Reservation.host_id, Reservation.device_id, Reservation.state)
            .where(Reservation.id.in_(sorted(set(ids))))
            .with_for_update()
        )
    }
    for rid in sorted(set(ids)):
        row = rows.get(rid)
        if row is None:
            if _was_returned(conn, rid, host_id):
                continue  # poold returned it already (drain, expiry, pressure): nothing to do
            raise UnknownReservation(f"no reservation {rid!r}", reservation_id=rid)
        if row.host_id != host_id:
            raise NotOwner(f"reservation {rid} is not held by host {host_name!r}")
        inside = _leases_inside(conn, rid)
        if inside and row.state != HELD:
            # Asked back or returning already: its TTL is over now, so the reaper drops
            # it once its last lease ends.
            conn.execute(update(Reservation).where(Reservation.id == rid).values(expires_at=now))
            continue
        if inside:
            raise ReservationInUse(
                f"reservation {rid} still has {len(inside)} live lease(s) in it",
                reservation_id=rid,
                lease_ids=inside[:20],
            )
        drop(conn, rid, host_id, row.device_id, actor, now, "given back")


def _was_returned(conn: Connection, reservation_id: str, host_id: int) -> bool:
    """Did this host hold the reservation once (its return event is in the journal)? The
    agent may give back what poold already returned: the reply told it too late."""
    return (
        conn.execute(
            select(Event.id)
            .where(
                Event.kind == "reservation.return",
                Event.host_id == host_id,
                Event.detail["reservation_id"].as_string() == reservation_id,
            )
            .limit(1)
        ).first()
        is not None
    )


def _leases_inside(conn: Connection, reservation_id: str) -> list[str]:
    return list(
        conn.execute(
            select(Lease.id).where(Lease.reservation_id == reservation_id, _LIVE_SQL).limit(100)
        ).scalars()
    )


def drop(
    conn: Connection,
    reservation_id: str,
    host_id: int,
    device_id: int,
    actor: str,
    now: datetime,
    reason: str,
) -> None:
    """The reservation goes, its return journalled (`_was_returned` reads that event)."""
    conn.execute(delete(Reservation).where(Reservation.id == reservation_id))
    transitions.record(
        conn,
        event_row(
            at=now,
            actor=actor,
            kind="reservation.return",
            host_id=host_id,
            device_id=device_id,
            reason=reason,
            detail={"reservation_id": reservation_id},
        ),
    )


def _reserve(
    conn: Connection,
    host_id: int,
    host_name: str,
    req: DelegationRequest,
    actor: str,
    now: datetime,
    expires_at: datetime,
    policy: DelegationPolicy,
) -> None:
    """Place each wanted reservation with the grants' placement code, each capped."""
    found, paths = granting.candidates(conn, host_id)
    # Whole-only devices (static dax regions) can only be leased whole: never reserved.
    candidates = {c.device_id: c for c in found if not c.whole_only}
    by_uid = {paths[c]["uid"]: c for c in candidates}
    # The cap is of each device's free bytes as this request found them.
    cap_left = {
        d: extents.align_down(
            max(
                0,
                min(
                    int(extents.free_bytes(c.capacity_bytes, c.used) * policy.cap_fraction),
                    extents.free_bytes(c.capacity_bytes, c.used)
                    - math.ceil(c.capacity_bytes * policy.keep_free_fraction),
                ),
            ),
            c.alignment_bytes,
        )
        for d, c in candidates.items()
    }
    for want in req.reserve:
        pool = list(candidates.values())
        if want.device_uid is not None:
            if want.device_uid not in by_uid:
                _refuse_device(conn, want.device_uid, host_name)
            pool = [candidates[by_uid[want.device_uid]]]
        choice = _place_capped(want.bytes, want.media, pool, cap_left)
        if choice is None:
            continue  # nothing to spare now: the agent's requests take the central path
        dev, ext = choice.candidate, choice.extent
        seen = dev.generation
        # Past the epoch block in one swap: the block's epochs are this reservation's.
        moved = conn.execute(
            update(Device)
            .where(Device.id == dev.device_id, Device.generation == seen)
            .values(generation=seen + EPOCH_BLOCK)
        ).rowcount
        if moved != 1:
            raise transitions.LostRace("devices")
        rid = str(uuid.uuid4())
        conn.execute(
            insert(Reservation),
            {
                "id": rid,
                "host_id": host_id,
                "device_id": dev.device_id,
                "offset_bytes": ext.offset,
                "length_bytes": ext.length,
                "epoch_base": seen + 1,
                "state": HELD,
                "created_at": now,
                "expires_at": expires_at,
            },
        )
        transitions.record(
            conn,
            event_row(
                at=now,
                actor=actor,
                kind="reservation.reserve",
                host_id=host_id,
                device_id=dev.device_id,
                detail={
                    "reservation_id": rid,
                    "offset_bytes": ext.offset,
                    "length_bytes": ext.length,
                    "epoch_base": seen + 1,
                },
            ),
        )
        cap_left[dev.device_id] -= ext.length
        candidates[dev.device_id] = dataclasses.replace(
            dev, used=(*dev.used, ext), generation=seen + EPOCH_BLOCK
        )


def _refuse_device(conn: Connection, uid: str, host_name: str) -> None:
    if conn.execute(select(Device.id).where(Device.uid == uid)).first() is None:
        raise UnknownDevice(f"no device with uid {uid!r}", uid=uid)
    raise NotOwner(f"host {host_name!r} does not reach device {uid!r} (or it is whole-only)")


def _place_capped(
    want_bytes: int,
    media: str | None,
    pool: Sequence[placement.Candidate],
    cap_left: dict[int, int],
) -> placement.Choice | None:
    """The grants' placement for `want_bytes`, else for the most any device's cap allows."""
    eligible = placement.eligible(placement.Request(size_bytes=want_bytes, media=media), pool)
    room = {
        c.device_id: min(
            cap_left[c.device_id],
            extents.largest_free(c.capacity_bytes, c.alignment_bytes, c.used),
        )
        for c in eligible
    }
    sizes = [want_bytes]
    smaller = max(room.values(), default=0)
    if 0 < smaller < want_bytes:
        sizes.append(smaller)
    for size in sizes:
        fits = [
            c for c in eligible if room[c.device_id] >= extents.align_up(size, c.alignment_bytes)
        ]
        if not fits:
            continue
        choice = placement.place(placement.Request(size_bytes=size, media=media), fits)
        if isinstance(choice, placement.Choice):
            return choice
    return None
