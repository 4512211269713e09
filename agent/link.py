"""How the agent stays in step with poold: registration, heartbeats, the outbox.

One heartbeat per interval carries every pending renewal on the host (and the
inventory when it changed). Releases go into an ordered outbox that rides on
the next grant or is flushed within a few milliseconds by a background thread,
so a tenant's release costs no poold round trip, yet a release just before a
grant is applied before that grant (its bytes and quota are free in time). The ops
of local leases (granted inside the delegation) ride only on a grant of their own
tenant; the rest go in a batch at most LOCAL_FLUSH_S after they were queued (so does a
central lease's plain release while the host delegates, if no grant carries it first).
The queue and its order are agent/op_queue.py's; this module sends it. When poold is
down, or answers with an error, the outbox, renewals and reports are kept and replayed
in order; grants and op batches carry request ids so that a retry
after a lost reply is not applied twice (DESIGN.md, "every request to poold is
idempotent"). After a failed exchange the agent reconciles with poold
(agent/resync.py).

Each heartbeat also says what the agent holds, for poold's revocations and its
audit: per lease the holder (pid + start time), the dax sub-device and the local
state (held, revoked_held, or a scrub running, with its start), and the
sub-devices it made that no held lease accounts for (agent/leftovers.py). The link
asks one object for all of it, and tells it what poold replied: a
:class:`HeartbeatState` (agent/revocation.py's :class:`~agent.revocation.Revocations`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from agent import hand_off
from agent.op_queue import MAX_BATCH_OPS, OpQueue, TenantOf, new_request_id
from poold.api.client import PooldClient
from poold.errors import GenerationConflict, LedgerUnavailable, PooldUnreachable, PoolError
from poold.wire.agent import (
    AgentLease,
    AgentOps,
    BudgetSpent,
    GrantReply,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    InventoryDevice,
    LeaseOp,
    LeaseOpResult,
    LeaseReport,
    LeftoverSubDevice,
    LocalUse,
    Renewal,
)
from poold.wire.common import LeaseOut
from poold.wire.delegation import Delegation, DelegationRequest

log = logging.getLogger("pool_agent.link")

OUTBOX_LINGER_S = 0.005
# Ops of local leases (granted inside the delegation) wake no flush of their own: they
# go at most this long after they were queued (the issue allows ~1 s), so a busy host
# sends a few batches a second instead of one per lease.
LOCAL_FLUSH_S = 0.25
# How often the delegation is looked at for refill and give-back (and asked again after
# poold said it has no delegation route), off the request path.
DELEGATION_STEP_S = 1.0
# A grant poold did not answer is sent again after these pauses (same request id),
# all within the tenant's patience: the tenant client waits 30 s by default.
GRANT_BACKOFF_S = (0.2, 0.5, 1.0)
GRANT_PATIENCE_S = 20.0
# How long one wait for news may last (poold caps it at 60 s), and the pause before
# waiting again after a failed one.
NEWS_WAIT_S = 25.0
NEWS_RETRY_S = 1.0

# Per lease what the agent holds (holders, sub-device, local state, scrub progress),
# and the sub-devices it made that no held lease accounts for.
Holdings = tuple[list[AgentLease], list[LeftoverSubDevice]]


class HeartbeatState(Protocol):
    """What the link asks the agent for each heartbeat, and tells it of poold's replies."""

    def held_ids(self) -> list[str]:
        """Every lease the agent holds memory (or a holder) for."""
        ...

    def holdings(self) -> Holdings:
        """The richer report of what the agent holds; when it fails, the bare ids go."""
        ...

    def revoked_held_ids(self) -> list[str]:
        """Revoked leases their live holders still map."""
        ...

    def take_reports(self) -> list[LeaseReport]:
        """The tenants' accounting reports changed since the last call."""
        ...

    def admission_wanted_bytes(self) -> int:
        """What the oldest lease request waiting for capacity needs (0: none waits)."""
        ...

    def on_reply(self, reply: HeartbeatReply) -> None:
        """poold's reply to a heartbeat or a registration."""
        ...


def inventory_digest(inventory: list[InventoryDevice]) -> str:
    blob = "\n".join(d.model_dump_json() for d in sorted(inventory, key=lambda d: d.uid))
    return hashlib.sha256(blob.encode()).hexdigest()


