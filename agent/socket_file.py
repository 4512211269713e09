"""How is the agent's socket file made, and unmade, without harming anything else?

:func:`bind_listener` replaces only a stale socket nobody listens on (never a file of
another kind, never a live agent's), and sets the group and mode before ``listen()``;
:func:`unlink_listener` removes only the file it bound (a newer agent may have replaced
it since).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger("agent.server")  # it logs as the server it was split from


def bind_listener(
    path: Path, mode: int, group: str | int | None, backlog: int
) -> tuple[socket.socket, int]:
    """A listening socket at ``path`` and the inode of the file it bound."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        # Tenants must traverse it; their access is decided by the socket's own mode.
        os.chmod(path.parent, 0o755)  # noqa: S103  # world-traversable on purpose
    remove_stale_socket(path)
    gid = None if group is None else resolve_gid(group)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        # Permissions are set on purpose, before listen(): until then a connect is
        # refused, so nobody slips in under whatever the umask allowed.
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        bound_inode = os.stat(path).st_ino
        listener.listen(backlog)
    except BaseException:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return listener, bound_inode


def unlink_listener(path: Path, bound_inode: int | None) -> None:
    """Remove the socket file if it is still the one bound (inode ``bound_inode``)."""
    if bound_inode is None:
        return
    with contextlib.suppress(FileNotFoundError):
        if os.lstat(path).st_ino == bound_inode:
            os.unlink(path)


def remove_stale_socket(path: Path) -> None:
    """Unlink a socket file nobody listens on; refuse to touch anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, "exists and is not a socket; refusing to replace it", str(path)
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale agent socket %s", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
    raise OSError(errno.EADDRINUSE, "another agent is already listening", str(path))


def resolve_gid(group: str | int) -> int:
    """A group name or id as an id; LookupError for a name the system does not know."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise LookupError(f"no such group {group!r} for the agent socket") from None
