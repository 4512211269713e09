"""How long what is delegated lives, and how it is taken back: each heartbeat renews a
host's held reservations and budgets for the TTL (`renew`); a drain, a device no longer
online or a TTL passed returns reservations (`return_unleased`); pressure recalls them
(`recall`); the reaper drops expired ones and budgets (`reap`, `reap_expired`);
`poolctl audit --reclaim` returns those of down hosts (`return_for_audit`). Also the
bytes of each reservation no lease lies in (`unleased_by_reservation`, for capacity and
metrics).

Its own module because these are poold's own moves on a delegation, driven by the
heartbeat, the reaper, drains and audits, apart from the agent's refill and give-back
(poold/ledger/delegation.py, whose reservation states and `drop` it uses). A reservation
with no lease poold knows of may still hold a local lease its agent granted before it
heard, so these return (`returning`, `recalled`) rather than drop, but for the reaper.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, select, text, update

from poold import extents
from poold.extents import Extent
from poold.lease_states import LIVE_STATES_SQL
from poold.ledger import delegation, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Device, Host, Lease, Reservation
from poold.ledger.transitions import event_row
from poold.ledger.types import utcnow

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")


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
    for r in rows:
        if r.id in busy or not drop_empty:
            if r.state != delegation.RETURNING:
                conn.execute(
                    update(Reservation)
                    .where(Reservation.id == r.id)
                    .values(state=delegation.RETURNING)
                )
            continue
        delegation.drop(conn, r.id, r.host_id, r.device_id, actor, now, reason)
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
            Reservation.state == delegation.HELD,
            ~select(Lease.id).where(Lease.reservation_id == Reservation.id, _LIVE_SQL).exists(),
        )
        .order_by(Reservation.id)
        .with_for_update()
    ).all()
    now = utcnow()
    for r in rows:
        conn.execute(
            update(Reservation).where(Reservation.id == r.id).values(state=delegation.RECALLED)
        )
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
    conn: Connection,
    host_id: int,
    host_status: str,
    now: datetime,
    policy: delegation.DelegationPolicy,
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
                Reservation.state == delegation.HELD,
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
