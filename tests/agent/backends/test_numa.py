"""agent.backends.numa on this host's node 0: real memfd, real mbind, real move_pages."""

from __future__ import annotations

import errno
import fcntl
import math
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.backends import Backend
from agent.backends import numa as numa_backend
from agent.backends import numa_sys as sys_numa
from agent.backends.emulated import (
    F_GET_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    LEASE_SEALS,
)
from agent.backends.numa import (
    HUGE_2M,
    PLACEMENT_SAMPLES,
    NumaBackend,
    node_available_bytes,
    node_free_hugepages,
    pages_off_node,
    sample_pages,
)
from poold.errors import BackendFailed, InvalidSize

NODE = 0  # every Linux host has it; the CPU-less node case runs in tests/hw
T = TypeVar("T")
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


def test_a_shrinkable_lease_shrinks_but_never_grows(backend: NumaBackend) -> None:
    m = backend.materialise_on(NODE, 8 << 20, "poold-test", shrinkable=True)
    try:
        seals = fcntl.fcntl(m.fd, F_GET_SEALS)
        assert seals & F_SEAL_SHRINK == 0 and seals & F_SEAL_GROW and seals & F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(m.fd, 16 << 20)
        os.ftruncate(m.fd, 2 << 20)  # what the agent's shrink does
        assert os.fstat(m.fd).st_size == 2 << 20
        assert os.fstat(m.fd).st_blocks * 512 <= 2 << 20  # the tail's pages are gone
        assert pages_off_node(m.fd, 2 << 20, m.page_size_bytes, NODE) == {}
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


# --- fallocate under a bound thread, the file's shared policy, sampled placement check ---

