"""What this agent offers poold: discovered far memory, or an emulated device when there is none.

Only device kinds the agent has a backend for are offered: advertising memory
the agent cannot hand out would make every lease placed there fail.

The inventory is not read once: :class:`InventoryWatcher` rescans after hotplug
(udev events, debounced) or periodically where udev cannot be watched, and puts a
changed inventory on the link, whose next heartbeat carries it to poold.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.backends.devdax import carved_changes, carved_sub_devices
from agent.config import AgentConfig
from agent.discovery.annotations import AnnotationError, Annotations, from_agent_config
from agent.discovery.hotplug import EventSource, RescanScheduler, udev_source
from agent.journal import Journal, journalled_sub_devices
from agent.link import PooldLink, inventory_digest
from poold.extents import align_down
from poold.wire.agent import InventoryDevice

log = logging.getLogger("pool_agent.inventory")


def mem_total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def emulated_device(config: AgentConfig) -> InventoryDevice:
    alignment = config.emulated_alignment_bytes
    capacity = config.emulated_capacity_bytes or mem_total_bytes() // 4
    return InventoryDevice(
        uid=f"emulated:{config.host}",
        kind="emulated",
        media="emulated",
        capacity_bytes=align_down(capacity, alignment),
        alignment_bytes=alignment,
        health="ok",
        local_name="memfd",
        numa_node=None,
    )


def config_annotations(config: AgentConfig) -> Annotations | None:
    """The config's ``[annotations]``; a bad table is logged and ignored, not fatal."""
    if not config.annotations:
        return None
    try:
        return from_agent_config(config.annotations, config.host)
    except AnnotationError as exc:
        log.error("ignoring the agent config's [annotations]: %s", exc)
        return None


@dataclass
class Scan:
    """One discovery pass: what is offered to poold, and what no backend can serve yet."""

    offered: list[InventoryDevice] = field(default_factory=list)
    skipped: list[InventoryDevice] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def journal_path(config: AgentConfig) -> Path:
    """The agent's lease journal (agent/run.py opens the same file)."""
    return config.state_dir / "journal.db"


def own_sub_devices(config: AgentConfig, journal: Journal | None = None) -> set[str]:
    """Dax sub-devices this agent made for leases: its journal's and its backend's.

    Every other dax device with bytes in a region is someone else's (the kernel's dax0.0,
    an administrator's daxctl device) and goes to poold as reserved. A journalled
    sub-device whose lease is over (teardown failed, or the agent died before it) is a
    leftover for the audit (agent/leftovers.py), not a reserved range.

    ``journal`` is the running agent's own; without it the journal's files are read and
    never written (opening a second :class:`Journal` would compact the grant log under
    the running agent, whose appends would then go to the replaced file).
    Raises (sqlite3.Error) when the journal exists but cannot be read: reporting the
    agent's own leases as reserved would be worse than skipping one rescan.
    """
    own = carved_sub_devices(config.sysfs_root)
    if journal is not None:
        own.update(e.sub_device for e in journal.entries() if e.sub_device)
        own.update(s.sub_device for s in journal.sub_devices())  # leftovers included
        return own
    path = journal_path(config)
    if path.exists():  # never create it here: the agent service opens it (agent/run.py)
        own.update(journalled_sub_devices(path))
    return own


def numa_reserve_bytes(config: AgentConfig) -> int:
    """Bytes of each far node never offered (`numa_reserve_bytes`)."""
    return int(config.numa_reserve_bytes)


# Discovery runs again when the agent carved or deleted a sub-device during it; after this
# many tries the scan fails (a rescan keeps the last inventory and tries at the next one).
SCAN_ATTEMPTS = 3


class ScanRaced(RuntimeError):
    """The agent's sub-devices kept changing while discovery read sysfs."""


def scan(config: AgentConfig, kinds: set[str], journal: Journal | None = None) -> Scan:
    """Discover far memory under the sysfs root, annotated; raises if discovery breaks.

    Sysfs is read over a span of time, and the agent's own sub-devices are named after it:
    one released meanwhile (a lease's, a scrub's) shows in the reading, sized, but is no
    longer named, and would go to poold as someone else's, reserved. Every sub-device of
    this process is marked before it holds a byte and unmarked after it holds none, each
    change counted (agent/backends/devdax.py); an unchanged count across the reading means
    the names fit it, a changed one that discovery runs again.
    """
    from agent.discovery.inventory import discover, to_wire

    for _ in range(SCAN_ATTEMPTS):
        changes = carved_changes()
        inv = discover(
            config.sysfs_root,
            annotations=config_annotations(config),
            numa_reserve_bytes=numa_reserve_bytes(config),
        )
        own = own_sub_devices(config, journal)
        if carved_changes() == changes:
            break
    else:
        raise ScanRaced(
            f"sub-devices were carved or deleted during each of {SCAN_ATTEMPTS} discoveries"
        )
    found = to_wire(inv, config.host, own)
    return Scan(
        offered=[d for d in found if d.kind in kinds],
        skipped=[d for d in found if d.kind not in kinds],
        warnings=list(inv.warnings),
    )


