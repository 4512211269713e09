"""How a daemon tells systemd it is ready and alive: sd_notify(3) over ``$NOTIFY_SOCKET``.

A few lines instead of a dependency: one datagram per message to the AF_UNIX socket
named by ``NOTIFY_SOCKET`` (a leading ``@`` is the abstract namespace). Unset, every
call does nothing, so the daemons run the same outside systemd. ``READY=1`` goes out
once the daemon serves (poold: its HTTP socket is bound; the agent: its tenant socket
is), ``WATCHDOG=1`` from the loop that serves, every half ``WATCHDOG_USEC``, so a wedged
loop is restarted by ``WatchdogSec=`` rather than left running.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Final

log = logging.getLogger("poold.notify")

READY: Final = "READY=1"
WATCHDOG: Final = "WATCHDOG=1"
STOPPING: Final = "STOPPING=1"


def _address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock and other forms: not ours to speak


def notify(*messages: str) -> bool:
    """Send ``messages`` (``READY=1``, ``STATUS=…``) as one datagram; False outside systemd."""
    target = os.environ.get("NOTIFY_SOCKET", "")
    address = _address(target) if target else None
    if address is None:
        return False
    payload = "\n".join(messages).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(payload, address)
    except OSError as err:
        # systemd gone or the socket wrong: a daemon keeps serving, it says so once per call.
        log.warning("sd_notify to %s failed: %s", target, err)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``; None when not asked."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (we are a child of the one watched)
    return int(usec) / 2 / 1_000_000


class Watchdog:
    """Call :meth:`tick` from the serving loop as often as you like; it pings on schedule."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = watchdog_interval_s() if interval_s is None else interval_s
        self._next_at = 0.0

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def tick(self) -> None:
        if self.interval_s is None:
            return
        now = time.monotonic()
        if now >= self._next_at:
            self._next_at = now + self.interval_s
            notify(WATCHDOG)
