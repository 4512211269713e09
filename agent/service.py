"""What does the agent answer a tenant on its socket? The socket operations, one method each.

Identity is the kernel's (SO_PEERCRED): the uid, gids and pid the server read
from the connection are what poold checks against the tenant's allowed
users, never what the request claims. The operations work over the table of held
leases (agent/held.py); memory is made and dropped by agent/memory.py, a request
that finds the pool full waits in agent/admission.py, and what poold hears of the
host each heartbeat, and the leases it revokes, are agent/revocation.py's.

Any local user who can open the socket may call it, so nothing here costs the host
before the caller is authorised: a lease is granted (authorised) first and its memory
made after, within bounded in-flight budgets (:meth:`AgentService._authorise_then_make`);
a stranger learns neither which tenants exist nor what other tenants hold.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final

from agent import hand_off, restart
from agent import protocol as p
from agent.admission import Admission, InFlight, InFlightLimits
from agent.backends import Backend, Materialised
from agent.backends.emulated import available_bytes
from agent.delegation import DelegatedCapacity
from agent.held import HeldLease, HeldLeases
from agent.holders import Holder
from agent.journal import Journal
from agent.link import Holdings, PooldLink
from agent.local_grants import LocalGrants
from agent.memory import LeaseMemory, LocalDevice, Pin
from agent.peer import Peer
from agent.refill import RefillPolicy
from agent.resync import Resync
from agent.revocation import Revocations
from agent.warm import WarmPool
from poold import __version__
from poold.errors import (
    DelegationExpired,
    InvalidSize,
    LeaseNotActive,
    LedgerUnavailable,
    NotOwner,
    NotShrinkable,
    PooldUnreachable,
    UnknownTenant,
)
from poold.extents import align_up
from poold.lease_states import LeaseState
from poold.wire.agent import GrantRequest, LeaseOp, LeaseReport
from poold.wire.common import LeaseOut
from poold.wire.trusted import trusted

log = logging.getLogger("pool_agent")

# Memory larger than this (or populated, or a dax sub-device) is made off the socket's
# loop (agent/hand_off.py): a memfd of a few MiB from the warm pool is quicker than a
# thread switch; 1 GiB of fallocated pages is not.
_MADE_INLINE_BYTES: Final = 16 << 20


class AgentService:
    """Handler of every socket operation (the server checks all are present at start)."""

    def __init__(
        self,
        host: str,
        link: PooldLink,
        backends: dict[str, Backend],
        warm: WarmPool | None = None,
        *,
        in_flight: InFlightLimits | None = None,
        refill: RefillPolicy | None = None,
    ) -> None:
        self.host = host
        self.warm = warm
        self.link = link
        self.backends = backends
        self.started_at = time.monotonic()
        self.held = HeldLeases()
        # Leases granted here inside poold's delegation; anything else is poold's grant.
        self.delegation = LocalGrants(DelegatedCapacity(host, policy=refill), link, self.held)
        self.delegation.capacity.host_has_real = self._host_has_real
        self.admission = Admission(self._grant)
        self.in_flight = InFlight(in_flight)
        self.memory = LeaseMemory(link, backends, self.held, warm)
        self.leftovers = self.memory.leftovers
        self.revocations = Revocations(link, self.held, self.memory, self.admission)
        self.delegation.on_refused = self._local_refused
        link.heartbeat_state = self.revocations  # what each heartbeat reports
        self.resync = Resync(host, link, self.held, self.memory)
        self._holders: dict[int, Holder] = {}  # by connection id (see _holder)
        link.resync = self.resync  # reconciliation after a failed exchange

    # --- the agent's life (agent/run.py) -----------------------------------------------
    @property
    def journal(self) -> Journal | None:
        """Where the held leases are journalled (None: nowhere, as in most tests)."""
        return self.held.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self.held.journal = journal

    def set_local_devices(self, devices: dict[str, LocalDevice]) -> None:
        """How this host reaches each pool device (dax region, NUMA node), by device uid."""
        self.memory.set_local_devices(devices)

    def adopt(self) -> tuple[int, int]:
        """After a restart, before serving: (adopted, orphaned) journalled leases."""
        # Local leases' unapplied ops go back in the outbox first: an orphan op adopt
        # queues for a dead holder must follow its lease's local_grant.
        self.delegation.restore()
        return restart.adopt(self.link, self.held, self.memory, self.revocations)

    def reconcile(self) -> int:
        """End the live leases poold has for this host that the agent has no memory for."""
        return restart.reconcile(self.host, self.link, self.held, self.memory)

    def start_holder_watch(self, interval_s: float) -> None:
        """Orphan dead holders' leases and tear down due revocations every ``interval_s``."""
        self.revocations.start_holder_watch(interval_s)

    def holdings(self) -> Holdings:
        """What the next heartbeat reports this agent holds (see agent/revocation.py)."""
        return self.revocations.holdings()

    def take_reports(self) -> builtins.list[LeaseReport]:
        """The accounting reports the next heartbeat carries (see agent/revocation.py)."""
        return self.revocations.take_reports()

    def close(self) -> None:
        """Stop serving; the leases stay with their holders and in the journal."""
        self.revocations.stop()
        self.admission.close()  # waiting lease requests give up
        if self.warm is not None:
            self.warm.stop()
        # Shutting down is not releasing: tenants keep their mappings (a devdax
        # sub-device stays), the journal keeps the leases for the next start.
        for held in self.held.take_all():
            self.memory.close_copy(held)
        if self.held.journal is not None:
            self.held.journal.close()

    # --- operations ----------------------------------------------------------------
    def _result(self, held: HeldLease) -> p.LeaseResult:
        lease = held.lease
        # Built without validation, which would only re-check checked values: each comes
        # from the validated lease, the memory the backend made, or the held lease.
        return trusted(
            p.LeaseResult,
            {
                "lease_id": lease.id,
                "size_bytes": lease.requested_bytes,
                "length_bytes": lease.length_bytes,
                "offset_bytes": lease.offset_bytes,
                "epoch": lease.epoch,
                "media": lease.media,
                "backend": held.memory.backend if held.memory is not None else lease.device_kind,
                "numa_node": held.memory.numa_node
                if held.memory is not None and held.memory.numa_node is not None
                else lease.numa_node,
                "device_uid": lease.device_uid,
                "alignment_bytes": lease.alignment_bytes,
                "page_size_bytes": held.page_size_bytes,
                "expires_at": held.expires_at,
                "ttl_s": held.ttl_s,
                "shrinkable": held.shrinkable,
                "populated": held.memory is not None and held.memory.populated,
            },
        )

    def hello(self, peer: Peer, args: p.HelloArgs) -> p.HelloResult:
        return p.HelloResult(
            agent_version=__version__,
            host=self.host,
            agent_pid=os.getpid(),
            protocol_version=p.PROTOCOL_VERSION,
            peer_uid=peer.uid,
            peer_gid=peer.gid,
            peer_pid=peer.pid,
            peer_gids=list(peer.gids),
        )

    def lease(self, peer: Peer, args: p.LeaseArgs) -> tuple[p.LeaseResult, int]:
        with self.in_flight.request(peer.uid):
            lease, memory = self._authorise_then_make(peer, args)
        # The reply's fd is this request's own from here: nothing that ends the lease
        # once it is held (a holder check, a revocation) can close it under the send.
        fd = self.memory.to_send(memory, peer.connection_id)
        try:
            held = HeldLease(
                lease=lease,
                memory=memory,
                holder_uid=peer.uid,
                holder_pid=peer.pid,
                conn_id=peer.connection_id,
                ttl_s=lease.ttl_s,
                expires_at=lease.expires_at,
                page_size_bytes=memory.page_size_bytes,
                holder=self._holder(peer),
                sub_device=memory.sub_device,
                region_id=memory.dax_region_id,
                # What the tenant is told is checked on the fd, not assumed from the request.
                shrinkable=args.shrinkable and memory.can_shrink(),
            )
            # Journalled before the fd leaves: a crash after this point is re-adopted.
            if self.delegation.is_pending(lease.id):
                self.delegation.commit(held)  # an append, and its local_grant queued
            else:
                self.held.record(held)
            self.held.add(held)
        except BaseException:
            self.memory.sent(peer.connection_id, fd)  # no reply will carry it
            raise
        finally:
            # Held now, or aborted on the way: reconciliation may judge the lease from here.
            self.link.settled(lease.id)
        # Routine traffic (poold/logs.py): at INFO, a line per lease at a thousand leases
        # a second passes journald's rate limit in seconds, and the lines it then drops
        # are everyone's. poold's ledger keeps every lease with its events.
        log.debug(
            "lease %s: %d bytes on %s for uid %d pid %d",
            lease.id,
            lease.length_bytes,
            lease.device_uid,
            peer.uid,
            peer.pid,
        )
        return self._result(held), fd

    def fd_sent(self, peer: Peer, fd: int) -> None:
        """The reply carrying ``fd`` left (or could not): the agent's copy of a memfd's
        tenant reopen goes now (agent/release_check.py)."""
        self.memory.sent(peer.connection_id, fd)

    def _authorise_then_make(self, peer: Peer, args: p.LeaseArgs) -> tuple[LeaseOut, Materialised]:
        """The one way to a lease's memory: poold authorises it (grants it), then the agent
        makes its memory within the in-flight budgets (poold recorded it active with the
        grant; an older poold's granted lease is activated after the memory is made).

        Nothing is made, taken from the warm pool, or counted towards pressure before the
        grant, so a caller no tenant allows costs the host nothing but the refusal. (A
        local grant inside a delegation will authorise here instead of poold.)
        """
        lease = self._authorise(peer, args)
        if (
            lease.length_bytes > _MADE_INLINE_BYTES
            or args.populate
            or lease.device_kind == "devdax"
        ):
            hand_off.ahead()  # long to make: other tenants are served meanwhile
        making = False
        try:
            # RAM-backed memory also waits while what others are making would not fit
            # in what the host has free (the backend's own check sees only itself).
            ram = available_bytes if lease.device_kind == "emulated" else None
            with self.in_flight.making(
                peer.uid,
                lease.length_bytes,
                wait_s=max(self.in_flight.limits.wait_s, args.wait_s),
                available=ram,
            ):
                making = True  # from here on, materialise_placed aborts its own failures
                pin = Pin(args.populate, args.hugepages, args.numa_node)
                memory = self.memory.materialise_placed(lease, shrinkable=args.shrinkable, pin=pin)
        except BaseException as err:
            if not making:
                self.link.give_up(lease, f"not materialised: {err}")
            self.delegation.abandon(lease.id)  # a local grant's extent is free again
            self.link.settled(lease.id)
            raise
        return lease, memory

    def _local_refused(self, lease_id: str, why: str) -> None:
        """A local lease poold refused at commit: taken back as a revocation past its
        deadline (devdax: the sub-device goes; a memfd: the agent's copy goes, and its
        pages stay with a holder that still maps it); the tenant hears it is lost."""
        held = self.held.get(lease_id)
        if held is None:
            return
        held.extra["lost_reason"] = (p.LOST_ENDED, why)
        self.revocations.revoke([lease_id])

    def _host_has_devdax(self) -> bool:
        return any(d.kind == "devdax" for d in self.link.inventory)

    def _host_has_real(self) -> bool:
        """This host reaches real far memory (placement keeps emulated memory out then)."""
        return any(d.media != "emulated" and d.kind != "emulated" for d in self.link.inventory)

    def _grant(self, req: GrantRequest) -> LeaseOut:
        """Inside the delegation when the request fits it (one socket round trip, no
        network); poold's grant otherwise. Past the delegation's TTL with poold down, the
        tenant hears ``delegation_expired``, not a wait for a poold that does not answer."""
        try:
            local = self.delegation.grant(req)
        except DelegationExpired as expired:
            if self.link.failing:
                raise  # a central grant would only wait out its patience
            try:
                lease = self.delegation.central(req, self.link.grant_spending)
            except (PooldUnreachable, LedgerUnavailable) as err:
                raise expired from err
        else:
            if local is not None:
                return local
            # poold may pay it from this host's budget: the agent's view drops first.
            lease = self.delegation.central(req, self.link.grant_spending)
        self.delegation.capacity.note_demand(lease.tenant, lease.media, lease.length_bytes)
        return lease

    def _authorise(self, peer: Peer, args: p.LeaseArgs) -> LeaseOut:
        """poold's grant of the lease for the caller's kernel identity (not activated).

        A caller who may not act for the tenant it names hears the same ``not_owner``
        whether that tenant exists or not: the socket is no oracle of tenant names.
        """
        req = GrantRequest(
            tenant=args.tenant,
            size_bytes=args.size_bytes,
            ttl_s=args.ttl_s,
            media=args.media,
            uid=peer.uid,
            gids=list(peer.all_gids),
            pid=peer.pid,
            labels=dict(args.labels),
            # Recorded active at once where the memory is a memfd (made right after the
            # grant; one that cannot be is released, PooldLink.give_up): a separate
            # activation was a second round trip and transaction per central lease. A
            # host with dax devices keeps the two steps: carving a sub-device can fail,
            # and a lease that never had memory is aborted, not released.
            activate=not self._host_has_devdax(),
        )
        try:
            return self.admission.grant(req, args.wait_s)
        except (UnknownTenant, NotOwner) as err:
            if args.tenant is None:
                raise
            raise NotOwner(
                f"uid {peer.uid} may not act for tenant {args.tenant!r} on this host "
                "(no such tenant, or not yours)",
                tenant=args.tenant,
                uid=peer.uid,
            ) from err

    def renew(self, peer: Peer, args: p.RenewArgs) -> p.RenewResult:
        held = self.held.owned(peer.uid, args.lease_id, "renew")
        if held.revoke_deadline_at is not None:
            # Revoked: no more renewals; the reply says when the memory goes.
            self.revocations.take_shrink_hint(held.lease.id)
            return p.RenewResult(
                lease_id=held.lease.id,
                expires_at=held.revoke_deadline_at,
                revoke_deadline_at=held.revoke_deadline_at,
            )
        ttl_s = args.ttl_s or held.ttl_s
        held.ttl_s = ttl_s
        # poold applies it with the next heartbeat; the tenant's clock starts now.
        held.expires_at = datetime.now(UTC) + timedelta(seconds=ttl_s)
        self.link.renew_later(held.lease.id, ttl_s)
        hint = self.revocations.take_shrink_hint(held.lease.id)
        return p.RenewResult(
            lease_id=held.lease.id,
            expires_at=held.expires_at,
            shrink_target_bytes=hint.target_bytes if hint is not None else None,
            shrink_deadline_at=hint.deadline_at if hint is not None else None,
        )

    def release(self, peer: Peer, args: p.ReleaseArgs) -> p.ReleaseResult:
        self.held.owned(peer.uid, args.lease_id, "release")
        held = self.held.forget(args.lease_id, "released")
        if held is None:  # a concurrent release won
            raise LeaseNotActive(f"lease {args.lease_id} is released", lease_id=args.lease_id)
        revoked = held.revoke_deadline_at is not None
        if self.revocations.ended_mapped(held, "revoked" if revoked else "released"):
            # A memfd some process still maps or holds: counted until none does.
            state = "revoked_mapped" if revoked else "released_mapped"
            return p.ReleaseResult(lease_id=held.lease.id, state=state)
        if held.revoke_deadline_at is not None:
            # The holder let go of a revoked lease: that is the revocation done.
            self.memory.drop(held)
            self.revocations.revoke([held.lease.id])
            return p.ReleaseResult(lease_id=held.lease.id, state="reclaimed")
        self.memory.drop(held)
        # A devdax lease, whether made by this process or re-adopted from the journal
        # (no memory object then, only its sub-device): its bytes must be zeroed.
        if held.sub_device is not None and held.region_id is not None:
            # The bytes stay taken (scrubbing) until the agent has zeroed them.
            self.link.enqueue(
                LeaseOp(lease_id=held.lease.id, op="release_dirty", reason="holder released")
            )
            lease = held.lease  # its offset is the sub-device's range in the region
            self.memory.scrub_later(
                lease.device_kind, held.region_id, lease.offset_bytes, lease.length_bytes, lease.id
            )
            return p.ReleaseResult(lease_id=held.lease.id, state="scrubbing")
        # The one common ending, so its op and reply are built without validation.
        lease_id = held.lease.id
        self.link.enqueue(
            trusted(
                LeaseOp,
                {
                    "lease_id": lease_id,
                    "op": "release",
                    "reason": "holder released",
                    "length_bytes": None,
                    "grant": None,
                },
            )
        )
        self.admission.capacity_changed()
        return trusted(p.ReleaseResult, {"lease_id": lease_id, "state": LeaseState.RELEASED})

    def shrink(self, peer: Peer, args: p.ShrinkArgs) -> p.ShrinkResult:
        """Cut a shrinkable memfd lease down to ``size_bytes`` (aligned) and tell poold.

        The memfd is truncated first, so the pages are gone before the ledger frees the
        bytes (it never counts memory free that a tenant still has); the ledger op rides
        the outbox, so a shrink while poold is down is replayed like a release.
        """
        held = self.held.owned(peer.uid, args.lease_id, "shrink")
        lease = held.lease
        if held.revoke_deadline_at is not None:
            raise LeaseNotActive(
                f"lease {lease.id} was revoked; cannot shrink it", lease_id=lease.id
            )
        memory = held.memory
        if not held.shrinkable or memory is None or not memory.can_shrink():
            raise NotShrinkable(
                f"lease {lease.id} cannot be shrunk in place (lease it shrinkable, or "
                "release it and lease a smaller one)",
                lease_id=lease.id,
            )
        step = max(lease.alignment_bytes, held.page_size_bytes, 1)
        with self.held.lock:
            if held.ending is not None or held.memory is not memory:
                # Ended meanwhile (revoked, orphaned): its fd is closed, or about to be,
                # and its number may be another memfd's by now.
                raise LeaseNotActive(
                    f"lease {lease.id} has ended; cannot shrink it", lease_id=lease.id
                )
            old = lease.length_bytes
            new = align_up(args.size_bytes, step)
            if new >= old:
                raise InvalidSize(
                    f"lease {lease.id} is {old} bytes; shrinking to {args.size_bytes} "
                    f"(aligned: {new}) gives nothing back",
                    lease_id=lease.id,
                    size_bytes=args.size_bytes,
                    alignment_bytes=step,
                )
            try:
                os.ftruncate(memory.fd, new)
            except OSError as err:
                raise NotShrinkable(
                    f"lease {lease.id}: the memfd refused to shrink: {err.strerror}",
                    lease_id=lease.id,
                    errno=err.errno,
                ) from err
            lease.length_bytes = new
            lease.requested_bytes = min(lease.requested_bytes, new)
            held.memory = dataclasses.replace(memory, length_bytes=new)
        self.held.record(held)
        self.link.enqueue(
            LeaseOp(
                lease_id=lease.id,
                op="shrink",
                length_bytes=new,
                reason=f"holder gave back {old - new} bytes",
            )
        )
        self.admission.capacity_changed()
        log.debug("lease %s shrunk from %d to %d bytes", lease.id, old, new)  # in the ledger
        return p.ShrinkResult(lease_id=lease.id, length_bytes=new, freed_bytes=old - new)

    def list(self, peer: Peer, args: p.ListArgs) -> p.ListResult:
        mine = self.held.visible_to(peer.uid)
        return p.ListResult(
            leases=[
                p.LeaseListing(
                    **self._result(h).model_dump(),
                    state=h.lease.state,
                    revoke_deadline_at=h.revoke_deadline_at,
                )
                for h in mine
            ]
        )

    def stats(self, peer: Peer, args: p.StatsArgs) -> p.StatsResult:
        """Host-wide counts for root; anyone else sees only their own uid's leases (a
        stranger: none), so the socket tells nobody what other tenants hold."""
        everything = self.held.visible_to(peer.uid)
        held = [h for h in everything if not h.revoked_held]
        revoked = [h for h in everything if h.revoked_held]
        # Revoked memfds still mapped by anyone, watched by inode (agent/revocation.py).
        watched = [m for m in self.held.mapped_visible_to(peer.uid) if m.why == "revoked"]
        return p.StatsResult(
            scope="host" if peer.uid == 0 else "caller",
            leases_held=len(held),
            bytes_held=sum(h.lease.length_bytes for h in held),
            revoked_held_leases=len(revoked) + len(watched),
            revoked_held_bytes=sum(h.lease.length_bytes for h in revoked)
            + sum(m.length_bytes for m in watched),
            uptime_s=time.monotonic() - self.started_at,
            poold_reachable=self.link.reachable,
            last_heartbeat_at=self.link.last_heartbeat_at,
        )

    def report(self, peer: Peer, args: p.ReportArgs) -> p.ReportResult:
        held = self.held.owned(peer.uid, args.lease_id, "report on")
        held.extra["report"] = args.model_dump()
        # Only the latest counts: the next heartbeat carries it (DESIGN.md: batched).
        self.revocations.note_report(LeaseReport(**held.extra["report"]))
        return p.ReportResult(accepted=True)

    def attach_push(self, push: Callable[[int, int, p.Event], bool]) -> None:
        """The server's way to a lease holder's session (revoke, shrink, lost events)."""
        self.revocations.push = push

    def holds_leases(self, peer: Peer) -> bool:
        """Whether the peer's process holds a lease here: its idle connection stays open."""
        return bool(self.held.of_pid(peer.pid))

    def _holder(self, peer: Peer) -> Holder:
        """The peer's process as a lease holder (pid + start time), read once per
        connection: the start time costs a /proc read through psutil (~0.1-0.25 ms), and
        a connection's peer pid never changes (SO_PEERCRED at connect)."""
        holder = self._holders.get(peer.connection_id)
        if holder is None or holder.pid != peer.pid:
            holder = Holder.of(peer.pid, peer.uid)
            self._holders[peer.connection_id] = holder
        return holder

    def disconnected(self, peer: Peer) -> None:
        """A connection closed. Its leases stay while the holder lives (it may reconnect)."""
        self._holders.pop(peer.connection_id, None)
        mine = self.held.of_pid(peer.pid)
        if mine:
            hand_off.ahead()  # a look at the holders' processes
            self.revocations.check_holders(mine)
