"""How does Python ask the kernel where memory must live, and where it actually is?

A small ctypes layer over the raw NUMA syscalls, mbind(2), set_mempolicy(2),
get_mempolicy(2) and move_pages(2), through libc's ``syscall()``: no libnuma and no extra
dependency (the PyPI ``numa`` package does not build on 3.11). Only what the numa backend
needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

# include/uapi/linux/mempolicy.h
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_MF_STRICT = 1 << 0  # fail if existing pages don't follow the policy
MPOL_MF_MOVE = 1 << 1  # move this process's pages that don't
MPOL_F_ADDR = 1 << 1  # get_mempolicy: the policy that governs an address, not the task's

# madvise(2) advice (Linux 5.14+); not in Python 3.11's mmap module.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23

# memfd_create(2) flags for hugetlbfs-backed memfds (include/uapi/linux/memfd.h)
MFD_HUGETLB = 0x0004
MFD_HUGE_SHIFT = 26
MFD_HUGE_2MB = 21 << MFD_HUGE_SHIFT

# Syscall numbers per architecture (arch/*/entry/syscalls, include/uapi/asm-generic/unistd.h).
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "move_pages": 239},
}
# get_mempolicy(2) fails with EINVAL unless the mask has room for every possible node
# (nr_node_ids); 4096 bits is more than any kernel's MAX_NUMNODES (NODES_SHIFT <= 10).
_POLICY_MASK_WORDS = 4096 // (ctypes.sizeof(ctypes.c_ulong) * 8)

_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _nr(name: str) -> int:
    table = _SYSCALLS.get(platform.machine())
    if table is None:
        raise OSError(f"NUMA syscalls are not wired for {platform.machine()}")
    return table[name]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def nodemask(nodes: list[int]) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """A kernel nodemask for ``nodes`` and the ``maxnode`` to pass with it."""
    words = max(nodes, default=0) // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // _ULONG_BITS] |= 1 << (node % _ULONG_BITS)
    # The kernel reads maxnode - 1 bits (mm/mempolicy.c get_nodes(): "--maxnode"),
    # so pass one more than the bits we have, as libnuma does.
    return mask, words * _ULONG_BITS + 1


def mbind(address: int, length_bytes: int, mode: int, nodes: list[int], flags: int = 0) -> None:
    """Set the memory policy of ``[address, address+length)`` (page aligned)."""
    mask, maxnode = nodemask(nodes)
    _check(
        _syscall(
            ctypes.c_long(_nr("mbind")),
            ctypes.c_void_p(address),
            ctypes.c_ulong(length_bytes),
            ctypes.c_ulong(mode),
            mask,
            ctypes.c_ulong(maxnode),
            ctypes.c_uint(flags),
        ),
        "mbind",
    )


def _get_mempolicy(address: int | None) -> tuple[int, list[int]]:
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _POLICY_MASK_WORDS)()
    _check(
        _syscall(
            ctypes.c_long(_nr("get_mempolicy")),
            ctypes.byref(mode),
            mask,
            ctypes.c_ulong(_POLICY_MASK_WORDS * _ULONG_BITS + 1),
            ctypes.c_void_p(address),
            ctypes.c_ulong(0 if address is None else MPOL_F_ADDR),
        ),
        "get_mempolicy",
    )
    nodes = [
        word * _ULONG_BITS + bit
        for word in range(_POLICY_MASK_WORDS)
        if mask[word]
        for bit in range(_ULONG_BITS)
        if mask[word] >> bit & 1
    ]
    return mode.value, nodes


def address_policy(address: int) -> tuple[int, list[int]]:
    """The memory policy that governs ``address`` in this process (get_mempolicy(2) with
    MPOL_F_ADDR): ``(mode, nodes)``. For a shmem mapping that is the file's shared policy,
    the one every mapping of the file (the tenant's too) allocates under."""
    return _get_mempolicy(address)


def thread_policy() -> tuple[int, list[int]]:
    """The calling thread's memory policy, ``(mode with its mode flags, nodes)``."""
    return _get_mempolicy(None)


def set_thread_policy(mode: int, nodes: list[int]) -> None:
    """set_mempolicy(2): the calling thread's policy (other threads keep theirs)."""
    if nodes:
        mask, maxnode = nodemask(nodes)
        result = _syscall(
            ctypes.c_long(_nr("set_mempolicy")), ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode)
        )
    else:  # MPOL_DEFAULT, MPOL_LOCAL: no nodemask
        result = _syscall(
            ctypes.c_long(_nr("set_mempolicy")),
            ctypes.c_int(mode),
            ctypes.c_void_p(None),
            ctypes.c_ulong(0),
        )
    _check(result, "set_mempolicy")


@contextmanager
def bound_thread(mode: int, nodes: list[int]) -> Iterator[None]:
    """This thread allocates under ``mode`` on ``nodes`` inside the block, then gets back
    the policy it had (read with get_mempolicy(2), so ``numactl --membind`` survives)."""
    before = thread_policy()
    set_thread_policy(mode, nodes)
    try:
        yield
    finally:
        set_thread_policy(*before)


def page_nodes(addresses: list[int]) -> list[int]:
    """The node of the page at each address of this process, via move_pages(2) in query mode
    (``nodes`` NULL): a node id, or ``-errno`` (``-ENOENT``: not faulted in)."""
    count = len(addresses)
    if count == 0:
        return []
    pages = (ctypes.c_void_p * count)(*addresses)
    status = (ctypes.c_int * count)()
    _check(
        _syscall(
            ctypes.c_long(_nr("move_pages")),
            ctypes.c_int(0),
            ctypes.c_ulong(count),
            pages,
            ctypes.c_void_p(None),
            status,
            ctypes.c_int(0),
        ),
        "move_pages",
    )
    return list(status)


_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def madvise(address: int, length_bytes: int, advice: int) -> None:
    """madvise(2) on raw addresses (Python's mmap.madvise needs the mmap object)."""
    _check(
        _libc.madvise(
            ctypes.c_void_p(address), ctypes.c_size_t(length_bytes), ctypes.c_int(advice)
        ),
        "madvise",
    )


_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, length_bytes: int) -> int:
    """mmap(2) ``fd`` read-write MAP_SHARED; the raw address (no Python buffer pins it)."""
    prot = 0x1 | 0x2  # PROT_READ | PROT_WRITE
    address = _libc.mmap(None, length_bytes, prot, 0x01, fd, 0)  # MAP_SHARED
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    return int(address)


def unmap(address: int, length_bytes: int) -> None:
    """munmap(2) a mapping made by :func:`map_shared`."""
    _check(_libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(length_bytes)), "munmap")
