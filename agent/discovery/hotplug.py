"""When must the agent look at the hardware again?

A udev monitor on the cxl, dax, memory and node subsystems turns hot-add/remove (a region
created, a dax device reconfigured, memory blocks onlined) into a rescan. One user action
makes dozens of uevents (``daxctl reconfigure-device`` onlines every memory block), so
rescans are debounced: the rescan runs once the events have been quiet for
``debounce_s``, and at the latest ``max_delay_s`` after the first one. Where udev can't be
monitored (a container without the netlink socket), rescans fall back to a fixed period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

SUBSYSTEMS = ("cxl", "dax", "memory", "node")

log = logging.getLogger(__name__)


class EventSource(Protocol):
    """Something that blocks up to ``timeout_s`` for the next device event."""

    def poll(self, timeout_s: float) -> str | None:
        """A short description of the event ("add dax dax0.1"), or None on timeout."""
        ...


class UdevEventSource:
    """pyudev's netlink monitor, filtered to the subsystems discovery reads."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor

    def poll(self, timeout_s: float) -> str | None:
        """Next uevent, or None on timeout."""
        device = self._monitor.poll(timeout=timeout_s)
        if device is None:
            return None
        return f"{device.action} {device.subsystem} {device.sys_name}"


def udev_source() -> UdevEventSource | None:
    """A started udev monitor, or None when this host can't give us one."""
    try:
        # Imported here: pyudev loads libudev lazily and containers may lack it.
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        for subsystem in SUBSYSTEMS:
            monitor.filter_by(subsystem)
        monitor.start()
    except (ImportError, OSError) as exc:  # no libudev, EPERM/EACCES on the netlink socket
        log.info("udev monitoring unavailable (%s); rescanning periodically", exc)
        return None
    return UdevEventSource(monitor)


class RescanScheduler:
    """Calls ``rescan`` after device events settle, and every ``fallback_interval_s``
    without one (with or without udev: a numa device's capacity is what its node can give
    now, which moves without any uevent).

    Time comes from ``clock`` so tests drive it; :meth:`step` does one wait-and-decide
    round and :meth:`run` loops it until stopped.
    """

    def __init__(
        self,
        rescan: Callable[[], object],
        source: EventSource | None,
        *,
        debounce_s: float = 0.5,
        max_delay_s: float = 5.0,
        fallback_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.rescan = rescan
        self.source = source
        self.debounce_s = debounce_s
        self.max_delay_s = max_delay_s
        self.fallback_interval_s = fallback_interval_s
        self.clock = clock
        self.sleep = sleep
        self.first_event_at: float | None = None
        self.last_event_at: float | None = None
        self.last_rescan_at = clock()
        self.rescans = 0
        self.events = 0

    @property
    def periodic(self) -> bool:
        """True when falling back to periodic rescans."""
        return self.source is None

    def _due_at(self) -> float | None:
        if self.first_event_at is None or self.last_event_at is None:
            return None
        return min(self.last_event_at + self.debounce_s, self.first_event_at + self.max_delay_s)

    def _fire(self) -> None:
        self.first_event_at = self.last_event_at = None
        self.last_rescan_at = self.clock()
        self.rescans += 1
        try:
            self.rescan()
        except Exception:  # a failed rescan must not stop watching; the next one retries
            log.exception("rescan failed")

    def step(self) -> None:
        """Wait for one event or deadline, then rescan if one is due."""
        now = self.clock()
        if self.source is None:
            due = self.last_rescan_at + self.fallback_interval_s
            if now < due:
                self.sleep(due - now)
            self._fire()
            return
        due_at = self._due_at()
        timeout = self.fallback_interval_s if due_at is None else max(0.0, due_at - now)
        event = self.source.poll(timeout)
        now = self.clock()
        if event is not None:
            self.events += 1
            log.debug("uevent: %s", event)
            if self.first_event_at is None:
                self.first_event_at = now
            self.last_event_at = now
        due_at = self._due_at()
        if due_at is not None and now >= due_at:
            self._fire()
        elif due_at is None and now >= self.last_rescan_at + self.fallback_interval_s:
            self._fire()  # quiet for an interval: rescan anyway (class docstring)

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set (checked between events)."""
        while not stop.is_set():
            self.step()
