"""How does an administrator take a device or a host out of service, and back? Draining
and undraining.

* Draining a target, a device or a host, is one mechanism (`_drain`, `_undrain`):
  the target goes `draining`, so no new lease is placed on it; its live leases
  are revoked at the drain's deadline (by the reaper) or at once (`now`). The
  deadline is kept in the `device.drain` / `host.drain` event, the journal of
  the drain; undraining cancels it. A device drain always has a deadline; a host
  drain may have none, and then its leases run to their end. Its reservations no
  lease lies in are returned (poold/ledger/delegation_renewal.py `return_unleased`).
* A drain and an undrain bump the target's generation (a device's or a host's)
  with a compare-and-swap, as a grant does: a grant that read the target before
  the drain committed then fails its own swap and reads `draining` (STYLE.md
  pattern 1). A repeated drain never postpones: the earliest deadline already set
  stands (a shorter one brings it forward), so a repeat with no deadline or a later
  one, like an undrain of a target not draining, writes nothing and says so
  (`changed` False, `deadline_at` the one that stands).

Its own module (it was part of admin_ops.py): a drain changes a target's state and
leaves its leases to the reaper's deadline, where revoking or ending a lease
(poold/ledger/admin_ops.py) moves one lease now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from poold.errors import BadRequest
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger import delegation_renewal, devices, hosts, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Event, Host, Lease
from poold.ledger.reaper import revoke_matching
from poold.ledger.types import utcnow
from poold.wire.admin import DrainResult


@dataclass(frozen=True)
class _Found:
    """A drain target as one transaction read it."""

    id: int
    state: str
    generation: int


@dataclass(frozen=True)
class _Kind:
    """What differs between draining a device and draining a host; the rest is `_drain`."""

    noun: str  # "device" / "host": the events are `<noun>.drain` / `<noun>.undrain`
    name_key: str  # the detail key naming the target in a refusal
    in_service: str  # the state an undrain goes back to
    never_drained: tuple[str, ...]  # states a drain refuses
    find: Callable[[Session, str], _Found]
    # Set the target's state (and bump its generation, if it has one) where it still
    # is as `found`: False when another writer changed it since.
    set_state: Callable[[Connection, _Found, str, datetime], bool]
    event_target: str  # the events column naming the target
    lease_target: InstrumentedAttribute[int]  # the leases column naming it


def _find_device(session: Session, uid: str) -> _Found:
    dev = devices.get_by_uid(session, uid)
    return _Found(dev.id, dev.state, dev.generation)


def _set_device_state(conn: Connection, found: _Found, state: str, now: datetime) -> bool:
    # The state change rides on the generation swap: it is applied only if no grant
    # (or other drain) moved the device since it was read.
    return transitions.compare_and_bump(
        conn, Device, found.id, found.generation, state=state, updated_at=now
    )


def _find_host(session: Session, name: str) -> _Found:
    host = hosts.get_by_name(session, name)
    return _Found(host.id, host.status, host.generation)


def _set_host_status(conn: Connection, found: _Found, status: str, _now: datetime) -> bool:
    # As for a device: every grant on the host swaps its generation, so a grant
    # that read it `up` before this committed loses its swap and reads `draining`.
    return transitions.compare_and_bump(conn, Host, found.id, found.generation, status=status)


_DEVICE = _Kind(
    noun="device",
    name_key="uid",
    in_service="online",
    never_drained=("retired",),
    find=_find_device,
    set_state=_set_device_state,
    event_target="device_id",
    lease_target=Lease.device_id,
)
_HOST = _Kind(
    noun="host",
    name_key="host",
    in_service="up",
    never_drained=(),
    find=_find_host,
    set_state=_set_host_status,
    event_target="host_id",
    lease_target=Lease.host_id,
)


def _live_leases(session: Session, kind: _Kind, target_id: int) -> int:
    return int(
        session.scalar(
            select(func.count(Lease.id)).where(
                kind.lease_target == target_id, Lease.state.in_(LIVE_STATE_VALUES)
            )
        )
        or 0
    )


@dataclass(frozen=True)
class _Changed:
    """What `_change` found and did: the target, its live leases, its state now."""

    target_id: int
    live: int
    state: str
    changed: bool


def _latest_drain_deadline(session: Session, kind: _Kind, target_id: int) -> str | None:
    """The deadline (ISO text) of the target's latest drain event, None when it had none."""
    detail = session.scalar(
        select(Event.detail)
        .where(
            Event.kind == f"{kind.noun}.drain",
            getattr(Event, kind.event_target) == target_id,
        )
        .order_by(Event.id.desc())
        .limit(1)
    )
    found = (detail or {}).get("deadline_at")
    return str(found) if found is not None else None


