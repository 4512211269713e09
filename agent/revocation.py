"""What does poold hear of this host's leases, and how does a lease end that poold revoked
or whose holder died?

:class:`Revocations` is the one object the heartbeat link (agent/link.py, the
:class:`~agent.link.HeartbeatState` protocol) asks what to report, every heartbeat: the
held lease ids and holdings (holder, sub-device, state, scrub progress, leftovers),
the revoked leases still mapped, the tenants' accounting reports and what the oldest
waiting lease request wants; and that it tells what poold replied: renewals refused or
extended, revocations, shrink hints, scrub orders.

A revoked lease is torn down at its deadline, not at once, so that its tenant (told in
its renew replies) can move its blocks away first. devdax memory is taken back by the
kernel; a memfd cannot be taken from whoever maps or holds it (its holder, or any process
it passed the fd to). So every memfd lease that ends (released, revoked, orphaned) is
checked by inode across /proc (agent/mappings.py): one still mapped is *watched* (its
bytes stay counted: `release_mapped`, `reclaim_mapped`, and reported in every heartbeat
with the pids that map it) until a scan finds nobody, then `unmapped`. The holder watch
orphans the leases whose holder is gone, and rescans the watched memfds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

from agent import mappings, release_check
from agent.admission import Admission
from agent.backends.emulated import OnceFd
from agent.held import Ending, HeldLease, HeldLeases
from agent.holders import alive as holder_alive
from agent.link import Holdings, PooldLink
from agent.memory import LeaseMemory
from agent.protocol import LOST_ENDED, LOST_REVOKED, Event, LostEvent, RevokeEvent, ShrinkEvent
from poold.errors import PoolError
from poold.wire.agent import (
    AgentLease,
    HeartbeatReply,
    LeaseHolder,
    LeaseOp,
    LeaseReport,
    Revocation,
    ScrubProgress,
    ShrinkHint,
)

log = logging.getLogger("pool_agent")

# Tear a revoked lease down this long before poold's deadline, so the confirmation
# arrives in time and the reaper never has to reclaim it by force.
REVOKE_MARGIN_S = 1.0
# How long a second path to end a lease waits for the first one's verdict (a /proc scan
# at most, normally); past it the lease counts as freed by the first.
ENDING_WAIT_S = 10.0


class Revocations:
    """The agent's side of every heartbeat, and the end of revoked and orphaned leases."""

    def __init__(
        self, link: PooldLink, held: HeldLeases, memory: LeaseMemory, admission: Admission
    ) -> None:
        self.link = link
        self.held = held
        self.memory = memory
        self.admission = admission
        self._lock = threading.Lock()
        # Latest accounting report per lease, not yet handed to the link's heartbeat.
        self._reports: dict[str, LeaseReport] = {}
        # poold's shrink hints (pressure) per held lease, handed out once in `renew`.
        self._shrink: dict[str, ShrinkHint] = {}
        self._stop = threading.Event()
        # Where processes are looked for (tests point it at a fixture tree).
        self.proc_root: str = str(mappings.PROC)
        self._warned_unreadable = False
        # Tenant sessions (agent/server.py AgentServer.push: connection id, pid, event);
        # None until a server attaches. Renew replies stay the fallback path.
        self.push: Callable[[int, int, Event], bool] | None = None
        self._told_shrink: dict[str, tuple[int, int, datetime]] = {}  # hint last pushed

    def tell(self, held: HeldLease, event: Event) -> None:
        """Push ``event`` to the lease's holder's session, if it has one; never blocks."""
        push = self.push
        if push is not None:
            try:
                push(held.conn_id, held.holder_pid, event)
            except Exception:
                log.exception("could not queue a %s event for lease %s", event.event, held.lease.id)

    # --- what the link asks ---------------------------------------------------------
    def held_ids(self) -> list[str]:
        """Every lease this agent holds memory (or a holder) for."""
        return self.held.ids()

    def revoked_held_ids(self) -> list[str]:
        """Revoked leases still mapped by their live holders."""
        return self.held.revoked_held_ids()

    def admission_wanted_bytes(self) -> int:
        """What the oldest waiting lease request needs."""
        return self.admission.wanted_bytes()

    def take_reports(self) -> list[LeaseReport]:
        """The reports changed since the last call, of leases still held."""
        with self._lock:
            pending, self._reports = self._reports, {}
        return [r for lease_id, r in pending.items() if lease_id in self.held]

    def holdings(self) -> Holdings:
        """Per lease its holder, sub-device and state (scrubs running included, with the
        bytes zeroed so far), and the sub-devices this agent made that no held lease or
        running scrub accounts for.

        Built without validation (model_construct): it runs every heartbeat over every lease.
        """
        held = self.held.all()
        running, tied = self.memory.scrubs(held)
        report: list[AgentLease] = []
        for h in held:
            scrub = running.pop(h.lease.id, None)
            report.append(
                AgentLease.model_construct(
                    lease_id=h.lease.id,
                    state="revoked_held" if h.revoked_held else "held",
                    holders=[
                        LeaseHolder.model_construct(
                            pid=h.holder_pid,
                            start_time=h.holder.start_time if h.holder is not None else None,
                        )
                    ],
                    sub_device=h.sub_device,
                    scrub=ScrubProgress.model_construct(started_at=scrub[0], bytes_done=scrub[1])
                    if scrub is not None
                    else None,
                )
            )
        for m in self.held.mapped():
            report.append(
                AgentLease.model_construct(
                    lease_id=m.lease_id,
                    state="mapped",
                    holders=[LeaseHolder.model_construct(pid=pid) for pid in sorted(m.pids)],
                    sub_device=None,
                    scrub=None,
                    mapped_since=m.since,
                )
            )
        for lease_id, (started_at, bytes_done) in sorted(running.items()):
            # bytes_done: what the backend's scrub has zeroed so far.
            report.append(
                AgentLease.model_construct(
                    lease_id=lease_id,
                    state="scrubbing",
                    holders=[],
                    sub_device=None,
                    scrub=ScrubProgress.model_construct(
                        started_at=started_at, bytes_done=bytes_done
                    ),
                )
            )
        return report, self.memory.leftovers.sweep(self.held.journal, tied)

    # --- what the socket operations leave for it ------------------------------------
    def note_report(self, report: LeaseReport) -> None:
        """A tenant's accounting: only the latest counts; the next heartbeat carries it."""
        with self._lock:
            self._reports[report.lease_id] = report

    def take_shrink_hint(self, lease_id: str) -> ShrinkHint | None:
        """poold's pressure hint for a held lease, handed out once."""
        with self._lock:
            return self._shrink.pop(lease_id, None)

    # --- poold's answers ------------------------------------------------------------
    def on_reply(self, reply: HeartbeatReply) -> None:
        """What poold replied to a heartbeat (or a registration)."""
        # Revocations first: the same reply refuses the renewal of a lease it revokes,
        # and the holder must be told the deadline (renew), not that the lease is lost.
        if reply.revocations:
            self._note_revocations(reply.revocations)
        for result in reply.renewed:
            if result.code is not None:
                log.warning("renewal of %s refused: %s", result.lease_id, result.message)
                held = self.held.get(result.lease_id)
                if (
                    held is not None
                    and held.revoke_deadline_at is None
                    and result.code in ("lease_not_active", "unknown_lease")
                ):
                    held.lost = True
                    self.tell(
                        held,
                        LostEvent(
                            lease_id=held.lease.id,
                            reason=LOST_ENDED,
                            message=(result.message or result.code)[:512],
                        ),
                    )
            elif result.expires_at is not None:
                held = self.held.get(result.lease_id)
                if held is not None:
                    held.expires_at = result.expires_at
        self.admission.capacity_changed()
        self._store_shrink_hints(reply.shrink)
        for order in reply.scrub:
            self.memory.scrub_ordered(order)

    def _store_shrink_hints(self, hints: list[ShrinkHint]) -> None:
        """Keep the latest hint of each held lease; a lease poold no longer asks has none.

        A hint not yet handed to its tenant keeps its earlier deadline.
        """
        held = set(self.held.ids())
        with self._lock:
            fresh: dict[str, ShrinkHint] = {}
            for hint in hints:
                if hint.lease_id not in held:
                    continue
                pending = self._shrink.get(hint.lease_id)
                if pending is not None and pending.deadline_at < hint.deadline_at:
                    hint = hint.model_copy(update={"deadline_at": pending.deadline_at})
                fresh[hint.lease_id] = hint
            self._shrink = fresh
            told, self._told_shrink = self._told_shrink, {}
            news: list[ShrinkHint] = []
            for hint in fresh.values():
                key = (hint.target_bytes, hint.replica_bytes, hint.deadline_at)
                self._told_shrink[hint.lease_id] = key
                if told.get(hint.lease_id) != key:
                    news.append(hint)
        for hint in news:  # new or changed: the session hears it now, renewals later
            held_lease = self.held.get(hint.lease_id)
            if held_lease is not None:
                self.tell(
                    held_lease,
                    ShrinkEvent(
                        lease_id=hint.lease_id,
                        target_bytes=hint.target_bytes,
                        replica_bytes=hint.replica_bytes,
                        deadline_at=hint.deadline_at,
                    ),
                )

    def _note_revocations(self, revocations: list[Revocation]) -> None:
        """Revoked leases are torn down at their deadline, not at once.

        Until then the tenant's renewals are answered with the deadline, so the
        engine can move its blocks away before the memory goes. Leases this agent
        does not hold are confirmed at once (there is nothing to tear down).
        """
        now = datetime.now(UTC)
        unknown: list[str] = []
        for r in revocations:
            held = self.held.get(r.lease_id)
            if held is None:
                unknown.append(r.lease_id)
            elif held.revoke_deadline_at is None:
                # Keep a safety margin before poold's own deadline.
                deadline = (r.deadline_at or now) - timedelta(seconds=REVOKE_MARGIN_S)
                held.revoke_deadline_at = max(deadline, now)
                if held.revoke_deadline_at > now:
                    self.tell(
                        held,
                        RevokeEvent(lease_id=held.lease.id, deadline_at=held.revoke_deadline_at),
                    )
                else:  # no notice (the ledger ended it): the tenant hears it is lost
                    held.extra["lost_reason"] = (LOST_ENDED, r.reason)
        if unknown:
            # A leftover sub-device of an ended lease (poolctl audit --reclaim) goes too.
            self.memory.leftovers.delete(self.held.journal, unknown, self.memory.tied())
            self.revoke(unknown)
        self.revoke_due()

    # --- ending leases --------------------------------------------------------------
    def revoke_due(self) -> int:
        """Tear down the revoked leases whose deadline has come; how many."""
        now = datetime.now(UTC)
        due = [
            h.lease.id
            for h in self.held.all()
            if h.revoke_deadline_at is not None
            and h.revoke_deadline_at <= now
            and not h.revoked_held
        ]
        if due:
            self.revoke(due)
        return len(due)

    def revoke(self, lease_ids: list[str]) -> None:
        """Tear down revoked leases, then confirm to poold (revoking -> reclaimed/scrubbing).

        devdax memory is taken back by the kernel (the sub-device goes; the holder's
        next access is SIGBUS). A memfd cannot be taken from a live mapping: the
        agent drops its copy and the holder's later renewals get `lease_not_active`.
        """
        confirm: list[str] = []
        taken: list[HeldLease] = []  # still held (not released by its tenant): lost now
        for lease_id in lease_ids:
            held = self.held.get(lease_id)
            if held is not None:
                taken.append(held)
            if held is not None and self.ended_mapped(held, "revoked"):
                continue
            if held is not None and held.inode is None and self._pages_stay_with_holder(held):
                # Re-adopted from a journal older than inodes: only the holder is known.
                if not held.revoked_held:
                    log.warning(
                        "lease %s revoked, but holder pid %d still maps its memfd: "
                        "it counts as used until the holder exits",
                        lease_id,
                        held.holder_pid,
                    )
                    held.revoked_held = True
                    self.memory.close_copy(held)  # the agent's own copy goes now
                    held.memory = None
                continue
            gone = self.held.forget(lease_id, "revoked")
            if gone is not None:
                log.warning("lease %s revoked by poold; tearing it down", lease_id)
                self.memory.drop(gone)
            confirm.append(lease_id)
        for held in taken:  # after the teardown: told lost, it is gone
            reason, message = held.extra.get("lost_reason", (LOST_REVOKED, "revoked"))
            self.tell(held, LostEvent(lease_id=held.lease.id, reason=reason, message=message[:512]))
        if not confirm:
            return
        try:
            self.link.client.confirm_revoked(confirm)
        except PoolError as err:
            log.warning("could not confirm revocations to poold: %s", err.message)

    def _pages_stay_with_holder(self, held: HeldLease) -> bool:
        """A memfd (emulated, numa) lease whose holder lives: revoking cannot unmap it."""
        backend = self.memory.backend_of(held)
        if (backend is not None and backend.revoke_unmaps) or held.holder is None:
            return False
        return holder_alive(held.holder)

    # --- memory that follows the pages ----------------------------------------------
    def scan(self, inodes: set[mappings.Inode], probes: Iterable[OnceFd] = ()) -> mappings.Scan:
        """Who maps or holds these memfds now (one pass over /proc); the agent's own
        ``probes`` (agent/release_check.py) do not count."""
        me = os.getpid()
        ignore = [(me, fd) for fd in (p.fd for p in probes) if fd is not None]
        found = mappings.scan(inodes, proc_root=self.proc_root, ignore=ignore)
        if found.unreadable and not self._warned_unreadable:
            self._warned_unreadable = True
            log.warning(
                "%d process(es) could not be read under %s: memfds they map are not seen "
                "(the agent needs root, or CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH)",
                found.unreadable,
                self.proc_root,
            )
        return found

    def ended_mapped(self, held: HeldLease, why: str) -> bool:
        """A memfd lease ends (``why``: released, revoked, orphaned): the agent's own copy
        goes, and if any process still maps or holds the memfd the lease is watched and
        poold told its bytes stay counted; True then. False (nothing maps it, or it is no
        memfd) leaves the ending to the caller.

        Once per lease: a second caller (a release racing a revocation's teardown) gets
        the first one's verdict. Judging on its own, with the memory already taken, it
        would scan /proc and could find the memfd in the agent's own warm pool, given
        back meanwhile: the lease watched for ever.
        """
        if not self._follows_pages(held):
            return False  # no memfd: nothing to watch, and the ending is the caller's
        ending = self.held.claim_end(held)
        if ending is None:
            claimed = held.ending
            assert claimed is not None  # set once, never unset
            return claimed.verdict(ENDING_WAIT_S)
        mapped = False
        try:
            mapped = self._judge(held, why)
        finally:
            ending.settle(mapped)
        return mapped

    def _follows_pages(self, held: HeldLease) -> bool:
        """A memfd lease (its inode known): one whose pages stay with whoever maps them."""
        backend = self.memory.backend_of(held)
        return held.inode is not None and not (backend is not None and backend.revoke_unmaps)

    def _judge(self, held: HeldLease, why: str, found: mappings.Scan | None = None) -> bool:
        """:meth:`ended_mapped` by the path that claimed the ending, for a lease whose
        pages follow their mappings (:meth:`_follows_pages`). ``found``: a scan the
        caller made after taking the agent's copies (:meth:`check_holders`)."""
        inode = held.inode
        assert inode is not None  # _follows_pages
        probe: OnceFd | None = None  # open while the kernel counts another file of it
        if found is None:
            free, probe = self._end(held)
            if free:
                return False  # the kernel says nobody: no scan
            found = self.scan({inode}, [probe] if probe is not None else [])
        pids = found.pids.get(inode) or set()
        if not pids and (probe is None or not release_check.still_held(probe)):
            if probe is not None:
                probe.close()
            return False
        # Either /proc names who holds it, or the kernel counts a file of it that no
        # process's fd table shows (an fd in flight in a socket, a file held for
        # someone by the kernel): the scan alone would have called it free.
        if self.held.watch(held, why, pids, probe) is None:
            if probe is not None:
                probe.close()
            return False
        who = ",".join(str(p) for p in sorted(pids)) or "none /proc shows (an fd in flight?)"
        log.warning(
            "lease %s %s, but pid(s) %s still map or hold its memfd: its %d bytes stay "
            "counted until none does",
            held.lease.id,
            why,
            who,
            held.lease.length_bytes,
        )
        # An orphan stays orphaned (the reaper reads the watch in the next report).
        op = {"released": "release_mapped", "revoked": "reclaim_mapped"}.get(why)
        if op is not None:
            self.link.enqueue(
                LeaseOp(
                    lease_id=held.lease.id,
                    op=op,
                    reason=f"memfd still mapped by pid(s) {who}",
                )
            )
        return True

    def _unheld(self, held: HeldLease) -> bool:
        """The agent's files of an ending memfd lease go (once, whoever calls), and True
        when the kernel says no other process holds or maps it (agent/release_check.py):
        then no /proc scan is needed. False: maybe held, scan."""
        free, probe = self._end(held)
        if probe is not None:
            probe.close()
        return free

    def _end(self, held: HeldLease) -> tuple[bool, OnceFd | None]:
        """:meth:`_unheld`, and the probe, still open, when the kernel says held."""
        memory = self.held.take_memory(held)
        if memory is None:
            return False, None
        return self.memory.release_check.end(memory)

    def check_mapped(self) -> int:
        """Rescan the watched memfds (one pass); those nobody maps or holds any more are
        `unmapped` (their bytes free again). Returns how many."""
        watched = self.held.mapped()
        if not watched:
            return 0
        found = self.scan({m.inode for m in watched}, [m.probe for m in watched if m.probe])
        freed = 0
        for m in watched:
            pids = found.pids.get(m.inode)
            if pids:
                m.pids = set(pids)
                continue
            if m.probe is not None and release_check.still_held(m.probe):
                m.pids = set()  # still open somewhere /proc does not show
                continue
            if self.held.unwatch(m.lease_id) is None:
                continue
            log.debug(
                "lease %s: no process maps its memfd any more; its bytes are free", m.lease_id
            )
            self.link.enqueue(
                LeaseOp(lease_id=m.lease_id, op="unmapped", reason="no process maps its memfd")
            )
            freed += 1
        if freed:
            self.admission.capacity_changed()
        return freed

    def check_holders(self, candidates: list[HeldLease] | None = None) -> int:
        """Orphan the leases whose holder process is gone (pid + start time); return how many.

        The agent drops its side of the memory (a devdax sub-device is destroyed)
        and tells poold, which reclaims the range after its grace period.
        """
        if candidates is None:
            candidates = self.held.all()
        dead = [h for h in candidates if h.holder is not None and not holder_alive(h.holder)]
        # A tenant's disconnect and the holder watch may both find its process gone: each
        # lease is ended by the check that claims it, and the other leaves it alone.
        endings = {h.lease.id: e for h in dead if (e := self.held.claim_end(h)) is not None}
        dead = [h for h in dead if h.lease.id in endings]
        try:
            return self._orphan(dead, endings)
        finally:
            for ending in endings.values():
                ending.settle(False)  # a no-op for those settled already

    def _orphan(self, dead: list[HeldLease], endings: dict[str, Ending]) -> int:
        """:meth:`check_holders` for the gone holders' leases it claimed."""
        found = mappings.Scan()
        # Their holders are gone: the agent's copies go first (the kernel may say at once
        # that nobody holds a memfd any more), then one scan for all the others.
        unheld = {h.lease.id for h in dead if h.inode is not None and self._unheld(h)}
        memfds = {h.inode for h in dead if h.inode is not None and h.lease.id not in unheld}
        if memfds:
            found = self.scan(memfds)
        orphaned = 0
        for held in dead:
            if held.revoked_held:
                # The revoked holder is gone at last: its pages are free; confirm.
                if self.held.forget(held.lease.id, "revoked") is not None:
                    self.revoke([held.lease.id])
                continue
            mapped_elsewhere = self._follows_pages(held) and self._judge(held, "orphaned", found)
            endings[held.lease.id].settle(mapped_elsewhere)
            if not mapped_elsewhere and self.held.forget(held.lease.id, "orphaned") is None:
                continue
            log.warning(
                "holder pid %d of lease %s is gone: orphaned", held.holder_pid, held.lease.id
            )
            if not mapped_elsewhere:
                self.memory.drop(held)
            self.link.enqueue(
                LeaseOp(
                    lease_id=held.lease.id,
                    op="orphan",
                    reason=f"holder pid {held.holder_pid} exited",
                )
            )
            orphaned += 1
        return orphaned

    def start_holder_watch(self, interval_s: float) -> None:
        """Check holders and revocation deadlines every ``interval_s``, until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check_holders()
                    self.revoke_due()
                    self.check_mapped()
                except Exception:
                    log.exception("holder check failed")

        threading.Thread(target=loop, name="agent-holders", daemon=True).start()

    def stop(self) -> None:
        """End the holder watch."""
        self._stop.set()
