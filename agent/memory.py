"""How does a granted lease become memory on this host, and how does that memory go again?

Memory is made by the backend of the lease's device kind (agent/backends), always
after poold granted the lease: a dax sub-device at the ledger's offset, a memfd on the
device's NUMA node, an emulated memfd (from the warm pool when one is ready). It is
dropped when the lease ends, and a released devdax range is zeroed (scrubbed) off the
request path before poold counts it free. Where each pool
device lives on this host (its dax region or node) is a :class:`LocalDevice`.

Every dax sub-device made here, for a lease or for a scrub, is recorded with the
leftover sweep (agent/leftovers.py) before it holds a byte, and tied to its lease or
scrub while one exists, so that it is never reported as a leftover meanwhile.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from agent.backends import Backend, Materialised, Placement
from agent.backends.emulated import EmulatedBackend, MemfdMaterialised, OnceFd
from agent.backends.numa import NumaBackend
from agent.held import HeldLease, HeldLeases
from agent.journal import SubDevice
from agent.leftovers import LeftoverSweep, Tied
from agent.link import PooldLink
from agent.release_check import ReleaseCheck, Taker, close_copies
from agent.warm import WarmPool
from poold.errors import BackendFailed, PoolError
from poold.wire.agent import InventoryDevice, LeaseOp, ScrubOrder
from poold.wire.common import LeaseOut

log = logging.getLogger("pool_agent")

# Told how long a backend took to make or to scrub memory: (what, device kind, ok,
# seconds), what being "materialise" or "scrub". agent/metrics.py sets it on the
# service's LeaseMemory; unset, nothing is timed.
Timed = Callable[[str, str, bool, float], None]


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


@dataclass(frozen=True)
class Pin:
    """What a tenant asked of a lease's pages (pin-ready leases, agent/protocol.py
    LeaseArgs): the default asks nothing."""

    populate: bool = False
    hugepages: str | None = None
    numa_node: int | None = None


@dataclass
class _RunningScrub:
    """A scrub this agent runs now: reported in heartbeats, its sub-device tied meanwhile."""

    started_at: datetime
    bytes_done: int = 0
    sub: SubDevice | None = None  # the temporary sub-device, once it has a name


class _Recycle:
    """A released warm memfd's way back to the pool (agent/release_check.py ``Taker``),
    settled once: zeroed and offered (:meth:`__call__`), or cancelled. Each is used by
    one thread: the punch thread, or the releasing thread past the punch bound."""

    __slots__ = ("_check", "_memory", "_settled", "_warm")

    def __init__(self, warm: WarmPool, check: ReleaseCheck, memory: MemfdMaterialised) -> None:
        self._warm = warm
        self._check = check
        self._memory = memory
        self._settled = False

    def __call__(self, fd: int) -> bool:
        if self._settled:
            return False
        self._settled = True
        memory = self._memory
        offered = False  # recycle() settles the pool's promise; anything else gives it back
        try:
            fresh = self._check.prepare(
                MemfdMaterialised(
                    fd=fd,
                    backend=memory.backend,
                    length_bytes=memory.length_bytes,
                    page_size_bytes=memory.page_size_bytes,
                    warm=True,
                )
            )
            if not isinstance(fresh, MemfdMaterialised) or fresh.tenant is None:
                return False  # no copies could be made: punched and closed instead
            offered = True
            if self._warm.recycle(fresh, promised=True):
                return True
            close_copies(fresh, keep_fd=True)
            return False
        finally:
            if not offered:
                self._warm.unpromise(memory.length_bytes)

    def cancel(self) -> None:
        if not self._settled:
            self._settled = True
            self._warm.unpromise(self._memory.length_bytes)


class LeaseMemory:
    """Makes, drops and scrubs the memory of this agent's leases (thread-safe)."""

    def __init__(
        self,
        link: PooldLink,
        backends: dict[str, Backend],
        held: HeldLeases,
        warm: WarmPool | None = None,
    ) -> None:
        self.link = link
        self.backends = backends
        self.held = held
        self.warm = warm
        # Sub-devices are the devdax backend's (the kind poold names it by) alone.
        self.leftovers = LeftoverSweep(backends.get("devdax"))
        self._lock = threading.Lock()
        self._local: dict[str, LocalDevice] = {}
        self._scrubbing: set[str] = set()  # lease ids whose range is being (or was) zeroed
        self._scrubs_running: dict[str, _RunningScrub] = {}  # by lease id
        self._scrub_reissues: dict[str, datetime] = {}  # lease id -> reissued_at acted on
        self.timed: Timed | None = None
        # Whether a released memfd is still held, asked of the kernel (agent/release_check.py).
        self.release_check = ReleaseCheck.for_this_kernel()
        for backend in backends.values():
            if isinstance(backend, EmulatedBackend) and self.release_check.usable:
                backend.hand_out = self.release_check.prepare  # warm memfds come prepared
        if warm is not None:
            self.release_check.recycler = self._recycler
        # The tenant reopens not yet sent, by (connection id, fd): closed once sent.
        self._unsent: dict[tuple[int, int], OnceFd] = {}

    # --- where devices live ---------------------------------------------------------
    def set_local_devices(self, devices: dict[str, LocalDevice]) -> None:
        """How this host reaches each pool device (dax region, NUMA node), by device uid."""
        with self._lock:
            self._local = dict(devices)

    def locate(self, device_uid: str) -> LocalDevice | None:
        """Where a device lives here: set explicitly, or read off the current inventory."""
        with self._lock:
            local = self._local.get(device_uid)
        if local is not None:
            return local
        for device in self.link.inventory:
            if device.uid == device_uid:
                return local_device(device)
        return None

    def backend_of(self, held: HeldLease) -> Backend | None:
        """The backend of a held lease's memory (of its device kind, when re-adopted)."""
        kind = held.memory.backend if held.memory is not None else held.lease.device_kind
        return self.backends.get(kind)

    # --- made after placement -------------------------------------------------------
    def _make(
        self, backend: Backend, lease: LeaseOut, *, shrinkable: bool = False, pin: Pin | None = None
    ) -> Materialised:
        """Memory for a placed lease, where this host has its device."""
        local = self.locate(lease.device_uid)
        pin = pin or Pin()
        placement = Placement(
            device_uid=lease.device_uid,
            offset_bytes=lease.offset_bytes,
            length_bytes=lease.length_bytes,
            dax_region_id=local.dax_region_id if local is not None else None,
            numa_node=local.numa_node if local is not None else lease.numa_node,
            hugepages=pin.hugepages,
            populate=pin.populate,
            wanted_node=pin.numa_node if lease.device_kind == "emulated" else None,
        )

        def carved(device: str) -> None:
            # Journalled before it is sized: a crash between the carve and the lease's
            # journal entry leaves a sub-device the next start destroys (adopt), never
            # one reported to poold as someone else's range.
            assert placement.dax_region_id is not None  # only a dax region is carved
            sub = SubDevice(
                placement.dax_region_id, device, lease.id, lease.length_bytes, time.time()
            )
            self.leftovers.record(self.held.journal, sub)

        started = time.perf_counter()
        ok = False
        try:
            if placement.wanted_node is not None:
                memory = self._bound_emulated(placement, f"poold-lease-{lease.id}", shrinkable)
            else:
                memory = backend.materialise_placed(
                    placement, f"poold-lease-{lease.id}", shrinkable=shrinkable, on_carve=carved
                )
            ok = True
        finally:
            if self.timed is not None:
                self.timed("materialise", lease.device_kind, ok, time.perf_counter() - started)
        if pin.numa_node is not None and memory.numa_node != pin.numa_node:
            backend.release(memory)
            raise BackendFailed(
                f"lease {lease.id} was placed on {lease.device_uid}, whose memory is on node "
                f"{memory.numa_node}, not the node {pin.numa_node} asked for",
                numa_node=memory.numa_node,
                wanted_node=pin.numa_node,
            )
        if memory.backend == "devdax" and not memory.populated:
            memory = replace(memory, populated=True)  # device memory: nothing to allocate
        return memory

    @staticmethod
    def _bound_emulated(placement: Placement, name: str, shrinkable: bool) -> Materialised:
        """Emulated memory a tenant asked on a node: a memfd bound there, as the numa
        backend makes them (node check, MPOL_BIND, placement check), reported emulated."""
        mode = placement.hugepages or "off"
        if mode not in ("off", "prefer", "required"):
            raise BackendFailed(f"unknown hugepages mode {mode!r}")
        assert placement.wanted_node is not None
        bound = NumaBackend().materialise_on(
            placement.wanted_node,
            placement.length_bytes,
            name,
            mode,  # type: ignore[arg-type]  # checked above
            shrinkable=shrinkable,
            populate_pages=placement.populate,
        )
        return replace(bound, backend="emulated")

    def _warm(
        self, lease: LeaseOut, *, shrinkable: bool, pin: Pin | None = None
    ) -> Materialised | None:
        """A fresh warm memfd of the lease's length (emulated; warm ones are sealed
        against shrinking, so not for a shrinkable lease, and made with base pages,
        unpopulated, unbound: not for a pin-ready one), taken only once it is granted."""
        if self.warm is None or shrinkable or lease.device_kind != "emulated":
            return None
        if pin is not None and pin != Pin():
            return None
        return self.warm.take(lease.length_bytes)

    def _recycler(self, memory: MemfdMaterialised) -> Taker | None:
        """For a released warm memfd no one else holds, while the warm pool wants its
        length: the taker that gives it back to the pool once the punch thread zeroed
        it, with a fresh tenant reopen and probe (the old ones are closed). Its room in
        the pool is held from now until it is back or punched."""
        warm = self.warm
        if warm is None or not memory.warm or not warm.promise(memory.length_bytes):
            return None
        return _Recycle(warm, self.release_check, memory)

    def materialise_placed(
        self, lease: LeaseOut, *, shrinkable: bool = False, pin: Pin | None = None
    ) -> Materialised:
        """Memory for a granted lease, then its activation in the ledger.

        Only ever after poold granted the lease: the agent makes no memory for a request
        nobody has authorised (DESIGN.md "Memory follows the pages").
        """
        backend = self.backends.get(lease.device_kind)
        try:
            if backend is None:
                raise BackendFailed(f"no backend for device kind {lease.device_kind}")
            memory = self._warm(lease, shrinkable=shrinkable, pin=pin) or self._make(
                backend, lease, shrinkable=shrinkable, pin=pin
            )
        except BaseException as exc:
            self.link.give_up(lease, f"materialise failed: {exc}")
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
        return self.release_check.prepare(memory)

    def to_send(self, memory: Materialised, connection_id: int) -> int:
        """The fd a lease's reply carries, the sending path's own until :meth:`sent`: a
        memfd's tenant reopen, taken out of the memory, or a dup of the memory's own fd.

        Taken before the lease is held: a holder check or a revocation that ends it
        meanwhile closes the lease's files, never the one about to be sent, whose number
        could be another file's by then (a memfd given back to the warm pool, another
        tenant's lease)."""
        tenant = memory.tenant if isinstance(memory, MemfdMaterialised) else None
        fd = tenant.take() if tenant is not None else None
        if fd is None:
            fd = os.dup(memory.fd)
        with self._lock:
            self._unsent[(connection_id, fd)] = OnceFd(fd)
        return fd

    def sent(self, connection_id: int, fd: int) -> None:
        """The reply carrying ``fd`` left on that connection (or failed to): the agent's
        copy goes, so the tenant's is the only one counted. Keyed by the connection too:
        its replies are sent in turn, and the number stays taken until this closes it."""
        with self._lock:
            tenant = self._unsent.pop((connection_id, fd), None)
        if tenant is not None:
            tenant.close()

    # --- dropped --------------------------------------------------------------------
    def drop(self, held: HeldLease) -> None:
        """Give an ended lease's memory back (a devdax sub-device is destroyed)."""
        if held.memory is None:
            # Re-adopted: a devdax sub-device is destroyed by name; a memfd's pages
            # go when the holder unmaps them (the agent has no fd left to close).
            backend = self.backend_of(held)
            if backend is not None and held.sub_device is not None:
                try:
                    backend.revoke(held.region_id or 0, held.sub_device)
                except Exception:
                    log.exception("destroying %s of lease %s", held.sub_device, held.lease.id)
            return
        backend = self.backends.get(held.memory.backend)
        close_copies(held.memory, keep_fd=True)  # the backend closes the memory's own fd
        try:
            if backend is not None:
                backend.release(held.memory)
            else:
                os.close(held.memory.fd)
        except OSError:
            log.exception("releasing memory of lease %s", held.lease.id)

    def close_copy(self, held: HeldLease) -> None:
        """Close the agent's own fd of a lease, whose holder keeps its mapping."""
        if held.memory is not None:
            close_copies(held.memory)

    # --- scrubs ---------------------------------------------------------------------
    def scrub_later(
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
            self.leftovers.record(self.held.journal, sub)

        def deleted(device: str) -> None:
            with self._lock:  # untied first: a sweep meanwhile sees it gone, and forgets it
                sub, running.sub = running.sub, None
            if sub is not None:
                try:
                    self.leftovers.forget(self.held.journal, sub)
                except Exception:  # the sweep drops the record once it sees the device gone
                    log.exception("forgetting scrub sub-device %s", device)

        def zeroed(bytes_done: int) -> None:
            running.bytes_done = bytes_done

        def run() -> None:
            ok = False
            started = time.perf_counter()
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
            if self.timed is not None:
                self.timed("scrub", kind, ok, time.perf_counter() - started)
            op = "scrubbed" if ok else "scrub_failed"
            reason = "range zeroed" if ok else "scrub failed: range goes to quarantine"
            self.link.enqueue(LeaseOp(lease_id=lease_id, op=op, reason=reason))
            with self._lock:  # after the enqueue: the verdict is on its way to poold
                self._scrubs_running.pop(lease_id, None)

        threading.Thread(target=run, name=f"scrub-{lease_id}", daemon=True).start()

    def scrub_ordered(self, order: ScrubOrder) -> None:
        """poold's scrub order (a heartbeat reply's): zero the range, once."""
        if order.reissued_at is not None:
            self._scrub_reissued(order)
        local = self.locate(order.device_uid)
        if local is not None and local.dax_region_id is not None:
            self.scrub_later(
                local.kind,
                local.dax_region_id,
                order.offset_bytes,
                order.length_bytes,
                order.lease_id,
            )

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

    def scrubbing_ids(self) -> set[str]:
        """The leases whose range this agent zeroes, or zeroed (poold's to end)."""
        with self._lock:
            return set(self._scrubbing)

    def scrubs(self, held: list[HeldLease]) -> tuple[dict[str, tuple[datetime, int]], Tied]:
        """The running scrubs, by lease id (start, bytes zeroed so far), and the
        sub-devices tied by ``held`` and by them, read together."""
        with self._lock:
            running = {
                lease_id: (scrub.started_at, scrub.bytes_done)
                for lease_id, scrub in self._scrubs_running.items()
            }
            return running, self._tied_locked(held)

    def tied(self) -> Tied:
        """The sub-device of every held lease and running scrub: never a leftover, never
        deleted as one."""
        held = self.held.all()
        with self._lock:
            return self._tied_locked(held)

    def _tied_locked(self, held: list[HeldLease]) -> Tied:
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
