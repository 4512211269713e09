"""What do we say about a device: the agent's report, the administrator's word, and which wins.

An agent reports media, recycled, provenance and cost with every inventory; an
administrator may annotate the same fields (``poolctl devices annotate``). Both are kept
(``reported_annotations``, ``admin_annotations``) and the device's own columns hold the
effective value, the administrator's where set, so that placement reads one column and the
next inventory upsert cannot undo what an administrator said.

An agent also reports which ranges of a devdax device are held by dax devices poold did
not place (``reserved_extents``): they count as occupied wherever free space is computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from poold import extents
from poold.errors import BadRequest, UnknownDevice
from poold.extents import Extent
from poold.ledger import transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device
from poold.ledger.types import utcnow
from poold.wire.admin import DeviceAnnotate, DeviceAnnotation
from poold.wire.agent import InventoryDevice

ANNOTATION_FIELDS = ("media", "recycled", "provenance", "cost_per_gib_month")
# What a device is when nobody said anything (the models' column defaults).
UNANNOTATED: dict[str, Any] = {
    "media": "unknown",
    "recycled": False,
    "provenance": None,
    "cost_per_gib_month": None,
}


def reported(item: InventoryDevice) -> dict[str, Any]:
    """The annotation fields of one inventory row, as stored in ``reported_annotations``;
    with them the agent's other word on the device that no administrator overrides:
    ``whole_only`` (see :func:`whole_only`). A JSON column: no migration for a new field."""
    out: dict[str, Any] = {field: getattr(item, field) for field in ANNOTATION_FIELDS}
    if item.whole_only:
        out["whole_only"] = True
    return out


def whole_only(reported: dict[str, Any] | None) -> bool:
    """Whether the agent leases this device only whole (a static dax region): placement
    then takes it only for a lease of exactly its usable size (pure)."""
    return bool((reported or {}).get("whole_only", False))


def effective(reported: dict[str, Any], admin: dict[str, Any]) -> dict[str, Any]:
    """Field by field: the administrator's value, else the agent's, else the default (pure)."""
    out: dict[str, Any] = {}
    for field in ANNOTATION_FIELDS:
        if field in admin:
            out[field] = admin[field]
        elif field in reported:
            out[field] = reported[field]
        else:
            out[field] = UNANNOTATED[field]
    return out


def apply_effective(dev: Device) -> None:
    """Set the device's media/recycled/provenance/cost columns from both sources."""
    values = effective(dev.reported_annotations or {}, dev.admin_annotations or {})
    dev.media = values["media"]
    dev.recycled = values["recycled"]
    dev.provenance = values["provenance"]
    dev.cost_per_gib_month = values["cost_per_gib_month"]


def reserved(stored: Iterable[Sequence[int]] | None) -> list[Extent]:
    """A ``reserved_extents`` column value as extents (pure; None and [] are nothing)."""
    return [Extent(int(offset), int(length)) for offset, length in stored or ()]


def usable_capacity_bytes(dev: Device) -> int:
    """Capacity less its reserved extents: what leases could ever occupy."""
    held = extents.normalise_used(dev.capacity_bytes, reserved(dev.reserved_extents))
    return dev.capacity_bytes - sum(e.length for e in held)


def set_reserved(session: Session, dev: Device, item: InventoryDevice) -> None:
    """Store the ranges the agent found held by dax devices poold did not place.

    A change bumps the device generation (`transitions.bump`): a grant that read the
    old ranges then loses its compare-and-swap and places again (STYLE.md pattern 1).
    """
    new = [[offset, length] for offset, length in sorted(item.reserved_extents)]
    if dev.id is not None and (dev.reserved_extents or []) != new:
        generation = transitions.bump(session.connection(), Device, dev.id)
        set_committed_value(dev, "generation", generation)  # what the row now holds
    dev.reserved_extents = new


def admin_annotation(dev: Device) -> DeviceAnnotation:
    """The administrator's annotation of a device, as the wire shows it."""
    return DeviceAnnotation.model_validate(dev.admin_annotations or {})


def get_by_uid(session: Session, uid: str) -> Device:
    dev = session.scalar(select(Device).where(Device.uid == uid))
    if dev is None:
        raise UnknownDevice(f"no device with uid {uid!r}", uid=uid)
    return dev


def annotate(session: Session, uid: str, change: DeviceAnnotate, actor: str) -> Device:
    """Set (or clear) administrator annotations on one device; journaled as an event."""
    dev = get_by_uid(session, uid)
    setting = {
        field: getattr(change, field)
        for field in ANNOTATION_FIELDS
        if field in change.model_fields_set and getattr(change, field) is not None
    }
    both = sorted(set(setting) & set(change.clear))
    if both:
        raise BadRequest(f"cannot both set and clear {', '.join(both)}", fields=both)
    before = dict(dev.admin_annotations or {})
    after = {k: v for k, v in before.items() if k not in change.clear}
    after.update(setting)
    if after == before:
        return dev
    dev.admin_annotations = after  # a new dict: SQLAlchemy sees the JSON change
    apply_effective(dev)
    dev.updated_at = utcnow()
    transitions.record(
        session,
        transitions.event_row(
            actor=actor,
            kind="device.annotate",
            device_id=dev.id,
            detail={"uid": uid, "set": setting, "cleared": sorted(change.clear)},
        ),
    )
    return dev


def annotate_device(ledger: Ledger, uid: str, change: DeviceAnnotate, actor: str) -> None:
    """`annotate` in a transaction of its own (the API opens none)."""
    with ledger.write() as session:
        annotate(session, uid, change, actor)
