"""How a tenant's budgets move when a lease is granted: what counts against its quota
(`QuotaUse`), a central grant spending its own host's budget (`spend_for_central`) and a
local grant kept past its host's budget while the quota has room (`fit_local_grant`),
and the refusal of a grant the quota cannot take (`over_quota`, `refuse_over_quota`).

Its own module so that the grant paths (poold/ledger/leases.py, local_commit.py) and the
delegation (poold/ledger/delegation.py) all use it without importing each other. The rule behind
both moves: the budget is a mechanism, the quota is the invariant (docs/design-changes.md
"Local grants poold has not heard of yet").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from sqlalchemy import Connection, update

from poold.errors import QuotaExceeded
from poold.ledger import transitions
from poold.ledger.mapped import still_mapped
from poold.ledger.models import Budget
from poold.ledger.transitions import event_row


@dataclass(frozen=True)
class QuotaUse:
    """What counts against a tenant's quota: its central leases, and per host the larger
    of its budget there and its local leases there (a budget clawed back below what its
    agent already granted still counts what was granted)."""

    central_bytes: int = 0
    central_leases: int = 0
    # host id -> (bytes, leases)
    local: Mapping[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    budgets: Mapping[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def _per_host(self, i: int, skip_host: int | None) -> int:
        hosts = (set(self.local) | set(self.budgets)) - {skip_host}
        return sum(max(self.local.get(h, (0, 0))[i], self.budgets.get(h, (0, 0))[i]) for h in hosts)

    def bytes(self, skip_host: int | None = None) -> int:
        """Quota bytes in use (not counting `skip_host`'s budget and local leases)."""
        return self.central_bytes + self._per_host(0, skip_host)

    def leases(self, skip_host: int | None = None) -> int:
        return self.central_leases + self._per_host(1, skip_host)

    def delegated_bytes(self) -> int:
        return self._per_host(0, None)

    def delegated_leases(self) -> int:
        return self._per_host(1, None)


def spend_for_central(
    conn: Connection,
    tenant_id: int,
    host_id: int,
    use: QuotaUse,
    quota_bytes: int,
    quota_leases: int,
    length_bytes: int,
    actor: str,
    reported: tuple[int, int] | None = None,
) -> tuple[QuotaUse, tuple[int, int]]:
    """A central grant of `length_bytes` asked by host `host_id` that the tenant's quota
    refuses only because of the tenant's unspent budget on that same host: spend that
    budget on it (the budget shrinks by what the grant needs, never below the host's
    local use, with a `budget.spend` event); the quota use after, and the (bytes, leases)
    spent. Unchanged, (0, 0), when the budget cannot cover the excess: the caller
    refuses `quota_exceeded`.

    The host's local use is the larger of what poold has committed and what the agent
    `reported` with the request (its own count, local grants not yet committed
    included): the agent lowered its view of the budget by the request in the same
    step, so what it may still grant alone fits what is left here, and it need not wait
    for its earlier local grants to reach poold. Runs inside the grant's transaction,
    which swaps the tenant's generation: a racing local grant, budget change or
    clawback makes one of them read again.
    """
    spend = spendable(use, host_id, quota_bytes, quota_leases, length_bytes, reported)
    if spend is None:
        return use, (0, 0)
    budget = use.budgets[host_id]
    give_bytes, give_leases = spend
    new = (budget[0] - give_bytes, budget[1] - give_leases)
    conn.execute(
        update(Budget)
        .where(Budget.tenant_id == tenant_id, Budget.host_id == host_id)
        .values(bytes=new[0], leases=new[1])
    )
    transitions.record(
        conn,
        event_row(
            actor=actor,
            kind="budget.spend",
            tenant_id=tenant_id,
            host_id=host_id,
            reason="a central grant of this host spent its unspent budget",
            detail={
                "bytes": new[0],
                "leases": new[1],
                "spent_bytes": give_bytes,
                "spent_leases": give_leases,
                "length_bytes": length_bytes,
            },
        ),
    )
    return dataclasses.replace(use, budgets={**use.budgets, host_id: new}), spend


def spendable(
    use: QuotaUse,
    host_id: int,
    quota_bytes: int,
    quota_leases: int,
    length_bytes: int,
    reported: tuple[int, int] | None = None,
) -> tuple[int, int] | None:
    """The (bytes, leases) of host `host_id`'s unspent budget that a central grant of
    `length_bytes` over the quota would spend (`spend_for_central`), or None: the grant
    is not over the quota, or that budget cannot cover the excess. Pure: a grant refused
    before it is placed asks it with its requested size, the least its lease can be."""
    budget = use.budgets.get(host_id)
    if budget is None:
        return None
    local_bytes, local_leases = use.local.get(host_id, (0, 0))
    if reported is not None:
        local_bytes, local_leases = max(local_bytes, reported[0]), max(local_leases, reported[1])
    over_bytes = max(0, use.bytes() + length_bytes - quota_bytes)
    over_leases = max(0, use.leases() + 1 - quota_leases)
    give_bytes = min(over_bytes, max(0, budget[0] - local_bytes))
    give_leases = min(over_leases, max(0, budget[1] - local_leases))
    if (give_bytes, give_leases) != (over_bytes, over_leases) or not (give_bytes or give_leases):
        return None
    return give_bytes, give_leases


def fit_local_grant(
    conn: Connection,
    *,
    tenant_id: int,
    host_id: int,
    use: QuotaUse,
    quota_bytes: int,
    quota_leases: int,
    length_bytes: int,
    lease_id: str,
    actor: str,
) -> bool:
    """May a local grant of `length_bytes` on host `host_id` that its budget there no
    longer covers (lowered after the agent granted it: a quota cut, a central grant of
    the host, a fair-share cap) be kept? Yes when the tenant's quota has room for it,
    with a `budget.overrun` event; False: the quota itself would be exceeded.

    The budget row is left as it is: quota use counts max(budget, local leases) per
    host, so the lease counts once committed, and not writing the row keeps the lock
    order of a central grant (budget, then tenant) from meeting this batch's (tenant,
    then budget). The caller swaps the tenant's generation, so a racing grant or
    clawback reads again."""
    local_bytes, local_leases = use.local.get(host_id, (0, 0))
    after = dataclasses.replace(
        use, local={**use.local, host_id: (local_bytes + length_bytes, local_leases + 1)}
    )
    if after.bytes() > quota_bytes or after.leases() > quota_leases:
        return False
    budget = use.budgets.get(host_id, (0, 0))
    transitions.record(
        conn,
        event_row(
            actor=actor,
            kind="budget.overrun",
            tenant_id=tenant_id,
            host_id=host_id,
            reason="a local grant its host made before its budget was lowered fits the quota",
            detail={
                "budget_bytes": budget[0],
                "budget_leases": budget[1],
                "local_bytes": local_bytes + length_bytes,
                "local_leases": local_leases + 1,
                "lease_id": lease_id,
            },
        ),
    )
    return True


def over_quota(tenant: Any, used_bytes: int, used_leases: int, length: int) -> bool:
    """Would a grant of ``length`` bytes take the tenant past its quota (``used_*``: its
    quota use, `QuotaUse.bytes`/`leases`)?"""
    return bool(used_leases + 1 > tenant.quota_leases or used_bytes + length > tenant.quota_bytes)


def refuse_over_quota(
    conn: Connection,
    tenant: Any,
    use: QuotaUse,
    used_bytes: int,
    used_leases: int,
    length: int,
    *,
    by_budgets: bool = False,
) -> NoReturn:
    """`quota_exceeded` for a grant of ``length`` bytes: the lease count first.
    ``by_budgets``: it would fit but for hosts' unspent budgets (central_room.py), which
    the message says, with when to try again."""
    mapped, why = still_mapped(conn, tenant.id)
    if by_budgets:
        mapped = {**mapped, "held_by_budgets": True}
        why += (
            "; the rest is hosts' unspent budgets, which poold now leaves room beside for "
            "a grant this size: retry in a few seconds"
        )
    if used_leases + 1 > tenant.quota_leases:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} holds {used_leases} of {tenant.quota_leases} leases{why}",
            quota_leases=tenant.quota_leases,
            live_leases=used_leases,
            **({"delegated_leases": use.delegated_leases()} if use.budgets else {}),
            **mapped,
        )
    raise QuotaExceeded(
        f"tenant {tenant.name!r} would hold {used_bytes + length} bytes, "
        f"quota is {tenant.quota_bytes}{why}",
        quota_bytes=tenant.quota_bytes,
        leased_bytes=used_bytes,
        **({"delegated_bytes": use.delegated_bytes()} if use.budgets else {}),
        requested_bytes=length,
        **mapped,
    )
