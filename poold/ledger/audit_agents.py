"""Does the ledger agree with what each host's agent says it holds?

What agents report with every heartbeat (per lease: its holders as pid + start
time, its dax sub-device, its local state and any scrub running; plus leftover
sub-devices; older agents send only lease ids; stored as
poold/ledger/agent_reports.py says) is compared with the ledger:

* a live lease the agent holds nothing for is *stale* (reclaimable: it is
  orphaned, the reaper reclaims it after grace);
* memory an agent holds for a lease the ledger ended is *leaked* (poold already
  revokes it in the next heartbeat reply; the audit lists it), and so is a
  leftover sub-device made for a lease the ledger ended or does not know: with
  `reclaim` the audit orders it deleted (a `host.leftover_delete` event; the
  host's next heartbeat reply revokes the lease id, and the agent destroys the
  sub-device);
* a lease `scrubbing` in the ledger for longer than `scrub_stuck_after_s`
  while its agent reports no scrub running is an *unfinished scrub*: with
  `reclaim` the scrub order is re-issued (a `lease.scrub_reissue` event; the
  order in the reply then carries `reissued_at`, and the agent scrubs again);
  if the agent is down nobody can zero the range: it needs a human;
* a ledger holder pid the agent does not report, or a leftover sub-device of
  a live lease, is a *holder mismatch* (listed, for a person to look at).

Everything the audit asks of an agent goes through the ledger (events) and the
heartbeat reply: poold never calls agents.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from poold.lease_states import LIVE_STATES, LeaseEvent, LeaseState
from poold.ledger import transitions
from poold.ledger.agent_reports import LEFTOVER_DELETE, SCRUB_REISSUE, parse_stored
from poold.ledger.audit_ledger import ACTOR, LeaseRow
from poold.ledger.db import Ledger
from poold.ledger.models import Host, Lease
from poold.wire.admin import AgentFindings, AuditItem
from poold.wire.agent import AgentLease, LeftoverSubDevice

# An agent's report is trusted for this long, and a lease granted (or ended) less than
# STALE_MARGIN_S before the report may simply not have reached (or left) the agent's
# list yet: the heartbeat that carries the list and the op batch that ends a lease are
# sent apart, and either may arrive first.
AGENT_REPORT_FRESH_S = 60.0
STALE_MARGIN_S = 5.0
# A lease may sit in `scrubbing` with no scrub running on its agent for this long
# (the order rides on the next heartbeat reply; the verdict on the agent's outbox)
# before the audit calls the scrub unfinished. A running scrub is never unfinished,
# however long it takes: the agent reports it, with its progress.
SCRUB_STUCK_AFTER_S = 120.0
# An unfinished scrub nobody can finish (its agent is down): the audit's action for it.
NEEDS_HUMAN = "needs_human"


@dataclass(frozen=True)
class AgentReport:
    """What one host's agent last said it holds (hosts.agent_leases), and whether it is up."""

    at: datetime | None  # when the report arrived (None: the agent never sent one)
    leases: dict[str, AgentLease]
    leftovers: list[LeftoverSubDevice]
    # False: an older agent's bare list of ids (no holders, scrubs or leftovers).
    detailed: bool
    status: str = "up"
    last_heartbeat_at: datetime | None = None

    def fresh(self, now: datetime) -> bool:
        return self.at is not None and (now - self.at).total_seconds() <= AGENT_REPORT_FRESH_S

    def agent_up(self, now: datetime) -> bool:
        heard = self.last_heartbeat_at
        return (
            self.status != "down"
            and heard is not None
            and (now - heard).total_seconds() <= AGENT_REPORT_FRESH_S
        )

    def held(self) -> set[str]:
        """The ids the agent holds memory for (a running scrub is not holding, nor is a
        watched memfd that other processes map: see `mapped`)."""
        return {i for i, x in self.leases.items() if x.state not in ("scrubbing", "mapped")}

    def mapped(self) -> dict[str, AgentLease]:
        """Ended memfd leases some process still maps or holds (the agent watches them)."""
        return {i: x for i, x in self.leases.items() if x.state == "mapped"}


