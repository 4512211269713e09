"""Ended leases whose memory is still mapped: which of a tenant's count against its
quota (`still_mapped`, for a refusal to name them) and what an agent's detailed report
says of a host's (`settle_mapped`, in the heartbeat's transaction).

DESIGN.md "Memory follows the pages": a lease released or revoked while a process still
maps its memfd stays `released_mapped` / `revoked_mapped` until nobody does. Its own
module because neither the grant path nor the heartbeat owns that question; both ask it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, select

from poold.lease_states import MAPPED_STATE_VALUES, LeaseEvent, LeaseState
from poold.ledger import transitions
from poold.ledger.models import Lease

_MAPPED_OF_TENANT = (
    select(Lease.id, Lease.state, Lease.length_bytes)
    .where(Lease.tenant_id == bindparam("tenant_id"), Lease.state.in_(MAPPED_STATE_VALUES))
    .order_by(Lease.granted_at, Lease.id)
)
# How many of them a quota refusal names (the detail carries as many).
_MAPPED_NAMED = 20


def still_mapped(conn: Connection, tenant_id: int) -> tuple[dict[str, Any], str]:
    """The tenant's ended leases whose memfd some process still maps (they count against
    its quota: DESIGN.md "Memory follows the pages"), and the words a refusal adds for
    them (detail `mapped_leases`, absent when none). Read only on the refusal path."""
    rows = conn.execute(_MAPPED_OF_TENANT, {"tenant_id": tenant_id}).all()
    if not rows:
        return {}, ""
    mapped = [
        {"lease_id": r.id, "state": r.state, "length_bytes": int(r.length_bytes)}
        for r in rows[:_MAPPED_NAMED]
    ]
    total = sum(int(r.length_bytes) for r in rows)
    named = ", ".join(f"{m['lease_id']} ({m['state']})" for m in mapped)
    more = f" and {len(rows) - len(mapped)} more" if len(rows) > len(mapped) else ""
    why = (
        f"; {len(rows)} ended lease(s) of {total} bytes still count because a process "
        f"still maps or holds their memory: {named}{more} (unmap and close them)"
    )
    return {"mapped_leases": mapped, "mapped_bytes": total}, why


_MAPPED_OF_HOST = (
    select(Lease.id, Lease.state, Lease.tenant_id, Lease.host_id, Lease.device_id)
    .where(Lease.host_id == bindparam("host_id"), Lease.state.in_(MAPPED_STATE_VALUES))
    .order_by(Lease.id)  # lock order
)


def settle_mapped(
    conn: Connection, host_id: int, host_name: str, reported: Mapping[str, str], now: datetime
) -> list[str]:
    """What a detailed agent report (lease id -> the agent's state of it) says of the host's
    leases that ended with their memfd still mapped; in the heartbeat's transaction.

    A lease the agent no longer reports at all is mapped and held by nobody: the agent
    watches every such memfd until none does (agent/mappings.py), so its silence is the
    word `unmapped` (released_mapped -> released, revoked_mapped -> reclaimed), the same
    move its own `unmapped` op makes, whichever lands first. A lease the agent still
    reports as held (the reaper ended an expired or orphaned memfd lease under a live
    holder) is returned: the reply revokes it, and the agent takes it into its watch.
    """
    rows = conn.execute(_MAPPED_OF_HOST, {"host_id": host_id}).all()
    if not rows:
        return []
    held: list[str] = []
    for row in rows:
        agent_state = reported.get(row.id)
        if agent_state is None:
            transitions.move_if(
                conn,
                row.id,
                LeaseState(row.state),
                LeaseEvent.UNMAPPED,
                actor=f"agent:{host_name}",
                reason="the agent sees no process mapping or holding its memfd",
                now=now,
                lease=row,
            )
        elif agent_state in ("held", "revoked_held"):
            held.append(row.id)
    return held
