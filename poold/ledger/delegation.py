"""What is delegated to which host: its reservations of device extents and its tenants'
budgets, which its agent spends alone (DESIGN.md "Delegated capacity").

* `delegate` (`POST /v1/agent/delegation`): give back reservations, reserve more, set
  budgets, in one transaction; idempotent by request id; the reply is the host's whole
  delegation. Reservations are placed with the pure placement/extent code grants use,
  on devices the host reaches, around every lease, reservation, reserved and
  quarantined range, under the device-generation swap, which moves the device's
  generation past an epoch block (`EPOCH_BLOCK`): the reservation's local leases take
  epochs from that block, every later grant of those bytes a larger one.
* Budgets: a tenant's quota use is its central leases plus, per host, the larger of its
  budget and its local leases there (`granting.quota_use`); a budget is set under the
  tenant's generation swap, so it and a racing central grant cannot both pass. Raised
  at most to a fair share when other hosts of the tenant want some (`_set_budget`);
  lowered only by its agent, a quota cut (`claw_back`), or a central grant of the same
  host, which spends it (poold/ledger/budgets.py `spend_for_central`); raised by a
  local grant committed past it while the quota has room (`budgets.fit_local_grant`).
* `renew` (each heartbeat): held reservations and budgets live on for the TTL; a
  reservation on a device that is no longer online, or of a draining host, is returned
  (`return_unleased`). `claw_back`: a quota lowered below what is delegated.
* `reap` (the reaper): expired reservations with no lease inside go; one with leases
  inside stays, taking no new lease, until they end. Expired budgets go.

Reservation states: "held" (renewed, takes local grants), "returning" (its TTL passed,
its device or host drains, or `audit --reclaim` found its host down: it takes no new
lease and goes when its agent gives it back, or once its TTL has passed with no live
lease in it; a local grant its agent made before it heard is still committed into it)
and "recalled" (asked back under pressure, `recall`: goes when its agent gives it back,
or at its TTL).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from poold import extents, placement
from poold.errors import (
    NotOwner,
    ReservationInUse,
    UnknownDevice,
    UnknownReservation,
    UnknownTenant,
)
from poold.extents import Extent
from poold.lease_states import LIVE_STATES_SQL
from poold.ledger import agent_requests, granting, leases, transitions
from poold.ledger.db import Ledger
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


@dataclass(frozen=True)
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


def host_delegation(conn: Connection, host_id: int, now: datetime) -> Delegation:
    """What the host holds now: its held reservations and its budgets."""
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
        for r in conn.execute(
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
            .where(Reservation.host_id == host_id, Reservation.state == HELD)
            .order_by(Device.uid, Reservation.offset_bytes)
        )
    ]
    rows = conn.execute(
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
        )
        .join(Tenant, Tenant.id == Budget.tenant_id)
        .where(Budget.host_id == host_id)
        .order_by(Tenant.name)
    ).all()
    shares = _shares(conn, host_id, rows)
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
        # A zero budget only says that this host wants some (`fair_share`): nothing to spend.
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
                host_id = leases._host_id(ledger, conn, host_name)
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
            raise transitions.LostRace from exc

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
        if not transitions.compare_and_bump(conn, Host, host_id, int(host_generation)):
            raise transitions.LostRace
        _reserve(conn, host_id, host_name, req, actor, now, expires_at, policy)
    for want in sorted(req.budgets, key=lambda w: w.tenant):  # tenants swapped in one order
        _set_budget(conn, host_id, host_name, want.tenant, want.bytes, want.leases, now, expires_at)
    return host_delegation(conn, host_id, now)


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
    freed: set[int] = set()
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
        _drop(conn, rid, host_id, row.device_id, actor, now, "given back")
        freed.add(row.device_id)
    for device_id in sorted(freed):  # freed bytes change what the allocator may hand out
        transitions.bump(conn, Device, device_id)


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


def _drop(
    conn: Connection,
    reservation_id: str,
    host_id: int,
    device_id: int,
    actor: str,
    now: datetime,
    reason: str,
) -> None:
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
            raise transitions.LostRace
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


# --- budgets -----------------------------------------------------------------------------

_TENANT = select(
    Tenant.id,
    Tenant.name,
    Tenant.quota_bytes,
    Tenant.quota_leases,
    Tenant.allowed_hosts,
    Tenant.generation,
).where(Tenant.name == bindparam("name"))


def fair_share(quota: int, central: int, hosts: int) -> int:
    """One host's fair share of what a tenant's central leases leave of its quota, among
    the `hosts` that hold (or asked for) a budget of it."""
    return max(0, math.ceil((quota - central) / max(1, hosts)))


def _set_budget(
    conn: Connection,
    host_id: int,
    host_name: str,
    tenant_name: str,
    want_bytes: int,
    want_leases: int,
    now: datetime,
    expires_at: datetime,
) -> None:
    """The tenant's budget on this host: what it asks, as far as its quota allows, and no
    more than a fair share when other hosts of the tenant want some too.

    The rule (docs/design-changes.md "Budgets that never starve"):
    * raised to at most min(want, what the quota leaves, max(fair share, local use
      here)), where the fair share is `fair_share` over the hosts holding a budget row of
      the tenant (a host that asked and got nothing keeps a zero row: it wants some);
    * never lowered below min(old, want): the agent may be spending up to what it last
      held, and it lowered its own view to `want` before it asked (agent/delegation.py),
      so only the agent lowers its budget (a quota cut: `claw_back`; a central grant of
      this host: `spend_for_central`). A host holding more than its share hears it
      (`Budget.share_bytes`) and asks less next time.
    """
    tenant = conn.execute(_TENANT, {"name": tenant_name}).one_or_none()
    if tenant is None:
        raise UnknownTenant(f"no tenant named {tenant_name!r}", tenant=tenant_name)
    if tenant.allowed_hosts and host_name not in tenant.allowed_hosts:
        raise NotOwner(f"tenant {tenant_name!r} may not lease on host {host_name!r}")
    use = granting.quota_use(conn, tenant.id)
    old = use.budgets.get(host_id)
    hosts = len(set(use.budgets) | {host_id})
    local_bytes, local_leases = use.local.get(host_id, (0, 0))
    if hosts > 1:
        fair_bytes = fair_share(tenant.quota_bytes, use.central_bytes, hosts)
        fair_leases = fair_share(tenant.quota_leases, use.central_leases, hosts)
    else:
        fair_bytes, fair_leases = tenant.quota_bytes, tenant.quota_leases
    cap_bytes = min(tenant.quota_bytes - use.bytes(skip_host=host_id), max(fair_bytes, local_bytes))
    cap_leases = min(
        tenant.quota_leases - use.leases(skip_host=host_id), max(fair_leases, local_leases)
    )
    new_bytes = max(0, min(want_bytes, cap_bytes))
    new_leases = max(0, min(want_leases, cap_leases))
    if old is not None:
        new_bytes = max(new_bytes, min(old[0], want_bytes))
        new_leases = max(new_leases, min(old[1], want_leases))
    if old == (new_bytes, new_leases):
        _renew_budget(conn, tenant.id, host_id, expires_at)
        return
    if not transitions.compare_and_bump(conn, Tenant, tenant.id, tenant.generation):
        raise transitions.LostRace
    if want_bytes == 0 and want_leases == 0:
        conn.execute(delete(Budget).where(Budget.tenant_id == tenant.id, Budget.host_id == host_id))
    elif old is None:
        conn.execute(
            insert(Budget),
            {
                "tenant_id": tenant.id,
                "host_id": host_id,
                "bytes": new_bytes,
                "leases": new_leases,
                "created_at": now,
                "expires_at": expires_at,
            },
        )
    else:
        conn.execute(
            update(Budget)
            .where(Budget.tenant_id == tenant.id, Budget.host_id == host_id)
            .values(bytes=new_bytes, leases=new_leases, expires_at=expires_at)
        )


def _shares(conn: Connection, host_id: int, rows: Sequence[Any]) -> dict[int, tuple[int, int]]:
    """Per tenant id: the fair share of this host, where it holds more than that while
    other hosts hold (or asked for) a budget of the same tenant."""
    if not rows:
        return {}
    ids = [r.id for r in rows]
    hosts = dict(
        conn.execute(
            select(Budget.tenant_id, func.count(Budget.id))
            .where(Budget.tenant_id.in_(ids))
            .group_by(Budget.tenant_id)
        ).all()
    )
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        n = int(hosts.get(r.id, 1))
        if n <= 1:
            continue
        use = granting.quota_use(conn, r.id)
        share = (
            fair_share(r.quota_bytes, use.central_bytes, n),
            fair_share(r.quota_leases, use.central_leases, n),
        )
        if r.bytes > share[0] or r.leases > share[1]:
            out[r.id] = share
    return out


def _renew_budget(conn: Connection, tenant_id: int, host_id: int, expires_at: datetime) -> None:
    conn.execute(
        update(Budget)
        .where(Budget.tenant_id == tenant_id, Budget.host_id == host_id)
        .values(expires_at=expires_at)
    )


def claw_back(conn: Connection, tenant_id: int) -> None:
    """Reduce the tenant's budgets until its quota use fits its quota again (a quota was
    lowered); agents learn it from their next reply.

    First down to the fair share of the new quota (`fair_share`), the hosts holding the
    most above it first, then, if still over, down to what each host granted as poold
    knows it. A budget never goes below its host's committed local use; and a host that
    had granted no more than its fair share keeps room for it, though poold may not have
    heard of those grants yet (their commit is then within its budget, or, past it, within
    the quota: local_commit.py `commit`)."""
    tenant = conn.execute(
        select(Tenant.quota_bytes, Tenant.quota_leases).where(Tenant.id == tenant_id)
    ).one()
    use = granting.quota_use(conn, tenant_id)
    over_bytes = use.bytes() - tenant.quota_bytes
    over_leases = use.leases() - tenant.quota_leases
    if over_bytes <= 0 and over_leases <= 0:
        return
    budgets = dict(use.budgets)
    n = max(1, len(budgets))
    fair = (
        fair_share(tenant.quota_bytes, use.central_bytes, n),
        fair_share(tenant.quota_leases, use.central_leases, n),
    )
    for i, over in ((0, over_bytes), (1, over_leases)):
        committed = {h: use.local.get(h, (0, 0))[i] for h in budgets}
        for floors in ({h: max(fair[i], c) for h, c in committed.items()}, committed):
            for host in sorted(budgets, key=lambda h: floors[h] - budgets[h][i]):
                if over <= 0:
                    break
                cur = list(budgets[host])
                give = min(over, max(0, cur[i] - floors[host]))
                cur[i] -= give
                over -= give
                budgets[host] = (cur[0], cur[1])
    for host, (nbytes, nleases) in budgets.items():
        if (nbytes, nleases) != use.budgets[host]:
            conn.execute(
                update(Budget)
                .where(Budget.tenant_id == tenant_id, Budget.host_id == host)
                .values(bytes=nbytes, leases=nleases)
            )
            transitions.record(
                conn,
                event_row(
                    actor="poold",
                    kind="budget.clawback",
                    tenant_id=tenant_id,
                    host_id=host,
                    reason="quota lowered below what is delegated",
                    detail={"bytes": nbytes, "leases": nleases},
                ),
            )


# --- renewal, drain, expiry ------------------------------------------------------------------


def return_unleased(
    conn: Connection,
    actor: str,
    reason: str,
    *,
    device_id: int | None = None,
    host_id: int | None = None,
    expired_before: datetime | None = None,
    reservation_ids: Sequence[str] | None = None,
    drop_empty: bool = False,
) -> int:
    """Return the matching reservations: each becomes `returning` (listed to its agent no
    more, so it takes no new local lease); how many went.

    One goes only when its agent gives it back or its TTL has passed (`drop_empty`, the
    reaper and `audit --reclaim`) with no live lease inside: a reservation with no lease
    poold knows of may still hold a local lease its agent granted before it heard, whose
    local_grant is on its way (a drain used to drop it, and that commit was refused
    `unknown_reservation`)."""
    where: list[Any] = []
    if device_id is not None:
        where.append(Reservation.device_id == device_id)
    if host_id is not None:
        where.append(Reservation.host_id == host_id)
    if expired_before is not None:
        where.append(Reservation.expires_at <= expired_before)
    if reservation_ids is not None:
        where.append(Reservation.id.in_(list(reservation_ids)))
    rows = conn.execute(
        select(Reservation.id, Reservation.host_id, Reservation.device_id, Reservation.state)
        .where(*where)
        .order_by(Reservation.id)
        .with_for_update()
    ).all()
    if not rows:
        return 0
    now = utcnow()
    busy = set(
        conn.execute(
            select(Lease.reservation_id)
            .where(Lease.reservation_id.in_([r.id for r in rows]), _LIVE_SQL)
            .distinct()
        ).scalars()
    )
    freed: set[int] = set()
    for r in rows:
        if r.id in busy or not drop_empty:
            if r.state != RETURNING:
                conn.execute(
                    update(Reservation).where(Reservation.id == r.id).values(state=RETURNING)
                )
            continue
        _drop(conn, r.id, r.host_id, r.device_id, actor, now, reason)
        freed.add(r.device_id)
    for dev in sorted(freed):
        transitions.bump(conn, Device, dev)
    return len([r for r in rows if r.id not in busy]) if drop_empty else 0


def recall(conn: Connection, reservation_ids: Sequence[str], actor: str, reason: str) -> list[str]:
    """Ask held reservations back (pressure): each with no live lease inside becomes
    `recalled` (the others are left alone); the ids recalled, with an event each.

    Not dropped here: its agent may have granted inside it a lease poold has not heard
    of yet. The heartbeat reply's delegation omits it, so the agent grants no more there
    and gives it back (`delegate` give_back) once no local lease of its lies inside; its
    bytes are free then. If the agent never does, its TTL returns it (it is not renewed).
    """
    if not reservation_ids:
        return []
    rows = conn.execute(
        select(Reservation.id, Reservation.host_id, Reservation.device_id)
        .where(
            Reservation.id.in_(sorted(set(reservation_ids))),
            Reservation.state == HELD,
            ~select(Lease.id).where(Lease.reservation_id == Reservation.id, _LIVE_SQL).exists(),
        )
        .order_by(Reservation.id)
        .with_for_update()
    ).all()
    now = utcnow()
    for r in rows:
        conn.execute(update(Reservation).where(Reservation.id == r.id).values(state=RECALLED))
        transitions.record(
            conn,
            event_row(
                at=now,
                actor=actor,
                kind="reservation.recall",
                host_id=r.host_id,
                device_id=r.device_id,
                reason=reason,
                detail={"reservation_id": r.id},
            ),
        )
    return [r.id for r in rows]


def renew(
    conn: Connection, host_id: int, host_status: str, now: datetime, policy: DelegationPolicy
) -> None:
    """A heartbeat: the host's held reservations on online devices and its budgets live on
    for the TTL; reservations of a draining host or on a device no longer online are
    returned (kept `returning` while leases lie in them)."""
    expires_at = now + timedelta(seconds=policy.ttl_s)
    not_online = select(Device.id).where(Device.state != "online").scalar_subquery()
    if host_status == "draining":
        return_unleased(conn, "poold", "host draining", host_id=host_id)
    else:
        stale = list(
            conn.execute(
                select(Reservation.id).where(
                    Reservation.host_id == host_id,
                    Reservation.device_id.in_(not_online),
                )
            ).scalars()
        )
        if stale:
            return_unleased(conn, "poold", "device not online", reservation_ids=stale)
        conn.execute(
            update(Reservation)
            .where(
                Reservation.host_id == host_id,
                Reservation.state == HELD,
                Reservation.device_id.not_in(not_online),
            )
            .values(expires_at=expires_at)
        )
    conn.execute(update(Budget).where(Budget.host_id == host_id).values(expires_at=expires_at))


def reap(conn: Connection, now: datetime) -> int:
    """Expired reservations and budgets: how many went (reservations with leases inside
    stay, `returning`, until those end; a returning one whose leases ended goes too).

    Only those whose host has spoken since they expired: an agent cut off from poold
    keeps granting until the TTL and commits afterwards, so what it held must still be
    there when it comes back (a host that never does: `poolctl audit --reclaim`).
    """
    expired = list(
        conn.execute(
            select(Reservation.id)
            .join(Host, Host.id == Reservation.host_id)
            .where(
                Reservation.expires_at <= now,
                Host.last_heartbeat_at.is_not(None),
                Host.last_heartbeat_at >= Reservation.expires_at,
            )
        ).scalars()
    )
    gone = 0
    if expired:
        # A returning one too: not renewed, it goes here once its last lease has ended.
        gone += return_unleased(
            conn, "poold", "ttl passed without renewal", reservation_ids=expired, drop_empty=True
        )
    stale_budgets = list(
        conn.execute(
            select(Budget.id)
            .join(Host, Host.id == Budget.host_id)
            .where(
                Budget.expires_at <= now,
                Host.last_heartbeat_at.is_not(None),
                Host.last_heartbeat_at >= Budget.expires_at,
            )
        ).scalars()
    )
    if stale_budgets:
        conn.execute(delete(Budget).where(Budget.id.in_(stale_budgets)))
    return gone + len(stale_budgets)


def reap_expired(ledger: Ledger, now: datetime | None = None) -> int:
    """`reap` in a transaction of its own."""

    def attempt() -> int:
        with ledger.write_conn() as conn:
            return reap(conn, now or utcnow())

    return transitions.retrying(attempt, what="delegation expiry")


def unleased_by_reservation(conn: Connection) -> dict[str, int]:
    """Each reservation's bytes no live lease lies in (reserved-but-unleased)."""
    out: dict[str, int] = {}
    inside: dict[str, list[Extent]] = defaultdict(list)
    for rid, offset, length in conn.execute(
        select(Lease.reservation_id, Lease.offset_bytes, Lease.length_bytes).where(
            Lease.reservation_id.is_not(None), _LIVE_SQL
        )
    ):
        inside[str(rid)].append(Extent(offset, length))
    for rid, offset, length in conn.execute(
        select(Reservation.id, Reservation.offset_bytes, Reservation.length_bytes)
    ):
        shifted = [Extent(e.offset - offset, e.length) for e in inside.get(rid, [])]
        out[rid] = extents.free_bytes(length, shifted)
    return out


def return_for_audit(ledger: Ledger, items: Sequence[Any], actor: str) -> int:
    """`poolctl audit --reclaim`: return the reservations of down hosts it found (each
    `AuditItem` of kind reservation_of_down_host), marking what was done; how many went."""
    todo = [it for it in items if it.kind == "reservation_of_down_host" and it.reservation_id]
    if not todo:
        return 0

    def attempt() -> int:
        with ledger.write_conn() as conn:
            # Still down and still without a lease inside: return_unleased re-checks leases.
            down = select(Host.id).where(Host.status == "down").scalar_subquery()
            ids = list(
                conn.execute(
                    select(Reservation.id).where(
                        Reservation.id.in_([it.reservation_id for it in todo]),
                        Reservation.host_id.in_(down),
                    )
                ).scalars()
            )
            if not ids:
                return 0
            return return_unleased(
                conn, actor, "audit: its host is down", reservation_ids=ids, drop_empty=True
            )

    went = transitions.retrying(attempt, what="returning reservations of down hosts")
    for it in todo:
        it.action = "returned" if went else "lost_race"
    return went
