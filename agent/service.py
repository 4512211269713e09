"""What the agent does for a tenant: the socket operations, between tenant, poold and memory.

Identity is the kernel's (SO_PEERCRED): the uid, gids and pid the server read
from the connection are what poold checks against the tenant's allowed
users, never what the request claims. A lease's memory is made by a backend
(emulated memfd here; devdax and numa later) and handed over as an fd.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from agent import protocol as p
from agent.backends import Backend, Materialised, Placement
from agent.holders import Holder
from agent.holders import alive as holder_alive
from agent.journal import Entry as JournalEntry
from agent.journal import Journal, SubDevice
from agent.leftovers import LeftoverSweep
from agent.link import Holdings, PooldLink
from agent.server import Peer
from agent.warm import WarmPool
from poold import __version__
from poold.errors import (
    BackendFailed,
    InvalidSize,
    LeaseNotActive,
    NoCapacity,
    NotOwner,
    NotShrinkable,
    PoolError,
    UnknownLease,
)
from poold.extents import align_up
from poold.wire.agent import (
    AgentLease,
    GrantRequest,
    HeartbeatReply,
    InventoryDevice,
    LeaseHolder,
    LeaseOp,
    LeaseReport,
    Revocation,
    ScrubOrder,
    ScrubProgress,
    ShrinkHint,
)
from poold.wire.common import LeaseOut

log = logging.getLogger("pool_agent")


ENDED_MEMORY = 4096
# Tear a revoked lease down this long before poold's deadline, so the confirmation
# arrives in time and the reaper never has to reclaim it by force.
REVOKE_MARGIN_S = 1.0  # how many ended lease ids the agent remembers, for clear errors
# A lease request waiting for capacity (wait_s) retries its grant when a heartbeat reply
# arrives or a local lease is released, and at least this often otherwise.
ADMISSION_RETRY_S = 1.0


class _Waiting:
    """A lease request waiting for capacity; identity is its place in the queue."""

    __slots__ = ("size_bytes",)

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes


@dataclass(frozen=True)
class LocalDevice:
    """Where a pool device lives on this host: its dax region or NUMA node."""

    kind: str
    dax_region_id: int | None = None
    numa_node: int | None = None


_DAX_REGION_NAME = re.compile(r"^dax_region(\d+)$|^dax(\d+)\.\d+$")


def local_device(device: InventoryDevice) -> LocalDevice:
    """The local facts behind a wire inventory entry (discovery names dax regions
    `dax_region<N>`; a static pmem namespace goes by its device, `dax<N>.0`)."""
    match = _DAX_REGION_NAME.match(device.local_name)
    region = next((int(g) for g in match.groups() if g is not None), None) if match else None
    return LocalDevice(device.kind, dax_region_id=region, numa_node=device.numa_node)


@dataclass
class _RunningScrub:
    """A scrub this agent runs now: reported in heartbeats, its sub-device tied meanwhile."""

    started_at: datetime
    bytes_done: int = 0
    sub: SubDevice | None = None  # the temporary sub-device, once it has a name


@dataclass
class HeldLease:
    lease: LeaseOut
    # None for a lease re-adopted after an agent restart: the holder keeps its
    # own mapping; the agent lost its fd (devdax: the sub-device is by name).
    memory: Materialised | None
    holder_uid: int
    holder_pid: int
    conn_id: int
    ttl_s: int
    expires_at: datetime
    page_size_bytes: int
    holder: Holder | None = None
    sub_device: str | None = None
    region_id: int | None = None
    lost: bool = False
    # poold revoked it: torn down at this time (the tenant is told in renew replies).
    revoke_deadline_at: datetime | None = None
    # Revoked, but a memfd whose live holder still maps it: nothing can take the
    # pages back, so the lease stays revoking (used) until the holder exits.
    revoked_held: bool = False
    # A memfd left unsealed against shrinking (LeaseArgs.shrinkable): `shrink` may cut it.
    shrinkable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class AgentService:
    """Handler of every socket operation (the server checks all are present at start)."""

    def __init__(
        self, host: str, link: PooldLink, backends: dict[str, Backend], warm: WarmPool | None = None
    ) -> None:
        self.host = host
        self.warm = warm
        self.link = link
        self.backends = backends
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self._held: dict[str, HeldLease] = {}
        self._ended: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (state, uid)
        self._local: dict[str, LocalDevice] = {}
        self.journal: Journal | None = None
        self._stop = threading.Event()
        self._scrubbing: set[str] = set()  # lease ids whose range is being (or was) zeroed
        self._scrubs_running: dict[str, _RunningScrub] = {}  # by lease id
        self._scrub_reissues: dict[str, datetime] = {}  # lease id -> reissued_at acted on
        # Sub-devices are the devdax backend's (the kind poold names it by) alone.
        self.leftovers = LeftoverSweep(backends.get("devdax"))
        # Latest accounting report per lease, not yet handed to the link's heartbeat.
        self._reports: dict[str, LeaseReport] = {}
        # poold's shrink hints (pressure) per held lease, handed out once in `renew`.
        self._shrink: dict[str, ShrinkHint] = {}
        link.on_reply = self._on_heartbeat_reply
        link.reports_provider = self.take_reports
        # Lease requests waiting for capacity, oldest first: only the oldest retries.
        self._admission = threading.Condition()
        self._waiting: deque[_Waiting] = deque()
        self._capacity_epoch = 0  # bumped whenever capacity may have been freed
        self._last_refusal: NoCapacity | None = None
        link.revoked_held_provider = self.revoked_held_ids
        link.admission_provider = self.admission_wanted_bytes
        link.held_provider = self.held_ids
        link.holdings_provider = self.holdings

    # --- helpers -----------------------------------------------------------
    def _premade_length(self, args: p.LeaseArgs) -> tuple[Backend, int] | None:
        """For memfd-only hosts, the length the grant will have, so memory can be made first.

        Emulated memory does not depend on where on the device the lease sits, so
        the agent materialises it before asking poold and grants+activates in one
        round trip. Any other device kind needs the placement first.
        """
        inv = self.link.inventory
        if not inv or any(d.kind != "emulated" for d in inv):
            return None
        if args.media is not None and args.media != "emulated":
            return None
        backend = self.backends.get("emulated")
        if backend is None:
            return None
        alignment = max(d.alignment_bytes for d in inv)
        return backend, align_up(args.size_bytes, alignment)

    def _result(self, held: HeldLease) -> p.LeaseResult:
        lease = held.lease
        return p.LeaseResult(
            lease_id=lease.id,
            size_bytes=lease.requested_bytes,
            length_bytes=lease.length_bytes,
            offset_bytes=lease.offset_bytes,
            epoch=lease.epoch,
            media=lease.media,
            backend=held.memory.backend if held.memory is not None else lease.device_kind,
            numa_node=held.memory.numa_node
            if held.memory is not None and held.memory.numa_node is not None
            else lease.numa_node,
            device_uid=lease.device_uid,
            alignment_bytes=lease.alignment_bytes,
            page_size_bytes=held.page_size_bytes,
            expires_at=held.expires_at,
            ttl_s=held.ttl_s,
            shrinkable=held.shrinkable,
        )

    def _owned(self, peer: Peer, lease_id: str, op: str) -> HeldLease:
        """The held lease, if this peer may act on it; otherwise a coded refusal."""
        with self._lock:
            held = self._held.get(lease_id)
            ended = self._ended.get(lease_id)
        if held is None:
            if ended is not None:
                state, uid = ended
                if uid != peer.uid and peer.uid != 0:
                    raise NotOwner(f"lease {lease_id} is not yours", lease_id=lease_id)
                raise LeaseNotActive(
                    f"lease {lease_id} is {state}; cannot {op} it", lease_id=lease_id, state=state
                )
            raise UnknownLease(f"no lease {lease_id} on this host", lease_id=lease_id)
        if held.holder_uid != peer.uid and peer.uid != 0:
            raise NotOwner(f"lease {lease_id} is held by another user", lease_id=lease_id)
        if held.lost and held.revoke_deadline_at is None:
            raise LeaseNotActive(f"lease {lease_id} was ended by poold", lease_id=lease_id)
        return held

    def _forget(self, lease_id: str, state: str) -> HeldLease | None:
        with self._lock:
            held = self._held.pop(lease_id, None)
            if held is not None:
                self._ended[lease_id] = (state, held.holder_uid)
                while len(self._ended) > ENDED_MEMORY:
                    self._ended.popitem(last=False)
        if held is not None and self.journal is not None:
            self.journal.remove(lease_id)
        return held

    def _drop_memory(self, held: HeldLease) -> None:
        if held.memory is None:
            # Re-adopted: a devdax sub-device is destroyed by name; a memfd's pages
            # go when the holder unmaps them (the agent has no fd left to close).
            backend = self.backends.get(held.lease.device_kind)
            if backend is not None and held.sub_device is not None:
                try:
                    backend.revoke(held.region_id or 0, held.sub_device)
                except Exception:
                    log.exception("destroying %s of lease %s", held.sub_device, held.lease.id)
            return
        backend = self.backends.get(held.memory.backend)
        try:
            if backend is not None:
                backend.release(held.memory)
            else:
                os.close(held.memory.fd)
        except OSError:
            log.exception("releasing memory of lease %s", held.lease.id)

    # --- operations ----------------------------------------------------------
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
        gids = list(peer.all_gids)
        req = GrantRequest(
            tenant=args.tenant,
            size_bytes=args.size_bytes,
            ttl_s=args.ttl_s,
            media=args.media,
            uid=peer.uid,
            gids=gids,
            pid=peer.pid,
            labels=dict(args.labels),
        )
        premade = self._premade_length(args)
        memory: Materialised | None = None
        if premade is not None:
            backend, length = premade
            # Warm memfds are sealed against shrinking: a shrinkable lease is made here.
            if self.warm is not None and not args.shrinkable:
                memory = self.warm.take(length)
            if memory is None:
                memory = backend.materialise(
                    length, f"poold-lease-{peer.pid}", shrinkable=args.shrinkable
                )
            try:
                lease = self._grant(req.model_copy(update={"activate": True}), args.wait_s)
            except BaseException:
                # Never handed out: still fresh, so it may wait for the next tenant.
                if self.warm is not None:
                    self.warm.give_back(memory)
                else:
                    backend.release(memory)
                raise
            if lease.length_bytes != memory.length_bytes:
                # poold aligned differently than the inventory said: redo, never mis-size.
                backend.release(memory)
                memory = None
        else:
            lease = self._grant(req, args.wait_s)
        if memory is None:
            memory = self._materialise_placed(lease, shrinkable=args.shrinkable)
        held = HeldLease(
            lease=lease,
            memory=memory,
            holder_uid=peer.uid,
            holder_pid=peer.pid,
            conn_id=peer.connection_id,
            ttl_s=lease.ttl_s,
            expires_at=lease.expires_at,
            page_size_bytes=memory.page_size_bytes,
            holder=Holder.of(peer.pid, peer.uid),
            sub_device=memory.sub_device,
            region_id=memory.dax_region_id,
            # What the tenant is told is checked on the fd, not assumed from the request.
            shrinkable=args.shrinkable and memory.can_shrink(),
        )
        # Journalled before the fd leaves: a crash after this point is re-adopted.
        self._journal(held)
        with self._lock:
            self._held[lease.id] = held
        log.info(
            "lease %s: %d bytes on %s for uid %d pid %d",
            lease.id,
            lease.length_bytes,
            lease.device_uid,
            peer.uid,
            peer.pid,
        )
        return self._result(held), memory.fd

    def _grant(self, req: GrantRequest, wait_s: float) -> LeaseOut:
        """Grant through poold; on no_capacity, wait up to ``wait_s`` in arrival order.

        Requests waiting on this agent queue FIFO: only the oldest retries (after a
        heartbeat reply, a local release, or ADMISSION_RETRY_S), so a later one never
        overtakes it. Past the wait, the request fails with the last no_capacity seen
        (the details name the free bytes per device).
        """
        if wait_s <= 0:
            return self.link.grant(req)
        deadline = time.monotonic() + wait_s
        ticket = _Waiting(req.size_bytes)
        last: NoCapacity | None = None
        with self._admission:
            self._waiting.append(ticket)
        try:
            while True:
                with self._admission:
                    while self._waiting[0] is not ticket:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self._stop.is_set():
                            raise self._still_no_capacity(req, wait_s, last)
                        self._admission.wait(remaining)
                    epoch = self._capacity_epoch
                try:
                    return self.link.grant(req)
                except NoCapacity as err:
                    if "host_status" in err.detail:  # draining: no capacity will come
                        raise
                    last = err
                    self._last_refusal = err
                with self._admission:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._stop.is_set():
                        raise last
                    if self._capacity_epoch == epoch and not self._stop.is_set():
                        self._admission.wait(min(remaining, ADMISSION_RETRY_S))
        finally:
            with self._admission:
                self._waiting.remove(ticket)
                self._admission.notify_all()

    def _still_no_capacity(
        self, req: GrantRequest, wait_s: float, last: NoCapacity | None
    ) -> NoCapacity:
        """The refusal of a request that waited its whole time behind older ones."""
        seen = last or self._last_refusal
        details = dict(seen.detail) if seen is not None else {}
        because = f": {seen.message}" if seen is not None else ""
        return NoCapacity(
            f"no capacity for {req.size_bytes} bytes within {wait_s:g} s "
            f"(older requests were waiting first){because}",
            **{**details, "waited_s": wait_s},
        )

    def admission_wanted_bytes(self) -> int:
        """For the heartbeat: what the oldest waiting lease request needs (FIFO: only it)."""
        with self._admission:
            return self._waiting[0].size_bytes if self._waiting else 0

    def _capacity_changed(self) -> None:
        """Capacity may have been freed: the oldest waiting lease request retries."""
        with self._admission:
            self._capacity_epoch += 1
            self._admission.notify_all()

    def set_local_devices(self, devices: dict[str, LocalDevice]) -> None:
        """How this host reaches each pool device (dax region, NUMA node), by device uid."""
        with self._lock:
            self._local = dict(devices)

    def _locate(self, device_uid: str) -> LocalDevice | None:
        """Where a device lives here: set explicitly, or read off the current inventory."""
        with self._lock:
            local = self._local.get(device_uid)
        if local is not None:
            return local
        for device in self.link.inventory:
            if device.uid == device_uid:
                return local_device(device)
        return None

    def _make(self, backend: Backend, lease: LeaseOut, *, shrinkable: bool = False) -> Materialised:
        """Memory for a placed lease, made the way its device kind needs."""
        local = self._locate(lease.device_uid)
        placement = Placement(
            device_uid=lease.device_uid,
            offset_bytes=lease.offset_bytes,
            length_bytes=lease.length_bytes,
            dax_region_id=local.dax_region_id if local is not None else None,
            numa_node=local.numa_node if local is not None else lease.numa_node,
        )

        def carved(device: str) -> None:
            # Journalled before it is sized: a crash between the carve and the lease's
            # journal entry leaves a sub-device the next start destroys (adopt), never
            # one reported to poold as someone else's range.
            assert placement.dax_region_id is not None  # only a dax region is carved
            sub = SubDevice(
                placement.dax_region_id, device, lease.id, lease.length_bytes, time.time()
            )
            self.leftovers.record(self.journal, sub)

        return backend.materialise_placed(
            placement, f"poold-lease-{lease.id}", shrinkable=shrinkable, on_carve=carved
        )

    def _materialise_placed(self, lease: LeaseOut, *, shrinkable: bool = False) -> Materialised:
        """Two-step path: memory made after placement, then activated in the ledger."""
        backend = self.backends.get(lease.device_kind)
        try:
            if backend is None:
                raise BackendFailed(f"no backend for device kind {lease.device_kind}")
            memory = self._make(backend, lease, shrinkable=shrinkable)
        except BaseException as exc:
            self.link.abort_now(lease.id, f"materialise failed: {exc}")
            if isinstance(exc, PoolError):
                raise
            raise BackendFailed(f"could not materialise lease: {exc}") from exc
        if lease.state == "granted":
            try:
                activated = self.link.activate(lease.id)
            except BaseException:
                backend.release(memory)
                self.link.abort_now(lease.id, "activation failed")
                raise
            lease.state = activated.state
            lease.expires_at = activated.expires_at
        return memory

    def renew(self, peer: Peer, args: p.RenewArgs) -> p.RenewResult:
        held = self._owned(peer, args.lease_id, "renew")
        if held.revoke_deadline_at is not None:
            # Revoked: no more renewals; the reply says when the memory goes.
            with self._lock:
                self._shrink.pop(held.lease.id, None)
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
        with self._lock:
            hint = self._shrink.pop(held.lease.id, None)
        return p.RenewResult(
            lease_id=held.lease.id,
            expires_at=held.expires_at,
            shrink_target_bytes=hint.target_bytes if hint is not None else None,
            shrink_deadline_at=hint.deadline_at if hint is not None else None,
        )

    def release(self, peer: Peer, args: p.ReleaseArgs) -> p.ReleaseResult:
        self._owned(peer, args.lease_id, "release")
        held = self._forget(args.lease_id, "released")
        if held is None:  # a concurrent release won
            raise LeaseNotActive(f"lease {args.lease_id} is released", lease_id=args.lease_id)
        if held.revoke_deadline_at is not None:
            # The holder let go of a revoked lease: that is the revocation done.
            self._drop_memory(held)
            self._revoke([held.lease.id])
            return p.ReleaseResult(lease_id=held.lease.id, state="reclaimed")
        self._drop_memory(held)
        # A devdax lease, whether made by this process or re-adopted from the journal
        # (no memory object then, only its sub-device): its bytes must be zeroed.
        if held.sub_device is not None and held.region_id is not None:
            # The bytes stay taken (scrubbing) until the agent has zeroed them.
            self.link.enqueue(
                LeaseOp(lease_id=held.lease.id, op="release_dirty", reason="holder released")
            )
            lease = held.lease  # its offset is the sub-device's range in the region
            self._scrub_later(
                lease.device_kind, held.region_id, lease.offset_bytes, lease.length_bytes, lease.id
            )
            return p.ReleaseResult(lease_id=held.lease.id, state="scrubbing")
        self.link.enqueue(LeaseOp(lease_id=held.lease.id, op="release", reason="holder released"))
        self._capacity_changed()
        return p.ReleaseResult(lease_id=held.lease.id, state="released")

    def shrink(self, peer: Peer, args: p.ShrinkArgs) -> p.ShrinkResult:
        """Cut a shrinkable memfd lease down to ``size_bytes`` (aligned) and tell poold.

        The memfd is truncated first, so the pages are gone before the ledger frees the
        bytes (it never counts memory free that a tenant still has); the ledger op rides
        the outbox, so a shrink while poold is down is replayed like a release.
        """
        held = self._owned(peer, args.lease_id, "shrink")
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
        with self._lock:
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
        self._journal(held)
        self.link.enqueue(
            LeaseOp(
                lease_id=lease.id,
                op="shrink",
                length_bytes=new,
                reason=f"holder gave back {old - new} bytes",
            )
        )
        self._capacity_changed()
        log.info("lease %s shrunk from %d to %d bytes", lease.id, old, new)
        return p.ShrinkResult(lease_id=lease.id, length_bytes=new, freed_bytes=old - new)

    def _scrub_later(
        self, kind: str, region_id: int, offset_bytes: int, length_bytes: int, lease_id: str
    ) -> None:
        """Zero a released devdax range off the request path, then tell poold how it went.

        ``kind``: the device kind of the range, whose backend zeroes it."""
        backend = self.backends.get(kind)
        running = _RunningScrub(started_at=datetime.now(UTC))
        with self._lock:
            if lease_id in self._scrubbing:
                return
            self._scrubbing.add(lease_id)
            self._scrubs_running[lease_id] = running  # reported in heartbeats

        def carved(device: str) -> None:
            # Tied first, then journalled: a crash from here on leaves a sub-device the
            # next start destroys (clean_start), never one reported as someone else's.
            sub = SubDevice(region_id, device, lease_id, length_bytes, time.time())
            with self._lock:
                running.sub = sub
            self.leftovers.record(self.journal, sub)

        def deleted(device: str) -> None:
            with self._lock:  # untied first: a sweep meanwhile sees it gone, and forgets it
                sub, running.sub = running.sub, None
            if sub is not None:
                try:
                    self.leftovers.forget(self.journal, sub)
                except Exception:  # the sweep drops the record once it sees the device gone
                    log.exception("forgetting scrub sub-device %s", device)

        def zeroed(bytes_done: int) -> None:
            running.bytes_done = bytes_done

        def run() -> None:
            ok = False
            try:
                if backend is not None:
                    ok = backend.scrub(
                        region_id,
                        offset_bytes,
                        length_bytes,
                        on_carve=carved,
                        on_deleted=deleted,
                        progress=zeroed,
                    )
            except Exception:
                log.exception("scrub of lease %s failed", lease_id)
            op = "scrubbed" if ok else "scrub_failed"
            reason = "range zeroed" if ok else "scrub failed: range goes to quarantine"
            self.link.enqueue(LeaseOp(lease_id=lease_id, op=op, reason=reason))
            with self._lock:  # after the enqueue: the verdict is on its way to poold
                self._scrubs_running.pop(lease_id, None)

        threading.Thread(target=run, name=f"scrub-{lease_id}", daemon=True).start()

    def list(self, peer: Peer, args: p.ListArgs) -> p.ListResult:
        with self._lock:
            mine = [h for h in self._held.values() if h.holder_uid == peer.uid or peer.uid == 0]
        return p.ListResult(
            leases=[
                p.LeaseListing(**self._result(h).model_dump(), state=h.lease.state) for h in mine
            ]
        )

    def stats(self, peer: Peer, args: p.StatsArgs) -> p.StatsResult:
        with self._lock:
            everything = list(self._held.values())
        held = [h for h in everything if not h.revoked_held]
        revoked = [h for h in everything if h.revoked_held]
        return p.StatsResult(
            leases_held=len(held),
            bytes_held=sum(h.lease.length_bytes for h in held),
            revoked_held_leases=len(revoked),
            revoked_held_bytes=sum(h.lease.length_bytes for h in revoked),
            uptime_s=time.monotonic() - self.started_at,
            poold_reachable=self.link.reachable,
            last_heartbeat_at=self.link.last_heartbeat_at,
        )

    def report(self, peer: Peer, args: p.ReportArgs) -> p.ReportResult:
        held = self._owned(peer, args.lease_id, "report on")
        held.extra["report"] = args.model_dump()
        # Only the latest counts: the next heartbeat carries it (DESIGN.md: batched).
        with self._lock:
            self._reports[args.lease_id] = LeaseReport(**held.extra["report"])
        return p.ReportResult(accepted=True)

    def take_reports(self) -> builtins.list[LeaseReport]:
        """The reports changed since the last call, of leases still held (the link's provider)."""
        with self._lock:
            pending, self._reports = self._reports, {}
            return [r for lease_id, r in pending.items() if lease_id in self._held]

    def disconnected(self, peer: Peer) -> None:
        """A connection closed. Its leases stay while the holder lives (it may reconnect)."""
        with self._lock:
            mine = [h for h in self._held.values() if h.holder_pid == peer.pid]
        if mine:
            self.check_holders(mine)

    # --- holders, orphans, restarts ---------------------------------------------
    def _journal(self, held: HeldLease) -> None:
        if self.journal is None:
            return
        lease = held.lease
        self.journal.add(
            JournalEntry(
                lease_id=lease.id,
                device_uid=lease.device_uid,
                backend=held.memory.backend if held.memory is not None else lease.device_kind,
                offset_bytes=lease.offset_bytes,
                length_bytes=lease.length_bytes,
                epoch=lease.epoch,
                holder_pid=held.holder_pid,
                holder_uid=held.holder_uid,
                holder_start=held.holder.start_time if held.holder else None,
                ttl_s=held.ttl_s,
                sub_device=held.sub_device,
                region_id=held.region_id,
                lease_json=lease.model_dump_json(),
            )
        )

    def check_holders(self, candidates: builtins.list[HeldLease] | None = None) -> int:
        """Orphan the leases whose holder process is gone (pid + start time); return how many.

        The agent drops its side of the memory (a devdax sub-device is destroyed)
        and tells poold, which reclaims the range after its grace period.
        """
        if candidates is None:
            with self._lock:
                candidates = list(self._held.values())
        orphaned = 0
        for held in candidates:
            if held.holder is None or holder_alive(held.holder):
                continue
            if held.revoked_held:
                # The revoked holder is gone at last: its pages are free; confirm.
                if self._forget(held.lease.id, "revoked") is not None:
                    self._revoke([held.lease.id])
                continue
            if self._forget(held.lease.id, "orphaned") is None:
                continue
            log.warning(
                "holder pid %d of lease %s is gone: orphaned", held.holder_pid, held.lease.id
            )
            self._drop_memory(held)
            self.link.enqueue(
                LeaseOp(
                    lease_id=held.lease.id,
                    op="orphan",
                    reason=f"holder pid {held.holder_pid} exited",
                )
            )
            orphaned += 1
        return orphaned

    def adopt(self) -> tuple[int, int]:
        """After a restart: keep journalled leases whose holder lives, orphan the rest,
        and destroy every other sub-device the journal knows (call before serving).

        Returns (adopted, orphaned). Renewals of adopted leases work again at
        once; their memory stays with the holder, which never noticed the restart.
        A journalled sub-device no adopted lease ties is a crash's leftover: a lease's
        whose teardown never ran, or a scrub's temporary one. It goes now, so the
        region is clean when poold sends the scrub order again and it is redone.
        """
        if self.journal is None:
            return 0, 0
        adopted = orphaned = 0
        for entry in self.journal.entries():
            lease = LeaseOut.model_validate_json(entry.lease_json)
            holder = Holder(
                pid=entry.holder_pid, uid=entry.holder_uid, start_time=entry.holder_start
            )
            held = HeldLease(
                lease=lease,
                memory=None,
                holder_uid=entry.holder_uid,
                holder_pid=entry.holder_pid,
                conn_id=0,
                ttl_s=entry.ttl_s,
                expires_at=lease.expires_at,
                page_size_bytes=lease.alignment_bytes,
                holder=holder,
                sub_device=entry.sub_device,
                region_id=entry.region_id,
            )
            with self._lock:
                self._held[lease.id] = held
            if holder_alive(holder):
                adopted += 1
                self.link.renew_later(lease.id, entry.ttl_s)
            else:
                orphaned += self.check_holders([held])
        self.leftovers.clean_start(self.journal, self._tied())  # logs each one it destroys
        return adopted, orphaned

    def reconcile(self) -> int:
        """Tell poold about live leases on this host that this agent has no memory for.

        After a crash the ledger can hold leases the agent never journalled (killed
        between grant and journal) or whose release it never sent: without this
        they would stand, memoryless, until their ttl ran out. Granted ones are
        aborted, the others orphaned (reclaimed after poold's grace). Returns how many.
        """
        try:
            live = self.link.client.list_leases(host=self.host, live=True, limit=100_000)
        except PoolError as err:
            log.warning("cannot reconcile with poold yet: %s", err.message)
            return 0
        with self._lock:
            known = set(self._held) | self._scrubbing
        stray = 0
        for lease in live:
            if lease.id in known or lease.state not in ("granted", "active"):
                continue
            op = "abort" if lease.state == "granted" else "orphan"
            log.warning(
                "lease %s is %s in poold but unknown to this agent: %s", lease.id, lease.state, op
            )
            self.link.enqueue(
                LeaseOp(lease_id=lease.id, op=op, reason="agent restarted without this lease")
            )
            stray += 1
        return stray

    def start_holder_watch(self, interval_s: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check_holders()
                    self.revoke_due()
                except Exception:
                    log.exception("holder check failed")

        threading.Thread(target=loop, name="agent-holders", daemon=True).start()

    # --- poold's answers ------------------------------------------------------
    def _on_heartbeat_reply(self, reply: HeartbeatReply) -> None:
        # Revocations first: the same reply refuses the renewal of a lease it revokes,
        # and the holder must be told the deadline (renew), not that the lease is lost.
        if reply.revocations:
            self._note_revocations(reply.revocations)
        for result in reply.renewed:
            if result.code is not None:
                log.warning("renewal of %s refused: %s", result.lease_id, result.message)
                with self._lock:
                    held = self._held.get(result.lease_id)
                if (
                    held is not None
                    and held.revoke_deadline_at is None
                    and result.code in ("lease_not_active", "unknown_lease")
                ):
                    held.lost = True
            elif result.expires_at is not None:
                with self._lock:
                    held = self._held.get(result.lease_id)
                if held is not None:
                    held.expires_at = result.expires_at
        self._capacity_changed()
        self._store_shrink_hints(reply.shrink)
        for order in reply.scrub:
            if order.reissued_at is not None:
                self._scrub_reissued(order)
            local = self._locate(order.device_uid)
            if local is not None and local.dax_region_id is not None:
                self._scrub_later(
                    local.kind,
                    local.dax_region_id,
                    order.offset_bytes,
                    order.length_bytes,
                    order.lease_id,
                )

    def _store_shrink_hints(self, hints: builtins.list[ShrinkHint]) -> None:
        """Keep the latest hint of each held lease; a lease poold no longer asks has none.

        A hint not yet handed to its tenant keeps its earlier deadline.
        """
        with self._lock:
            fresh: dict[str, ShrinkHint] = {}
            for hint in hints:
                if hint.lease_id not in self._held:
                    continue
                pending = self._shrink.get(hint.lease_id)
                if pending is not None and pending.deadline_at < hint.deadline_at:
                    hint = hint.model_copy(update={"deadline_at": pending.deadline_at})
                fresh[hint.lease_id] = hint
            self._shrink = fresh

    def _note_revocations(self, revocations: builtins.list[Revocation]) -> None:
        """Revoked leases are torn down at their deadline, not at once.

        Until then the tenant's renewals are answered with the deadline, so the
        engine can move its blocks away before the memory goes. Leases this agent
        does not hold are confirmed at once (there is nothing to tear down).
        """
        now = datetime.now(UTC)
        unknown: builtins.list[str] = []
        with self._lock:
            for r in revocations:
                held = self._held.get(r.lease_id)
                if held is None:
                    unknown.append(r.lease_id)
                elif held.revoke_deadline_at is None:
                    # Keep a safety margin before poold's own deadline.
                    deadline = (r.deadline_at or now) - timedelta(seconds=REVOKE_MARGIN_S)
                    held.revoke_deadline_at = max(deadline, now)
        if unknown:
            # A leftover sub-device of an ended lease (poolctl audit --reclaim) goes too.
            self.leftovers.delete(self.journal, unknown, self._tied())
            self._revoke(unknown)
        self.revoke_due()

    def revoke_due(self) -> int:
        """Tear down the revoked leases whose deadline has come; how many."""
        now = datetime.now(UTC)
        with self._lock:
            due = [
                h.lease.id
                for h in self._held.values()
                if h.revoke_deadline_at is not None
                and h.revoke_deadline_at <= now
                and not h.revoked_held
            ]
        if due:
            self._revoke(due)
        return len(due)

    def _revoke(self, lease_ids: builtins.list[str]) -> None:
        """Tear down revoked leases, then confirm to poold (revoking -> reclaimed/scrubbing).

        devdax memory is taken back by the kernel (the sub-device goes; the holder's
        next access is SIGBUS). A memfd cannot be taken from a live mapping: the
        agent drops its copy and the holder's later renewals get `lease_not_active`.
        """
        confirm: builtins.list[str] = []
        for lease_id in lease_ids:
            with self._lock:
                held = self._held.get(lease_id)
            if held is not None and self._pages_stay_with_holder(held):
                if not held.revoked_held:
                    log.warning(
                        "lease %s revoked, but holder pid %d still maps its memfd: "
                        "it counts as used until the holder exits",
                        lease_id,
                        held.holder_pid,
                    )
                    held.revoked_held = True
                    if held.memory is not None:  # the agent's own copy goes now
                        with contextlib.suppress(OSError):
                            os.close(held.memory.fd)
                        held.memory = None
                continue
            held = self._forget(lease_id, "revoked")
            if held is not None:
                log.warning("lease %s revoked by poold; tearing it down", lease_id)
                self._drop_memory(held)
            confirm.append(lease_id)
        if not confirm:
            return
        try:
            self.link.client.confirm_revoked(confirm)
        except PoolError as err:
            log.warning("could not confirm revocations to poold: %s", err.message)

    def _pages_stay_with_holder(self, held: HeldLease) -> bool:
        """A memfd (emulated, numa) lease whose holder lives: revoking cannot unmap it."""
        kind = held.memory.backend if held.memory is not None else held.lease.device_kind
        backend = self.backends.get(kind)
        if (backend is not None and backend.revoke_unmaps) or held.holder is None:
            return False
        return holder_alive(held.holder)

    def held_ids(self) -> builtins.list[str]:
        """For the heartbeat: every lease this agent holds memory (or a holder) for."""
        with self._lock:
            return sorted(self._held)

    def _scrub_reissued(self, order: ScrubOrder) -> None:
        """poold re-issued a scrub it saw no progress on (audit --reclaim): scrub again,
        once per `reissued_at`, unless one is running (it serves the re-issue)."""
        with self._lock:
            if self._scrub_reissues.get(order.lease_id) == order.reissued_at:
                return
            assert order.reissued_at is not None
            self._scrub_reissues[order.lease_id] = order.reissued_at
            if order.lease_id not in self._scrubs_running:
                self._scrubbing.discard(order.lease_id)
                log.warning("scrub of lease %s re-issued by poold: scrubbing again", order.lease_id)

    def _tied(self) -> dict[tuple[int, str], tuple[str, int]]:
        """The sub-device of every held lease and running scrub: never a leftover, never
        deleted as one."""
        with self._lock:
            return self._tied_locked(builtins.list(self._held.values()))

    def _tied_locked(
        self, held: builtins.list[HeldLease]
    ) -> dict[tuple[int, str], tuple[str, int]]:
        tied = {
            (h.region_id, h.sub_device): (h.lease.id, h.lease.length_bytes)
            for h in held
            if h.sub_device is not None and h.region_id is not None
        }
        for lease_id, scrub in self._scrubs_running.items():
            if scrub.sub is not None:
                tied[(scrub.sub.region_id, scrub.sub.sub_device)] = (
                    lease_id,
                    scrub.sub.length_bytes,
                )
        return tied

    def holdings(self) -> Holdings:
        """For the heartbeat: per lease its holder, sub-device and state (scrubs running
        included, with the bytes zeroed so far), and the sub-devices this agent made that
        no held lease or running scrub accounts for.

        Built without validation (model_construct): it runs every heartbeat over every lease.
        """
        with self._lock:
            held = builtins.list(self._held.values())
            running = {
                lease_id: (scrub.started_at, scrub.bytes_done)
                for lease_id, scrub in self._scrubs_running.items()
            }
            tied = self._tied_locked(held)
        report: builtins.list[AgentLease] = []
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
        return report, self.leftovers.sweep(self.journal, tied)

    def revoked_held_ids(self) -> builtins.list[str]:
        """For the heartbeat: revoked leases still mapped by their live holders."""
        with self._lock:
            return [h.lease.id for h in self._held.values() if h.revoked_held]

    def close(self) -> None:
        self._stop.set()
        self._capacity_changed()  # waiting lease requests give up
        if self.warm is not None:
            self.warm.stop()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        # Shutting down is not releasing: tenants keep their mappings (a devdax
        # sub-device stays), the journal keeps the leases for the next start.
        for h in held:
            if h.memory is not None:
                with contextlib.suppress(OSError):
                    os.close(h.memory.fd)
        if self.journal is not None:
            self.journal.close()
