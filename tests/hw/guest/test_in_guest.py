"""Runs INSIDE the QEMU guest, as root, against the real kernel CXL/DAX/NUMA drivers.

The backends are driven directly, below poold and the agent (test_stack_in_guest.py
shows the same facts through the whole stack), in the part of the devdax region that the
kernel's dax0.0 does not hold (conftest.py): offsets start at ``machine.free_offset_bytes``.
Tenants are forked children that drop to
uid/gid 1000 and receive their lease fd over a socketpair (SCM_RIGHTS), as from the agent.
Every lease here is 2 MiB and touches a few bytes: emulated CXL memory runs at 10-20 MB/s.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import mmap
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.backends.devdax import DevdaxBackend, DevdaxMaterialised
from agent.backends.numa import HUGE_2M, NumaBackend, pages_off_node
from agent.discovery.inventory import Inventory, discover, reserved_extents
from agent.discovery.model import PoolDevice
from poold.errors import BackendFailed
from tests.fixtures.machines.loader import Machine
from tests.hw.guest.conftest import GuestMachine, dax_device_state

MIB = 1 << 20
LEASE = 2 * MIB
TENANT_UID = 1000
RW = mmap.PROT_READ | mmap.PROT_WRITE


def run_as_tenant(fd: int, body: Callable[[int], int]) -> int:
    """Fork a child that becomes uid/gid 1000, receives ``fd`` by SCM_RIGHTS and runs
    ``body(fd)``; returns the raw wait status."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the tenant
        code = 101
        try:
            parent.close()
            os.setgroups([])
            os.setgid(TENANT_UID)
            os.setuid(TENANT_UID)
            _, fds, _, _ = socket.recv_fds(child, 16, 1)
            code = body(fds[0])
        except BaseException as exc:
            os.write(2, f"tenant: {exc!r}\n".encode())
        os._exit(code)
    child.close()
    socket.send_fds(parent, [b"f"], [fd])
    _, status = os.waitpid(pid, 0)
    parent.close()
    return status


def exit_code(status: int) -> int | None:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None


def killed_by(status: int) -> int | None:
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None


@pytest.fixture
def devdax() -> DevdaxBackend:
    return DevdaxBackend()


def sized_devices(backend: DevdaxBackend, machine: GuestMachine) -> dict[str, int]:
    """The region's sub-devices that hold memory, dax0.0 (not the backend's) left out."""
    devices = backend.sub_devices(machine.dax_region)
    return {name: size for name, size in devices.items() if size and name != machine.claimed_device}


class LiveMachine(Machine):
    """This guest, shaped like a recorded machine: the tools' JSON is run, not read."""

    def _tool(self, *argv: str) -> list[dict[str, Any]]:
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
        data = json.loads(out) if out else []
        return data if isinstance(data, list) else [data]

    def cxl_list(self) -> list[dict[str, Any]]:
        return self._tool("cxl", "list", "-BMPDERTEi")

    def daxctl_list(self) -> list[dict[str, Any]]:
        # -i also lists idle size-0 devices (seeds); the recorded checks compare devices
        # that have memory, as in every capture (dax0.0, holding the region's start, is one).
        regions = self._tool("daxctl", "list", "-RDMi")
        for region in regions:
            region["devices"] = [d for d in region.get("devices", []) if d.get("size")]
        return regions

    def ndctl_list(self) -> list[dict[str, Any]]:
        return []


def check_discovery(live: LiveMachine) -> Inventory:
    """The very checks the recorded machines pass (tests/agent/discovery), on the live guest."""
    recorded = importlib.import_module("tests.agent.discovery.test_recorded_machines")
    inventory = discover(Path("/sys"))
    for check in (
        "test_memdevs_match_cxl_list",
        "test_regions_match_cxl_list",
        "test_dax_matches_daxctl_list",
        "test_dax_regions_tie_to_cxl_regions",
        "test_pool_devices_follow_the_dax_modes",
    ):
        getattr(recorded, check)((live, inventory))
    return inventory


def devdax_device(inventory: Inventory, machine: GuestMachine) -> PoolDevice:
    """The pool device discovery built from the devdax region."""
    return next(d for d in inventory.devices if d.dax_region_id == machine.dax_region)


