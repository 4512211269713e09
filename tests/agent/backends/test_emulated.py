"""agent.backends.emulated: real memfds, real seals, real mmap."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.backends import Backend
from agent.backends.emulated import (
    F_GET_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    EmulatedBackend,
    available_bytes,
    materialise,
    release,
)
from poold.errors import BackendFailed, InvalidSize

TWO_MIB = 2 << 20


@pytest.fixture
def fd() -> Iterator[int]:
    fd = materialise(TWO_MIB, "poold-test")
    yield fd
    release(fd)


def test_memfd_has_exactly_the_length(fd: int) -> None:
    assert os.fstat(fd).st_size == TWO_MIB


def test_memory_is_allocated_up_front(fd: int) -> None:
    # st_blocks counts 512-byte units actually backing the file: prefaulted, not sparse.
    assert os.fstat(fd).st_blocks * 512 >= TWO_MIB


def test_memory_reads_zero_and_is_writable_through_mmap(fd: int) -> None:
    with mmap.mmap(fd, TWO_MIB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as view:
        assert view[:] == bytes(TWO_MIB)
        view[TWO_MIB - 3 :] = b"end"
    assert os.pread(fd, 3, TWO_MIB - 3) == b"end"


def test_sealed_against_growth_shrink_and_new_seals(fd: int) -> None:
    seals = fcntl.fcntl(fd, F_GET_SEALS)
    wanted = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL
    assert seals & wanted == wanted
    for length in (TWO_MIB * 2, TWO_MIB // 2, 0):
        with pytest.raises(PermissionError) as caught:
            os.ftruncate(fd, length)
        assert caught.value.errno == errno.EPERM
    assert os.fstat(fd).st_size == TWO_MIB


def test_fd_is_close_on_exec(fd: int) -> None:
    assert not os.get_inheritable(fd)


def test_name_shows_in_proc(fd: int) -> None:
    assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:poold-test (deleted)"


def test_overlong_or_odd_names_are_accepted() -> None:
    fd = materialise(4096, "x" * 1000 + "\0tail")
    release(fd)


@pytest.mark.parametrize("length_bytes", [0, -1])
def test_invalid_length(length_bytes: int) -> None:
    with pytest.raises(InvalidSize):
        materialise(length_bytes, "poold-test")


def test_more_than_the_host_has_is_backend_failed_not_oom() -> None:
    with pytest.raises(BackendFailed) as caught:
        materialise(1 << 62, "poold-test")
    assert caught.value.code == "backend_failed"


def test_release_closes(fd: int) -> None:
    copy = os.dup(fd)
    release(copy)
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(copy)


def test_backend_protocol() -> None:
    backend: Backend = EmulatedBackend()
    assert backend.name == "emulated"
    materialised = backend.materialise(8192, "poold-test")
    try:
        assert materialised.backend == "emulated"
        assert materialised.length_bytes == 8192
        assert materialised.page_size_bytes == mmap.PAGESIZE
        assert materialised.numa_node is None
        assert os.fstat(materialised.fd).st_size == 8192
    finally:
        backend.release(materialised)


def test_each_lease_gets_fresh_zeroed_memory() -> None:
    first = materialise(TWO_MIB, "poold-test")
    os.pwrite(first, b"secret kv block", 0)
    release(first)
    second = materialise(TWO_MIB, "poold-test")
    try:
        assert os.pread(second, TWO_MIB, 0) == bytes(TWO_MIB)
    finally:
        release(second)


def test_available_bytes_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemAvailable:    8192 kB\n")
    assert available_bytes(str(meminfo)) == 8192 * 1024
    assert available_bytes(str(tmp_path / "missing")) is None
    live = available_bytes()
    assert live is not None
    assert live > 0
