"""Who is on the other end of an agent connection?

The kernel says, not the request: ``SO_PEERCRED`` for pid/uid/gid and
``SO_PEERGROUPS`` for supplementary groups, both captured at ``connect()``
(:func:`read_peer`). :class:`Peer` is what every handler method receives.
"""

from __future__ import annotations

import array
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Final

# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED = struct.Struct("iII")
# SO_PEERGROUPS (Linux 4.13) is not exported by Python 3.11's socket module; the value
# is the same on every architecture's asm-generic socket.h.
_SO_PEERGROUPS: Final[int] = getattr(socket, "SO_PEERGROUPS", 59)
# CPython caps getsockopt buffers at 1024 bytes: 256 groups; more falls back to /proc.
_PEERGROUPS_BUFLEN: Final = 1024


@dataclass(frozen=True, slots=True)
class Peer:
    """A connected tenant process as the kernel identified it when it connected."""

    connection_id: int
    pid: int
    uid: int
    gid: int
    gids: tuple[int, ...] = ()  # supplementary groups; empty when the kernel would not say
    connected_at: float = field(default_factory=time.time)

    @property
    def all_gids(self) -> tuple[int, ...]:
        """Primary group first, then supplementary ones, without repeats."""
        return tuple(dict.fromkeys((self.gid, *self.gids)))


def read_peer(sock: socket.socket, connection_id: int) -> Peer:
    """The peer's pid/uid/gid (SO_PEERCRED) and supplementary groups, as of connect()."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Peer(
        connection_id=connection_id, pid=pid, uid=uid, gid=gid, gids=_peer_groups(sock, pid)
    )


def _peer_groups(sock: socket.socket, pid: int) -> tuple[int, ...]:
    # SO_PEERGROUPS is captured at connect() like SO_PEERCRED, so it cannot race with
    # the pid exiting and being reused; /proc is the fallback for older kernels and for
    # peers with more than 256 groups.
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _PEERGROUPS_BUFLEN)
    except OSError:
        return _proc_groups(pid)
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % groups.itemsize])
    return tuple(groups)


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return tuple(int(gid) for gid in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()
