"""How does a KV store's accounting reach the agent, without a report per put?

A :class:`Reporter` sends a store's exclusive/replica counts through ``report`` (the
lease's :meth:`agent.client.Lease.report`), batched: at most once per interval, only
when they changed, on a thread of its own that only reads the counters (DESIGN.md
"Exclusive-copy accounting"). It never raises into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

# The store's logger, not this module's: engines (and tests) that tune "agent.kv" hear
# from the store's reporter as they did when both lived in that module.
log = logging.getLogger("agent.kv")


class ReportedStore(Protocol):
    """What the reporter reads of a store (agent/kv.py's KVStore): its counters."""

    @property
    def lease_id(self) -> str: ...

    @property
    def version(self) -> int:
        """Bumped by every accounting change: the reporter's "dirty" bit."""
        ...

    @property
    def exclusive_bytes(self) -> int: ...

    @property
    def replica_bytes(self) -> int: ...

    @property
    def exclusive_blocks(self) -> int: ...

    @property
    def replica_blocks(self) -> int: ...


class ReportFn(Protocol):
    """The shape of :meth:`agent.client.Lease.report`."""

    def __call__(
        self,
        *,
        used_bytes: int,
        exclusive_bytes: int,
        replica_bytes: int,
        exclusive_blocks: int = 0,
        replica_blocks: int = 0,
    ) -> bool: ...


class Reporter:
    """Sends a store's accounting through ``report`` (e.g. ``lease.report``), batched.

    At most once per ``min_interval_s`` (on ``clock``), and only when the accounting
    changed since the last report sent. Never raises: a failed send (agent restarting,
    socket gone) is logged once per outage and retried at the next interval; a report
    the agent refuses (lease no longer ours) is logged and not repeated for that state.
    :meth:`poll` does one check; :meth:`start` runs it on a daemon thread;
    :meth:`flush` sends now, interval or not.
    """

    def __init__(
        self,
        store: ReportedStore,
        report: ReportFn,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.report = report
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.sent = 0
        self.failures = 0
        self._sent_version = -1
        self._last_attempt_at: float | None = None
        self._failing = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Send if the accounting changed and the interval passed; True when a report went out."""
        with self._lock:
            if self.store.version == self._sent_version:
                return False
            now = self.clock()
            last = self._last_attempt_at
            if last is not None and now - last < self.min_interval_s:
                return False
            return self._send(now)

    def flush(self) -> bool:
        """Send now if the accounting changed, ignoring the interval; True when one went out."""
        with self._lock:
            if self.store.version == self._sent_version:
                return False
            return self._send(self.clock())

    def _send(self, now: float) -> bool:
        store = self.store
        # Read the version first: a change racing with the reads below bumps it again,
        # so the next poll sends the newer state. Every snapshot is valid on its own
        # (used is exclusive + replica by construction).
        version = store.version
        exclusive_bytes, replica_bytes = store.exclusive_bytes, store.replica_bytes
        self._last_attempt_at = now
        try:
            accepted = self.report(
                used_bytes=exclusive_bytes + replica_bytes,
                exclusive_bytes=exclusive_bytes,
                replica_bytes=replica_bytes,
                exclusive_blocks=store.exclusive_blocks,
                replica_blocks=store.replica_blocks,
            )
        except Exception as err:
            self.failures += 1
            if not self._failing:
                log.warning("kv report for lease %s failed, will retry: %s", store.lease_id, err)
            else:
                log.debug("kv report for lease %s failed again: %s", store.lease_id, err)
            self._failing = True
            return False
        if self._failing:
            log.info("kv report for lease %s sent again", store.lease_id)
            self._failing = False
        if not accepted:
            log.warning("the agent did not accept the kv report for lease %s", store.lease_id)
        self._sent_version = version
        self.sent += 1
        return True

    def start(self) -> None:
        """Poll on a daemon thread every ``min_interval_s`` until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-report-{self.store.lease_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.min_interval_s):
            self.poll()

    def stop(self, flush: bool = True) -> None:
        """Stop the thread (if started) and send the last change unless ``flush=False``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if flush:
            self.flush()