def log_skipped(skipped: list[InventoryDevice]) -> None:
    for d in skipped:
        log.warning(
            "not offering %s device %s (%s, %d bytes): this agent has no %s backend yet",
            d.kind,
            d.uid,
            d.local_name,
            d.capacity_bytes,
            d.kind,
        )


def discovered_devices(config: AgentConfig, kinds: set[str]) -> list[InventoryDevice]:
    """Far memory found under the sysfs root, limited to kinds with a backend."""
    try:
        found = scan(config, kinds)
    except Exception:  # discovery must never keep the agent from serving
        log.exception("discovery failed; offering no far memory")
        return []
    log_skipped(found.skipped)
    return found.offered


def with_emulated(config: AgentConfig, devices: list[InventoryDevice]) -> list[InventoryDevice]:
    """Add the emulated device when forced, or (by default) when there is no far memory."""
    if config.emulated or (config.emulated is None and not devices):
        return [*devices, emulated_device(config)]
    return devices


def host_inventory(config: AgentConfig, backend_kinds: set[str]) -> list[InventoryDevice]:
    return with_emulated(config, discovered_devices(config, backend_kinds - {"emulated"}))


class StoppableSource:
    """An event source whose poll returns soon after ``stop`` is set (slices the wait)."""

    SLICE_S = 0.2

    def __init__(self, source: EventSource, stop: threading.Event) -> None:
        self.source = source
        self.stop = stop

    def poll(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            event = self.source.poll(max(0.0, min(left, self.SLICE_S)))
            if event is not None or left <= self.SLICE_S:
                return event
        return None


class InventoryWatcher:
    """Rescans the host on hotplug (or periodically) and keeps ``link.inventory`` current.

    A failed rescan keeps the last inventory: a transient sysfs error must not make
    poold mark every device missing.
    """

    def __init__(
        self,
        config: AgentConfig,
        backend_kinds: set[str],
        link: PooldLink,
        source: EventSource | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.config = config
        self.kinds = backend_kinds - {"emulated"}
        self.link = link
        self.source = source
        self.journal = journal  # the running agent's: its sub-devices, without a file read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._skipped: set[str] = set()
        self.scheduler: RescanScheduler | None = None

    def rescan(self) -> bool:
        """One discovery pass; True when the inventory changed (and is now on the link)."""
        if self._stop.is_set():
            return False
        try:
            found = scan(self.config, self.kinds, self.journal)
        except Exception:
            log.exception("rescan failed; keeping the last inventory")
            return False
        skipped = {d.uid for d in found.skipped}
        if skipped != self._skipped:  # say it once per change, not every 30 s
            log_skipped([d for d in found.skipped if d.uid not in self._skipped])
            self._skipped = skipped
        inventory = with_emulated(self.config, found.offered)
        old = self.link.inventory
        if inventory_digest(inventory) == inventory_digest(old):
            return False
        before = {d.uid for d in old}
        after = {d.uid for d in inventory}
        log.info(
            "inventory changed: %d device(s), added %s, removed %s; next heartbeat reports it",
            len(inventory),
            sorted(after - before) or "none",
            sorted(before - after) or "none",
        )
        self.link.inventory = inventory  # one reference swap: heartbeats read it lock-free
        return True

    def start(self) -> None:
        """Watch udev (when configured and available), else rescan every interval."""
        source = self.source
        if source is None and self.config.udev:
            source = udev_source()
        if source is not None:
            source = StoppableSource(source, self._stop)
        self.scheduler = RescanScheduler(
            self.rescan,
            source,
            debounce_s=self.config.rescan_debounce_s,
            fallback_interval_s=self.config.rescan_interval_s,
            sleep=self._stop.wait,  # wakes at once on stop()
        )
        mode = "periodic" if self.scheduler.periodic else "udev"
        log.info("watching for hotplug (%s, every %gs)", mode, self.config.rescan_interval_s)
        scheduler = self.scheduler

        def loop() -> None:
            try:
                scheduler.run(self._stop)
            except Exception:  # the watcher may die; the agent keeps serving
                log.exception("hotplug watcher stopped")

        self._thread = threading.Thread(target=loop, name="agent-hotplug", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)  # polls are sliced: this returns within ~0.2 s