def test_discovery_equals_cxl_list_and_daxctl_list(
    machine: GuestMachine, devdax: DevdaxBackend
) -> None:
    live = LiveMachine("live-guest")
    inventory = check_discovery(live)
    assert {r.region for r in inventory.cxl.regions} == {"region0", "region1"}
    # dax0.0 holds the region's start: the agent would report it reserved
    claimed = [(0, machine.free_offset_bytes)]
    assert reserved_extents(devdax_device(inventory, machine)) == claimed
    # again with a lease's sub-device live in the devdax region
    m = devdax.materialise_at(machine.dax_region, machine.free_offset_bytes, LEASE, "discovered")
    try:
        assert isinstance(m, DevdaxMaterialised)
        with_lease = check_discovery(live)
        devices = {d.chardev: d for d in with_lease.dax.devices()}
        assert devices[m.device].size == LEASE and devices[m.device].mode == "devdax"
        # the agent's own sub-device is a lease, not reserved; anyone else's would be
        pool_device = devdax_device(with_lease, machine)
        assert reserved_extents(pool_device, {m.device}) == claimed
        assert reserved_extents(pool_device) == [*claimed, (machine.free_offset_bytes, LEASE)]
    finally:
        devdax.release(m)
    kinds = {
        (d.kind, d.dax_region_id if d.kind == "devdax" else d.numa_node) for d in inventory.devices
    }
    assert ("devdax", machine.dax_region) in kinds
    assert ("numa", machine.numa_node) in kinds


def test_devdax_lease_maps_writes_and_reads_back(
    machine: GuestMachine, devdax: DevdaxBackend, lease_name: str
) -> None:
    m = devdax.materialise_at(machine.dax_region, machine.free_offset_bytes, LEASE, lease_name)
    try:
        assert isinstance(m, DevdaxMaterialised)
        dev = f"/sys/bus/dax/devices/{m.device}"
        assert os.path.basename(os.readlink(f"{dev}/driver")) == "device_dax"
        assert int(Path(f"{dev}/size").read_text()) == LEASE
        assert os.readlink(f"/proc/self/fd/{m.fd}") == f"/dev/{m.device}"

        def tenant(fd: int) -> int:
            with mmap.mmap(fd, LEASE, mmap.MAP_SHARED, RW) as view:
                view[:5] = b"hello"
                view[LEASE - 3 :] = b"end"
                return 0 if (view[:5], view[LEASE - 3 :]) == (b"hello", b"end") else 1

        assert exit_code(run_as_tenant(m.fd, tenant)) == 0
        with mmap.mmap(m.fd, LEASE, mmap.MAP_SHARED, mmap.PROT_READ) as agent_view:
            assert agent_view[:5] == b"hello"  # the tenant's writes are in the device
    finally:
        devdax.release(m)


def test_two_leases_are_separate_sub_devices(machine: GuestMachine, devdax: DevdaxBackend) -> None:
    free = machine.free_offset_bytes
    a = devdax.materialise_at(machine.dax_region, free, LEASE, "tenant-a")
    b = devdax.materialise_at(machine.dax_region, free + LEASE, LEASE, "tenant-b")
    try:
        assert isinstance(a, DevdaxMaterialised) and isinstance(b, DevdaxMaterialised)
        assert a.device != b.device
        starts = {
            m.device: int(Path(f"/sys/bus/dax/devices/{m.device}/mapping0/start").read_text(), 0)
            for m in (a, b)
        }
        assert starts[b.device] - starts[a.device] == LEASE  # the ledger offsets, physically
        other = f"/dev/{b.device}"

        def tenant_a(fd: int) -> int:
            try:
                os.open(other, os.O_RDWR)
                return 2  # opened the other tenant's device
            except PermissionError:
                pass
            with mmap.mmap(fd, LEASE, mmap.MAP_SHARED, RW) as view:
                view[0] = 0x41
            # Map twice its length: the mapping is allowed, but the page past the lease
            # has no backing in this sub-device, so touching it is SIGBUS, never b's memory.
            view = mmap.mmap(fd, 2 * LEASE, mmap.MAP_SHARED, RW)
            view[LEASE] = 0x42
            return 3  # must not get here

        status = run_as_tenant(a.fd, tenant_a)
        assert killed_by(status) == signal.SIGBUS, f"tenant a: exit {exit_code(status)}"
        with mmap.mmap(b.fd, LEASE, mmap.MAP_SHARED, mmap.PROT_READ) as view_b:
            assert view_b[0] != 0x42
    finally:
        devdax.release(b)
        devdax.release(a)