def _ended_in_flight(ended_at: datetime | None, report: AgentReport) -> bool:
    """The lease ended so shortly before the report arrived (or after it) that the report
    may have been made before the agent let go of it: not a leak yet."""
    assert report.at is not None  # a fresh report
    return ended_at is not None and (report.at - ended_at).total_seconds() <= STALE_MARGIN_S


def check_agents(
    leases: Iterable[LeaseRow],
    reports: dict[int, AgentReport],
    host_names: dict[int, str],
    now: datetime,
    *,
    state_since: dict[str, datetime] | None = None,
    device_uids: dict[int, str] | None = None,
    scrub_stuck_after_s: float = SCRUB_STUCK_AFTER_S,
) -> AgentFindings:
    """Compare the ledger with what each agent says it holds (pure)."""
    since = state_since or {}
    uids = device_uids or {}
    fresh = {host_id: r for host_id, r in reports.items() if r.fresh(now)}
    if not fresh:
        # No report to compare: only scrubs can be stuck (their agents are down).
        leases = [x for x in leases if x.state == LeaseState.SCRUBBING.value]
    stale: list[AuditItem] = []
    mismatches: list[AuditItem] = []
    scrubs: list[AuditItem] = []
    live_by_host: dict[int, set[str]] = defaultdict(set)
    state_of: dict[str, str] = {}
    ended_at: dict[str, datetime] = {}

    def item(kind: str, lease: LeaseRow, message: str, **kw: Any) -> AuditItem:
        return AuditItem(
            kind=kind,
            lease_id=lease.id,
            device_id=lease.device_id,
            device_uid=uids.get(lease.device_id),
            host=host_names.get(lease.host_id),
            state=lease.state,
            message=message,
            **kw,
        )

    for lease in leases:
        state_of[lease.id] = lease.state
        if lease.state not in LIVE_STATES:
            if lease.ended_at is not None:
                ended_at[lease.id] = lease.ended_at
            continue
        live_by_host[lease.host_id].add(lease.id)
        if lease.state == LeaseState.SCRUBBING.value:
            found = _unfinished_scrub(
                lease, reports.get(lease.host_id), since.get(lease.id), now, scrub_stuck_after_s
            )
            if found is not None:
                message, action = found
                scrubs.append(item("unfinished_scrub", lease, message, action=action))
            continue
        report = fresh.get(lease.host_id)
        if report is None:
            continue
        entry = report.leases.get(lease.id)
        if entry is None or entry.state == "scrubbing":
            # Only leases whose memory must exist, granted well before the report.
            assert report.at is not None
            if (
                lease.state in ("active", "revoking")
                and (report.at - lease.granted_at).total_seconds() > STALE_MARGIN_S
            ):
                stale.append(
                    item(
                        "stale",
                        lease,
                        "live in the ledger, but its host's agent holds no memory for it",
                        sub_device=entry.sub_device if entry is not None else None,
                    )
                )
            continue
        if entry.state == "mapped":
            continue  # listed below, with every mapping the agent watches
        pids = {h.pid for h in entry.holders}
        if lease.holder_pid is not None and pids and lease.holder_pid not in pids:
            agent_says = ", ".join(
                f"pid {h.pid}"
                + (f" started {_at(h.start_time)}" if h.start_time is not None else "")
                for h in entry.holders
            )
            mismatches.append(
                item(
                    "holder_mismatch",
                    lease,
                    f"the ledger's holder is pid {lease.holder_pid}; the agent reports "
                    f"{agent_says} ({entry.state})",
                    sub_device=entry.sub_device,
                )
            )
    leaked = [
        AuditItem(
            kind="leaked",
            lease_id=lease_id,
            host=host_names.get(host_id),
            state=state_of.get(lease_id),
            sub_device=report.leases[lease_id].sub_device,
            message="the agent holds memory for a lease the ledger does not have live "
            "(poold revokes it in the next heartbeat reply)",
        )
        for host_id, report in fresh.items()
        for lease_id in sorted(report.held() - live_by_host[host_id])
        if not _ended_in_flight(ended_at.get(lease_id), report)
    ]
    for host_id, report in fresh.items():
        for lease_id, entry in sorted(report.mapped().items()):
            leaked.append(
                _leaked_mapping(
                    lease_id, entry, state_of.get(lease_id), host_names.get(host_id), now
                )
            )
        for left in report.leftovers:
            state = state_of.get(left.lease_id)
            what = (
                f"sub-device {left.sub_device} ({left.size_bytes} bytes of dax region "
                f"{left.region_id}) that the agent made for this lease"
            )
            common = {
                "lease_id": left.lease_id,
                "host": host_names.get(host_id),
                "state": state,
                "sub_device": left.sub_device,
            }
            if state is not None and state in LIVE_STATES:
                mismatches.append(
                    AuditItem(
                        kind="leftover_of_live_lease",
                        message=f"{what} remains, but the agent holds no lease for it",
                        **common,
                    )
                )
            else:
                ended = f"has ended ({state})" if state is not None else "does not know"
                leaked.append(
                    AuditItem(
                        kind="leftover_sub_device",
                        message=f"{what} remains; the ledger {ended} the lease "
                        "(--reclaim has the agent delete it)",
                        **common,
                    )
                )
    note = (
        f"{len(fresh)} agent(s) reported within {AGENT_REPORT_FRESH_S:g}s"
        if fresh
        else "no agent reported its leases recently"
    )
    return AgentFindings(
        available=bool(fresh),
        leaked=leaked,
        stale=stale,
        unfinished_scrubs=scrubs,
        holder_mismatches=mismatches,
        note=note,
    )


