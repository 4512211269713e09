"""Is the process that holds a lease still alive? pid plus start time, never pid alone.

A pid is reused by the kernel; a (pid, start time) pair is not, so a holder
that died and whose pid now belongs to someone else is seen as dead.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Holder:
    pid: int
    uid: int
    start_time: float | None  # psutil create_time(); None when it could not be read

    @classmethod
    def of(cls, pid: int, uid: int) -> Holder:
        return cls(pid=pid, uid=uid, start_time=start_time(pid))


def start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def alive(holder: Holder) -> bool:
    """True while the very process that took the lease exists (zombies count as dead)."""
    try:
        proc = psutil.Process(holder.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if holder.start_time is None:
            return True  # nothing to compare: trust the pid (rare: /proc unreadable)
        return bool(abs(proc.create_time() - holder.start_time) < 0.01)
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # cannot tell (e.g. hidepid): never orphan on a guess