class LocalOps(Protocol):
    """What the link tells the agent's local grants (agent/local_grants.py LocalGrants)."""

    enabled: bool  # this host grants inside a delegation

    def is_local(self, lease_id: str) -> bool:
        """The lease was granted inside the delegation (its ops are journalled)."""
        ...

    def tenant_of(self, lease_id: str) -> str | None:
        """The tenant of a lease granted inside the delegation (None: not one)."""
        ...

    def on_enqueue(self, op: LeaseOp) -> None:
        """An op is about to be queued: a local lease's is journalled first."""
        ...

    def on_queued(self, op: LeaseOp) -> None:
        """A local lease's op is in the outbox now (a release frees its budget here)."""
        ...

    def on_delivered(self, ops: list[LeaseOp]) -> None:
        """poold applied (or refused one by one) these ops."""
        ...

    def uncommitted(self, lease_id: str) -> bool:
        """A local lease poold has not heard of yet (its renewals wait for the grant)."""
        ...

    def riding_use(self, use: LocalUse, riding: list[LeaseOp]) -> LocalUse:
        """A central grant's local use less the released leases whose release rides."""
        ...

    def abandon(self, lease_id: str) -> bool:
        """A local lease whose memory was never made: freed, nothing to tell poold."""
        ...

    def refused(self, lease_id: str, code: str, message: str) -> None:
        """poold refused a local lease's grant at commit: it ends now."""
        ...

    def step(self) -> None:
        """Refill or give back (the delegation thread calls it)."""
        ...


class Resync(Protocol):
    """What the link tells the agent's reconciliation (agent/resync.py) of its exchanges."""

    def failed(self) -> None:
        """An exchange with poold failed: what poold holds for this host may be off."""
        ...

    def step(self) -> None:
        """poold answered a heartbeat: take the next look, if one is due."""
        ...


def _no_verdict(err: PoolError) -> bool:
    """poold gave no verdict on the request: it may or may not have been applied.

    No answer, the ledger unavailable, or poold failing (5xx). 507 ``no_capacity`` is a
    verdict (nothing was placed), not a failure.
    """
    return isinstance(err, PooldUnreachable | LedgerUnavailable) or err.http_status in (
        500,
        502,
        503,
        504,
    )


def _pending_applied(err: PoolError) -> bool:
    """Did poold apply a grant's pending ops before refusing the grant itself with ``err``?

    The ops run in their own transaction before the grant's checks, so a refusal of the
    grant (no capacity, quota, unknown tenant, not the owner) comes after them. Anything
    else (no answer, a 5xx, the credential refused, a malformed request) may have come
    first: the ops are replayed, which is safe (an op already applied is refused alone).
    """
    if _no_verdict(err) or isinstance(err, GenerationConflict):
        return False  # a conflict may be the pending ops' own batch losing its races
    return err.http_status not in (400, 401, 403, 413, 422) or err.code == "not_owner"


def _pending_results(err: PoolError) -> list[LeaseOpResult]:
    """What became of the ops that rode on a grant poold refused (its error's
    ``detail.pending``; none from an older poold, or if unreadable)."""
    raw = err.detail.get("pending")
    if not isinstance(raw, list):
        return []
    try:
        return [LeaseOpResult.model_validate(x) for x in raw]
    except ValueError:
        log.warning("poold's refusal of a grant carried unreadable op results; ignored")
        return []


