"""After a failed exchange with poold, which leases does poold count as this host's
that the agent does not hold?

A grant whose reply was lost (and whose retries gave up, or whose retry made a second
lease before poold deduplicated request ids) leaves a live lease in the ledger that no
tenant holds. Once poold answers again, the agent looks twice at the host's live
leases: a lease that is live at both looks, unknown to the agent at both, and not
possibly the lease of a grant still running at the first look, is a stray. Granted
strays are aborted and active ones orphaned, through the outbox, as the reconcile at
start (agent/restart.py) does; the other direction, a lease the agent holds that poold
no longer counts as live, is the heartbeat's (poold revokes what it did not grant).

Two looks rather than one because a lease a grant just made is live in poold before
the agent holds it: waiting until every grant running at the first look has ended,
and asking again, leaves only the leases no grant will claim.
"""

from __future__ import annotations

import logging
import threading

from agent.held import HeldLeases
from agent.link import PooldLink
from agent.memory import LeaseMemory
from poold.errors import PoolError
from poold.wire.agent import LeaseOp

log = logging.getLogger("pool_agent.resync")

_LIVE_UNHELD = ("granted", "active")  # revoking ones are the revocation's


class Resync:
    """The reconciliation after failed exchanges, one step per answered heartbeat."""

    def __init__(self, host: str, link: PooldLink, held: HeldLeases, memory: LeaseMemory) -> None:
        self.host = host
        self.link = link
        self.held = held
        self.memory = memory
        self._lock = threading.Lock()
        # Failed exchanges so far, and how many of them the round under way (or the
        # last one) began after: a failure during a round calls for another one.
        self._failures = 0
        self._covered = 0
        self._suspects: set[str] | None = None  # the first look's unknown leases
        self._grants_seen: set[int] = set()  # grants running at the first look
        self._round_from = 0

    def failed(self) -> None:
        with self._lock:
            self._failures += 1

    @property
    def due(self) -> bool:
        """A reconciliation is pending (an exchange failed since the last one began)."""
        with self._lock:
            return self._suspects is not None or self._failures != self._covered

    def step(self) -> None:
        """Take the next look if one is due; the second one ends the strays it confirms."""
        with self._lock:
            first = self._suspects is None
            if first and self._failures == self._covered:
                return
            failures_before = self._failures
            grants_before = self.link.grants_in_flight()
            if not first and grants_before & self._grants_seen:
                return  # a grant of the first look still runs: its lease may be a suspect
        try:
            live = self.link.client.list_leases(host=self.host, live=True, limit=100_000)
        except PoolError as err:
            log.debug("cannot reconcile with poold yet: %s", err.message)
            return
        # What the agent knows is read after the list: a lease granted before the list
        # and held since is known by now.
        known = (
            set(self.held.ids())
            | self.memory.scrubbing_ids()
            | self.link.unsettled()
            | self.link.queued_lease_ids()
        )
        unknown = {lease.id: lease for lease in live if lease.state in _LIVE_UNHELD}
        for lease_id in known:
            unknown.pop(lease_id, None)
        with self._lock:
            if first:
                # Failures after this look are the next round's.
                self._round_from = failures_before
                if unknown:
                    self._suspects = set(unknown)
                    self._grants_seen = grants_before
                else:
                    self._covered = failures_before
                return
            confirmed = [unknown[i] for i in sorted(self._suspects or ()) if i in unknown]
            self._suspects = None
            self._grants_seen = set()
            self._covered = self._round_from
        for lease in confirmed:
            op = "abort" if lease.state == "granted" else "orphan"
            log.warning(
                "lease %s is %s in poold but no tenant of this agent holds it "
                "(a grant whose reply was lost): %s",
                lease.id,
                lease.state,
                op,
            )
            self.link.enqueue(
                LeaseOp(lease_id=lease.id, op=op, reason="no holder after a failed exchange")
            )
