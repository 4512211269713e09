"""Static dax regions (a pmem namespace in devdax mode) leased whole, again and again.

A copy of the recorded QEMU pmem machine, its static ``dax2.0`` shrunk to 8 MiB so that
scrubs are quick; :class:`FakeDaxKernel` plays the kernel at the sysfs boundary. Who holds
the device is read from the real ``/proc``: this test process, holding the fake node open
or mapped, is the tenant that has not let go. The real kernel's side (ENXIO after a rebind
under open files) is tests/hw's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from agent.backends import numa_sys
from agent.backends.devdax import DevdaxBackend, device_holders
from poold.errors import BackendFailed
from tests.agent.backends.test_devdax import (
    DRIVER,
    MIB,
    FakeDaxKernel,
    _add_write_only_attrs,
)
from tests.fixtures.machines.loader import Machine

SIZE = 8 * MIB


@pytest.fixture
def static(tmp_path: Path) -> tuple[DevdaxBackend, FakeDaxKernel, Path]:
    root = Machine("qemu-full-05-pmem").extract(tmp_path / "machine")
    _add_write_only_attrs(root)
    device = Path(os.path.realpath(root / "bus/dax/devices/dax2.0"))
    for attr in (device / "size", device.parent / "dax_region" / "size"):
        attr.write_text(str(SIZE))
    dev = tmp_path / "dev"
    dev.mkdir()
    with open(dev / "dax2.0", "wb") as node:  # bound at boot: the node exists
        node.truncate(SIZE)
    kernel = FakeDaxKernel(root, dev)
    backend = DevdaxBackend(root, dev, apply=kernel, require_char_device=False, holder_wait_s=0.5)
    return backend, kernel, dev


def test_device_holders_sees_fds_and_mappings_without_fds(tmp_path: Path) -> None:
    path = tmp_path / "node"
    path.write_bytes(bytes(mmap.PAGESIZE))
    assert os.getpid() not in device_holders(path)
    fd = os.open(path, os.O_RDWR)
    try:
        assert device_holders(path)[os.getpid()] == "fd"
        # A raw mmap(2): Python's mmap module would keep a dup of the fd.
        address = numa_sys.map_shared(fd, mmap.PAGESIZE)
    finally:
        os.close(fd)
    try:
        assert device_holders(path)[os.getpid()] == "map"  # the mapping keeps the file
    finally:
        numa_sys.unmap(address, mmap.PAGESIZE)
    assert os.getpid() not in device_holders(path)


def test_lease_release_scrub_three_times_never_binds_under_an_open_file(
    static: tuple[DevdaxBackend, FakeDaxKernel, Path],
) -> None:
    backend, kernel, _ = static
    for round_ in range(3):
        m = backend.materialise_at(2, 0, SIZE, f"whole-{round_}")
        # The tenant's copy of the fd, mapped and written, as a tenant would.
        tenant = os.dup(m.fd)
        address = numa_sys.map_shared(tenant, SIZE)
        ctypes.memmove(address, b"taken", 5)
        backend.release(m)  # revoke: unbind only, the agent's fd closed
        assert kernel.writes[-1] == (f"{DRIVER}/unbind", "dax2.0")
        os.close(tenant)  # the fd goes, the mapping stays: still a holder
        assert backend.scrub(2, 0, SIZE) is False  # waited 0.5 s, never bound
        assert kernel.writes[-1] == (f"{DRIVER}/unbind", "dax2.0")
        numa_sys.unmap(address, SIZE)
        assert backend.scrub(2, 0, SIZE) is True  # nobody holds it: bound, zeroed, unbound
        assert [w for w, _ in kernel.writes[-2:]] == [f"{DRIVER}/bind", f"{DRIVER}/unbind"]
    binds = [w for w in kernel.writes if w[0] == f"{DRIVER}/bind"]
    assert len(binds) == 3 + 2  # each scrub and each later lease, never under a holder


def test_a_lease_of_a_held_unbound_device_is_refused_not_bound(
    static: tuple[DevdaxBackend, FakeDaxKernel, Path],
) -> None:
    backend, kernel, _ = static
    m = backend.materialise_at(2, 0, SIZE, "first")
    tenant = os.dup(m.fd)
    try:
        backend.release(m)
        with pytest.raises(BackendFailed, match="still held") as err:
            backend.materialise_at(2, 0, SIZE, "second")
        assert err.value.detail["holders"] == [os.getpid()]
        assert f"{DRIVER}/bind" not in [w for w, _ in kernel.writes]
    finally:
        os.close(tenant)
    again = backend.materialise_at(2, 0, SIZE, "second")  # let go: bound again
    backend.release(again)
