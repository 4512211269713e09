"""How the agent stays in step with poold: registration, heartbeats, the outbox.

One heartbeat per interval carries every pending renewal on the host (and the
inventory when it changed). Releases go into an ordered outbox that rides on
the next grant or is flushed within a few milliseconds by a background thread,
so a tenant's release costs no poold round trip, yet a release just before a
grant is applied before that grant (its bytes and quota are free in time).
When poold is down the outbox and renewals are kept and replayed.

Each heartbeat also says what the agent holds, for poold's revocations and its
audit: per lease the holder (pid + start time), the dax sub-device and the local
state (held, revoked_held, or a scrub running, with its start), and the
sub-devices it made that no held lease accounts for (agent/leftovers.py). The link
asks one object for all of it, and tells it what poold replied: a
:class:`HeartbeatState` (agent/revocation.py's :class:`~agent.revocation.Revocations`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import datetime
from typing import Protocol

from poold.api.client import PooldClient
from poold.errors import PooldUnreachable, PoolError
from poold.wire.agent import (
    AgentLease,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    InventoryDevice,
    LeaseOp,
    LeaseReport,
    LeftoverSubDevice,
    Renewal,
)
from poold.wire.common import LeaseOut

log = logging.getLogger("pool_agent.link")

OUTBOX_LINGER_S = 0.005

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


class PooldLink:
    """The agent's one channel to poold (thread-safe)."""

    def __init__(self, client: PooldClient, agent_version: str) -> None:
        self.client = client
        self.agent_version = agent_version
        self._lock = threading.Lock()
        self._outbox: list[LeaseOp] = []
        self._renewals: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.inventory: list[InventoryDevice] = []
        self._sent_digest: str | None = None
        self.reachable = False
        self.last_heartbeat_at: datetime | None = None
        # Set by the agent service; without it (a bare link) heartbeats say nothing is held.
        self.heartbeat_state: HeartbeatState | None = None
        # Reports a failed heartbeat could not deliver wait here, unless a newer report of
        # the same lease replaces them.
        self._unsent_reports: dict[str, LeaseReport] = {}

    # --- synchronous calls ----------------------------------------------
    def register(self, inventory: list[InventoryDevice]) -> HeartbeatReply:
        self.inventory = inventory
        digest = inventory_digest(inventory)
        reply = self.client.register(
            Heartbeat(
                agent_version=self.agent_version, inventory_digest=digest, inventory=inventory
            )
        )
        self._sent_digest = digest
        self._mark(reply)
        return reply

    def grant(self, req: GrantRequest) -> LeaseOut:
        """Grant through poold, delivering the outbox with it."""
        with self._lock:
            pending, self._outbox = self._outbox, []
        try:
            lease = self.client.grant(req.model_copy(update={"pending": pending}))
        except PooldUnreachable:
            self.reachable = False
            self._requeue(pending)
            raise
        except PoolError as err:
            # 4xx: the pending ops were applied in their own transaction before the
            # grant was refused, nothing to requeue; 500: maybe not, replay them.
            self.reachable = True
            if err.http_status == 500:
                self._requeue(pending)
            raise
        self.reachable = True
        return lease

    def abort_now(self, lease_id: str, reason: str) -> None:
        try:
            self.client.abort(lease_id, reason)
        except PooldUnreachable:
            self.enqueue(LeaseOp(lease_id=lease_id, op="abort", reason=reason))

    def activate(self, lease_id: str) -> LeaseOut:
        return self.client.activate(lease_id)

    # --- batched ------------------------------------------------------------
    def enqueue(self, op: LeaseOp) -> None:
        with self._lock:
            self._outbox.append(op)
            self._renewals.pop(op.lease_id, None)
        self._wake.set()

    def renew_later(self, lease_id: str, ttl_s: int) -> None:
        with self._lock:
            self._renewals[lease_id] = ttl_s

    def _requeue(self, ops: list[LeaseOp]) -> None:
        if ops:
            with self._lock:
                self._outbox[:0] = ops

    def flush(self) -> None:
        """Send the outbox now (the background thread does this within a few ms)."""
        with self._lock:
            pending, self._outbox = self._outbox, []
        if not pending:
            return
        try:
            self.client.apply_ops(pending)
            self.reachable = True
        except PooldUnreachable:
            self.reachable = False
            self._requeue(pending)
        except PoolError as err:
            self.reachable = True
            if err.http_status in (401, 403, 500):
                # poold failed mid-request (nothing or everything committed), or does not
                # take this agent's credential (yet): keep them. Replaying is safe: ops
                # already applied are refused and change nothing.
                self._requeue(pending)
                raise
            # A batch poold will never accept (it says why): keeping it would block
            # every later op behind it.
            log.error("poold refused %d queued lease ops: %s %s", len(pending), err.code, err)

    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

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
        with self._lock:
            renewals, self._renewals = self._renewals, {}
        reports = self._take_reports()
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
        try:
            reply = self.client.heartbeat(beat)
        except PooldUnreachable as exc:
            log.warning("heartbeat failed, keeping %d renewal(s): %s", len(renewals), exc)
            self.reachable = False
            with self._lock:
                for k, v in renewals.items():
                    self._renewals.setdefault(k, v)
                for r in reports:
                    self._unsent_reports.setdefault(r.lease_id, r)
            return None
        for refusal in reply.report_errors:
            log.warning("report for lease %s refused: %s", refusal.lease_id, refusal.message)
        self._sent_digest = digest if beat.inventory is not None else self._sent_digest
        if reply.want_inventory:
            self._sent_digest = None
        self._mark(reply)
        return reply

    def _mark(self, reply: HeartbeatReply) -> None:
        self.reachable = True
        self.last_heartbeat_at = reply.server_time
        if self.heartbeat_state is not None:
            self.heartbeat_state.on_reply(reply)

    # --- threads ----------------------------------------------------------
    def start(self, interval_s: float) -> None:
        def beat_loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.flush()
                    self.heartbeat()
                except Exception:
                    log.exception("heartbeat loop error")

        def outbox_loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(1.0)
                if self._stop.is_set():
                    break
                # Linger briefly: a grant that follows a release carries it for free.
                time.sleep(OUTBOX_LINGER_S)
                self._wake.clear()
                try:
                    self.flush()
                except Exception:
                    log.exception("outbox flush error")
                if self.outbox_size() and not self.reachable:
                    self._stop.wait(min(interval_s, 1.0))  # poold down: retry, don't spin

        for target, name in ((beat_loop, "heartbeat"), (outbox_loop, "outbox")):
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            self.flush()
        except Exception:
            log.exception("final outbox flush failed")
