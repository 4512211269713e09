"""When, and how, does a tenant client renew the leases it holds?

:class:`Renewer`: one daemon thread per client renewing every lease it tracks at about
a third of its ttl (two more tries before it can expire), sooner after a failed try; a
renewal that finds the lease over marks it lost.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Final

from poold.errors import LeaseNotActive, UnknownLease

if TYPE_CHECKING:
    from agent.lease import Lease

log = logging.getLogger("agent.client")  # it logs as the client it was split from

# Renew at a third of the ttl: two more tries before the lease can expire.
_RENEW_FRACTION: Final = 1 / 3
_MIN_RENEW_RETRY_S: Final = 0.1


class Renewer:
    """One daemon thread per client renewing every lease it tracks at ~ttl/3."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._due_at: dict[str, float] = {}  # lease_id -> time.monotonic() of next renewal
        self._thread: threading.Thread | None = None
        self._stopped = False

    def track(self, lease: Lease) -> None:
        with self._cond:
            if self._stopped:
                return
            self._leases[lease.lease_id] = lease
            self._due_at[lease.lease_id] = time.monotonic() + lease.ttl_s * _RENEW_FRACTION
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="poold-lease-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def forget(self, lease_id: str) -> None:
        with self._cond:
            self._leases.pop(lease_id, None)
            self._due_at.pop(lease_id, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                due: list[Lease] = []
                while not self._stopped:
                    now = time.monotonic()
                    due = [self._leases[i] for i, at in self._due_at.items() if at <= now]
                    if due:
                        break
                    next_at = min(self._due_at.values(), default=math.inf)
                    self._cond.wait(None if next_at == math.inf else next_at - now)
                if self._stopped:
                    return
                for lease in due:  # in flight: not due again until rescheduled
                    del self._due_at[lease.lease_id]
            for lease in due:
                self._renew(lease)

    def _renew(self, lease: Lease) -> None:
        interval_s = lease.ttl_s * _RENEW_FRACTION
        try:
            lease.renew()
        except (LeaseNotActive, UnknownLease) as err:
            self.forget(lease.lease_id)
            lease._mark_lost(err)
            return
        except Exception as err:
            # Agent restarting, poold unreachable...: try again well before expiry.
            log.warning("renewing lease %s failed, retrying: %s", lease.lease_id, err)
            interval_s = max(_MIN_RENEW_RETRY_S, interval_s / 3)
        with self._cond:
            if lease.lease_id in self._leases and not self._stopped:
                self._due_at[lease.lease_id] = time.monotonic() + interval_s
                self._cond.notify()
