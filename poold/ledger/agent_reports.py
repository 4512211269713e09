"""How is what an agent says it holds stored in the ledger, and read back?

Each heartbeat that reports its leases leaves the report in `hosts.agent_leases`
(poold/ledger/heartbeat.py writes it, the audit reads it: poold/ledger/audit_agents.py).
What the audit asks of an agent in return is journalled under the event kinds
below, which the heartbeat turns into its reply (a scrub order's `reissued_at`,
a revocation of a leftover sub-device's lease id): poold never calls agents.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from poold.wire.agent import AgentLease, Heartbeat, LeftoverSubDevice

# `poolctl audit --reclaim` re-issued the scrub order of a lease stuck in scrubbing.
SCRUB_REISSUE = "lease.scrub_reissue"
# `poolctl audit --reclaim` ordered a leftover sub-device of an ended lease deleted.
LEFTOVER_DELETE = "host.leftover_delete"

_LEASES = TypeAdapter(list[AgentLease])
_LEFTOVERS = TypeAdapter(list[LeftoverSubDevice])


def stored_report(beat: Heartbeat) -> list[Any] | dict[str, Any]:
    """What `hosts.agent_leases` keeps of a heartbeat that reported its leases.

    An older agent's list of ids is kept as it came (the column's first format);
    a newer agent's per-lease report and leftovers as {"leases": [...], "leftovers":
    [...]}, defaults left out to keep the row small. `parse_stored` reads both.
    """
    if beat.held_leases is None:
        return list(beat.held or [])
    return {
        "leases": _LEASES.dump_python(beat.held_leases, mode="json", exclude_defaults=True),
        "leftovers": _LEFTOVERS.dump_python(beat.leftovers, mode="json"),
    }


def parse_stored(
    raw: Any,
) -> tuple[dict[str, AgentLease], list[LeftoverSubDevice], bool] | None:
    """(leases by id, leftovers, detailed) from a stored report of either format;
    None when it cannot be read (never taken as "the agent holds nothing")."""
    if isinstance(raw, dict):
        try:
            found = _LEASES.validate_python(raw.get("leases") or [])
            leftovers = _LEFTOVERS.validate_python(raw.get("leftovers") or [])
        except ValidationError:
            return None  # written by some other version
        return {x.lease_id: x for x in found}, leftovers, True
    ids = [str(x) for x in raw or [] if isinstance(x, str)]
    return {i: AgentLease(lease_id=i) for i in ids}, [], False
