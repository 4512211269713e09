"""How does a lease on a device-DAX region become memory that only its tenant can map?

One dax sub-device per lease, carved from the lease's dax region the way
``daxctl create-device`` does it (kernel ABI: Documentation/ABI/testing/sysfs-bus-dax,
drivers/dax/bus.c):

1. take the region's ``seed`` device (a size-0 device the kernel keeps ready); when there
   is none, write ``1`` to the region's ``create`` and read ``seed`` again;
2. write ``0`` to its ``size``, then the exact physical range to its ``mapping``
   (``"<start>-<end>"``, hex, end inclusive), so that the ledger's offset *is* the device's
   real range: region base + offset;
3. bind it to ``device_dax``: ``new_id`` on the driver (which also attaches it), and
   ``bind`` when the kernel did not attach it on its own;
4. open ``/dev/daxX.Y`` (the agent opens it; the fd goes to the tenant by SCM_RIGHTS).

Every write goes through a :class:`~agent.backends.sysfs_write.SysfsTransaction`: if a
step fails, the writes before it are undone (unbind, ``remove_id``, ``size`` 0, region
``delete``), so a failed lease leaves no sub-device behind.

Release and revoke unbind the sub-device, which makes the kernel unmap it from every
process (``kill_dev_dax`` + ``unmap_mapping_range``: a later access is SIGBUS), then
shrink it to 0 and ``delete`` it. :meth:`DevdaxBackend.scrub` zeroes a released range
through a fresh sub-device before the ledger reports it free.

A caller that must find its sub-devices again after a crash (the agent, through its
journal) passes ``on_carve``: it is called with the sub-device's name after the seed is
picked and before the sub-device holds a byte, so no crash leaves a sized sub-device the
caller never heard of (discovery would report it as someone else's, reserved). The
scrub's ``on_deleted`` says when its sub-device is gone again.

Static regions (a pmem namespace in devdax mode, hmem) cannot be carved: they have no
``seed``/``create``/``delete``. Such a region is leased whole, to one lease at a time,
through its one device (poold places nothing smaller there: the inventory marks it
``whole_only``). Its device is never rebound while any process still holds a file of it.
Measured in the QEMU guest (Linux 6.12, a CXL pmem namespace in devdax mode,
docs/design-changes.md "Static devdax"):

* unbinding ``daxN.0`` while fds and mappings are open is safe: every mapping faults
  (SIGBUS) from then on, and opening the node still works;
* rebinding while a file of the old binding is still open, or still mapped after its fd
  was closed, is not: the old mapping works again (the revoked tenant can read and write
  the next lease's bytes), and when that last old file goes, the kernel tears the new
  binding's char device down (``cd_forget``): every later open is ENXIO, until the device
  is unbound and bound again with nothing open. ``ndctl disable-namespace`` /
  ``enable-namespace`` under an open mapping is worse: a ``list_del corruption`` BUG;
* rebinding with nothing open always worked.

So revoking (and releasing) a static lease only unbinds: the agent's fd is closed right
after, and the device stays unbound. It is bound again by the next lease of it, or by the
scrub, which first waits until no process has an fd or a mapping of the device
(:func:`device_holders`, over ``/proc``) and fails the scrub (the range is quarantined)
when one still does after ``holder_wait_s``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.backends import Materialised, OnCarve, Placement
from agent.backends.sysfs_write import ApplyHook, SysfsTransaction, write_attr
from agent.discovery.sysfs import SysfsReader
from poold.errors import BackendFailed, InvalidSize
from poold.wire.common import DeviceKind

log = logging.getLogger(__name__)

DRIVER = "device_dax"
_BUS = Path("bus/dax")
_SCRUB_CHUNK_BYTES = 2 << 20

# Sub-devices this process carved (lease or scrub) and has not shrunk back, by sysfs root.
# Discovery reports every other dax device of a region to poold as reserved, and runs
# without the backend object (agent/inventory.py): a sub-device is marked from the moment
# its seed is picked, so a rescan in the middle of a carve or a scrub never calls it foreign.
_carved: dict[str, set[str]] = {}
_carved_lock = threading.Lock()
# Bumped by every mark and unmark: discovery reads sysfs over a span of time, and a count
# unchanged across it means the marks it compares with held all along.
_carved_changes = 0


def carved_sub_devices(sysfs_root: Path) -> set[str]:
    """Names of the sub-devices devdax backends of this process hold under ``sysfs_root``."""
    with _carved_lock:
        return set(_carved.get(os.path.realpath(sysfs_root), ()))


def carved_changes() -> int:
    """How many times a sub-device was marked or unmarked in this process (any root)."""
    with _carved_lock:
        return _carved_changes


def _unmark(sysfs_root: Path, device: str) -> None:
    global _carved_changes
    with _carved_lock:
        _carved.get(os.path.realpath(sysfs_root), set()).discard(device)
        _carved_changes += 1


@contextmanager
def _marking(sysfs_root: Path) -> Iterator[Callable[[str], None]]:
    """Yields ``mark(device)``; a marked device is unmarked again if the block fails."""
    marked: list[str] = []

    def mark(device: str) -> None:
        global _carved_changes
        with _carved_lock:
            _carved.setdefault(os.path.realpath(sysfs_root), set()).add(device)
            _carved_changes += 1
        marked.append(device)

    try:
        yield mark
    except BaseException:
        for device in marked:
            _unmark(sysfs_root, device)
        raise


@dataclass(frozen=True, slots=True)
class DaxRegionInfo:
    """What the backend needs to know about one dax region (read fresh for every lease)."""

    id: int
    path: Path  # the region device directory, relative to the sysfs root
    base_bytes: int  # host-physical address of the region's first byte
    size_bytes: int
    align_bytes: int
    static: bool  # no seed/create/delete: cannot be carved, only leased whole


@dataclass(frozen=True, slots=True)
class DevdaxMaterialised(Materialised):
    """A devdax lease: which sub-device of which region, at which offset."""

    device: str = ""  # "dax0.2"
    region_id: int = -1
    offset_bytes: int = 0

    @property
    def sub_device(self) -> str | None:
        return self.device

    @property
    def dax_region_id(self) -> int | None:
        return self.region_id


def device_holders(dev_path: Path, proc_root: Path = Path("/proc")) -> dict[int, str]:
    """{pid: "fd" or "map"} of the processes that hold ``dev_path`` open or mapped.

    Read from ``/proc/<pid>/fd`` (links to the node) and ``/proc/<pid>/maps`` (a mapping
    keeps its file after its fd is closed). The agent runs as root, so every process is
    readable; one that exits meanwhile, or that cannot be read, is skipped.
    """
    target = str(dev_path)
    out: dict[int, str] = {}
    try:
        pids = [int(name) for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return out
    for pid in pids:
        base = Path(proc_root) / str(pid)
        try:
            for fd in os.listdir(base / "fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(base / "fd" / fd).removesuffix(" (deleted)") == target:
                        out[pid] = "fd"
                        break
            if pid in out:
                continue
            with (base / "maps").open() as maps:
                for line in maps:
                    # "7f..-7f.. rw-s 00000000 00:05 1234    /dev/dax0.0"
                    fields = line.split(maxsplit=5)
                    if (
                        len(fields) == 6
                        and fields[5].rstrip("\n").removesuffix(" (deleted)") == target
                    ):
                        out[pid] = "map"
                        break
        except OSError:
            continue  # gone, or not ours to read
    return out


def _parse_int(value: str | None, what: str) -> int:
    if value is None or value == "":
        raise BackendFailed(f"{what} is missing from sysfs")
    try:
        return int(value, 0)
    except ValueError as err:
        raise BackendFailed(f"{what} is not a number: {value!r}") from err


class DevdaxBackend:
    """The :class:`agent.backends.Backend` for dax sub-devices.

    ``sysfs_root``/``dev_root``/``proc_root`` are injected (tests use a recorded machine);
    ``apply`` is the tests' stand-in for the kernel's reaction to writes.
    ``require_char_device`` is off only in tests, whose ``/dev`` holds plain files.
    ``holder_wait_s``: how long the scrub of a static region waits for the last process
    holding its device to let go before it fails (module docstring).
    """

    HOLDER_POLL_S = 0.2

    def __init__(
        self,
        sysfs_root: Path = Path("/sys"),
        dev_root: Path = Path("/dev"),
        *,
        apply: ApplyHook | None = None,
        require_char_device: bool = True,
        proc_root: Path = Path("/proc"),
        holder_wait_s: float = 300.0,
    ) -> None:
        self.sysfs_root = Path(sysfs_root)
        self.dev_root = Path(dev_root)
        self.apply = apply
        self.require_char_device = require_char_device
        self.proc_root = Path(proc_root)
        self.holder_wait_s = holder_wait_s
        self._lock = threading.Lock()  # one carve at a time: the seed is shared state
        self._whole: set[int] = set()  # static regions currently leased

    @property
    def name(self) -> DeviceKind:
        return "devdax"

    @property
    def revoke_unmaps(self) -> bool:
        return True  # unbinding unmaps the sub-device from every process (see revoke)

    # -- discovery of what we write to -------------------------------------------------

    def _read(self, rel: str | Path) -> str | None:
        """The attribute ``rel`` under the sysfs root, read the way discovery reads it; None
        when this kernel (or device) lacks it. One that is there but cannot be read fails
        the step rather than read as absent: a region whose ``create`` is unreadable is
        not a static one."""
        reader = SysfsReader(self.sysfs_root)  # per read: its warnings are this read's
        value = reader.read_str(reader.path(str(rel)), probe=True)
        if reader.warnings:
            raise BackendFailed(f"sysfs attribute {reader.warnings[0]}", path=str(rel))
        return value

    def region(self, region_id: int) -> DaxRegionInfo:
        """The dax region ``region_id``, found through its device ``dax<id>.0``."""
        link = self.sysfs_root / _BUS / "devices" / f"dax{region_id}.0"
        if not os.path.lexists(link):
            raise BackendFailed(f"dax region {region_id} not found (no {link})")
        real = Path(os.path.realpath(link)).parent
        rel = real.relative_to(os.path.realpath(self.sysfs_root))
        attrs = rel / "dax_region"
        static = self._read(attrs / "create") is None
        # A CXL dax region spans its CXL region (drivers/dax/cxl.c: hpa_range); an nd
        # (pmem) one carries its own resource.
        base_attr = rel.parent / "resource" if rel.parent.name.startswith("region") else None
        base = self._read(base_attr) if base_attr is not None else None
        if base is None:
            base = self._read(rel / "resource")
        return DaxRegionInfo(
            id=region_id,
            path=rel,
            base_bytes=_parse_int(base, f"base address of dax region {region_id}")
            if not static
            else int(base or "0", 0),
            size_bytes=_parse_int(self._read(attrs / "size"), f"size of dax region {region_id}"),
            align_bytes=int(self._read(attrs / "align") or str(2 << 20), 0),
            static=static,
        )

    def _device_rel(self, region: DaxRegionInfo, device: str) -> Path:
        return region.path / device

    def _bound_driver(self, region: DaxRegionInfo, device: str) -> str | None:
        """The driver ``device`` is bound to; None when unbound (no ``driver`` link)."""
        reader = SysfsReader(self.sysfs_root)
        return reader.link_name(reader.path(str(region.path), device, "driver"))

    def sub_device_sizes(self, region_id: int) -> dict[str, int]:
        """The region's sub-devices and their sizes; {} for a static region, whose one
        device is leased whole and never carved."""
        if self.region(region_id).static:
            return {}
        return self.sub_devices(region_id)

    def sub_devices(self, region_id: int) -> dict[str, int]:
        """Every device of the region with its size in bytes (size-0 seeds included)."""
        region = self.region(region_id)
        out: dict[str, int] = {}
        prefix = f"dax{region_id}."
        # os.listdir, not SysfsReader.listdir: a region gone meanwhile must fail (the
        # leftover sweep then keeps its records), not read as a region with no devices.
        for entry in sorted(os.listdir(self.sysfs_root / region.path)):
            if entry.startswith(prefix):
                out[entry] = int(self._read(region.path / entry / "size") or "0", 0)
        return out

    # -- materialise -------------------------------------------------------------------

    def materialise(
        self, length_bytes: int, name: str, *, shrinkable: bool = False
    ) -> Materialised:
        """A devdax lease needs its region and offset: the agent calls :meth:`materialise_at`."""
        raise BackendFailed(
            "the devdax backend needs the lease's dax region and offset (materialise_at)",
            length_bytes=length_bytes,
        )

    def materialise_placed(
        self,
        placement: Placement,
        name: str,
        *,
        shrinkable: bool = False,
        on_carve: OnCarve | None = None,
    ) -> Materialised:
        """The sub-device at the placement's offset of its dax region (device memory has
        no seals: ``shrinkable`` does not apply)."""
        if placement.dax_region_id is None:
            raise BackendFailed(f"device {placement.device_uid} has no dax region on this host")
        # The ledger offset is the sub-device's real range inside the region.
        return self.materialise_at(
            placement.dax_region_id,
            placement.offset_bytes,
            placement.length_bytes,
            name,
            on_carve=on_carve,
        )

    def materialise_at(
        self,
        region_id: int,
        offset_bytes: int,
        length_bytes: int,
        name: str,
        *,
        on_carve: OnCarve | None = None,
    ) -> DevdaxMaterialised:
        """A sub-device of exactly ``[offset, offset+length)`` of the region, bound and opened.

        ``on_carve(device)`` runs before the sub-device is sized (not for a static region,
        whose one device always exists); if it raises, nothing is sized.
        """
        region = self.region(region_id)
        align = region.align_bytes
        if length_bytes <= 0 or length_bytes % align or offset_bytes < 0 or offset_bytes % align:
            raise InvalidSize(
                f"devdax lease offset {offset_bytes} and length {length_bytes} must be "
                f"multiples of the region alignment {align}",
                offset_bytes=offset_bytes,
                length_bytes=length_bytes,
                alignment_bytes=align,
            )
        if offset_bytes + length_bytes > region.size_bytes:
            raise InvalidSize(
                f"[{offset_bytes}, {offset_bytes + length_bytes}) is outside dax region "
                f"{region_id} of {region.size_bytes} bytes",
                offset_bytes=offset_bytes,
                length_bytes=length_bytes,
            )
        with self._lock:
            if region.static:
                return self._lease_whole(region, offset_bytes, length_bytes, name)
            return self._carve(region, offset_bytes, length_bytes, name, on_carve)

    def _seed(self, region: DaxRegionInfo, txn: SysfsTransaction) -> str:
        attrs = region.path / "dax_region"
        seed = self._read(attrs / "seed")
        if not seed:
            # No seed: the last one was bound or deleted. create_store makes a size-0
            # device and makes it the seed when there is none (drivers/dax/bus.c).
            txn.write(attrs / "create", "1")
            seed = self._read(attrs / "seed")
            if not seed:
                raise BackendFailed(f"dax region {region.id} has no seed device after create")
            txn.on_rollback(attrs / "delete", seed)
        size = self._read(region.path / seed / "size")
        if self._bound_driver(region, seed) is not None or (size not in (None, "0")):
            raise BackendFailed(
                f"seed device {seed} of dax region {region.id} is in use (size {size})"
            )
        return seed

    def _carve(
        self,
        region: DaxRegionInfo,
        offset_bytes: int,
        length_bytes: int,
        name: str,
        on_carve: OnCarve | None = None,
    ) -> DevdaxMaterialised:
        start = region.base_bytes + offset_bytes
        end = start + length_bytes - 1
        drivers = _BUS / "drivers" / DRIVER
        txn = SysfsTransaction(self.sysfs_root, self.apply)
        with _marking(self.sysfs_root) as mark, txn:  # rolled back before unmarked
            device = self._seed(region, txn)
            mark(device)
            if on_carve is not None:
                on_carve(device)  # recorded while it still holds nothing
            dev_rel = self._device_rel(region, device)
            log.info(
                "devdax lease %s: %s = dax region %d [%#x, %#x] (offset %d)",
                name, device, region.id, start, end, offset_bytes,
            )  # fmt: skip
            txn.write(dev_rel / "size", "0")
            txn.write(dev_rel / "mapping", f"{start:#x}-{end:#x}", undo=[(dev_rel / "size", "0")])
            got = self._read(dev_rel / "size")
            if got is None or int(got, 0) != length_bytes:
                raise BackendFailed(
                    f"{device} has {got} bytes after mapping [{start:#x}, {end:#x}], "
                    f"wanted {length_bytes}",
                    device=device,
                )
            txn.write(drivers / "new_id", device, undo=[(drivers / "remove_id", device)])
            if self._bound_driver(region, device) == DRIVER:
                txn.on_rollback(drivers / "unbind", device)  # new_id attached it
            else:
                txn.write(drivers / "bind", device, undo=[(drivers / "unbind", device)])
            fd = self._open(region, device)
            txn.commit()
        return DevdaxMaterialised(
            fd=fd,
            backend="devdax",
            length_bytes=length_bytes,
            page_size_bytes=region.align_bytes,
            numa_node=self._target_node(region, device),
            device=device,
            region_id=region.id,
            offset_bytes=offset_bytes,
        )

    def _lease_whole(
        self, region: DaxRegionInfo, offset_bytes: int, length_bytes: int, name: str
    ) -> DevdaxMaterialised:
        if offset_bytes != 0 or length_bytes != region.size_bytes:
            raise InvalidSize(
                f"dax region {region.id} is static (cannot be partitioned): it is leased "
                f"whole, offset 0 and {region.size_bytes} bytes",
                offset_bytes=offset_bytes,
                length_bytes=length_bytes,
            )
        if region.id in self._whole:
            raise BackendFailed(f"static dax region {region.id} is already leased")
        device = f"dax{region.id}.0"
        drivers = _BUS / "drivers" / DRIVER
        txn = SysfsTransaction(self.sysfs_root, self.apply)
        with txn:
            driver = self._bound_driver(region, device)
            if driver not in (None, DRIVER):
                raise BackendFailed(f"{device} is bound to {driver}, not {DRIVER}")
            if driver is None:
                # Never bound under a file of the last binding (module docstring).
                holders = device_holders(self.dev_root / device, self.proc_root)
                if holders:
                    raise BackendFailed(
                        f"{device} is still held by the last lease's processes "
                        f"{sorted(holders)}: it cannot be bound again yet",
                        device=device,
                        holders=sorted(holders),
                    )
                txn.write(drivers / "bind", device, undo=[(drivers / "unbind", device)])
            log.info("devdax lease %s: whole static region %d (%s)", name, region.id, device)
            fd = self._open(region, device)
            txn.commit()
        self._whole.add(region.id)
        return DevdaxMaterialised(
            fd=fd,
            backend="devdax",
            length_bytes=length_bytes,
            page_size_bytes=region.align_bytes,
            numa_node=self._target_node(region, device),
            device=device,
            region_id=region.id,
            offset_bytes=0,
        )

    def _target_node(self, region: DaxRegionInfo, device: str) -> int | None:
        raw = self._read(region.path / device / "target_node")
        node = int(raw) if raw not in (None, "") else -1
        return node if node >= 0 else None

    def _open(self, region: DaxRegionInfo, device: str) -> int:
        """Open ``/dev/<device>`` and check it is the char device sysfs says it is."""
        path = self.dev_root / device
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as err:
            raise BackendFailed(f"cannot open {path}: {err.strerror}", errno=err.errno) from err
        try:
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode):
                want = self._read(region.path / device / "dev")  # "major:minor"
                got = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
                if want is not None and want != got:
                    raise BackendFailed(f"{path} is {got}, but sysfs says {device} is {want}")
            elif self.require_char_device:
                raise BackendFailed(f"{path} is not a character device")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- release / revoke --------------------------------------------------------------

    def release(self, materialised: Materialised) -> None:
        """Destroy the lease's sub-device (every mapping of it faults from now on), close the fd."""
        if not isinstance(materialised, DevdaxMaterialised):
            raise BackendFailed("not a devdax lease")
        try:
            self.revoke(materialised.region_id, materialised.device)
        finally:
            os.close(materialised.fd)

    def revoke(self, region_id: int, device: str) -> None:
        """Unbind and delete ``device`` (static regions: unbind only), whoever maps it.

        Usable by an agent that restarted and knows the device only from its journal.
        Raises ``backend_failed`` when a step fails; the sub-device is then left for the
        audit to find, never reused.
        """
        region = self.region(region_id)
        drivers = _BUS / "drivers" / DRIVER
        with self._lock:
            if self._bound_driver(region, device) is not None:
                # Unbinding runs kill_dev_dax(): unmap_mapping_range() on the device's
                # inode, so every process's mapping is gone and a later touch is SIGBUS.
                write_attr(self.sysfs_root, drivers / "unbind", device, self.apply)
            if region.static:
                # Left unbound: rebinding while the tenant still holds the device would
                # give its mapping back and break the node (module docstring).
                self._whole.discard(region.id)
                return
            try:
                write_attr(self.sysfs_root, drivers / "remove_id", device, self.apply)
            except BackendFailed as err:  # the id may be gone already; the delete matters
                log.warning("remove_id %s: %s", device, err)
            write_attr(self.sysfs_root, region.path / device / "size", "0", self.apply)
            _unmark(self.sysfs_root, device)  # it holds no bytes any more
            write_attr(self.sysfs_root, region.path / "dax_region" / "delete", device, self.apply)

    # -- scrub -------------------------------------------------------------------------

    def scrub(
        self,
        region_id: int,
        offset_bytes: int,
        length_bytes: int,
        *,
        on_carve: OnCarve | None = None,
        on_deleted: Callable[[str], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Zero ``[offset, offset+length)`` through a fresh sub-device; True when it read back zero.

        The ledger keeps the range in ``scrubbing`` until this returns True, and
        quarantines it when it returns False. ``on_carve(device)`` runs before the
        temporary sub-device is sized, ``on_deleted(device)`` once it is deleted again (not
        when its teardown failed: it is then left for the audit to find);
        ``progress(bytes_done)`` after each zeroed chunk. A static region's scrub first
        waits (up to ``holder_wait_s``) until no process holds its device.
        """
        try:
            if self.region(region_id).static and not self._wait_unheld(f"dax{region_id}.0"):
                return False
        except BackendFailed:
            log.exception("scrub of dax region %d [%d, +%d)", region_id, offset_bytes, length_bytes)
            return False
        try:
            m = self.materialise_at(
                region_id, offset_bytes, length_bytes, "poold-scrub", on_carve=on_carve
            )
        except BackendFailed:
            log.exception("scrub of dax region %d [%d, +%d)", region_id, offset_bytes, length_bytes)
            return False
        ok = False
        try:
            ok = _zero_and_verify(m.fd, length_bytes, progress)
        except OSError:
            log.exception("scrub of %s", m.device)
        finally:
            try:
                self.release(m)
            except BackendFailed:
                log.exception("removing scrub device %s", m.device)
                ok = False
            else:
                if on_deleted is not None:
                    on_deleted(m.device)
        return ok

    def _wait_unheld(self, device: str) -> bool:
        """True once no process holds ``/dev/<device>``; False after ``holder_wait_s``."""
        deadline = time.monotonic() + self.holder_wait_s
        logged = False
        while True:
            holders = device_holders(self.dev_root / device, self.proc_root)
            if not holders:
                return True
            if time.monotonic() >= deadline:
                log.error(
                    "%s is still held by %s after %gs: not bound again, scrub failed",
                    device, holders, self.holder_wait_s,
                )  # fmt: skip
                return False
            if not logged:
                log.info("%s: waiting for %s to let go before its scrub", device, holders)
                logged = True
            time.sleep(self.HOLDER_POLL_S)


def _zero_and_verify(
    fd: int, length_bytes: int, progress: Callable[[int], None] | None = None
) -> bool:
    """Write zeros over the mapping, chunk by chunk (``progress`` after each), read them back."""
    zeros = bytes(min(_SCRUB_CHUNK_BYTES, length_bytes))
    with mmap.mmap(fd, length_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as view:
        for at in range(0, length_bytes, len(zeros)):
            n = min(len(zeros), length_bytes - at)
            view[at : at + n] = zeros[:n]
            if progress is not None:
                progress(at + n)
        # No msync: device-dax has no fsync (EINVAL); stores to the mapping are the memory.
        return all(
            view[at : at + len(zeros)] == zeros[: min(len(zeros), length_bytes - at)]
            for at in range(0, length_bytes, len(zeros))
        )