MIB = 1 << 20
SAMPLED_LEASE = 64 * MIB  # 16384 pages: more than PLACEMENT_SAMPLES, so the check samples


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_binding_is_the_files_shared_policy(backend: NumaBackend) -> None:
    m = backend.materialise(SAMPLED_LEASE, "poold-test")
    try:
        # A fresh mapping, as the tenant's will be, still sees MPOL_BIND: the policy lives
        # on the file, not on the agent's (long gone) mapping.
        address = sys_numa.map_shared(m.fd, m.length_bytes)
        try:
            for offset in (0, m.length_bytes // 2, m.length_bytes - mmap.PAGESIZE):
                assert sys_numa.address_policy(address + offset) == (sys_numa.MPOL_BIND, [NODE])
        finally:
            sys_numa.unmap(address, m.length_bytes)
        assert os.fstat(m.fd).st_blocks * 512 >= m.length_bytes  # every page allocated
        assert pages_off_node(m.fd, m.length_bytes, m.page_size_bytes, NODE) == {}
    finally:
        backend.release(m)


def test_an_unbound_memfd_has_no_policy() -> None:
    fd = os.memfd_create("poold-test")
    try:
        os.ftruncate(fd, 4096)
        address = sys_numa.map_shared(fd, 4096)
        try:
            assert sys_numa.address_policy(address) == (sys_numa.MPOL_DEFAULT, [])
        finally:
            sys_numa.unmap(address, 4096)
    finally:
        os.close(fd)


def test_sampled_check_sees_pages_on_another_node(backend: NumaBackend) -> None:
    m = backend.materialise(SAMPLED_LEASE, "poold-test")
    try:
        pages = sample_pages(m.length_bytes // m.page_size_bytes)
        assert PLACEMENT_SAMPLES <= len(pages) <= PLACEMENT_SAMPLES + 2
        assert pages_off_node(m.fd, m.length_bytes, m.page_size_bytes, NODE, pages) == {}
        wrong = pages_off_node(m.fd, m.length_bytes, m.page_size_bytes, NODE + 1, pages)
        assert sorted(wrong) == pages and set(wrong.values()) == {NODE}
    finally:
        backend.release(m)


def two_node_tree(tmp_path: Path) -> Path:
    """A sysfs root where nodes 0 and 1 exist (no meminfo: no capacity pre-check)."""
    for node in (0, 1):
        (tmp_path / f"devices/system/node/node{node}").mkdir(parents=True)
    return tmp_path


def test_pages_that_land_on_the_wrong_node_are_backend_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend believes it binds to node 1 while the kernel puts every page on node 0
    (a fallback MPOL_BIND must never allow): the sampled check turns it into backend_failed
    and the fd is closed."""
    real_bound_thread, real_mbind = sys_numa.bound_thread, sys_numa.mbind

    def bound_to_node0(mode: int, nodes: list[int]) -> AbstractContextManager[None]:
        return real_bound_thread(mode, [NODE])

    def mbind_to_node0(
        address: int, length_bytes: int, mode: int, nodes: list[int], flags: int = 0
    ) -> None:
        real_mbind(address, length_bytes, mode, [NODE], flags)

    monkeypatch.setattr(sys_numa, "bound_thread", bound_to_node0)
    monkeypatch.setattr(sys_numa, "mbind", mbind_to_node0)
    backend = NumaBackend(node=1, sysfs_root=two_node_tree(tmp_path))
    before = open_fds()
    with pytest.raises(BackendFailed, match="sampled pages are not on node 1") as caught:
        backend.materialise(SAMPLED_LEASE, "poold-test")
    detail = caught.value.detail
    assert detail["pages_off_node"] == detail["pages_checked"] >= PLACEMENT_SAMPLES
    assert open_fds() == before


def fail_while_bound() -> None:
    with sys_numa.bound_thread(sys_numa.MPOL_BIND, [NODE]):
        assert sys_numa.thread_policy() == (sys_numa.MPOL_BIND, [NODE])
        raise OSError("fail inside")


def in_a_thread(body: Callable[[], T]) -> T:
    """Run ``body`` in a fresh thread, so that thread policies never leak into pytest's."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(body).result()


@pytest.mark.parametrize("policy", [(sys_numa.MPOL_DEFAULT, []), (sys_numa.MPOL_PREFERRED, [NODE])])
def test_the_agents_thread_gets_its_policy_back(policy: tuple[int, list[int]]) -> None:
    """The allocation binds the calling thread only while it runs, and puts back what the
    thread had (numactl --preferred, say), after a lease and after a failed one."""

    def body() -> list[tuple[int, list[int]]]:
        sys_numa.set_thread_policy(*policy)
        backend = NumaBackend(node=NODE)
        seen = []
        m = backend.materialise(MIB, "poold-test")
        backend.release(m)
        seen.append(sys_numa.thread_policy())
        with pytest.raises(BackendFailed):
            backend.materialise_on(NODE, node_total_bytes(NODE) + (1 << 30), "poold-test")
        seen.append(sys_numa.thread_policy())
        with pytest.raises(OSError, match="fail inside"):
            fail_while_bound()
        seen.append(sys_numa.thread_policy())
        return seen

    assert in_a_thread(body) == [policy] * 3
    assert sys_numa.thread_policy() == (sys_numa.MPOL_DEFAULT, [])  # pytest's own thread


def test_a_binding_the_kernel_dropped_is_backend_failed(
    backend: NumaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages on the right node (the thread was bound) but no MPOL_BIND left on the file:
    the tenant's later allocations (swap-in) would not be bound, so the lease is refused."""
    noop: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731
    monkeypatch.setattr(sys_numa, "mbind", noop)
    before = open_fds()
    with pytest.raises(BackendFailed, match="not MPOL_BIND to node 0") as caught:
        backend.materialise(SAMPLED_LEASE, "poold-test")
    assert caught.value.detail["policy_mode"] == sys_numa.MPOL_DEFAULT
    assert open_fds() == before


def node_total_bytes(node: int) -> int:
    for line in Path(f"/sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
        if "MemTotal:" in line:
            return int(line.split()[3]) * 1024
    raise AssertionError("no MemTotal")


def test_a_lease_the_node_cannot_hold_is_refused_before_allocating(
    backend: NumaBackend,
) -> None:
    """Past the node's memory, a bound fallocate would not fail but reclaim and call the
    OOM killer: the agent refuses first, with ENOMEM, and allocates nothing."""
    available = node_available_bytes(NODE)
    assert available is not None and 0 < available <= node_total_bytes(NODE)
    before = open_fds()
    with pytest.raises(BackendFailed, match="node out of memory") as caught:
        backend.materialise(node_total_bytes(NODE) + (1 << 30), "poold-test")
    assert caught.value.detail["errno"] == errno.ENOMEM
    assert caught.value.detail["available_bytes"] > 0
    assert open_fds() == before


def test_an_allocation_error_is_backend_failed_with_its_errno(
    backend: NumaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(numa_backend.os, "posix_fallocate", no_space)
    before = open_fds()
    with pytest.raises(BackendFailed, match="node out of memory") as caught:
        backend.materialise(MIB, "poold-test")
    assert caught.value.detail["errno"] == errno.ENOSPC
    assert open_fds() == before


@pytest.mark.parametrize("mode", ["required", "prefer"])
def test_a_hugepage_pool_the_kernel_cannot_serve(tmp_path: Path, mode: str) -> None:
    """sysfs claims free 2 MiB pages on node 0, the real pool is empty: hugetlbfs fallocate
    says ENOSPC (no OOM killer for hugetlb), which is an error for ``required`` and a fall
    back to base pages for ``prefer``."""
    if (node_free_hugepages(NODE) or 0) > 0:
        pytest.skip("node 0 has free 2 MiB pages: the kernel would serve them")
    pool = tmp_path / "devices/system/node/node0/hugepages/hugepages-2048kB"
    pool.mkdir(parents=True)
    (pool / "free_hugepages").write_text("4\n")
    backend = NumaBackend(node=NODE, hugepages=mode, sysfs_root=tmp_path)  # type: ignore[arg-type]
    before = open_fds()
    if mode == "required":
        with pytest.raises(BackendFailed, match="2 MiB pages on node 0") as caught:
            backend.materialise(2 * HUGE_2M, "poold-test")
        assert caught.value.detail["errno"] == errno.ENOSPC
    else:
        m = backend.materialise(2 * HUGE_2M, "poold-test")
        assert m.page_size_bytes == mmap.PAGESIZE
        backend.release(m)
    assert open_fds() == before


def write_node(root: Path, node: int, meminfo_kib: dict[str, int]) -> None:
    path = root / f"devices/system/node/node{node}"
    path.mkdir(parents=True)
    (path / "meminfo").write_text(
        "".join(f"Node {node} {field}:{value:>16} kB\n" for field, value in meminfo_kib.items())
    )


ZONEINFO = """Node 0, zone   Normal
  per-node stats
      nr_inactive_file 10
  pages free     4511046
        boost    0
        min      100
        low      200
        high     300
Node 1, zone  Movable
  pages free     65536
        boost    0
        min      10
        low      20
        high     30
        spanned  65536
"""


def test_node_available_bytes_is_a_per_node_memavailable(tmp_path: Path) -> None:
    write_node(
        tmp_path,
        1,
        {
            "MemTotal": 262144,
            "MemFree": 200000,
            "Active(file)": 1000,
            "Inactive(file)": 3000,
            "KReclaimable": 40,
        },
    )
    (tmp_path / "zoneinfo").write_text(ZONEINFO)
    page_kib = mmap.PAGESIZE // 1024
    low, high = 20 * page_kib, 30 * page_kib  # node 1's zone only, not node 0's
    expected_kib = (200000 - high) + (4000 - min(2000, low)) + (40 - min(20, low))
    assert node_available_bytes(1, tmp_path, tmp_path) == expected_kib * 1024
    # No zoneinfo: no watermarks to subtract. No meminfo: the kernel does not say.
    assert node_available_bytes(1, tmp_path, tmp_path / "absent") == (200000 + 4000 + 40) * 1024
    assert node_available_bytes(2, tmp_path, tmp_path) is None


def test_the_capacity_check_uses_the_backends_roots(tmp_path: Path) -> None:
    write_node(tmp_path, 0, {"MemTotal": 262144, "MemFree": 1024})
    backend = NumaBackend(node=NODE, sysfs_root=tmp_path, proc_root=tmp_path)
    with pytest.raises(BackendFailed, match="has 1048576 bytes available"):
        backend.materialise(2 * MIB, "poold-test")
    m = backend.materialise(MIB, "poold-test")
    backend.release(m)


@pytest.mark.parametrize("page_count", [1, 2, 512, PLACEMENT_SAMPLES + 2])
def test_small_leases_check_every_page(page_count: int) -> None:
    assert sample_pages(page_count) == list(range(page_count))


@given(st.integers(PLACEMENT_SAMPLES + 3, 1 << 24), st.integers(0, 1 << 24))
@settings(max_examples=200, deadline=None)
def test_every_run_of_one_stride_holds_a_sampled_page(page_count: int, start: int) -> None:
    """What makes the sample enough (numa.py docstring): a misplaced contiguous run of
    ceil(pages / samples) pages always contains a checked page; so do both ends."""
    pages = sample_pages(page_count)
    assert pages == sorted(set(pages)) and len(pages) <= PLACEMENT_SAMPLES + 2
    assert pages[0] == 0 and pages[-1] == page_count - 1
    run = math.ceil(page_count / PLACEMENT_SAMPLES)
    first = start % (page_count - run + 1)
    assert any(first <= p < first + run for p in pages)