def _leaked_mapping(
    lease_id: str, entry: AgentLease, state: str | None, host: str | None, now: datetime
) -> AuditItem:
    """A memfd lease that ended while processes still map or hold it: its bytes stay
    counted (DESIGN.md "Memory follows the pages"), and only those processes can give
    them back, so a human must see which (nothing to reclaim)."""
    pids = ", ".join(str(h.pid) for h in entry.holders) or "unknown"
    how_long = ""
    if entry.mapped_since is not None:
        since = entry.mapped_since
        age_s = (now - (since if since.tzinfo else since.replace(tzinfo=UTC))).total_seconds()
        how_long = f" for {max(0.0, age_s):.0f}s (since {since.isoformat(timespec='seconds')})"
    if state is None or state not in LIVE_STATES:
        counted = f"the ledger has it {state or 'unknown'}: those bytes are counted free"
    else:
        counted = "its bytes stay counted against the tenant and the device"
    return AuditItem(
        kind="leaked_mapping",
        lease_id=lease_id,
        host=host,
        state=state,
        message=f"ended, but pid(s) {pids} still map or hold its memfd{how_long}; {counted}",
    )


def _unfinished_scrub(
    lease: LeaseRow,
    report: AgentReport | None,
    since: datetime | None,
    now: datetime,
    stuck_after_s: float,
) -> tuple[str, str | None] | None:
    """(message, action) when a scrubbing lease's scrub looks dropped; None while it may run."""
    if since is None or (now - since).total_seconds() < stuck_after_s:
        return None
    for_s = f"scrubbing since {since.isoformat(timespec='seconds')}"
    if report is None or not report.agent_up(now):
        heard = report.last_heartbeat_at if report is not None else None
        last = heard.isoformat(timespec="seconds") if heard is not None else "never"
        return (
            f"{for_s}, and its host's agent is down (last heartbeat: {last}): "
            "nobody can zero the range",
            NEEDS_HUMAN,
        )
    if not report.fresh(now) or not report.detailed:
        return None  # an agent that does not report its scrubs: cannot tell
    assert report.at is not None
    if (report.at - since).total_seconds() <= STALE_MARGIN_S:
        return None
    entry = report.leases.get(lease.id)
    if entry is not None and entry.state == "scrubbing":
        return None  # running (its progress is in the agent's report)
    return f"{for_s}; its agent reports no scrub running (--reclaim re-issues the order)", None