def test_revoke_is_sigbus_in_the_holder(machine: GuestMachine, devdax: DevdaxBackend) -> None:
    m = devdax.materialise_at(machine.dax_region, machine.free_offset_bytes, LEASE, "revoked")
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def holder(fd: int) -> int:
        with mmap.mmap(fd, LEASE, mmap.MAP_SHARED, RW) as view:
            view[0] = 1
            os.write(ready_w, b"r")
            os.read(go_r, 1)  # parent revokes meanwhile
            view[0] = 2  # the sub-device is gone: SIGBUS
        return 4

    pid = os.fork()
    if pid == 0:
        code = 101
        try:
            os.setgroups([])
            os.setgid(TENANT_UID)
            os.setuid(TENANT_UID)
            code = holder(m.fd)
        finally:
            os._exit(code)
    assert os.read(ready_r, 1) == b"r"
    devdax.release(m)  # unbind + delete while the holder maps it
    assert not os.path.exists(f"/sys/bus/dax/devices/{m.device}")
    os.write(go_w, b"g")
    _, status = os.waitpid(pid, 0)
    assert killed_by(status) == signal.SIGBUS, f"holder exit {exit_code(status)}"


def test_released_bytes_read_zero_in_the_next_lease(
    machine: GuestMachine, devdax: DevdaxBackend
) -> None:
    offset = machine.free_offset_bytes + 4 * LEASE
    first = devdax.materialise_at(machine.dax_region, offset, LEASE, "first")
    with mmap.mmap(first.fd, LEASE, mmap.MAP_SHARED, RW) as view:
        view[:6] = b"secret"
        view[LEASE - 6 :] = b"secret"
    devdax.release(first)
    # Without a scrub the next sub-device on that range would show the bytes:
    peek = devdax.materialise_at(machine.dax_region, offset, LEASE, "peek")
    with mmap.mmap(peek.fd, LEASE, mmap.MAP_SHARED, mmap.PROT_READ) as view:
        assert view[:6] == b"secret"
    devdax.release(peek)
    assert devdax.scrub(machine.dax_region, offset, LEASE) is True
    second = devdax.materialise_at(machine.dax_region, offset, LEASE, "second")
    try:
        with mmap.mmap(second.fd, LEASE, mmap.MAP_SHARED, mmap.PROT_READ) as view:
            assert view[:] == bytes(LEASE)
    finally:
        devdax.release(second)


def test_failing_steps_leave_no_sub_device(machine: GuestMachine, devdax: DevdaxBackend) -> None:
    free = machine.free_offset_bytes
    claimed = dax_device_state(machine.claimed_device)
    before = devdax.sub_devices(machine.dax_region)
    held = devdax.materialise_at(machine.dax_region, free, LEASE, "holder")
    try:
        with_held = devdax.sub_devices(machine.dax_region)
        # 1. the kernel refuses the mapping: the range belongs to another sub-device, the
        #    lease's or dax0.0 (why poold must never place a lease on a reserved range)
        for offset in (free, free - LEASE):
            with pytest.raises(BackendFailed, match="mapping"):
                devdax.materialise_at(machine.dax_region, offset, LEASE, "overlap")
            assert devdax.sub_devices(machine.dax_region) == with_held
        # 2. a failure after bind (the device node cannot be opened): unbind, remove_id,
        #    size 0 and delete are undone in the real kernel
        broken = DevdaxBackend(dev_root=Path("/nonexistent"))
        with pytest.raises(BackendFailed, match="cannot open"):
            broken.materialise_at(machine.dax_region, free + 2 * LEASE, LEASE, "unopenable")
        assert devdax.sub_devices(machine.dax_region) == with_held
        assert isinstance(held, DevdaxMaterialised)
        assert sized_devices(devdax, machine) == {held.device: LEASE}
    finally:
        devdax.release(held)
    assert sized_devices(devdax, machine) == {}
    assert dax_device_state(machine.claimed_device) == claimed
    assert set(devdax.sub_devices(machine.dax_region)) <= set(before) | {held.device}


