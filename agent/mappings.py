"""Which processes still map or hold a memfd? One pass over ``/proc`` for every watched inode.

A memfd cannot be taken back from a process that maps it (DESIGN.md "Memory follows the
pages"), and its fd can be passed to any process (SCM_RIGHTS), so the holder's pid says
nothing about where the pages are. What does is the memfd's inode: the agent records
(st_dev, st_ino) when it makes the memfd (:meth:`Inode.of_fd`), and :func:`scan` looks for
it in every process's mappings (``/proc/<pid>/maps``: the dev ``major:minor`` and inode
columns) and open files (``/proc/<pid>/fd/*``, ``os.stat`` through the magic link). The
pages are free only once no process has either.

Privilege: reading another user's ``maps`` and ``fd`` needs ptrace read access to it
(root, or CAP_SYS_PTRACE plus CAP_DAC_READ_SEARCH). The agent runs as root; a process it
cannot read is counted in :attr:`Scan.unreadable`, never guessed at.

Races are the normal case: a process may exit between the directory listing and the
read (its entries vanish: it maps nothing), and an fd may close mid-listing. Both are
skipped. The root is injected (STYLE.md pattern 6), so tests run the same scan over a
fixture tree whose ``fd`` entries are symlinks to ordinary files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pool_agent")

PROC = Path("/proc")


@dataclass(frozen=True, order=True)
class Inode:
    """A file's identity as ``stat`` gives it: (st_dev, st_ino), the same in every process."""

    dev: int
    ino: int

    @classmethod
    def of_fd(cls, fd: int) -> Inode:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino)

    @classmethod
    def of_path(cls, path: str | os.PathLike[str]) -> Inode:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino)

    def maps_dev(self) -> bytes:
        """The dev column of ``/proc/<pid>/maps`` for this inode (the kernel's ``%02x:%02x``)."""
        return f"{os.major(self.dev):02x}:{os.minor(self.dev):02x}".encode()


@dataclass
class Scan:
    """What one pass found: per watched inode the pids that map or hold it (an inode
    absent from ``pids`` is free), and how many processes could not be read."""

    pids: dict[Inode, set[int]] = field(default_factory=dict)
    processes: int = 0
    unreadable: int = 0

    def mapped(self, inode: Inode) -> bool:
        return bool(self.pids.get(inode))


def scan(
    watched: Collection[Inode],
    *,
    proc_root: str | os.PathLike[str] = PROC,
    ignore: Iterable[tuple[int, int]] = (),
) -> Scan:
    """Every process that maps or holds one of ``watched``, in one pass over ``proc_root``.

    ``ignore``: (pid, fd) pairs that do not count, for fds the caller is about to close
    (the agent's own copy of a memfd it is releasing); the same pid's other fds and
    mappings still do.
    """
    out = Scan()
    wanted = set(watched)
    if not wanted:
        return out
    skip = set(ignore)
    by_stat = {(i.dev, i.ino): i for i in wanted}
    # maps lines are matched on the inode token first, then on the dev column.
    by_token = {str(i.ino).encode(): i for i in wanted}
    root = Path(proc_root)
    try:
        entries = os.listdir(root)
    except OSError as err:
        log.warning("cannot list %s: %s", root, err.strerror)
        out.unreadable += 1
        return out
    for name in entries:
        if not name.isdigit():
            continue
        pid = int(name)
        out.processes += 1
        denied = _scan_fds(root / name, pid, by_stat, skip, out)
        denied |= _scan_maps(root / name / "maps", pid, by_token, out)
        if denied:
            out.unreadable += 1
    return out


def _found(out: Scan, inode: Inode, pid: int) -> None:
    out.pids.setdefault(inode, set()).add(pid)


def _scan_fds(
    proc: Path,
    pid: int,
    by_stat: dict[tuple[int, int], Inode],
    skip: set[tuple[int, int]],
    out: Scan,
) -> bool:
    """Add ``pid`` for each watched inode among its open files; True when access was denied."""
    fd_dir = proc / "fd"
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        return True
    except OSError:  # gone (ENOENT, ESRCH), or a kernel thread's odd entry
        return False
    for fd in fds:
        if skip and fd.isdigit() and (pid, int(fd)) in skip:
            continue
        try:
            st = os.stat(fd_dir / fd)
        except PermissionError:
            return True
        except OSError:  # closed meanwhile, or the process exited
            continue
        inode = by_stat.get((st.st_dev, st.st_ino))
        if inode is not None:
            _found(out, inode, pid)
    return False


def _scan_maps(maps: Path, pid: int, by_token: dict[bytes, Inode], out: Scan) -> bool:
    """Add ``pid`` for each watched inode it maps; True when access was denied."""
    try:
        with open(maps, "rb") as f:
            data = f.read()
    except PermissionError:
        return True
    except OSError:
        return False
    # Most processes map none of the watched inodes: look for the tokens before parsing.
    present = [token for token in by_token if b" " + token + b" " in data]
    if not present:
        return False
    for line in data.splitlines():
        # address perms offset dev inode [path]
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        inode = by_token.get(parts[4])
        if inode is not None and parts[3] == inode.maps_dev():
            _found(out, inode, pid)
    return False