def _at(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="seconds")


def load_agent_reports(ledger: Ledger) -> dict[int, AgentReport]:
    """Every host's last stored agent report, with its status and last heartbeat."""
    out: dict[int, AgentReport] = {}
    with ledger.read() as s:
        for host_id, status, heard, raw, at in s.execute(
            select(
                Host.id,
                Host.status,
                Host.last_heartbeat_at,
                Host.agent_leases,
                Host.agent_leases_at,
            )
        ):
            parsed = parse_stored(raw) if at is not None else None
            found, leftovers, detailed = parsed or ({}, [], False)
            out[host_id] = AgentReport(
                at if parsed is not None else None, found, leftovers, detailed, status, heard
            )
    return out


def reclaim_stale(ledger: Ledger, stale: list[AuditItem], now: datetime) -> int:
    """Orphan stale active leases: no memory is behind them; the reaper reclaims after grace."""
    done = 0
    for it in stale:
        if it.lease_id is None or it.state != "active":
            continue
        with ledger.write() as s:
            moved = transitions.move_if(
                s.connection(),
                it.lease_id,
                LeaseState.ACTIVE,
                LeaseEvent.ORPHAN,
                actor=ACTOR,
                reason="its host's agent holds no memory for it",
                now=now,
            )
        it.action = "orphaned" if moved else "lost_race"
        done += int(moved)
    return done


def order_leftover_deletes(
    ledger: Ledger, leaked: list[AuditItem], host_ids: dict[str, int]
) -> int:
    """Ask agents to delete leftover sub-devices of ended leases (one event each)."""
    done = 0
    for it in leaked:
        host_id = host_ids.get(it.host or "")
        if it.kind != "leftover_sub_device" or it.lease_id is None or host_id is None:
            continue
        with ledger.write() as s:
            transitions.record(
                s,
                transitions.event_row(
                    actor=ACTOR,
                    kind=LEFTOVER_DELETE,
                    lease_id=it.lease_id,
                    host_id=host_id,
                    reason=f"audit: leftover sub-device {it.sub_device} of an ended lease",
                    detail={"sub_device": it.sub_device},
                ),
            )
        it.action = "delete_ordered"
        done += 1
    return done


def reissue_scrubs(ledger: Ledger, scrubs: list[AuditItem], stuck_after_s: float) -> int:
    """Re-issue the scrub order of unfinished scrubs whose agent is up (one event each)."""
    done = 0
    for it in scrubs:
        if it.lease_id is None or it.action is not None:
            continue  # needs a human: its agent is down
        with ledger.write() as s:
            row = s.execute(
                select(Lease.state, Lease.host_id, Lease.device_id, Lease.tenant_id).where(
                    Lease.id == it.lease_id
                )
            ).one_or_none()
            if row is None or row.state != LeaseState.SCRUBBING.value:
                it.action = "lost_race"  # scrubbed (or failed) since the audit read it
                continue
            transitions.record(
                s,
                transitions.event_row(
                    actor=ACTOR,
                    kind=SCRUB_REISSUE,
                    lease_id=it.lease_id,
                    host_id=row.host_id,
                    device_id=row.device_id,
                    tenant_id=row.tenant_id,
                    reason=f"audit: no scrub running on the agent for over {stuck_after_s:g}s",
                ),
            )
        it.action = "scrub_reissued"
        done += 1
    return done