class PooldLink:
    """The agent's one channel to poold (thread-safe)."""

    def __init__(
        self,
        client: PooldClient,
        agent_version: str,
        *,
        grant_patience_s: float = GRANT_PATIENCE_S,
    ) -> None:
        self.client = client
        self.agent_version = agent_version
        self.grant_patience_s = grant_patience_s
        self._lock = threading.Lock()
        # The lease ops and renewals waiting for poold, and their order (agent/op_queue.py).
        self.ops = OpQueue()
        # One flush at a time (a caller's flush returns once what was queued is sent).
        self._deliver = threading.Lock()
        self._wake = threading.Event()
        # Set when poold says it has news for this host: the heartbeat goes now.
        self._beat_now = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.inventory: list[InventoryDevice] = []
        self._sent_digest: str | None = None
        # poold answered the last exchange at the HTTP level (what `stats` reports).
        self.reachable = False
        # Why exchanges fail now (None: the last one worked): one WARNING when it starts,
        # one INFO when it ends, not a line per failed request.
        self._failing: str | None = None
        self.last_heartbeat_at: datetime | None = None
        # Set by the agent service; without it (a bare link) heartbeats say nothing is held.
        self.heartbeat_state: HeartbeatState | None = None
        # Set by the agent service: reconciliation after a failed exchange.
        self.resync: Resync | None = None
        # Set by the agent service: its local grants (agent/local_grants.py).
        self.local: LocalOps | None = None
        # Told every delegation a heartbeat reply carries (the whole of it: replaced).
        # With when the request it answers left (monotonic), which orders replies.
        self.on_delegation: Callable[[Delegation, float | None], None] | None = None
        self._step_now = threading.Event()
        # Reports a failed heartbeat could not deliver wait here, unless a newer report of
        # the same lease replaces them.
        self._unsent_reports: dict[str, LeaseReport] = {}
        # Grants running now (by a token), and leases a grant returned that the agent has
        # not yet made memory for or given up on: reconciliation leaves both alone.
        self._grant_tokens = itertools.count()
        self._grants_in_flight: set[int] = set()
        self._unsettled: set[str] = set()

    # --- how the exchanges go -------------------------------------------------
    def _answered(self) -> None:
        """An exchange worked: say so once if they were failing."""
        self.reachable = True
        with self._lock:
            was, self._failing = self._failing, None
        if was is not None:
            log.info(
                "poold answers again; replaying %d queued op(s) and %d renewal(s)",
                self.ops.size(),
                self.ops.renewal_count(),
            )
            self._wake.set()  # at once, not at the next retry

    def _failed(self, err: PoolError) -> None:
        """An exchange failed (nothing it carried is lost): say so once, and resync later."""
        self.reachable = not isinstance(err, PooldUnreachable)
        why = f"{err.code}: {err.message}"
        with self._lock:
            was, self._failing = self._failing, why
        if was is None:
            log.warning(
                "poold exchanges failing (%s); renewals, reports and lease ops stay queued "
                "until it answers",
                why,
            )
        if self.resync is not None:
            self.resync.failed()

    @property
    def failing(self) -> bool:
        """The last exchange with poold failed."""
        return self._failing is not None

    # --- synchronous calls ----------------------------------------------
    def register(self, inventory: list[InventoryDevice]) -> HeartbeatReply:
        self.inventory = inventory
        digest = inventory_digest(inventory)
        sent_at = time.monotonic()
        reply = self.client.register(
            Heartbeat(
                agent_version=self.agent_version, inventory_digest=digest, inventory=inventory
            )
        )
        self._sent_digest = digest
        self._mark(reply, sent_at)
        return reply

    def grant(self, req: GrantRequest) -> LeaseOut:
        """:meth:`grant_spending`'s lease."""
        return self.grant_spending(req)[0]

    def grant_spending(self, req: GrantRequest) -> tuple[LeaseOut, BudgetSpent | None]:
        """Grant through poold, delivering the outbox with it, retried under one request id;
        the lease, and what poold says it took from this host's budget of the tenant
        (None: it does not say). The tenant's request waits for poold here: the socket loop
        goes on without it (agent/hand_off.py).

        A grant that gets no answer (unreachable, timed out, reply lost) or
        ``ledger_unavailable`` is sent again with the same request id, a few times with
        backoff within ``grant_patience_s``; poold answers a repeat with the lease the
        first attempt made. Past that the tenant gets the retryable error, and the next
        resync ends any lease the lost attempts left.
        """
        hand_off.ahead()
        if req.request_id is None:
            req = req.model_copy(update={"request_id": new_request_id()})
        # The queued ops ride on the grant (a release just before it frees its bytes and
        # quota in time), except those of leases with an op still on its way, and those
        # of other tenants' local leases: they free nothing this grant can use (their
        # bytes are the host's reservations, and other tenants' quota is theirs), so
        # they wait for their flush (LOCAL_FLUSH_S). Riding on every central grant made
        # each a batch transaction of a few ops in poold, the larger part of its CPU
        # under delegation (bench/scale.py --delegation, py-spy). The grant's own
        # tenant's go: one at its quota frees it in time by releasing a local lease.
        pending = self.ops.take(self._tenant_of(), for_tenant=req.tenant or "")
        if pending and req.local_use is not None and self.local is not None:
            req = req.model_copy(
                update={"local_use": self.local.riding_use(req.local_use, pending)}
            )
        with self._lock:
            token = next(self._grant_tokens)
            self._grants_in_flight.add(token)
        try:
            try:
                lease = self._grant_retrying(req.model_copy(update={"pending": pending}))
            except BaseException as err:
                if pending and not (isinstance(err, PoolError) and _pending_applied(err)):
                    self.ops.put_back(AgentOps(ops=pending, request_id=new_request_id()))
                    self._wake.set()
                elif pending:
                    self._tell_delivered(pending)
                    if isinstance(err, PoolError):  # it is, to get here
                        self._refused(pending, _pending_results(err))
                raise
            else:
                with self._lock:
                    self._unsettled.add(lease.id)
                self._tell_delivered(pending)
                self._refused(pending, lease.pending)
                # The lease alone from here on (journalled, listed, re-read as a LeaseOut).
                out = LeaseOut.model_construct(
                    **{k: v for k, v in lease if k not in ("pending", "budget_spent")}
                )
                return out, lease.budget_spent
        finally:
            with self._lock:
                self._grants_in_flight.discard(token)
            self.ops.delivered(pending)
            # Ops that waited for these (a later op of a lease whose op rode) go now; the
            # rest keep their own time (waking for any queued op sent a batch after every
            # central grant: most of poold's batches under delegation).
            if pending and self.ops.any_queued_of({op.lease_id for op in pending}):
                self._wake.set()

    def _grant_retrying(self, req: GrantRequest) -> GrantReply:
        deadline = time.monotonic() + self.grant_patience_s
        for backoff in (*GRANT_BACKOFF_S, None):
            try:
                lease = self.client.grant(req, deadline=deadline)
            except (PooldUnreachable, LedgerUnavailable) as err:
                self._failed(err)  # the outcome is unknown: resync once poold answers
                if backoff is None or time.monotonic() + backoff >= deadline:
                    raise
                time.sleep(backoff)
                continue
            except GenerationConflict:
                # Concurrent grants on one device lost their races in poold: nothing was
                # made (a verdict, so a fresh id). The pending ops go again: the conflict
                # may be their own batch's (applied ones are refused alone, harmlessly);
                # dropping them lost local grants under load (issue 12).
                self.reachable = True
                if backoff is None or time.monotonic() + backoff >= deadline:
                    raise
                req = req.model_copy(update={"request_id": new_request_id()})
                # Jitter, so the racers spread out (not a secret: S311 does not apply).
                time.sleep(random.uniform(0.01, 0.1))  # noqa: S311
                continue
            except PoolError as err:
                if _no_verdict(err):
                    self._failed(err)  # it may have failed after the commit
                else:
                    self.reachable = True  # a refusal is an answer
                raise
            self._answered()
            return lease
        raise AssertionError("unreachable: the last attempt raises or returns")

    def settled(self, lease_id: str) -> None:
        """The agent holds the granted lease now, or gave it up (aborted): resync may look."""
        with self._lock:
            self._unsettled.discard(lease_id)

    def grants_in_flight(self) -> set[int]:
        """Tokens of the grants running now (reconciliation waits for those it saw)."""
        with self._lock:
            return set(self._grants_in_flight)

    def unsettled(self) -> set[str]:
        """Leases granted and not yet held or given up (reconciliation leaves them alone)."""
        with self._lock:
            return set(self._unsettled)

    def queued_lease_ids(self) -> set[str]:
        """Leases with an op queued or on its way (reconciliation leaves them alone)."""
        return self.ops.lease_ids()

    def _tenant_of(self) -> TenantOf | None:
        """How the queue tells a local lease's tenant (None: no delegation here)."""
        return self.local.tenant_of if self.local is not None else None

    def _tell_delivered(self, ops: list[LeaseOp]) -> None:
        if self.local is not None and ops:
            try:
                self.local.on_delivered(ops)
            except Exception:
                log.exception("noting %d delivered op(s) of local leases failed", len(ops))

    def delegate(self, req: DelegationRequest) -> Delegation:
        """Ask poold for (or give back) reservations and budgets: the whole delegation."""
        if req.request_id is None:
            req = req.model_copy(update={"request_id": new_request_id()})
        delegate = getattr(self.client, "delegate", None)
        if delegate is None:  # a client without the route: as a poold without it
            raise PoolError("this poold client cannot ask for a delegation")
        try:
            reply: Delegation = delegate(req)
        except PoolError as err:
            if _no_verdict(err):
                self._failed(err)
            raise
        self._answered()
        return reply

    def wake_delegation(self) -> None:
        """Run the delegation step now (a local grant crossed a low watermark)."""
        self._step_now.set()

    def abort_now(self, lease_id: str, reason: str) -> None:
        if self.local is not None and self.local.abandon(lease_id):
            return  # granted locally and never reported: poold has nothing to abort
        hand_off.ahead()
        try:
            self.client.abort(lease_id, reason)
        except PoolError as err:
            # No answer, or poold failed: the abort must still land, through the outbox.
            # A refusal (the lease is not granted any more) needs nothing.
            if _no_verdict(err) or err.http_status in (401, 403):
                self.enqueue(LeaseOp(lease_id=lease_id, op="abort", reason=reason))

    def give_up(self, lease: LeaseOut, reason: str) -> None:
        """A lease its tenant will not get (the memory could not be made): aborted while
        granted; one recorded active with its grant (``GrantRequest.activate``) released,
        at once as an abort is, so that the refusal the tenant gets finds the ledger
        already without it; through the outbox when poold gives no verdict."""
        if lease.state == "granted":
            self.abort_now(lease.id, reason)
            return
        if self.local is not None and self.local.abandon(lease.id):
            return  # granted locally and never reported: poold has nothing to end
        op = LeaseOp(lease_id=lease.id, op="release", reason=reason)
        hand_off.ahead()
        try:
            self.client.apply_ops([op], request_id=new_request_id())
        except PoolError as err:
            if _no_verdict(err) or err.http_status in (401, 403):
                self.enqueue(op)

    def activate(self, lease_id: str) -> LeaseOut:
        hand_off.ahead()
        return self.client.activate(lease_id)

    # --- batched ------------------------------------------------------------
    def enqueue(self, op: LeaseOp) -> None:
        local = self.local is not None and self.local.is_local(op.lease_id)
        if local:
            assert self.local is not None
            self.local.on_enqueue(op)  # journalled before it is queued
        crowded = self.ops.add(op) >= MAX_BATCH_OPS // 10
        if local:
            assert self.local is not None
            self.local.on_queued(op)  # in line now: what it frees may be spent after it
        # A local lease's op goes within LOCAL_FLUSH_S, and so does a central lease's
        # release while this host delegates: its tenant's next grant carries it (its
        # quota freed in time), and a batch woken per central release was most of
        # poold's batches, and a third of its CPU, under delegation (bench/scale.py).
        lazy = local or (op.op == "release" and self.local is not None and self.local.enabled)
        if crowded or not lazy:
            self._wake.set()

    def renew_later(self, lease_id: str, ttl_s: int) -> None:
        self.ops.renew_later(lease_id, ttl_s)

    def flush(self) -> None:
        """Send the outbox now (the background thread does this within a few ms).

        Batches go oldest first, each under its request id; one that fails, whatever
        the status, stays first in line and is sent again, unchanged, next time. A
        batch poold rejects as malformed (400, 413, 422) is dropped with an error,
        since it would be rejected forever and block every op behind it. Ops refused one
        by one in poold's answer are dropped with a warning; replaying one that poold
        did apply is refused that way and changes nothing. A failure other than no
        answer at all is raised, after the batch is back in line.
        """
        with self._deliver:
            # What is queued now, not what queues while this sends: ops keep coming at the
            # lease rate, and chasing them sent a batch of a few ops per round trip (50
            # requests a second at 300 leases a second) instead of one per LOCAL_FLUSH_S.
            # An op that must go at once wakes the loop again.
            due = self.ops.queued_count()
            while True:
                nxt = self.ops.next_batch(self._tenant_of(), fresh=due > 0)
                if nxt is None:
                    return  # nothing queued, or only ops waiting for a grant's
                batch, fresh = nxt
                if fresh:
                    due -= len(batch.ops)
                results: list[LeaseOpResult] | None
                try:
                    results = self.client.apply_ops(batch.ops, request_id=batch.request_id)
                except PoolError as err:
                    if err.http_status not in (400, 413, 422):
                        self.ops.put_back(batch)
                        self._failed(err)
                        if isinstance(err, PooldUnreachable):
                            return
                        raise
                    self.reachable = True
                    log.error(
                        "poold refused a batch of %d lease op(s) as malformed: %s %s",
                        len(batch.ops),
                        err.code,
                        err.message,
                    )
                    results = None  # dropped: not replayed forever
                except BaseException:
                    self.ops.put_back(batch)  # a bug here loses no op either
                    raise
                finally:
                    self.ops.delivered(batch.ops)
                if results is None:
                    self._tell_delivered(batch.ops)
                    continue
                self._answered()
                self._tell_delivered(batch.ops)
                self._refused(batch.ops, results)

    def _refused(self, ops: list[LeaseOp], results: list[LeaseOpResult]) -> None:
        """Ops poold refused one by one, in a batch's answer or a grant's (``pending``):
        dropped, each with a warning, and a refused local grant ended at once (the
        ledger has no row of it, so no heartbeat would ever end it). Results come in the
        ops' order (`leases.apply_ops`)."""
        paired = zip(ops, results, strict=False) if len(ops) == len(results) else ()
        grants = {r.lease_id for op, r in paired if op.op == "local_grant" and r.code}
        for result in results:
            if result.code is None:
                continue
            log.warning(
                "poold refused the queued op on lease %s (dropped): %s %s",
                result.lease_id,
                result.code,
                result.message or "",
            )
            if result.lease_id in grants and self.local is not None:
                grants.discard(result.lease_id)
                try:
                    self.local.refused(result.lease_id, result.code, result.message or "")
                except Exception:
                    log.exception("ending the refused local lease %s failed", result.lease_id)

    def outbox_size(self) -> int:
        return self.ops.size()

    def _take_reports(self) -> list[LeaseReport]:
        state = self.heartbeat_state
        fresh = state.take_reports() if state is not None else []
        with self._lock:
            reports, self._unsent_reports = self._unsent_reports, {}
        reports.update((r.lease_id, r) for r in fresh)
        return list(reports.values())

    def _holdings(self) -> Holdings | None:
        """The holdings for this beat; None (bare ids instead) if they cannot be made."""
        if self.heartbeat_state is None:
            return None
        try:
            return self.heartbeat_state.holdings()
        except Exception:
            log.exception("building the holdings report failed; sending lease ids only")
            return None

    def heartbeat(self) -> HeartbeatReply | None:
        """One heartbeat; None when it failed (its renewals and reports stay queued)."""
        renewals = self.ops.take_renewals()
        local = self.local
        if local is not None and renewals:
            # A renewal of a local lease poold has not heard of would be refused
            # unknown_lease (and the lease marked lost): it waits for the grant.
            early = {k: v for k, v in renewals.items() if local.uncommitted(k)}
            if early:
                renewals = {k: v for k, v in renewals.items() if k not in early}
                self.ops.keep_renewals(early)
        reports = self._take_reports()
        try:
            reply = self._send_heartbeat(renewals, reports)
        except BaseException as exc:
            # Whatever went wrong (no answer, a 500, a 503, a credential being rotated,
            # a bug here), nothing the tenants were told is lost: a renewal the agent
            # accepted reaches poold with a later heartbeat. A newer renewal or report
            # of the same lease, queued meanwhile, wins.
            self.ops.keep_renewals(renewals)
            with self._lock:
                for r in reports:
                    self._unsent_reports.setdefault(r.lease_id, r)
            if isinstance(exc, PoolError):
                self._failed(exc)
                return None
            raise
        if self.resync is not None:
            try:
                self.resync.step()
            except Exception:
                log.exception("reconciling with poold failed; trying again next heartbeat")
        return reply

    def _send_heartbeat(
        self, renewals: dict[str, int], reports: list[LeaseReport]
    ) -> HeartbeatReply:
        digest = inventory_digest(self.inventory)
        holdings = self._holdings()
        state = self.heartbeat_state
        beat = Heartbeat(
            agent_version=self.agent_version,
            inventory_digest=digest,
            inventory=self.inventory if digest != self._sent_digest else None,
            renewals=[Renewal(lease_id=k, ttl_s=v) for k, v in renewals.items()],
            reports=reports,
            revoked_held=state.revoked_held_ids() if state is not None else [],
            admission_wanted_bytes=state.admission_wanted_bytes() if state is not None else 0,
            held=state.held_ids() if holdings is None and state is not None else None,
            held_leases=holdings[0] if holdings is not None else None,
            leftovers=holdings[1] if holdings is not None else [],
        )
        sent_at = time.monotonic()  # the delegation's order (agent/delegation.py _Limit)
        reply = self.client.heartbeat(beat)
        for refusal in reply.report_errors:
            log.warning("report for lease %s refused: %s", refusal.lease_id, refusal.message)
        self._sent_digest = digest if beat.inventory is not None else self._sent_digest
        if reply.want_inventory:
            self._sent_digest = None
        self._mark(reply, sent_at)
        return reply

    def _mark(self, reply: HeartbeatReply, sent_at: float | None = None) -> None:
        self._answered()
        self.last_heartbeat_at = reply.server_time
        if reply.delegation is not None and self.on_delegation is not None:
            try:
                self.on_delegation(reply.delegation, sent_at)
            except Exception:
                log.exception("taking the delegation of a heartbeat reply failed")
        if self.heartbeat_state is not None:
            self.heartbeat_state.on_reply(reply)

    # --- threads ----------------------------------------------------------
    def start(self, interval_s: float) -> None:
        def beat_loop() -> None:
            while True:
                self._beat_now.wait(interval_s)
                if self._stop.is_set():
                    break
                self._beat_now.clear()
                try:
                    self.flush()
                except PoolError:
                    pass  # kept and logged once by the link; the heartbeat still goes
                except Exception:
                    log.exception("outbox flush error")
                try:
                    self.heartbeat()
                except Exception:
                    log.exception("heartbeat loop error")

        def delegation_loop() -> None:
            while not self._stop.is_set():
                self._step_now.wait(DELEGATION_STEP_S)
                if self._stop.is_set():
                    break
                self._step_now.clear()
                if self.local is None:
                    continue
                try:
                    self.local.step()
                except PoolError:
                    pass  # logged once by the link; the next step asks again
                except Exception:
                    log.exception("delegation step error")

        def outbox_loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(LOCAL_FLUSH_S)
                if self._stop.is_set():
                    break
                # Linger briefly: a grant that follows a release carries it for free.
                time.sleep(OUTBOX_LINGER_S)
                self._wake.clear()
                try:
                    self.flush()
                except PoolError:
                    pass  # kept and logged once by the link
                except Exception:
                    log.exception("outbox flush error")
                if self.outbox_size() and self.failing:
                    self._stop.wait(min(interval_s, 1.0))  # poold down: retry, don't spin

        loops = ((beat_loop, "heartbeat"), (outbox_loop, "outbox"), (delegation_loop, "delegation"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        # Not joined at stop: it may sit in a long poll; it sends nothing that matters.
        threading.Thread(target=self._news_loop, name="agent-news", daemon=True).start()

    def _news_loop(self) -> None:
        """Wait on poold for news of this host (a long poll) and heartbeat when it has some.

        A revocation, a lease the ledger ended or a shrink request reaches the agent in
        the reply of the heartbeat this starts, within a round trip of poold deciding it
        rather than within a heartbeat interval. A poold without the route (an older
        one) leaves the agent on its heartbeat interval alone.
        """
        token: str | None = None
        while not self._stop.is_set():
            try:
                news = self.client.wait_news(token, timeout_s=NEWS_WAIT_S)
            except PoolError as err:
                if err.http_status in (404, 405):
                    log.info("poold does not push news (%s); heartbeats alone carry it", err)
                    return
                token = None  # another poold may answer next: its tokens differ
                self._stop.wait(NEWS_RETRY_S)
                continue
            except Exception:
                log.exception("waiting for news from poold failed")
                self._stop.wait(NEWS_RETRY_S)
                continue
            if news.news:
                self._beat_now.set()
            token = news.token

    def stop(self) -> None:
        self._stop.set()
        self._beat_now.set()
        self._wake.set()
        self._step_now.set()
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            self.flush()
        except PoolError as err:
            # Expected at shutdown (a revoked credential, poold down): its code, no traceback.
            log.warning(
                "final outbox flush failed: %s: %s (%d op(s) not delivered)",
                err.code,
                err.message,
                self.outbox_size(),
            )
        except Exception:
            log.exception("final outbox flush failed")