def test_numa_lease_pages_are_on_the_cpu_less_node(machine: GuestMachine) -> None:
    node = machine.numa_node
    assert Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip() == ""
    backend = NumaBackend(node=node)
    m = backend.materialise(LEASE, "numa-lease")
    try:
        assert (m.backend, m.numa_node, m.page_size_bytes) == ("numa", node, mmap.PAGESIZE)
        assert pages_off_node(m.fd, LEASE, mmap.PAGESIZE, node) == {}
        assert len(pages_off_node(m.fd, LEASE, mmap.PAGESIZE, 0)) == LEASE // mmap.PAGESIZE
    finally:
        backend.release(m)


def test_numa_hugepage_lease_on_the_cpu_less_node(machine: GuestMachine) -> None:
    node = machine.numa_node
    pool = Path(f"/sys/devices/system/node/node{node}/hugepages/hugepages-2048kB")
    (pool / "nr_hugepages").write_text("1")
    try:
        assert int((pool / "free_hugepages").read_text()) == 1
        backend = NumaBackend(node=node, hugepages="required")
        m = backend.materialise(HUGE_2M, "numa-huge")
        try:
            assert m.page_size_bytes == HUGE_2M
            assert pages_off_node(m.fd, HUGE_2M, HUGE_2M, node) == {}
        finally:
            backend.release(m)
    finally:
        (pool / "nr_hugepages").write_text("0")


def _static_tenant(fd: int, round_: int, ready_w: int, go_r: int) -> int:
    """A tenant of a whole static lease: checks it reads zero, writes, keeps only the
    mapping (closes its fd), and touches it again once revoked (SIGBUS)."""
    with mmap.mmap(fd, LEASE, mmap.MAP_SHARED, RW) as view:
        if view[:8] != bytes(8):
            return 5  # the last round's bytes: not scrubbed
        view[:8] = b"round-%d\0" % round_
        os.close(fd)  # Python's mmap keeps a dup: the device stays held
        os.write(ready_w, b"r")
        os.read(go_r, 1)  # revoked, and the scrub waiting, meanwhile
        view[0] = 1  # unbound: SIGBUS
    return 4


def test_static_pmem_dax_is_leased_released_and_leased_again_three_times(
    static_dax_region: int,
) -> None:
    """Issue 13 point 8: the kernel breaks a static ``daxN.0`` rebound while a file of it
    is open (every later open ENXIO). Revoking only unbinds, and the scrub binds it again
    only once the tenant has let go: three rounds of lease, tenant, revoke, scrub."""
    region_id = static_dax_region
    backend = DevdaxBackend(holder_wait_s=120)
    region = backend.region(region_id)
    assert region.static
    device = f"dax{region_id}.0"
    for round_ in range(3):
        m = backend.materialise_at(region_id, 0, region.size_bytes, f"static-{round_}")
        assert isinstance(m, DevdaxMaterialised) and m.device == device
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()

        pid = os.fork()
        if pid == 0:
            code = 101
            try:
                os.setgroups([])
                os.setgid(TENANT_UID)
                os.setuid(TENANT_UID)
                faulthandler.disable()  # its SIGBUS is the test's point, not a crash
                code = _static_tenant(os.dup(m.fd), round_, ready_w, go_r)
            finally:
                os._exit(code)
        assert os.read(ready_r, 1) == b"r"
        backend.release(m)  # unbind only; the agent's fd is closed
        assert dax_device_state(device).driver is None
        result: list[bool] = []
        scrub = threading.Thread(
            target=lambda out=result: out.append(backend.scrub(region_id, 0, region.size_bytes))
        )
        scrub.start()
        scrub.join(timeout=1)
        # The tenant still maps it: the scrub waits, the device stays unbound.
        assert scrub.is_alive() and dax_device_state(device).driver is None
        os.write(go_w, b"g")
        _, status = os.waitpid(pid, 0)
        assert killed_by(status) == signal.SIGBUS, (
            f"round {round_}: tenant exit {exit_code(status)}"
        )
        scrub.join(timeout=120)
        assert result == [True], f"round {round_}: scrub {result}"
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    # A fourth lease opens (no ENXIO) and reads zero where every tenant wrote.
    last = backend.materialise_at(region_id, 0, region.size_bytes, "static-last")
    try:
        with mmap.mmap(last.fd, LEASE, mmap.MAP_SHARED, mmap.PROT_READ) as view:
            assert view[:8] == bytes(8)
    finally:
        backend.release(last)
