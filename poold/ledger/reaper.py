"""Which leases and hosts have run out of time? One reaper pass, and the thread that repeats it.

A pass ends what the clocks of DESIGN.md "Lease lifecycle" say has ended:

* active leases past `expires_at` expire (event `expire`), subject to the
  outage rule below;
* granted leases not activated within `activation_deadline_s` are aborted;
* expired leases `expiry_grace_s` after their expiry, and orphaned leases that
  long after they were orphaned, are reclaimed (`reclaim_event` is the hook for
  backends whose memory must be zeroed first);
* live leases of a draining device whose drain deadline passed are revoked,
  and those of a draining host whose drain was given a deadline;
  a revoking lease the agent did not confirm by its deadline is reclaimed;
* hosts whose agent has not beaten for `host_down_after_s` are marked down.

Every transition is its own transaction with one event (actor `poold:reaper`)
and is a conditional update (`transitions.move_if`), so several poold processes may
reap one PostgreSQL ledger at once: the loser of a race writes nothing.

**The outage rule: a lease does not expire because its agent could not reach
poold** (poold down, restarting, or the host cut off). The agent holds the
tenant's renewals and replays them, so poold only expires a lease on evidence:

1. A host is *in contact* when this poold has heard it within
   `host_silent_after_s` (a heartbeat older than the reaper's own start does
   not count: a poold that was down has not heard anyone since).
2. An active lease past `expires_at` is expired only if its host was heard at
   or after `expires_at` (a heartbeat came, and did not renew it), or the host
   has been silent for `host_silent_grace_s` (the host is presumed dead).
   Silence is counted from the later of the last heartbeat and the reaper's
   start, so poold's own downtime never counts against a host.
3. While a host is out of contact, and for at most `host_silent_grace_s`, its
   active leases are *held*: their `expires_at` is pushed to at least
   `now + host_silent_after_s` each pass. When the host's heartbeats resume,
   the replayed renewals therefore find their leases still active (the
   heartbeat's lazy expiry would otherwise end them first), and a lease
   nobody renews expires once the host is heard after its pushed expiry.

poold runs one pass before it starts serving, so that held leases are pushed
before the first resumed heartbeat can arrive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from poold.errors import LedgerUnavailable
from poold.lease_states import LeaseEvent, LeaseState
from poold.ledger import agent_reports, agent_requests, delegation_renewal, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Event, Host, Lease
from poold.ledger.types import utcnow
from poold.settings import PooldSettings

log = logging.getLogger("poold.reaper")

ACTOR = "poold:reaper"
# At most this many transitions of one kind per pass: a backlog drains over a few
# passes instead of one pass holding the ledger for minutes.
BATCH = 2000
# States a drain or an administrator may revoke (the state machine's REVOKE arrows).
REVOCABLE: tuple[LeaseState, ...] = (LeaseState.ACTIVE, LeaseState.ORPHANED, LeaseState.EXPIRED)


@dataclass(frozen=True)
class ReaperPolicy:
    """The clocks a pass enforces (from `PooldSettings`)."""

    activation_deadline_s: float = 30.0
    expiry_grace_s: float = 30.0
    revoke_deadline_s: float = 30.0
    host_down_after_s: float = 60.0
    host_silent_after_s: float = 10.0
    host_silent_grace_s: float = 300.0
    # How long an answered agent request id is remembered (a retry of it gets the
    # first answer). Not a PooldSettings field yet: agents retry for seconds, an hour
    # is ample.
    request_retention_s: float = 3600.0

    @classmethod
    def from_settings(cls, settings: PooldSettings) -> ReaperPolicy:
        return cls(
            activation_deadline_s=settings.activation_deadline_s,
            expiry_grace_s=settings.expiry_grace_s,
            revoke_deadline_s=settings.revoke_deadline_s,
            host_down_after_s=settings.host_down_after_s,
            host_silent_after_s=settings.host_silent_after_s,
            host_silent_grace_s=settings.host_silent_grace_s,
        )


@dataclass
class ReapResult:
    """What one pass did, by lease id (host names for `hosts_down`)."""

    expired: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)
    reclaimed: list[str] = field(default_factory=list)
    hosts_down: list[str] = field(default_factory=list)
    held: int = 0  # leases whose expiry was pushed because their host is out of contact
    # Reservations and budgets that expired (or whose last lease ended) and went.
    delegation_returned: int = 0

    def transitions(self) -> int:
        return len(self.expired) + len(self.aborted) + len(self.revoked) + len(self.reclaimed)


def reclaim_event(device_kind: str) -> LeaseEvent:
    """How a lease that ended without its holder's release gives its range back.

    memfd-backed kinds (emulated, numa) hand out fresh pages every time, so the
    range is free at once (`reclaim`). A devdax range is the same physical
    memory for the next sub-device: it goes to `scrubbing` (`reclaim_dirty`)
    and is free only after the agent reports `scrubbed` (the heartbeat reply
    orders the scrub; a failed scrub quarantines the range).
    """
    return LeaseEvent.RECLAIM_DIRTY if device_kind == "devdax" else LeaseEvent.RECLAIM


def reclaim_event_seen(
    device_kind: str,
    lease_id: str,
    granted_at: datetime,
    stored_report: Any,
    stored_at: datetime | None,
) -> LeaseEvent:
    """`reclaim_event`, for a lease whose holder did not release it, given what its
    agent last reported (`hosts.agent_leases`, at `stored_at`).

    A memfd's pages stay with whoever maps them (DESIGN.md "Memory follows the pages"),
    so a memfd lease is reclaimed to free bytes only on its agent's word that nothing
    maps it: the agent's last detailed report, made after the lease was granted, does
    not list it (the agent lists every lease it holds and every ended memfd it watches,
    agent/mappings.py). Otherwise it goes to `revoked_mapped` (`reclaim_mapped`) and
    stays counted until the agent's report or `unmapped` op frees it. An agent that
    sends no detailed report watches nothing: its leases are reclaimed as before.
    """
    event = reclaim_event(device_kind)
    if event is not LeaseEvent.RECLAIM or stored_report is None:
        return event
    parsed = agent_reports.parse_stored(stored_report)
    if parsed is None:
        return LeaseEvent.RECLAIM_MAPPED  # unreadable: never taken as "holds nothing"
    reported, _leftovers, detailed = parsed
    if not detailed:
        return event
    entry = reported.get(lease_id)
    if entry is not None and entry.state != "scrubbing":
        return LeaseEvent.RECLAIM_MAPPED
    if stored_at is None or _aware(stored_at) < _aware(granted_at):
        return LeaseEvent.RECLAIM_MAPPED  # the agent has said nothing since the grant
    return event


def reclaim_events(conn: Any, leases: Sequence[tuple[str, str]]) -> dict[str, LeaseEvent]:
    """`reclaim_event_seen` of each (lease id, device kind), reading each host's report
    once; only memfd leases need a read at all."""
    out = {lease_id: reclaim_event(kind) for lease_id, kind in leases}
    memfd = sorted(i for i, e in out.items() if e is LeaseEvent.RECLAIM)
    kinds = dict(leases)
    for chunk in transitions.chunks(memfd, 500):
        rows = conn.execute(
            select(Lease.id, Lease.granted_at, Host.agent_leases, Host.agent_leases_at)
            .join(Host, Host.id == Lease.host_id)
            .where(Lease.id.in_(chunk))
        ).all()
        for row in rows:
            out[row.id] = reclaim_event_seen(
                kinds[row.id], row.id, row.granted_at, row.agent_leases, row.agent_leases_at
            )
    return out


@dataclass(frozen=True)
class HostContact:
    """How recently this poold heard a host, for the outage rule."""

    host_id: int
    name: str
    last_heartbeat_at: datetime | None
    silence_s: float  # since the later of its last heartbeat and the reaper's start
    in_contact: bool


def host_contact(
    host_id: int,
    name: str,
    last_heartbeat_at: datetime | None,
    *,
    now: datetime,
    started_at: datetime,
    silent_after_s: float,
) -> HostContact:
    """Rule 1 of the module docstring, pure."""
    heard = last_heartbeat_at
    since = started_at if heard is None or heard < started_at else heard
    in_contact = (
        heard is not None
        and heard >= started_at
        and (now - heard).total_seconds() <= silent_after_s
    )
    return HostContact(host_id, name, heard, max(0.0, (now - since).total_seconds()), in_contact)


def may_expire(
    expires_at: datetime, contact: HostContact, *, now: datetime, silent_grace_s: float
) -> str | None:
    """Rule 2, pure: the reason to expire this active lease now, or None to keep it."""
    if expires_at > now:
        return None
    if contact.last_heartbeat_at is not None and contact.last_heartbeat_at >= expires_at:
        return "ttl passed without renewal"
    if contact.silence_s >= silent_grace_s:
        return f"ttl passed and host {contact.name} silent for {contact.silence_s:.0f}s"
    return None


class Reaper:
    """Runs reaper passes over one ledger; `started_at` anchors the outage rule."""

    def __init__(
        self, ledger: Ledger, policy: ReaperPolicy, *, started_at: datetime | None = None
    ) -> None:
        self.ledger = ledger
        self.policy = policy
        self.started_at = started_at or utcnow()

    def run_once(self, now: datetime | None = None) -> ReapResult:
        """One pass: every clock once, each transition in its own transaction."""
        now = now or utcnow()
        result = ReapResult()
        contacts = self._contacts(now)
        self._mark_hosts_down(now, result)
        self._hold(contacts, now, result)
        due = self._due(now)
        self._expire(due.get(LeaseState.ACTIVE.value, []), contacts, now, result)
        self._abort_stale(due.get(LeaseState.GRANTED.value, []), now, result)
        self._revoke_drained(now, result)
        self._revoke_unshrunk(now, result)
        self._reclaim(due, now, result)
        # After the reclaims: a returning reservation whose last lease just ended goes.
        result.delegation_returned = delegation_renewal.reap_expired(self.ledger, now)
        self._forget_requests(now)
        return result

    # --- steps ---------------------------------------------------------------

    def _contacts(self, now: datetime) -> dict[int, HostContact]:
        with self.ledger.read() as s:
            rows = s.execute(select(Host.id, Host.name, Host.last_heartbeat_at)).all()
        return {
            row.id: host_contact(
                row.id,
                row.name,
                row.last_heartbeat_at,
                now=now,
                started_at=self.started_at,
                silent_after_s=self.policy.host_silent_after_s,
            )
            for row in rows
        }

    def _mark_hosts_down(self, now: datetime, result: ReapResult) -> None:
        cutoff = now - timedelta(seconds=self.policy.host_down_after_s)
        with self.ledger.read() as s:
            stale = s.execute(
                select(Host.id, Host.name).where(
                    Host.status == "up", Host.last_heartbeat_at < cutoff
                )
            ).all()
        for host_id, name in stale:

            def attempt(host_id: int = host_id) -> bool:
                with self.ledger.write() as s:
                    changed = s.execute(
                        update(Host)
                        .where(
                            Host.id == host_id,
                            Host.status == "up",
                            Host.last_heartbeat_at < cutoff,
                        )
                        .values(status="down")
                    ).rowcount  # type: ignore[attr-defined]
                    if changed == 1:
                        transitions.record(
                            s,
                            transitions.event_row(
                                at=now,
                                actor=ACTOR,
                                kind="host.down",
                                host_id=host_id,
                                reason=f"no heartbeat for {self.policy.host_down_after_s:g}s",
                            ),
                        )
                    return bool(changed == 1)

            if transitions.retrying(attempt, what=f"marking host {name} down"):
                result.hosts_down.append(name)
                log.warning("host %s marked down: no heartbeat since %s", name, cutoff)

    def _hold(self, contacts: dict[int, HostContact], now: datetime, result: ReapResult) -> None:
        until = now + timedelta(seconds=self.policy.host_silent_after_s)
        for contact in contacts.values():
            if contact.in_contact or contact.silence_s >= self.policy.host_silent_grace_s:
                continue
            held = self.hold_host(contact.host_id, until)
            if held:
                log.info(
                    "host %s out of contact for %.0fs: held %d lease(s)",
                    contact.name,
                    contact.silence_s,
                    held,
                )
            result.held += int(held)

    def hold_host(self, host_id: int, until: datetime) -> int:
        """Push every active lease of the host expiring before `until` to `until`, in one
        transaction, locking them in id order; how many it pushed."""

        def attempt() -> int:
            with self.ledger.write() as s:
                return transitions.update_leases(
                    s,
                    (
                        Lease.host_id == host_id,
                        Lease.state == LeaseState.ACTIVE.value,
                        Lease.expires_at < until,
                    ),
                    {"expires_at": until},
                )

        return transitions.retrying(attempt, what=f"holding the leases of host {host_id}")

    def _forget_requests(self, now: datetime) -> None:
        cutoff = now - timedelta(seconds=self.policy.request_retention_s)
        forgotten = agent_requests.forget_older_than(self.ledger, cutoff, limit=BATCH)
        if forgotten:
            log.debug("forgot %d agent request id(s) older than %s", forgotten, cutoff)

    def _due(self, now: datetime) -> dict[str, list[Any]]:
        """Every lease some clock may have ended, by state, in one scan of `leases`.

        One statement instead of one per clock: without an index on `state`
        each is a full scan, and a pass runs every second.
        """
        grace_cutoff = now - timedelta(seconds=self.policy.expiry_grace_s)
        activation_cutoff = now - timedelta(seconds=self.policy.activation_deadline_s)
        with self.ledger.read() as s:
            rows = s.execute(
                select(
                    Lease.id,
                    Lease.state,
                    Lease.host_id,
                    Lease.expires_at,
                    Device.kind,
                )
                .join(Device, Device.id == Lease.device_id)
                .where(
                    or_(
                        and_(Lease.state == LeaseState.ACTIVE.value, Lease.expires_at <= now),
                        and_(
                            Lease.state == LeaseState.GRANTED.value,
                            Lease.granted_at <= activation_cutoff,
                        ),
                        and_(
                            Lease.state == LeaseState.EXPIRED.value,
                            Lease.expires_at <= grace_cutoff,
                        ),
                        and_(Lease.state == LeaseState.REVOKING.value, Lease.expires_at <= now),
                    )
                )
                .order_by(Lease.expires_at)
                .limit(BATCH)
            ).all()
        due: dict[str, list[Any]] = defaultdict(list)
        for row in rows:
            due[row.state].append(row)
        return due

    def _expire(
        self, rows: list[Any], contacts: dict[int, HostContact], now: datetime, result: ReapResult
    ) -> None:
        grace_cutoff = now - timedelta(seconds=self.policy.expiry_grace_s)
        for row in rows:
            contact = contacts.get(row.host_id)
            if contact is None:  # a host added after this pass read the hosts
                continue
            reason = may_expire(
                row.expires_at, contact, now=now, silent_grace_s=self.policy.host_silent_grace_s
            )
            if reason is None:
                continue
            if not self._move(
                row.id,
                LeaseState.ACTIVE,
                LeaseEvent.EXPIRE,
                reason,
                now,
                where=(Lease.expires_at <= now,),
            ):
                continue
            result.expired.append(row.id)
            if row.expires_at <= grace_cutoff and self._move(
                # Lapsed longer ago than the grace (its host was silent): reclaim it now.
                row.id,
                LeaseState.EXPIRED,
                self._reclaim_events([(row.id, row.kind)])[row.id],
                f"expired for {self.policy.expiry_grace_s:g}s (grace)",
                now,
                where=(Lease.expires_at <= grace_cutoff,),
            ):
                result.reclaimed.append(row.id)

    def _abort_stale(self, rows: list[Any], now: datetime, result: ReapResult) -> None:
        cutoff = now - timedelta(seconds=self.policy.activation_deadline_s)
        reason = f"not activated within {self.policy.activation_deadline_s:g}s"
        for row in rows:
            if self._move(
                row.id,
                LeaseState.GRANTED,
                LeaseEvent.ABORT,
                reason,
                now,
                where=(Lease.granted_at <= cutoff,),
            ):
                result.aborted.append(row.id)

    def _revoke(self, now: datetime, result: ReapResult, reason: Reason, *where: Any) -> None:
        result.revoked.extend(
            revoke_matching(
                self.ledger,
                where,
                reason=reason,
                actor=ACTOR,
                now=now,
                deadline_s=self.policy.revoke_deadline_s,
                limit=BATCH,
            )
        )

    def _revoke_drained(self, now: datetime, result: ReapResult) -> None:
        for device_id, uid, deadline in drain_deadlines(self.ledger):
            if deadline is None or deadline <= now:
                self._revoke(now, result, f"device {uid} drained", Lease.device_id == device_id)
        for host_id, name, deadline in host_drain_deadlines(self.ledger):
            if deadline is None or deadline > now:
                continue  # drained without a deadline: its leases run to their end
            reason = f"host {name} drained (deadline {deadline.isoformat(timespec='seconds')})"
            self._revoke(now, result, reason, Lease.host_id == host_id)

    def _revoke_unshrunk(self, now: datetime, result: ReapResult) -> None:
        """Pressure: a lease asked to give memory back that has not by the deadline."""
        self._revoke(
            now,
            result,
            lambda row: (
                f"pool pressure: {row.shrink_wanted_bytes} bytes not given back by the deadline"
            ),
            Lease.shrink_deadline_at <= now,
        )

    def _reclaim_events(self, leases: Sequence[tuple[str, str]]) -> dict[str, LeaseEvent]:
        if not leases:
            return {}
        with self.ledger.read() as s:
            return reclaim_events(s.connection(), leases)

    def _reclaim(self, due: dict[str, list[Any]], now: datetime, result: ReapResult) -> None:
        grace = timedelta(seconds=self.policy.expiry_grace_s)
        with self.ledger.read() as s:
            orphaned = [
                (lease_id, kind, since)
                for lease_id, kind, since in orphaned_since(s.connection(), limit=BATCH)
                if since <= now - grace
            ]
        events = self._reclaim_events(
            [
                (row.id, row.kind)
                for state in (LeaseState.EXPIRED.value, LeaseState.REVOKING.value)
                for row in due.get(state, [])
            ]
            + [(lease_id, kind) for lease_id, kind, _since in orphaned]
        )
        for row in due.get(LeaseState.EXPIRED.value, []):
            if self._move(
                row.id,
                LeaseState.EXPIRED,
                events[row.id],
                f"expired for {self.policy.expiry_grace_s:g}s (grace)",
                now,
                where=(Lease.expires_at <= now - grace,),
            ):
                result.reclaimed.append(row.id)
        for row in due.get(LeaseState.REVOKING.value, []):
            if self._move(
                row.id,
                LeaseState.REVOKING,
                events[row.id],
                "revocation deadline passed without the agent's confirmation",
                now,
                where=(Lease.expires_at <= now,),
            ):
                result.reclaimed.append(row.id)
        for lease_id, _kind, _since in orphaned:
            if self._move(
                lease_id,
                LeaseState.ORPHANED,
                events[lease_id],
                f"orphaned for {self.policy.expiry_grace_s:g}s (grace)",
                now,
            ):
                result.reclaimed.append(lease_id)

    def _move(
        self,
        lease_id: str,
        expected: LeaseState,
        event: LeaseEvent,
        reason: str,
        now: datetime,
        where: Iterable[Any] = (),
    ) -> bool:
        conditions = tuple(where)

        def attempt() -> bool:
            with self.ledger.write() as s:
                return transitions.move_if(
                    s.connection(),
                    lease_id,
                    expected,
                    event,
                    actor=ACTOR,
                    reason=reason,
                    now=now,
                    where=conditions,
                )

        moved = transitions.retrying(attempt, what=f"{event.value} of {lease_id}")
        if moved:
            log.info("lease %s: %s (%s)", lease_id, event.value, reason)
        return moved


def revoke_in(
    ledger: Ledger,
    lease_id: str,
    state: LeaseState,
    *,
    actor: str,
    reason: str,
    now: datetime,
    deadline_s: float,
) -> bool:
    """Revoke one lease in its own transaction; its `expires_at` becomes the revocation deadline.

    A revoking lease cannot be renewed, so `expires_at` is free to say when the
    holder's claim ends: the agent must confirm (`confirm_revoked`) before it,
    or the reaper reclaims the lease when it passes.
    """
    deadline = now + timedelta(seconds=deadline_s)

    def attempt() -> bool:
        with ledger.write() as s:
            return transitions.move_if(
                s.connection(),
                lease_id,
                state,
                LeaseEvent.REVOKE,
                actor=actor,
                reason=reason,
                now=now,
                values={"expires_at": deadline},
                detail={"deadline_at": deadline.isoformat()},
            )

    return transitions.retrying(attempt, what=f"revocation of {lease_id}")


# A revocation reason, or how to word it from the lease's row (id, state, shrink_wanted_bytes).
Reason = str | Callable[[Any], str]


def revoke_matching(
    ledger: Ledger,
    where: Iterable[Any],
    *,
    reason: Reason,
    actor: str,
    now: datetime,
    deadline_s: float,
    limit: int | None = None,
) -> list[str]:
    """Revoke every revocable lease matching ``where``, each in its own transaction; the ids
    revoked (a lease that changed state meanwhile is left as it is)."""
    stmt = (
        select(Lease.id, Lease.state, Lease.shrink_wanted_bytes)
        .where(*where, Lease.state.in_([st.value for st in REVOCABLE]))
        .order_by(Lease.id)  # lock order, though each revocation is its own transaction
    )
    with ledger.read() as s:
        rows = s.execute(stmt if limit is None else stmt.limit(limit)).all()
    return [
        row.id
        for row in rows
        if revoke_in(
            ledger,
            row.id,
            LeaseState(row.state),
            actor=actor,
            reason=reason if isinstance(reason, str) else reason(row),
            now=now,
            deadline_s=deadline_s,
        )
    ]


def drain_deadlines(ledger: Ledger) -> list[tuple[int, str, datetime | None]]:
    """Each draining device with the deadline of its latest `device.drain` (None: at once)."""
    with ledger.read() as s:
        draining = s.execute(select(Device.id, Device.uid).where(Device.state == "draining")).all()
        return _latest_deadlines(s, "device.drain", Event.device_id, draining)


def host_drain_deadlines(ledger: Ledger) -> list[tuple[int, str, datetime | None]]:
    """Each draining host with the deadline of its latest `host.drain` (None: no deadline)."""
    with ledger.read() as s:
        draining = s.execute(select(Host.id, Host.name).where(Host.status == "draining")).all()
        return _latest_deadlines(s, "host.drain", Event.host_id, draining)


def _latest_deadlines(
    s: Session, kind: str, target: Any, targets: Sequence[Any]
) -> list[tuple[int, str, datetime | None]]:
    """(id, name, deadline_at of the latest `kind` event of that id) for each target; the
    drain events are the journal of a drain (draining._drain)."""
    if not targets:
        return []
    latest = (
        select(target, func.max(Event.id).label("event_id"))
        .where(Event.kind == kind, target.in_([t[0] for t in targets]))
        .group_by(target)
        .subquery()
    )
    details: dict[int, dict[str, Any]] = {
        target_id: detail
        for target_id, detail in s.execute(
            select(target, Event.detail).join(latest, latest.c.event_id == Event.id)
        )
    }
    out: list[tuple[int, str, datetime | None]] = []
    for target_id, name in targets:
        raw = (details.get(target_id) or {}).get("deadline_at")
        out.append((target_id, name, datetime.fromisoformat(raw) if raw else None))
    return out


def orphaned_since(conn: Any, *, limit: int | None = None) -> list[tuple[str, str, datetime]]:
    """Orphaned leases, their device kind, and when they became orphaned (their latest event)."""
    stmt = (
        select(Lease.id, Device.kind, Lease.expires_at)
        .join(Device, Device.id == Lease.device_id)
        .where(Lease.state == LeaseState.ORPHANED.value)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = conn.execute(stmt).all()
    if not rows:
        return []  # the common case: no scan of the (large) events table at all
    since: dict[str, datetime] = {}
    ids = [row.id for row in rows]
    for chunk in transitions.chunks(ids, 500):  # short IN lists; events are indexed by lease_id
        since.update(
            (lease_id, _aware(at))
            for lease_id, at in conn.execute(
                select(Event.lease_id, func.max(Event.at))
                .where(
                    Event.lease_id.in_(chunk),
                    Event.to_state == LeaseState.ORPHANED.value,
                )
                .group_by(Event.lease_id)
            )
        )
    # A lease orphaned without an event breaks invariant 3 (the audit reports it);
    # its expiry is the best guess of when its holder stopped.
    return [
        (lease_id, kind, since.get(lease_id, expires_at)) for lease_id, kind, expires_at in rows
    ]


def _aware(value: Any) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class ReaperThread:
    """Runs `Reaper.run_once` every `interval_s` in a daemon thread until stopped.

    `on_pass` hears each pass's result ("ok", "ledger_unavailable", "failed") and
    duration: poold's metrics count them (poold/api/metrics.py).
    """

    def __init__(
        self,
        reaper: Reaper,
        interval_s: float,
        *,
        on_pass: Callable[[str, float], None] | None = None,
    ) -> None:
        self.reaper = reaper
        self.interval_s = interval_s
        self.on_pass = on_pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="poold-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(self.interval_s):
            started = time.perf_counter()
            outcome = "failed"
            try:
                self.reaper.run_once()
                outcome = "ok"
            except LedgerUnavailable as err:
                outcome = "ledger_unavailable"
                # The ledger is down (the Ledger logged the outage once): the pass is
                # tried again next interval, without a traceback each time.
                if not failing:
                    log.warning("reaper passes stop until the ledger is back: %s", err.message)
                failing = True
                continue
            except Exception:
                # A failed pass (a bug, a lock timeout) is retried next interval;
                # the reaper thread must outlive it.
                log.exception("reaper pass failed")
                continue
            finally:
                if self.on_pass is not None:
                    self.on_pass(outcome, time.perf_counter() - started)
            if failing:
                log.info("reaper passes resumed")
                failing = False
