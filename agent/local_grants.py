"""How does this agent's delegation meet the world? Local grants journalled, queued, refilled.

:class:`LocalGrants` is the I/O edge of :class:`agent.delegation.DelegatedCapacity` (the
pure state: reservations, budgets, placement inside them). It journals each grant
(agent/journal.py GrantLog) before the fd leaves, queues its ``local_grant`` op in the
outbox, lowers the agent's view of a budget before a central grant leaves, takes poold's
delegations in, and asks poold for refills and give-backs off the request path
(agent/link.py). How much to ask is agent/refill.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent import hand_off
from agent.delegation import DelegatedCapacity, LocalPlan
from agent.held import HeldLease, HeldLeases, memfd_inode
from agent.journal import Journal
from agent.link import PooldLink
from poold.errors import (
    LedgerUnavailable,
    NoCapacity,
    PooldUnreachable,
    PoolError,
    QuotaExceeded,
)
from poold.wire.agent import BudgetSpent, GrantRequest, LeaseOp, LocalUse
from poold.wire.common import LeaseOut
from poold.wire.delegation import Delegation, DelegationRequest, LocalGrant
from poold.wire.trusted import trusted

# The logger this code has always logged under (operators filter on it).
log = logging.getLogger("pool_agent.delegation")

# How long a central grant refused no_capacity waits for this host's idle reservations to
# go back before it asks again (a delegation step: one request to poold).
RECALL_WAIT_S = 2.0

# poold's central grant (PooldLink.grant_spending): the lease, and what it took from this
# host's budget of the tenant (None: poold does not say).
Granting = Callable[[GrantRequest], tuple[LeaseOut, BudgetSpent | None]]


class LocalGrants:
    """The local grants of one agent: :class:`DelegatedCapacity` bound to the journal
    (agent/journal.py GrantLog), the outbox and poold's ``delegate`` route (agent/link.py).

    What the link asks of it is :class:`agent.link.LocalOps`; the service asks
    :meth:`grant`, :meth:`commit` and :meth:`restore`.
    """

    # After poold said it has no delegation route (an older poold), ask again this late.
    NO_ROUTE_RETRY_S = 60.0

    def __init__(self, capacity: DelegatedCapacity, link: PooldLink, held: HeldLeases) -> None:
        self.capacity = capacity
        self.link = link
        self.held = held
        self._lock = threading.Lock()
        self._changed = threading.Condition()  # a local lease committed or given up
        self._plans: dict[str, LocalPlan] = {}  # granted, memory being made
        self._uncommitted: set[str] = set()  # journalled, local_grant not yet applied
        self._seq_of: dict[int, tuple[LeaseOp, int]] = {}  # id(op) -> (op, journal seq)
        self._asked = False
        self._no_route_until = 0.0
        # Delegation steps started and ended (one at a time, on the link's thread).
        self._stepped = threading.Condition()
        self._started = 0
        self._ended = 0
        self.enabled = True
        # Ends a local lease poold refused at commit (set by the service: a revocation).
        self.on_refused: Callable[[str, str], None] | None = None
        link.local = self
        link.on_delegation = self.replace

    @property
    def journal(self) -> Journal | None:
        return self.held.journal

    # --- the request path ---------------------------------------------------------
    def grant(self, req: GrantRequest) -> LeaseOut | None:
        """A local grant for ``req`` (memory not made yet), or None: the central path."""
        if not self.enabled or not self.capacity.holds_any():
            self.capacity.note_central("no_reservation" if self.enabled else "disabled")
            return None
        plan = self.capacity.grant_locally(req)
        if plan is None:
            return None
        with self._lock:
            self._plans[plan.lease.id] = plan
        if self.capacity.free_reserved_bytes() < self.capacity.policy.min_reserve_bytes:
            self.link.wake_delegation()  # refill off the request path
        return plan.lease

    def is_pending(self, lease_id: str) -> bool:
        return lease_id in self._plans

    def commit(self, held: HeldLease) -> None:
        """Journal a local lease (before its fd leaves) and queue its ``local_grant``."""
        with self._lock:
            plan = self._plans.pop(held.lease.id)
        grant = plan.grant
        op = trusted(
            LeaseOp,
            {
                "lease_id": grant.lease_id,
                "op": "local_grant",
                "reason": "",
                "length_bytes": None,
                "grant": grant,
            },
        )
        journal = self.journal
        if journal is not None:
            if held.inode is None and held.memory is not None:
                held.inode = memfd_inode(held.memory)
            seq = journal.add_local(
                held.journal_entry(),
                grant.model_dump_json(),
                grant.reservation_id,
                grant.epoch,
                plan.persistent,
            )
            with self._lock:
                self._seq_of[id(op)] = (op, seq)
        with self._lock:
            self._uncommitted.add(grant.lease_id)
        self.link.enqueue(op)

    def abandon(self, lease_id: str) -> bool:
        with self._lock:
            plan = self._plans.pop(lease_id, None)
        if plan is None:
            return False
        self.capacity.abandon(lease_id)
        with self._changed:
            self._changed.notify_all()
        return True

    def refused(self, lease_id: str, code: str, message: str) -> None:
        """poold refused this local lease's grant at commit (its budget no longer covers
        it and the quota has no room, its reservation is gone...): the tenant holds
        memory the ledger does not count. It ends now, as a revocation without notice
        (`on_refused`: the service's; the tenant hears `lost`), and its extent is free."""
        with self._lock:
            self._uncommitted.discard(lease_id)
        log.warning(
            "local lease %s refused by poold at commit (%s): ending it: %s", lease_id, code, message
        )
        if self.on_refused is not None:
            self.on_refused(lease_id, f"poold refused the local grant: {code}: {message}")
        self.capacity.abandon(lease_id)
        with self._changed:
            self._changed.notify_all()

    # --- what the link tells ------------------------------------------------------
    def is_local(self, lease_id: str) -> bool:
        return self.capacity.is_local(lease_id)

    @property
    def tenant_of(self) -> Callable[[str], str | None]:
        """The tenant of a local lease (None: not one), as the op queue asks it per op:
        the delegation's own method, without a call through this one."""
        return self.capacity.tenant_of

    def on_enqueue(self, op: LeaseOp) -> None:
        journal = self.journal
        if journal is None or op.op == "local_grant" or id(op) in self._seq_of:
            return
        seq = journal.local.op(op.lease_id, op.model_dump_json())
        with self._lock:
            self._seq_of[id(op)] = (op, seq)

    def on_queued(self, op: LeaseOp) -> None:
        """A local lease's op is in the outbox now (after on_enqueue journalled it): a
        release frees its tenant's budget only from here, so that any local grant that
        spends it is queued after it."""
        if op.op == "release":
            self.capacity.released(op.lease_id)

    def on_delivered(self, ops: list[LeaseOp]) -> None:
        seqs: list[int] = []
        with self._lock:
            for op in ops:
                known = self._seq_of.pop(id(op), None)
                if known is not None and known[0] is op:
                    seqs.append(known[1])
                if op.op == "local_grant":
                    self._uncommitted.discard(op.lease_id)
        self.capacity.delivered_all((op.lease_id, op.op, op.length_bytes) for op in ops)
        with self._changed:
            self._changed.notify_all()
        journal = self.journal
        if journal is not None and seqs:
            journal.local.acked(seqs)

    def riding_use(self, use: LocalUse, riding: list[LeaseOp]) -> LocalUse:
        """``use`` (a central grant's count of its tenant's local leases, released ones
        listed) less those whose release rides on that grant: poold applies the ride
        first, so the budget need not be kept for them."""
        ids = [op.lease_id for op in riding if op.op == "release"]
        if not ids:
            return use
        nbytes, nleases = self.capacity.released_among(use.tenant, ids)
        return LocalUse(
            tenant=use.tenant, bytes=max(0, use.bytes - nbytes), leases=max(0, use.leases - nleases)
        )

    def uncommitted(self, lease_id: str) -> bool:
        return lease_id in self._uncommitted

    def uncommitted_count(self) -> int:
        with self._lock:
            return len(self._uncommitted)

    # --- the central path --------------------------------------------------------
    def central(self, req: GrantRequest, grant: Granting) -> LeaseOut:
        """poold's grant of ``req`` (``grant``: the link's `grant_spending`), which poold
        may pay from this host's budget of the tenant: the agent's view of that budget is
        lowered by the request before it leaves (so no local grant meanwhile spends what
        poold takes), and the request says the tenant's local use here as the agent counts
        it, local grants poold has not heard of included (poold spends the budget only
        down to the larger of that and what it has committed). So it need not wait for
        those to be committed, however far behind the outbox is. poold's answer says
        what it spent: the debit becomes that (`DelegatedCapacity.settle`)."""
        try:
            return self._central_once(req, grant)
        except NoCapacity as err:
            # Room this host parked in reservations no local lease uses: give it back and
            # ask once more (a host draining has no room to come).
            free = err.detail.get("free_by_device")
            if "host_status" in err.detail or not self.capacity.recall_idle(
                req.media, req.size_bytes, free if isinstance(free, dict) else {}
            ):
                raise
            hand_off.ahead()
            if not self._after_next_step(RECALL_WAIT_S):
                self.capacity.forget_recall()
                raise
            log.info(
                "no room for %d bytes beside this host's idle reservations: gave them back",
                req.size_bytes,
            )
            return self._central_once(req, grant)

    def _central_once(self, req: GrantRequest, grant: Granting) -> LeaseOut:
        limit = self.capacity.debit(req, self._alignment())
        if limit is None:
            return self._central(req, grant)
        used_bytes, used_leases = limit.local_use
        req = req.model_copy(
            update={
                "local_use": LocalUse(tenant=limit.tenant, bytes=used_bytes, leases=used_leases)
            }
        )
        try:
            lease, said = grant(req)
        except PoolError as err:
            unknown = isinstance(err, (PooldUnreachable, LedgerUnavailable)) or (
                err.http_status >= 500
            )
            # A refusal (a verdict) spent nothing: its transaction wrote no budget.
            nothing = None if unknown else BudgetSpent(bytes=0, leases=0)
            self.capacity.settle(limit, None, known=not unknown, spent=nothing)
            if isinstance(err, QuotaExceeded):
                self.capacity.note_refused(limit.tenant, req.size_bytes)
            raise
        except BaseException:
            self.capacity.settle(limit, None, known=False)
            raise
        self.capacity.settle(limit, lease.length_bytes, known=True, spent=said)
        return lease

    def _central(self, req: GrantRequest, grant: Granting) -> LeaseOut:
        try:
            return grant(req)[0]
        except QuotaExceeded:
            if req.tenant is not None:
                self.capacity.note_refused(req.tenant, req.size_bytes)
            raise

    def _alignment(self) -> int:
        """The largest alignment of any device here: a central lease is at most its
        request rounded up to it."""
        aligns = [d.alignment_bytes for d in self.link.inventory]
        aligns += [r.alignment_bytes for r in self.capacity.reservations()]
        return max(aligns, default=1)

    # --- poold's side -----------------------------------------------------------------
    def replace(self, delegation: Delegation, sent_at: float | None = None) -> None:
        """poold's whole delegation now (a heartbeat or ``delegate`` reply; ``sent_at``:
        when its request left, monotonic)."""
        self.capacity.replace(delegation, sent_at=sent_at)
        journal = self.journal
        if journal is not None:
            journal.local.delegation(delegation.model_dump_json(), time.time())
        if self.capacity.has_withdrawn():
            self.link.wake_delegation()  # give back what poold asked back, now

    def step(self) -> None:
        """Refill or give back off the request path: ask poold once at start (what is held
        already), then whenever demand says so."""
        with self._stepped:
            self._started += 1
        try:
            self._step()
        finally:
            with self._stepped:
                self._ended += 1
                self._stepped.notify_all()

    def _after_next_step(self, timeout_s: float) -> bool:
        """Wake the delegation step and wait until the first one to start from now has
        ended (one running now may have read its wants already). False: not within
        ``timeout_s``, or no step will run (delegation off)."""
        if not self.enabled:
            return False
        with self._stepped:
            target = self._started + 1
        self.link.wake_delegation()
        deadline = time.monotonic() + timeout_s
        with self._stepped:
            while self._ended < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._stepped.wait(left)
        return True

    def _step(self) -> None:
        now = time.monotonic()
        if not self.enabled or now < self._no_route_until:
            return
        want = self.capacity.wants()
        if want is None:
            if self._asked:
                return
            want = DelegationRequest()
        sent_at = time.monotonic()
        try:
            delegation = self.link.delegate(want)
        except PoolError as err:
            self.capacity.asked(sent_at, ok=False)
            if err.http_status in (404, 405) or err.code == "internal":
                if not self._asked or now >= self._no_route_until:
                    log.info("poold grants no delegation (%s); every lease is central", err)
                self._no_route_until = now + self.NO_ROUTE_RETRY_S
                self._asked = True
                return
            raise
        except BaseException:
            self.capacity.asked(sent_at, ok=False)
            raise
        self._asked = True
        self.capacity.asked(sent_at, ok=True)
        self.replace(delegation, sent_at)

    # --- restart ----------------------------------------------------------------------
    def restore(self) -> int:
        """After a restart, before adoption: the journal's local leases occupy their
        extents, their epochs stay spent, the last delegation is held again (its TTL
        counted from when it came), and every op poold had not applied is queued again,
        in order (a repeat of one it did apply is answered idempotently). Returns how
        many ops were queued again."""
        journal = self.journal
        if journal is None:
            return 0
        state = journal.local.state
        grants = [LocalGrant.model_validate_json(g) for g in state.grants.values()]
        if state.delegation is not None:
            text, wall = state.delegation
            age = max(0.0, time.time() - wall)
            try:
                self.capacity.replace(
                    Delegation.model_validate_json(text), received_at=time.monotonic() - age
                )
            except ValueError:
                log.warning("the journalled delegation does not parse; waiting for poold's")
        self.capacity.restore(grants)
        for reservation_id, epoch in state.epochs.items():
            self.capacity.note_epoch(reservation_id, epoch)
        replayed = 0
        for seq, text in list(state.pending):
            op = LeaseOp.model_validate_json(text)
            with self._lock:
                self._seq_of[id(op)] = (op, seq)
                if op.op == "local_grant":
                    self._uncommitted.add(op.lease_id)
            self.link.enqueue(op)
            replayed += 1
        if replayed:
            log.info("journal: %d op(s) of local leases queued again for poold", replayed)
        return replayed
