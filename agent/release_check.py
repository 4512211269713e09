"""Does any process but the agent still hold a released memfd? The kernel says so in
microseconds, where a pass over ``/proc`` (agent/mappings.py) takes milliseconds.

A released memfd's bytes count against its tenant for as long as anyone maps or holds
it (DESIGN.md "Memory follows the pages"). Asking ``/proc`` costs a pass over every
process's ``maps`` and ``fd`` directory, on every release. The kernel keeps the answer
already: an inode's ``i_writecount`` and ``i_readcount`` count its open files
(fs/locks.c ``check_conflicting_open``), and ``fcntl(F_SETLEASE, F_WRLCK)`` is granted
only when the caller's own file is the only one counted. A mapping holds its file, so
a mapping whose fd was closed still counts; an fd passed over SCM_RIGHTS is the same
file, counted even while it sits unreceived in a socket (which ``/proc`` cannot see).

Two files are not counted, and the design works around both:

* the ``memfd_create`` file itself (it is set up without ``get_write_access``): so the
  tenant never gets it. It gets a *reopen* (``/proc/self/fd/N``, O_RDWR: a new open file
  description, counted); the agent keeps the original, which no one else ever sees, and a
  read-only reopen to ask the question on (:func:`prepare`).
* ``O_PATH`` files: such an fd can neither read, write nor map, but it keeps the inode
  (and its pages) and may be reopened later through ``/proc/self/fd``. So while the
  lease is held its mode is set to 0, so that only a process with CAP_DAC_OVERRIDE (root,
  which needs no pool to take host memory) can open it again, and the lease must still
  be unbroken (no open raced in), and granted once more, before the bytes are called
  free; then its pages are punched out (``FALLOC_FL_PUNCH_HOLE``, allowed under
  ``F_SEAL_SHRINK``: the size stays), off the request path, or, when the warm pool wants
  a memfd of that length, zeroed in place and handed out again (:class:`_Punch`).

Anything else (``EAGAIN``, a broken lease, any error) answers "maybe held", and the caller
scans ``/proc`` as before, to name the pids and watch the inode. So the check can only
skip a scan that would have found nobody.

Whether the kernel counts what this relies on is probed once per process
(:func:`self_test`), never assumed: ``i_readcount`` exists only with CONFIG_IMA on some
kernels, leases may be off (``fs.leases-enable=0``: EINVAL), or refused to a non-owner
without CAP_LEASE (EACCES). Any failure means every release is scanned, and the log says why.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import logging
import mmap
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from typing import Protocol

from agent import after_reply
from agent.backends import Materialised
from agent.backends.emulated import F_GET_SEALS, LEASE_SEALS, MemfdMaterialised, OnceFd

log = logging.getLogger("pool_agent")

# In the fcntl module on Linux; the fallbacks are include/uapi/linux/fcntl.h's values.
F_SETLEASE: int = getattr(fcntl, "F_SETLEASE", 1024)
F_GETLEASE: int = getattr(fcntl, "F_GETLEASE", 1025)
F_SETSIG: int = getattr(fcntl, "F_SETSIG", 10)
FALLOC_FL_KEEP_SIZE = 0x01  # include/uapi/linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_fallocate.restype = ctypes.c_int


def reopen(fd: int, flags: int) -> int:
    """A new open file description of ``fd``'s inode (counted, unlike a memfd_create file)."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def _quiet(probe_fd: int) -> None:
    """A lease break signals its holder, SIGIO by default, whose default action ends the
    process: point it at SIGURG, ignored by default, since the break is read with
    F_GETLEASE instead (set per file; the lease itself is held for microseconds)."""
    fcntl.fcntl(probe_fd, F_SETSIG, signal.SIGURG)


def _lease(probe_fd: int) -> bool:
    """F_SETLEASE F_WRLCK: True granted (held: the caller unlocks), False refused (EAGAIN)."""
    try:
        fcntl.fcntl(probe_fd, F_SETLEASE, fcntl.F_WRLCK)
    except OSError as err:
        if err.errno == errno.EAGAIN:
            return False
        raise
    return True


def _unlock(probe_fd: int) -> None:
    fcntl.fcntl(probe_fd, F_SETLEASE, fcntl.F_UNLCK)


