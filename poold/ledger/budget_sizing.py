"""How big a host's budget of a tenant may be: what `delegate` sets when its agent asks
(`set_budgets`: as far as the quota allows, at most a fair share when other hosts of the
tenant want some), the share a host holding more is told of (`shares`), and a quota cut
taking budgets back (`claw_back`). "The quota" here is the quota less the tenant's
central room while it runs (poold/ledger/central_room.py `kept`).

A tenant's quota use is its central leases plus, per host, the larger of its budget and
its local leases there (`granting.quota_use`); a budget is set under the tenant's
generation swap, so it and a racing central grant cannot both pass. A budget is lowered
only by its agent, a quota cut (`claw_back`), or a central grant of the same host, which
spends it (poold/ledger/budgets.py `spend_for_central`); raised by a local grant
committed past it while the quota has room (`budgets.fit_local_grant`).

Its own module because sizing a budget is a question of quota arithmetic, apart from
placing reservations (poold/ledger/delegation.py, which calls `set_budgets` and `shares`)
and from the grants' budget moves (poold/ledger/budgets.py). It imports neither
delegation nor leases (only granting and transitions), so it adds no import circle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, update

from poold.errors import NotOwner, UnknownTenant
from poold.ledger import central_room, granting, tenants, transitions
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Prepared, PreparedIn
from poold.ledger.models import Budget, Tenant
from poold.ledger.transitions import event_row

# `set_budgets`' statements, built once: building them per tenant and call cost more
# Python than running them (a delegate call sets dozens).
# (Bound names other than the columns': an UPDATE reserves those for its SET clause.)
_THIS_BUDGET = (
    Budget.tenant_id == bindparam("b_tenant_id"),
    Budget.host_id == bindparam("b_host_id"),
)
_SET_BUDGET = Prepared(
    update(Budget)
    .where(*_THIS_BUDGET)
    .values(
        bytes=bindparam("new_bytes"),
        leases=bindparam("new_leases"),
        expires_at=bindparam("expires_at"),
    )
)
_NEW_BUDGET = Prepared(
    insert(Budget),
    column_keys=("tenant_id", "host_id", "bytes", "leases", "created_at", "expires_at"),
)
_DROP_BUDGET = Prepared(delete(Budget).where(*_THIS_BUDGET))
_RENEW_BUDGETS = PreparedIn(
    lambda member: (
        update(Budget)
        .where(Budget.host_id == bindparam("b_host_id"), member(Budget.tenant_id, "tenant_ids"))
        .values(expires_at=bindparam("expires_at"))
    )
)


@dataclasses.dataclass(frozen=True)
class Want:
    """What a host's agent asks of one tenant's budget there."""

    tenant: str
    bytes: int
    leases: int


def fair_share(quota: int, central: int, hosts: int, *, exact: bool = False) -> int:
    """One host's fair share of what a tenant's central leases leave of its quota, among
    the `hosts` that hold (or asked for) a budget of it. Rounded up, so that a quota
    smaller than its hosts still gives each a lease; ``exact`` (while a central room
    runs): rounded down, so that the shares leave the room whole (rounded up, three
    hosts' shares of two leases were three, and the room's lease was never free)."""
    left = max(0, quota - central)
    n = max(1, hosts)
    return left // n if exact else math.ceil(left / n)


def set_budgets(
    conn: Connection,
    host_id: int,
    host_name: str,
    wants: Sequence[Want],
    now: datetime,
    expires_at: datetime,
) -> dict[int, QuotaUse]:
    """Each tenant's budget on this host: what it asks, as far as its quota allows, and
    no more than a fair share when other hosts of the tenant want some too.

    The rule (docs/design-changes.md "Budgets that never starve"):
    * raised to at most min(want, what the quota leaves, max(fair share, local use
      here)), where the fair share is `fair_share` over the hosts holding a budget row of
      the tenant (a host that asked and got nothing keeps a zero row: it wants some);
    * never lowered below min(old, want): the agent may be spending up to what it last
      held, and it lowered its own view to `want` before it asked (agent/delegation.py),
      so only the agent lowers its budget (a quota cut: `claw_back`; a central grant of
      this host: `spend_for_central`). A host holding more than its share hears it
      (`Budget.share_bytes`) and asks less next time.

    The tenants and their quota use are read in one statement each, whatever their
    number (an agent asks for dozens at once), the tenants under row locks taken in name
    order; the budgets that only live on are renewed in one, after every changed one's
    tenant was swapped. Returns the
    tenants' quota use after it (by id), for the reply's `shares`.
    """
    by_name = {w.tenant: w for w in wants}  # the last want of a tenant named twice
    if not by_name:
        return {}
    # Locked in name order (PostgreSQL), as an op batch locks the tenants it grants to:
    # a batch committing in between no longer makes a swap below fail and the whole
    # delegate run again (it waits for the lock instead).
    named = tenants.by_names(conn, by_name, lock=True)
    for name in sorted(by_name):
        tenant = named.get(name)
        if tenant is None:
            raise UnknownTenant(f"no tenant named {name!r}", tenant=name)
        if tenant.allowed_hosts and host_name not in tenant.allowed_hosts:
            raise NotOwner(f"tenant {name!r} may not lease on host {host_name!r}")
    uses = granting.quota_uses(conn, [t.id for t in named.values()])
    renew: list[int] = []
    swaps: dict[int, int] = {}  # tenant id -> generation read, in name order
    dropped: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    added: list[dict[str, Any]] = []
    for name in sorted(by_name):
        tenant, want = named[name], by_name[name]
        new = _sized(tenant, uses[tenant.id], host_id, want, central_room.kept(tenant, now))
        if new is None:
            renew.append(tenant.id)
            continue
        swaps[tenant.id] = int(tenant.generation)
        new_bytes, new_leases = new
        key = {"b_tenant_id": tenant.id, "b_host_id": host_id}
        after = {h: b for h, b in uses[tenant.id].budgets.items() if h != host_id}
        if want.bytes == 0 and want.leases == 0:  # given back
            dropped.append(key)
        elif host_id in uses[tenant.id].budgets:
            after[host_id] = new
            changed.append(
                {**key, "new_bytes": new_bytes, "new_leases": new_leases, "expires_at": expires_at}
            )
        else:
            after[host_id] = new
            added.append(
                {
                    "tenant_id": tenant.id,
                    "host_id": host_id,
                    "bytes": new_bytes,
                    "leases": new_leases,
                    "created_at": now,
                    "expires_at": expires_at,
                }
            )
        uses[tenant.id] = dataclasses.replace(uses[tenant.id], budgets=after)
    # Every changed tenant swapped, then its budget written: one executemany each.
    transitions.swap_all_or_rerun(conn, Tenant, swaps)
    for statement, rows in ((_DROP_BUDGET, dropped), (_SET_BUDGET, changed), (_NEW_BUDGET, added)):
        if rows:
            statement.write(conn, rows)
    if renew:
        _RENEW_BUDGETS.write(
            conn, {"b_host_id": host_id, "tenant_ids": sorted(renew), "expires_at": expires_at}
        )
    return uses


def _sized(
    tenant: Any, use: QuotaUse, host_id: int, want: Want, room: tuple[int, int]
) -> tuple[int, int] | None:
    """The (bytes, leases) `set_budgets`' rule gives the budget, or None: as it is.
    ``room``: what budgets leave of the quota for central grants (central_room.py)."""
    old = use.budgets.get(host_id)
    hosts = len(set(use.budgets) | {host_id})
    local_bytes, local_leases = use.local.get(host_id, (0, 0))
    quota_bytes, quota_leases = tenant.quota_bytes - room[0], tenant.quota_leases - room[1]
    exact = room != (0, 0)  # a room runs
    if hosts > 1:
        fair_bytes = fair_share(quota_bytes, use.central_bytes, hosts, exact=exact)
        fair_leases = fair_share(quota_leases, use.central_leases, hosts, exact=exact)
    else:
        fair_bytes, fair_leases = quota_bytes, quota_leases
    cap_bytes = min(quota_bytes - use.bytes(skip_host=host_id), max(fair_bytes, local_bytes))
    cap_leases = min(quota_leases - use.leases(skip_host=host_id), max(fair_leases, local_leases))
    new_bytes = max(0, min(want.bytes, cap_bytes))
    new_leases = max(0, min(want.leases, cap_leases))
    if old is not None:
        new_bytes = max(new_bytes, min(old[0], want.bytes))
        new_leases = max(new_leases, min(old[1], want.leases))
    if old == (new_bytes, new_leases):
        return None
    return new_bytes, new_leases


def shares(
    conn: Connection,
    host_id: int,
    rows: Sequence[Any],
    now: datetime,
    known: Mapping[int, QuotaUse] | None = None,
) -> dict[int, tuple[int, int]]:
    """Per tenant id: the fair share of this host, where it holds more than that while
    other hosts hold (or asked for) a budget of the same tenant, or while the tenant's
    central room keeps part of its quota out of budgets (one statement for all;
    ``known``: tenants' quota use this transaction already has, `set_budgets`')."""
    known = known or {}
    uses = {**granting.quota_uses(conn, [r.id for r in rows if r.id not in known]), **known}
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        use = uses[r.id]
        n = len(use.budgets)
        room_bytes, room_leases = central_room.kept(r, now)
        exact = (room_bytes, room_leases) != (0, 0)  # a room runs
        if n <= 1 and not exact:
            continue
        share = (
            fair_share(r.quota_bytes - room_bytes, use.central_bytes, n, exact=exact),
            fair_share(r.quota_leases - room_leases, use.central_leases, n, exact=exact),
        )
        if r.bytes > share[0] or r.leases > share[1]:
            out[r.id] = share
    return out


def claw_back(conn: Connection, tenant_id: int) -> None:
    """Reduce the tenant's budgets until they and its central leases fit its quota again
    (a quota was lowered); agents learn it from their next reply.

    First the unused part above the fair share of the new quota (`fair_share`), the
    hosts holding the most above it first; then the unused part; then, if the budgets
    still do not fit, below what a host's agent has granted, down to the fair share and
    at last to nothing. A budget below its host's committed local use is sound (quota use
    counts the larger of the two, `budgets.QuotaUse`) and is what stops the agent
    granting into it again as those leases end: the tenant's holdings come down to the
    new quota instead of staying over it. A host that had granted no more than its fair
    share keeps room for it, though poold may not have heard of those grants yet (their
    commit is then within its budget, or, past it, within the quota: local_commit.py
    `commit`)."""
    tenant = conn.execute(
        select(Tenant.quota_bytes, Tenant.quota_leases).where(Tenant.id == tenant_id)
    ).one()
    use = granting.quota_use(conn, tenant_id)
    budgets = dict(use.budgets)
    over_bytes = use.central_bytes + sum(b[0] for b in budgets.values()) - tenant.quota_bytes
    over_leases = use.central_leases + sum(b[1] for b in budgets.values()) - tenant.quota_leases
    if over_bytes <= 0 and over_leases <= 0:
        return
    n = max(1, len(budgets))
    fair = (
        fair_share(tenant.quota_bytes, use.central_bytes, n),
        fair_share(tenant.quota_leases, use.central_leases, n),
    )
    for i, over in ((0, over_bytes), (1, over_leases)):
        committed = {h: use.local.get(h, (0, 0))[i] for h in budgets}
        passes = (
            {h: max(fair[i], c) for h, c in committed.items()},
            committed,
            dict.fromkeys(budgets, fair[i]),
            dict.fromkeys(budgets, 0),
        )
        for floors in passes:
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
