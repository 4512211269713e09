"""How much of a tenant's quota do hosts' budgets leave for central grants, and when
does that change (its *central room*)?

Budgets split a tenant's quota across its hosts, and quota use counts each budget whole
whether its host has spent it or not (poold/ledger/budgets.py `QuotaUse`). For a tenant
whose quota is small against its leases (three leases, 48 MiB, asked for 32 MiB at a
time from four hosts) that split is a refusal: each host's fair share is too small for
the lease, so it goes central, where the other hosts' unspent budgets fill the quota and
the tenant, holding nothing, hears `quota_exceeded`. poold cannot take a budget back on
the spot (its agent may have granted into it without poold having heard yet), so it
keeps the room for next time: the central grant refused only because of unspent
budgets (`blocked_by_budgets`) notes its size on the tenant (`note`), and for
`ROOM_S` after, budgets are sized from the quota less that room and one lease
(`kept`; poold/ledger/budget_sizing.py), and hosts holding more hear the smaller share
(told at once through poold/ledger/news.py) and give it back (their agents ask for less
on their next delegation step). A central grant of that size renews the room (`renew`);
unused, it lapses, and budgets grow again.

The room only ever makes budgets smaller, so it never weakens the quota invariant; a
racing delegate call that sized a budget before a note is corrected by the shares it
hears next. Its own module: the grant paths note and renew it, budget sizing reads it,
and neither imports the other for it.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Connection, bindparam, select, update

from poold.errors import PoolError
from poold.ledger import news, transitions
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Tenant
from poold.ledger.transitions import event_row
from poold.ledger.types import utcnow

log = logging.getLogger(__name__)

# How long a noted room keeps budgets smaller: as long as a budget's TTL, so a tenant
# that asks big leases every few minutes keeps it without a refusal each time.
ROOM_S: Final = 600.0
_ROOM = timedelta(seconds=ROOM_S)

# Read under the row's lock (PostgreSQL): two notes at once keep the larger room.
_ROOM_OF = (
    select(Tenant.quota_bytes, Tenant.central_room_bytes, Tenant.central_room_until)
    .where(Tenant.id == bindparam("tenant_id"))
    .with_for_update()
)
# The generation moves too: a delegate call that read the tenant before this sized its
# budgets without the room, and its swap now fails, so it runs again and sees it.
_SET_ROOM = (
    update(Tenant)
    .where(Tenant.id == bindparam("tenant_id"))
    .values(
        central_room_bytes=bindparam("room_bytes"),
        central_room_until=bindparam("until"),
        generation=Tenant.generation + 1,
    )
)
_BUDGET_HOSTS = select(Budget.host_id).where(
    Budget.tenant_id == bindparam("tenant_id"), (Budget.bytes > 0) | (Budget.leases > 0)
)
_RENEW_ROOM = (
    update(Tenant)
    .where(Tenant.id == bindparam("tenant_id"))
    .values(central_room_until=bindparam("until"))
)


def kept(tenant: Any, now: datetime) -> tuple[int, int]:
    """(bytes, leases) of the tenant's quota that budgets leave alone now: its room and
    one lease while the room lasts, (0, 0) otherwise; the whole quota when the room is
    more than half of it (what budgets could still hold is smaller than the tenant's
    leases: its grants are the central path's, which counts exactly). ``tenant``: a row
    with the quota and room columns."""
    until = tenant.central_room_until
    if until is None or until <= now or not tenant.central_room_bytes:
        return 0, 0
    quota_bytes, quota_leases = int(tenant.quota_bytes), int(tenant.quota_leases)
    room = int(tenant.central_room_bytes)
    if 2 * room > quota_bytes:
        return quota_bytes, quota_leases
    return room, min(1, quota_leases)


def covered(tenant: Any, length_bytes: int, now: datetime) -> bool:
    """Does the tenant's running room (``tenant``: its row) already cover a refused
    grant of ``length_bytes``, with more than half its time left? Then noting it again
    would write nothing new (the refusals until its hosts have given back)."""
    until = tenant.central_room_until
    return (
        until is not None
        and until - now > _ROOM / 2
        and int(tenant.central_room_bytes) >= length_bytes
    )


def grown(was: int, length_bytes: int, quota_bytes: int) -> int:
    """The room after a refusal of ``length_bytes`` (``was``: the running room, 0 for
    none): that size at first; past the running room, at least double it, so that a
    tenant asking ever larger leases grows it (and wakes its hosts) a few times, not
    once per alignment step; never past the quota."""
    if length_bytes <= was:
        return was
    return min(quota_bytes, max(length_bytes, 2 * was))


def blocked_by_budgets(
    use: QuotaUse,
    quota_bytes: int,
    quota_leases: int,
    length_bytes: int,
    host_id: int,
    reported: tuple[int, int] | None = None,
) -> bool:
    """Would a central grant of ``length_bytes`` that the quota refuses fit, were every
    host's budget no more than what its host has leased (``reported``: the asking host's
    own count of its local leases, those poold has not heard of included)? Pure."""
    local = dict(use.local)
    if reported is not None:
        mine = local.get(host_id, (0, 0))
        local[host_id] = (max(mine[0], reported[0]), max(mine[1], reported[1]))
    leased_bytes = use.central_bytes + sum(b for b, _ in local.values())
    leased = use.central_leases + sum(n for _, n in local.values())
    return leased_bytes + length_bytes <= quota_bytes and leased + 1 <= quota_leases


def note(ledger: Ledger, tenant_id: int, length_bytes: int, actor: str) -> None:
    """A central grant of ``length_bytes`` was refused only because of the tenant's
    unspent budgets: keep that much room (the larger of it and a room still running)
    for ``ROOM_S``; a room that grew is a `budget.room` event. Its own short
    transaction, after the refusal's; a failure here (the ledger down) is logged and
    the refusal stands."""
    now = utcnow()
    try:
        with ledger.write_conn() as conn:
            row = conn.execute(_ROOM_OF, {"tenant_id": tenant_id}).one_or_none()
            if row is None or covered(row, length_bytes, now):
                return  # kept already (a note at the same time)
            until = row.central_room_until
            running = until is not None and until > now
            was = int(row.central_room_bytes) if running else 0
            room = grown(was, length_bytes, int(row.quota_bytes))
            conn.execute(
                _SET_ROOM, {"tenant_id": tenant_id, "room_bytes": room, "until": now + _ROOM}
            )
            if room > was:
                # Their agents heartbeat now and hear their smaller shares in the reply,
                # rather than at their next heartbeat (once per room that grew: a
                # heartbeat costs poold more than a refusal).
                hosts = conn.execute(_BUDGET_HOSTS, {"tenant_id": tenant_id}).scalars().all()
                news.tell(conn, hosts)
                transitions.record(
                    conn,
                    event_row(
                        at=now,
                        actor=actor,
                        kind="budget.room",
                        tenant_id=tenant_id,
                        reason="a central grant was refused for hosts' unspent budgets",
                        detail={
                            "room_bytes": room,
                            "until": (now + _ROOM).isoformat(),
                            "hosts_told": len(hosts),
                        },
                    ),
                )
    except Exception as err:  # the refusal stands whatever became of the room
        why = err.message if isinstance(err, PoolError) else f"{type(err).__name__}: {err}"
        log.warning("could not keep central room for tenant %d: %s", tenant_id, why)


def renew(conn: Connection, tenant: Any, length_bytes: int, now: datetime) -> None:
    """A central grant of ``length_bytes`` for the tenant (``tenant``: its row): one of
    the size its room is for (at least half of it) keeps the room from lapsing. Writes
    only past half the room's time, so a tenant's grants write it once in minutes. Runs
    after the grant's generation swaps (the tenant row is locked last, as they lock
    it)."""
    if not kept(tenant, now)[0] or length_bytes * 2 < int(tenant.central_room_bytes):
        return
    if tenant.central_room_until - now > _ROOM / 2:
        return
    conn.execute(_RENEW_ROOM, {"tenant_id": tenant.id, "until": now + _ROOM})
