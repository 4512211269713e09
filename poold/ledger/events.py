"""How a state change is journalled: one `events` row per transition (invariant 3)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from poold.ledger.models import Event
from poold.ledger.types import utcnow


def record(
    session: Session,
    *,
    actor: str,
    kind: str,
    lease_id: str | None = None,
    tenant_id: int | None = None,
    host_id: int | None = None,
    device_id: int | None = None,
    from_state: str | None = None,
    to_state: str | None = None,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Append one event in the caller's transaction, so it commits or rolls back with the change."""
    session.add(
        Event(
            at=utcnow(),
            actor=actor,
            kind=kind,
            lease_id=lease_id,
            tenant_id=tenant_id,
            host_id=host_id,
            device_id=device_id,
            from_state=from_state,
            to_state=to_state,
            reason=reason,
            detail=detail or {},
        )
    )