def _change(
    ledger: Ledger,
    kind: _Kind,
    name: str,
    actor: str,
    *,
    refused: Callable[[str], str | None],
    after: str,
    now: datetime,
    event: dict[str, Any],
    unchanged: Callable[[Session, _Found], bool] = lambda _s, _f: False,
) -> _Changed:
    """Move a target to `after`, journalled, again from a fresh read if it loses a race.

    `refused(state)`: why the target cannot move from `state` (bad_request), or None.
    `unchanged(session, found)`: the target already is as asked; then nothing is
    written (no event, no generation bump) and the result says `changed` False, so
    a repeated drain or undrain succeeds without journalling a second one.
    """

    def attempt() -> _Changed:
        with ledger.write() as s:
            found = kind.find(s, name)
            if unchanged(s, found):
                return _Changed(found.id, _live_leases(s, kind, found.id), found.state, False)
            why = refused(found.state)
            if why is not None:
                raise BadRequest(
                    f"{kind.noun} {name!r} is {found.state}{why}", **{kind.name_key: name}
                )
            if not kind.set_state(s.connection(), found, after, now):
                raise transitions.LostRace(f"{kind.noun}s")
            target: dict[str, Any] = {kind.event_target: found.id}
            transitions.record(
                s,
                transitions.event_row(
                    actor=actor, from_state=found.state, to_state=after, **target, **event
                ),
            )
            if after == "draining":  # its reservations no lease lies in go back now
                delegation_renewal.return_unleased(s.connection(), actor, event["kind"], **target)
            return _Changed(found.id, _live_leases(s, kind, found.id), after, True)

    return transitions.retrying(attempt, what=f"{event['kind']} of {name!r}")


def _drain(
    ledger: Ledger,
    kind: _Kind,
    name: str,
    actor: str,
    *,
    deadline_s: float | None,
    now_: bool,
    revoke_deadline_s: float,
) -> DrainResult:
    """Stop placing on a target; its live leases are revoked at the deadline, or at once.

    No deadline (`deadline_s` None and not `now_`): they run to their end.
    """
    now = utcnow()
    deadline = None
    if now_ or deadline_s is not None:
        deadline = now if now_ else now + timedelta(seconds=deadline_s or 0.0)
    if deadline is None:
        reason = "drain: leases run to their end"
    else:
        reason = "drain now" if now_ else f"drain within {deadline_s:g}s"

    kept: list[datetime] = []  # the deadline already set, when it stands

    def unchanged(session: Session, found: _Found) -> bool:
        # A repeated drain never postpones: the earliest deadline stands. Draining
        # already, a drain asking for no deadline or a later one writes nothing (a cron
        # re-running `drain --deadline-s N` would otherwise move it on every run and never
        # revoke); an earlier one brings it forward, and no deadline yet gets one.
        kept.clear()
        if found.state != "draining":
            return False
        raw = _latest_drain_deadline(session, kind, found.id)
        if raw is None:
            return deadline is None
        current = datetime.fromisoformat(raw)
        if deadline is None or current <= deadline:
            kept.append(current)
            return True
        return False

    done = _change(
        ledger,
        kind,
        name,
        actor,
        refused=lambda state: "; nothing to drain" if state in kind.never_drained else None,
        after="draining",
        now=now,
        event={
            "kind": f"{kind.noun}.drain",
            "reason": reason,
            # The reaper reads the latest drain's deadline (reaper.drain_deadlines).
            "detail": {"deadline_at": deadline.isoformat()} if deadline is not None else {},
        },
        unchanged=unchanged,
    )
    if not done.changed and kept:
        deadline = kept[0]
    revoked: list[str] = []
    if deadline is not None and deadline <= now:
        revoked = revoke_matching(
            ledger,
            [kind.lease_target == done.target_id],
            reason=f"{kind.noun} {name} drained",
            actor=actor,
            now=now,
            deadline_s=revoke_deadline_s,
        )
    return DrainResult(
        target=name,
        state="draining",
        deadline_at=deadline,
        live_leases=done.live,
        revoked=revoked,
        changed=done.changed or bool(revoked),
    )


def _undrain(ledger: Ledger, kind: _Kind, name: str, actor: str) -> DrainResult:
    """Put a draining target back in service (leases already revoked stay revoked).

    A target that is not draining is left as it is: success, `changed` False, its
    state as it is (a host `up` or `down`, a device `online`, `missing`...).
    """
    done = _change(
        ledger,
        kind,
        name,
        actor,
        refused=lambda _state: None,
        after=kind.in_service,
        now=utcnow(),
        event={"kind": f"{kind.noun}.undrain"},
        unchanged=lambda _s, found: found.state != "draining",
    )
    return DrainResult(
        target=name,
        state=done.state,
        live_leases=done.live,
        changed=done.changed,
    )


def drain_device(
    ledger: Ledger,
    uid: str,
    actor: str,
    *,
    deadline_s: float,
    now_: bool,
    revoke_deadline_s: float,
) -> DrainResult:
    """Stop placing on a device; revoke its live leases at the deadline, or at once."""
    return _drain(
        ledger,
        _DEVICE,
        uid,
        actor,
        deadline_s=deadline_s,
        now_=now_,
        revoke_deadline_s=revoke_deadline_s,
    )


def undrain_device(ledger: Ledger, uid: str, actor: str) -> DrainResult:
    """Put a draining device back online (leases already revoked stay revoked)."""
    return _undrain(ledger, _DEVICE, uid, actor)


def drain_host(
    ledger: Ledger,
    name: str,
    actor: str,
    *,
    draining: bool = True,
    deadline_s: float | None = None,
    now_: bool = False,
    revoke_deadline_s: float = 30.0,
) -> DrainResult:
    """Mark a host draining (no new grants), or back to service with `draining=False`.

    With `deadline_s` its live leases are revoked when it passes (by the reaper),
    with `now_` at once; without either they run to their end. Back in service, the
    host is `up`; the reaper marks it down again if its agent is silent.
    """
    if not draining:
        return _undrain(ledger, _HOST, name, actor)
    return _drain(
        ledger,
        _HOST,
        name,
        actor,
        deadline_s=deadline_s,
        now_=now_,
        revoke_deadline_s=revoke_deadline_s,
    )
