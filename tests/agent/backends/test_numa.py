"""agent.backends.numa on this host's node 0: real memfd, real mbind, real move_pages."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.backends import Backend
from agent.backends import numa_sys as sys_numa
from agent.backends.emulated import F_GET_SEALS, LEASE_SEALS
from agent.backends.numa import HUGE_2M, NumaBackend, node_free_hugepages, pages_off_node
from poold.errors import BackendFailed, InvalidSize

NODE = 0  # every Linux host has it; the CPU-less node case runs in tests/hw
HUGEPAGES_NODE0 = Path("/sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages")


@pytest.fixture
def backend() -> NumaBackend:
    return NumaBackend(node=NODE)


def test_lease_on_the_local_node(backend: NumaBackend) -> None:
    m = backend.materialise(8 << 20, "poold-test")
    try:
        assert (m.backend, m.numa_node, m.length_bytes) == ("numa", NODE, 8 << 20)
        assert m.page_size_bytes == mmap.PAGESIZE
        assert os.fstat(m.fd).st_size == 8 << 20
        assert os.fstat(m.fd).st_blocks * 512 >= 8 << 20  # prefaulted
        assert pages_off_node(m.fd, m.length_bytes, m.page_size_bytes, NODE) == {}
        with mmap.mmap(m.fd, m.length_bytes) as view:
            assert view[:] == bytes(m.length_bytes)
            view[-3:] = b"end"
    finally:
        backend.release(m)


def test_sealed_against_growth_and_shrink(backend: NumaBackend) -> None:
    m = backend.materialise(1 << 20, "poold-test")
    try:
        assert fcntl.fcntl(m.fd, F_GET_SEALS) & LEASE_SEALS == LEASE_SEALS
        for length in (2 << 20, 4096):
            with pytest.raises(PermissionError) as caught:
                os.ftruncate(m.fd, length)
            assert caught.value.errno == errno.EPERM
    finally:
        backend.release(m)


def test_verification_sees_pages_on_another_node(backend: NumaBackend) -> None:
    m = backend.materialise(1 << 20, "poold-test")
    try:
        # Every page is on node 0, so for "node 1" all of them are wrong: the check that
        # turns into backend_failed when a lease's pages land elsewhere.
        wrong = pages_off_node(m.fd, m.length_bytes, m.page_size_bytes, NODE + 1)
        assert len(wrong) == m.length_bytes // m.page_size_bytes
        assert set(wrong.values()) == {NODE}
    finally:
        backend.release(m)


def test_move_pages_reports_unfaulted_pages() -> None:
    fd = os.memfd_create("poold-test")
    try:
        os.ftruncate(fd, 4096)
        address = sys_numa.map_shared(fd, 4096)
        try:
            assert sys_numa.page_nodes([address]) == [-errno.ENOENT]
        finally:
            sys_numa.unmap(address, 4096)
    finally:
        os.close(fd)


def test_a_node_that_does_not_exist(backend: NumaBackend) -> None:
    with pytest.raises(BackendFailed, match="does not exist"):
        backend.materialise_on(4095, 1 << 20, "poold-test")


def test_mbind_to_a_node_without_memory_fails() -> None:
    fd = os.memfd_create("poold-test")
    try:
        os.ftruncate(fd, 4096)
        address = sys_numa.map_shared(fd, 4096)
        try:
            with pytest.raises(OSError, match="mbind") as caught:
                sys_numa.mbind(address, 4096, sys_numa.MPOL_BIND, [1000])
            assert caught.value.errno == errno.EINVAL
        finally:
            sys_numa.unmap(address, 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("length", [0, -4096])
def test_invalid_length(backend: NumaBackend, length: int) -> None:
    with pytest.raises(InvalidSize):
        backend.materialise(length, "poold-test")


def test_required_hugepages_fail_when_the_pool_is_empty(tmp_path: Path) -> None:
    pool = tmp_path / "devices/system/node/node0/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "free_hugepages").write_text("0\n")
    backend = NumaBackend(node=NODE, hugepages="required", sysfs_root=tmp_path)
    with pytest.raises(BackendFailed, match="free 2 MiB pages"):
        backend.materialise(HUGE_2M, "poold-test")
    with pytest.raises(InvalidSize):
        backend.materialise(HUGE_2M + 4096, "poold-test")


def test_prefer_falls_back_to_base_pages_and_says_so(tmp_path: Path) -> None:
    pool = tmp_path / "devices/system/node/node0/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "free_hugepages").write_text("0\n")
    backend: Backend = NumaBackend(node=NODE, hugepages="prefer", sysfs_root=tmp_path)
    m = backend.materialise(HUGE_2M, "poold-test")
    try:
        assert m.page_size_bytes == mmap.PAGESIZE
    finally:
        backend.release(m)


@pytest.fixture
def two_hugepages_on_node0() -> Iterator[None]:
    """Two 2 MiB pages in node 0's pool for the test, restored after (needs root)."""
    try:
        before = int(HUGEPAGES_NODE0.read_text())
        HUGEPAGES_NODE0.write_text(str(before + 2))
    except OSError as err:
        pytest.skip(f"cannot grow node 0's hugepage pool: {err}")
    try:
        if (node_free_hugepages(NODE) or 0) < 2:
            pytest.skip("the kernel could not find two free 2 MiB pages on node 0")
        yield
    finally:
        HUGEPAGES_NODE0.write_text(str(before))


@pytest.mark.usefixtures("two_hugepages_on_node0")
@pytest.mark.parametrize("mode", ["required", "prefer"])
def test_hugepages_from_the_node_pool(mode: str) -> None:
    backend = NumaBackend(node=NODE, hugepages=mode)  # type: ignore[arg-type]
    m = backend.materialise(2 * HUGE_2M, "poold-test")
    try:
        assert m.page_size_bytes == HUGE_2M
        assert pages_off_node(m.fd, m.length_bytes, HUGE_2M, NODE) == {}
        assert fcntl.fcntl(m.fd, F_GET_SEALS) & LEASE_SEALS == LEASE_SEALS
    finally:
        backend.release(m)