def punch(fd: int, length_bytes: int) -> None:
    """Free every page of the memfd, its size unchanged (F_SEAL_SHRINK allows it)."""
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, length_bytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# What zeroing writes from: one buffer, repeated in a single pwritev (IOV_MAX is 1024).
_ZEROS = bytes(64 << 10)


def data_ranges(fd: int, length_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of the memfd that may hold anything but zeros: what ``SEEK_DATA``
    and ``SEEK_HOLE`` call data, the rest reading as zeros whatever happens.

    A shmem page counts as data once it was read, written or faulted in (uptodate), or
    swapped out; a page ``fallocate`` made and nobody touched since is a hole (mm/filemap.c
    ``folio_seek_hole_data``, Linux 4.12+ for shmem's SEEK_DATA) and reads as zeros. So a
    lease whose tenant never touched its memory has no data at all, and its memfd needs no
    zeroing: ~20 us to ask instead of a 2 MiB write (~0.3 ms of the agent's CPU) that
    would also make every page data for the next release. Where the file system cannot
    say (EINVAL), the whole length is data.
    """
    ranges: list[tuple[int, int]] = []
    at = 0
    while at < length_bytes:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:  # nothing but holes from here
                break
            if err.errno == errno.EINVAL and at == 0:
                return [(0, length_bytes)]
            raise
        if start >= length_bytes:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), length_bytes)
        ranges.append((start, end))
        at = end
    return ranges


def _has_data(fd: int, length_bytes: int) -> bool:
    """Whether :func:`zero` would write anything (True when it cannot tell)."""
    try:
        return bool(data_ranges(fd, length_bytes))
    except OSError:
        return True


def _write_zeros(fd: int, start: int, end: int) -> bool:
    at = start
    while at < end:
        n = min((end - at) // len(_ZEROS), 1024)
        if n:
            chunk = n * len(_ZEROS)
            written = os.pwritev(fd, [_ZEROS] * n, at)
        else:
            chunk = end - at
            written = os.pwrite(fd, _ZEROS[:chunk], at)
        if written != chunk:
            return False
        at += written
    return True


def zero(fd: int, length_bytes: int) -> bool:
    """Overwrite every byte of the memfd that may not be zero (:func:`data_ranges`) with
    zeros in place, its pages kept: the GIL released, ~0.2 ms for 2 MiB of data here,
    where freeing the pages and allocating fresh ones costs ~1 ms. False when the kernel
    wrote less than asked (the caller then punches and closes the memfd, as for any
    other)."""
    return all(_write_zeros(fd, start, end) for start, end in data_ranges(fd, length_bytes))


class Taker(Protocol):
    """Who takes a released memfd once zeroed (the warm pool, agent/memory.py), settled
    exactly once: called with the fd (True: it kept it; False: punch and close it), or
    cancelled when the memfd is punched without being offered (it cannot be recycled)."""

    def __call__(self, fd: int) -> bool: ...

    def cancel(self) -> None: ...


def _sole(probe_fd: int) -> bool:
    """The agent's two files (the memfd_create original and the read-only probe) are the
    only ones of the inode open anywhere, and no one but root can open it again (its mode
    is 0). False when anything else holds it; OSError when the kernel refuses the lease
    for another reason. The pages an O_PATH holder may keep are punched out after
    (:class:`_Punch`)."""
    for _attempt in range(3):
        if not _lease(probe_fd):
            return False
        try:
            os.fchmod(probe_fd, 0)  # first: an open that starts now is refused (non-root)
            # An open since the grant broke the lease (the kernel orders the count and
            # the lease so that one of the two sees the other): ask again, it is counted.
            unbroken = fcntl.fcntl(probe_fd, F_GETLEASE) == fcntl.F_WRLCK
        finally:
            _unlock(probe_fd)
        # Once more with the mode 0: an open that was past its permission check before
        # the fchmod and counted only after the F_GETLEASE is seen here, if it still holds.
        if unbroken and _lease(probe_fd):
            _unlock(probe_fd)
            return True
    return False


class _Punch:
    """Frees a released memfd's pages and closes the agent's last files of it, off the
    request path: freeing 2 MiB of pages costs 0.1-0.4 ms (on the tenant's reply path
    it was the largest single cost of a release). Nothing can open the memfd any more
    (mode 0), so only an O_PATH holder could still reach it, and the punch leaves it
    nothing. One thread per process, started with the agent.

    A memfd put with a ``take`` (the warm pool wants one of its length) is instead
    zeroed in place (:func:`zero`) and given to the taker, which hands it out again with
    fresh copies (agent/memory.py): a pool reuses its memory, as a device-DAX pool reuses
    its ranges, and zeroing the pages costs a fifth of freeing them and allocating new
    ones. The kernel has just said that no file of it is open anywhere and its mode is 0,
    so nothing can open it again; an O_PATH holder keeps the inode, which it can neither
    read, write, map nor reopen (the permission check refuses mode 0 to all but root),
    whoever's memory it holds next.

    A release served on the agent's socket whose memfd the pool takes and that has
    nothing to zero (its tenant never touched it) does not come here: the thread that
    served it gives it back once the reply has left (agent/after_reply.py), which is
    cheaper than waking this one; this thread takes the rest (pages to zero or punch,
    revocations, expiries).

    While releases keep coming the thread stays awake and takes what queued every
    ``BATCH_S``, so a release wakes no thread (a wake-up per release cost the request
    thread more than the punch it saved); an idle one waits to be woken.

    What waits is bounded (``MAX_PENDING`` memfds, ``MAX_PENDING_BYTES``): each holds two
    fds and its pages, which the ledger already counts as free. A thread that falls
    behind (starved of the GIL or the CPU: seen under a profiler, at 500 releases/s, as
    the agent running out of fds) makes releases past the bound punch on their own
    thread instead: slower releases, never unbounded memory or fds.
    """

    BATCH_S = 0.005
    MAX_PENDING = 64
    MAX_PENDING_BYTES = 256 << 20

    def __init__(self) -> None:
        self._todo: collections.deque[tuple[int, OnceFd, int, Taker | None]] = collections.deque()
        self._wake = threading.Event()
        self._awake = False
        self._pending = 0  # handed over and not yet closed
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.inline = 0  # releases punched on their own thread (the bound was reached)
        self._behind = False  # an episode past the bound, logged at its start and end

    def start(self) -> None:
        """Start the thread, once per process: with the agent, since one that appeared at
        the first release would look like a thread a peer made the agent start."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agent-punch", daemon=True)
                self._thread.start()

    def put(self, fd: int, probe: OnceFd, length_bytes: int, take: Taker | None = None) -> None:
        self.start()
        with self._lock:
            behind = (
                self._pending >= self.MAX_PENDING
                or self._pending_bytes + length_bytes > self.MAX_PENDING_BYTES
            )
            self._pending += 1
            self._pending_bytes += length_bytes
            if behind:
                self.inline += 1
                if not self._behind:
                    self._behind = True
                    log.warning(
                        "%d released memfds (%d bytes) wait to be freed: releases free "
                        "their own until the punch thread catches up",
                        self._pending - 1,
                        self._pending_bytes - length_bytes,
                    )
        if behind:
            if take is not None:
                take.cancel()
            self._punch(fd, probe, length_bytes, None)
            return
        if take is not None and after_reply.defer(
            functools.partial(self._after_reply, fd, probe, length_bytes, take)
        ):
            return
        self._queue(fd, probe, length_bytes, take)

    def _after_reply(self, fd: int, probe: OnceFd, length_bytes: int, take: Taker) -> None:
        """On the thread that served the release, once its reply left (even the question
        is off the reply's path: ~20 us of ``SEEK_DATA`` over 2 MiB). Nothing to zero:
        taken back into the pool here. A memfd with pages to zero (or to punch) goes to
        this class's thread: the write runs beside the next request, not before it."""
        if _has_data(fd, length_bytes):
            self._queue(fd, probe, length_bytes, take)
        else:
            self._punch(fd, probe, length_bytes, take, clean=True)

    def _queue(self, fd: int, probe: OnceFd, length_bytes: int, take: Taker | None) -> None:
        self._todo.append((fd, probe, length_bytes, take))
        if not self._awake:  # read after the append: see _run
            self._wake.set()

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until every memfd handed over is punched and closed (tests)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.001)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._awake = True
            while True:
                while self._todo:
                    try:
                        self._punch(*self._todo.popleft())
                    except Exception:  # never the thread: every later memfd needs it
                        log.exception("closing a released memfd")
                time.sleep(self.BATCH_S)
                if self._todo:
                    continue
                # Asleep first, then look once more: a put between the two saw us awake
                # and set nothing, so its memfd is in the deque now.
                self._awake = False
                if not self._todo:
                    break
                self._awake = True

    def _done(self, length_bytes: int) -> None:
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= length_bytes
            if self._behind and not self._pending:
                self._behind = False
                log.info("the punch thread caught up")

    def _punch(
        self, fd: int, probe: OnceFd, length_bytes: int, take: Taker | None, clean: bool = False
    ) -> None:
        """``clean``: found with nothing to zero already (no file of it is open anywhere
        but the agent's, which write nothing, so it stays so)."""
        if take is not None:
            try:
                kept = (
                    recyclable(fd, length_bytes) and (clean or zero(fd, length_bytes)) and take(fd)
                )
            except Exception:
                log.exception("recycling a released memfd: its pages are punched instead")
                kept = False
            finally:
                take.cancel()  # a no-op once it was called
            if kept:
                try:
                    probe.close()
                finally:
                    self._done(length_bytes)
                return
        try:
            punch(fd, length_bytes)
        except OSError as err:  # hugetlb needs whole pages: closing frees them too
            log.debug("punching a released memfd: %s", err)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            try:
                probe.close()
            finally:
                self._done(length_bytes)


PUNCH = _Punch()


def recyclable(fd: int, length_bytes: int) -> bool:
    """The memfd is still as the warm pool makes them: a regular file of exactly its
    length, mode 0 (set by :func:`_sole`), sealed against growing and shrinking with the
    seal set frozen, so that a tenant changed nothing the next one would inherit."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != 0:
        return False
    if st.st_size != length_bytes:
        return False
    return fcntl.fcntl(fd, F_GET_SEALS) == LEASE_SEALS


def self_test() -> str | None:
    """None when the check is sound on this kernel; otherwise why it is not.

    Made on a memfd of the agent's own: refused while a read-only reopen is open (the
    kernel counts read-only opens: i_readcount) and while a mapping whose fd was closed
    exists, granted (with the pages punched and the mode 0) once both are gone.
    """
    try:
        fd = os.memfd_create("poold-release-check", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as err:
        return f"memfd_create failed: {err.strerror}"
    opened = [fd]
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        os.posix_fallocate(fd, 0, mmap.PAGESIZE)
        probe = reopen(fd, os.O_RDONLY)
        opened.append(probe)
        _quiet(probe)
        if not _lease(probe):
            return "F_SETLEASE refused with no other file open"
        _unlock(probe)
        other = reopen(fd, os.O_RDONLY)
        try:
            if _lease(probe):
                _unlock(probe)
                return "a read-only open is not counted (no i_readcount: CONFIG_IMA off?)"
        finally:
            os.close(other)
        writer = reopen(fd, os.O_RDWR)
        mapping = mmap.mmap(writer, mmap.PAGESIZE)
        os.close(writer)
        try:
            mapping[0] = 1
            if _lease(probe):
                _unlock(probe)
                return "a mapping whose fd was closed is not counted"
        finally:
            mapping.close()
        if not _sole(probe):
            return "F_SETLEASE refused once every other file was gone"
        punch(fd, mmap.PAGESIZE)
        if os.fstat(fd).st_blocks != 0 or stat.S_IMODE(os.fstat(fd).st_mode) != 0:
            return "punching the pages or clearing the mode did not take"
    except OSError as err:
        why = {
            errno.EINVAL: "leases are off (fs.leases-enable=0) or refused on memfds",
            errno.EACCES: "not the memfd's owner and no CAP_LEASE",
            errno.EPERM: "not permitted",
        }.get(err.errno or 0, err.strerror or str(err))
        return f"{why} ({errno.errorcode.get(err.errno or 0, err.errno)})"
    finally:
        for f in opened:
            os.close(f)
    return None


_verdict_lock = threading.Lock()
_verdict: list[str | None] = []  # the process's self-test result, once made


def kernel_verdict() -> str | None:
    """:func:`self_test`, made once per process and logged."""
    with _verdict_lock:
        if not _verdict:
            why = self_test()
            _verdict.append(why)
            if why is None:
                log.info("release check: F_SETLEASE (no /proc scan unless a memfd is held)")
            else:
                log.warning("release check: every release scans /proc: %s", why)
        return _verdict[0]


class ReleaseCheck:
    """Whether a released memfd is held by anyone, and the files that makes it answerable.

    ``usable`` False (the self-test failed, or tests ask for it) keeps the old way
    exactly: the tenant gets the agent's memfd, and every release scans.
    """

    def __init__(self, usable: bool, why: str | None = None) -> None:
        self.usable = usable
        self.why = why
        self._warned = False
        self.fast = 0  # releases the kernel answered (no scan)
        self.scanned = 0  # releases it said may be held (scanned)
        # Set by agent/memory.py: for a released memfd no one else holds, who takes it
        # once zeroed (None: its pages are punched). Asked on the release path: cheap.
        self.recycler: Callable[[MemfdMaterialised], Taker | None] | None = None

    @classmethod
    def for_this_kernel(cls) -> ReleaseCheck:
        why = kernel_verdict()
        if why is None:
            PUNCH.start()
        return cls(why is None, why)

    def prepare(self, memory: Materialised) -> Materialised:
        """A memfd about to be handed out: with the tenant's reopen (what is sent) and the
        agent's read-only probe. Unchanged when the check is off or for a dax device."""
        if not self.usable or not isinstance(memory, MemfdMaterialised):
            return memory
        if memory.tenant is not None:
            return memory
        try:
            if not stat.S_ISREG(os.fstat(memory.fd).st_mode):
                return memory
            probe = reopen(memory.fd, os.O_RDONLY)
        except OSError as err:
            log.warning("release check: no probe for a memfd (%s); it will be scanned", err)
            return memory
        try:
            _quiet(probe)
            tenant = reopen(memory.fd, os.O_RDWR)
        except OSError as err:
            os.close(probe)
            log.warning("release check: no reopen for a memfd (%s); it will be scanned", err)
            return memory
        return dataclasses.replace(memory, tenant=OnceFd(tenant), probe=OnceFd(probe))

    def unheld(self, memory: Materialised) -> bool:
        """True when no process but the agent holds the memfd (its pages are freed
        shortly after, off the request path); False when one may (scan to know who).
        Every agent file of it is closed (or handed to the punch thread, which closes it)."""
        free, probe = self.end(memory)
        if probe is not None:
            probe.close()
        return free

    def end(self, memory: Materialised) -> tuple[bool, OnceFd | None]:
        """:meth:`unheld`, and when the kernel says that some file of the memfd is still
        open, the probe, left open for the caller to ask again later (:func:`still_held`)."""
        copy = memory.probe if isinstance(memory, MemfdMaterialised) else None
        probe = copy.fd if copy is not None else None
        if copy is None or probe is None or not self.usable:  # off since it was handed out: scan
            close_copies(memory)
            self.scanned += 1
            return False, None
        sole: bool | None = None  # None: the kernel would not say
        try:
            close_copies(memory, keep_fd=True, keep_probe=True)  # the tenant's copy first
            sole = _sole(probe)
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("release check refused (%s): scanning /proc instead", err)
        finally:
            if sole:
                assert isinstance(memory, MemfdMaterialised)  # it has a probe
                take = self.recycler(memory) if self.recycler is not None else None
                PUNCH.put(memory.fd, copy, memory.length_bytes, take)  # closes both, or recycles
            else:
                close_copies(memory, keep_probe=sole is False)  # before the caller's scan
        if sole:
            self.fast += 1
            return True, None
        self.scanned += 1
        return False, copy if sole is False else None


def still_held(probe: OnceFd) -> bool:
    """Whether the kernel still counts some other open file (or mapping) of the memfd the
    probe is of; False also when it cannot say (the probe closed, leases refused)."""
    fd = probe.fd
    if fd is None:
        return False
    try:
        if not _lease(fd):
            return True
        _unlock(fd)
    except OSError:
        pass
    return False


def close_copies(memory: Materialised, *, keep_fd: bool = False, keep_probe: bool = False) -> None:
    """Close the agent's files of a memory: the tenant's reopen, the probe unless
    ``keep_probe``, and the memory's own fd unless ``keep_fd`` (a backend's release
    closes that one)."""
    if isinstance(memory, MemfdMaterialised):
        if memory.tenant is not None:
            memory.tenant.close()
        if memory.probe is not None and not keep_probe:
            memory.probe.close()
    if not keep_fd:
        with contextlib.suppress(OSError):
            os.close(memory.fd)
