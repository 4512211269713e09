"""An agent killed in the middle of a scrub: the next start cleans the region, the scrub is redone.

poold's API and ledger, the agent's journal and link are real; the kernel is the
recorded QEMU tree with FakeDaxKernel (tests/agent/backends/test_devdax.py), plus
:class:`RangeGuard`, which refuses a mapping over a range another sub-device holds, as
the kernel does. The crash is simulated by abandoning the service, its scrub thread
stopped for good where it was, and starting a new service (new backend, new link) on
the same journal and tree, as a restarted process would.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from agent import protocol as p
from agent.backends import devdax
from agent.backends.devdax import DevdaxBackend
from agent.config import AgentConfig
from agent.inventory import own_sub_devices
from agent.journal import Journal
from agent.link import PooldLink
from agent.memory import LocalDevice
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Quarantine
from tests.agent.backends.test_devdax import BASE0, DRIVER, FakeDaxKernel
from tests.agent.test_holdings import wait_for
from tests.agent.test_service import MIB, PEER, UID, devdax_agent

__all__ = ["devdax_agent"]  # the fixture

Agent = tuple[AgentService, FakeDaxKernel, Path]


class RangeGuard:
    """FakeDaxKernel, refusing a ``mapping`` that overlaps another sub-device's range:
    drivers/dax/bus.c alloc_dev_dax_range() fails with ENOMEM when __request_region()
    finds the range taken. Ranges are known from the mappings written through it."""

    def __init__(self, kernel: FakeDaxKernel) -> None:
        self.kernel = kernel
        self.ranges: dict[str, tuple[int, int]] = {}

    def __call__(self, path: Path, value: str) -> None:
        device = path.parent.name
        if path.name == "mapping":
            start, end = (int(x, 16) for x in value.split("-"))
            for other, (s, e) in self.ranges.items():
                if other != device and start <= e and s <= end:
                    raise OSError(errno.ENOMEM, f"{value} overlaps {other}")
            self.kernel(path, value)
            self.ranges[device] = (start, end)
            return
        self.kernel(path, value)
        if path.name == "size" and value == "0":
            self.ranges.pop(device, None)


def with_bytes(backend: DevdaxBackend) -> dict[str, int]:
    return {name: size for name, size in backend.sub_devices(0).items() if size}


BEFORE = {"dax0.0": 128 * MIB, "dax0.1": 64 * MIB}  # the recorded machine's own devices


@pytest.fixture
def guarded(devdax_agent: Agent, tmp_path: Path) -> tuple[AgentService, RangeGuard]:
    """The devdax agent with a journal, on a kernel that refuses overlapping mappings."""
    service, kernel, _dev = devdax_agent
    backend = service.backends["devdax"]
    assert isinstance(backend, DevdaxBackend)
    guard = RangeGuard(kernel)
    backend.apply = guard
    service.journal = Journal(tmp_path / "state" / "journal.db")
    service.leftovers.settle_s = 0  # an untied sub-device would be reported at first sight
    return service, guard


def restarted(old: AgentService, guard: RangeGuard, dev: Path) -> AgentService:
    """A new agent process on the same tree and journal: new backend, new link, no marks."""
    old_backend = old.backends["devdax"]
    assert isinstance(old_backend, DevdaxBackend) and old.journal is not None
    backend = DevdaxBackend(old_backend.sysfs_root, dev, apply=guard, require_char_device=False)
    link = PooldLink(old.link.client, "test")
    link.inventory = old.link.inventory
    agent = AgentService("h1", link, {"devdax": backend})
    agent.set_local_devices({UID: LocalDevice("devdax", dax_region_id=0)})
    agent.journal = Journal(old.journal.path)
    agent.leftovers.settle_s = 0
    return agent


def hold_scrub_at(
    backend: DevdaxBackend, monkeypatch: pytest.MonkeyPatch, bytes_done: int
) -> tuple[threading.Event, threading.Event]:
    """Stop the backend's next scrub once it has zeroed ``bytes_done``: (reached, resume)."""
    reached, resume = threading.Event(), threading.Event()
    real = backend.scrub

    def scrub(*args: Any, progress: Callable[[int], None] | None = None, **kw: Any) -> bool:
        def step(done: int) -> None:
            if progress is not None:
                progress(done)
            if done == bytes_done:
                reached.set()
                resume.wait(30)

        return real(*args, progress=step, **kw)

    monkeypatch.setattr(backend, "scrub", scrub)
    return reached, resume


def bury(old: AgentService, resume: threading.Event, tmp_path: Path) -> None:
    """Let the abandoned scrub thread end without touching the tree or poold: the process
    it stands for is dead. Its backend looks at an empty tree; its link is never flushed."""
    backend = old.backends["devdax"]
    assert isinstance(backend, DevdaxBackend)
    dead = tmp_path / "dead-process-sysfs"
    dead.mkdir(exist_ok=True)
    backend.sysfs_root = dead
    resume.set()
    for thread in threading.enumerate():
        if thread.name.startswith("scrub-"):
            thread.join(10)


def events_of(ledger: Ledger, lease_id: str) -> list[str]:
    with ledger.read() as s:
        return list(
            s.scalars(select(Event.kind).where(Event.lease_id == lease_id).order_by(Event.id))
        )


def quarantined(ledger: Ledger) -> list[tuple[int, int]]:
    with ledger.read() as s:
        rows = s.execute(select(Quarantine.offset_bytes, Quarantine.length_bytes))
        return [(offset, length) for offset, length in rows]


def test_a_scrub_killed_after_sizing_is_destroyed_at_start_and_redone(
    devdax_agent: Agent,
    guarded: tuple[AgentService, RangeGuard],
    admin: PooldClient,
    ledger: Ledger,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, guard = guarded
    _service, kernel, dev = devdax_agent
    backend = service.backends["devdax"]
    assert isinstance(backend, DevdaxBackend) and service.journal is not None
    result, _fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))  # release closes _fd
    lease_id = result.lease_id
    assert result.offset_bytes == 192 * MIB

    # The scrub stops halfway: its sub-device sized, bound, mapped, 2 of 4 MiB zeroed.
    reached, resume = hold_scrub_at(backend, monkeypatch, 2 * MIB)
    assert service.release(PEER, p.ReleaseArgs(lease_id=lease_id)).state == "scrubbing"
    try:
        assert reached.wait(10)
        service.link.flush()  # release_dirty reached poold: the ledger says scrubbing
        assert admin.show_lease(lease_id).state == "scrubbing"
        held, leftovers = service.holdings()
        [entry] = held
        assert (entry.lease_id, entry.state) == (lease_id, "scrubbing")
        assert entry.scrub is not None and entry.scrub.bytes_done == 2 * MIB
        assert leftovers == []  # the running scrub's sub-device is tied to it
        # Journalled with the lease it scrubs: a crash from here on leaves no stranger.
        [record] = service.journal.sub_devices()
        assert (record.region_id, record.sub_device, record.lease_id, record.length_bytes) == (
            0,
            "dax0.2",
            lease_id,
            4 * MIB,
        )
        assert with_bytes(backend) == {**BEFORE, "dax0.2": 4 * MIB}

        # kill -9. A new process has no marks of the old one's carves: its journal is
        # what keeps dax0.2 from being reported to poold as someone else's (reserved).
        monkeypatch.setattr(devdax, "_carved", {})
        config = AgentConfig(sysfs_root=backend.sysfs_root, state_dir=tmp_path / "state")
        assert "dax0.2" in own_sub_devices(config)
        agent = restarted(service, guard, dev)
        fresh = agent.backends["devdax"]
        assert isinstance(fresh, DevdaxBackend)
        # Left in place, the sub-device keeps the range: the scrub order would fail.
        assert fresh.scrub(0, 192 * MIB, 4 * MIB) is False
        try:
            assert agent.adopt() == (0, 0)
            # The start destroyed it the way a revoke does, and dropped its record.
            assert with_bytes(fresh) == BEFORE
            assert kernel.writes[-4:] == [
                (f"{DRIVER}/unbind", "dax0.2"),
                (f"{DRIVER}/remove_id", "dax0.2"),
                ("dax0.2/size", "0"),
                ("dax_region/delete", "dax0.2"),
            ]
            assert agent.journal is not None and agent.journal.sub_devices() == []
            assert agent.reconcile() == 0  # a scrubbing lease is poold's to re-order

            # poold's scrub order comes again with the heartbeat reply: redone from scratch.
            agent.link.heartbeat()

            def reclaimed() -> bool:
                agent.link.flush()
                return admin.show_lease(lease_id).state == "reclaimed"

            wait_for(reclaimed)
            assert "lease.scrubbed" in events_of(ledger, lease_id)
            assert "lease.scrub_failed" not in events_of(ledger, lease_id)
            assert quarantined(ledger) == [(0, 192 * MIB)]  # the fixture's, nothing more
            assert with_bytes(fresh) == BEFORE
            assert agent.journal.sub_devices() == []
            assert agent.holdings() == ([], [])
        finally:
            agent.close()
    finally:
        bury(service, resume, tmp_path)


def test_the_start_destroys_sub_devices_of_leases_it_does_not_hold(
    devdax_agent: Agent,
    guarded: tuple[AgentService, RangeGuard],
    tmp_path: Path,
) -> None:
    service, guard = guarded
    _service, kernel, dev = devdax_agent
    backend = service.backends["devdax"]
    assert isinstance(backend, DevdaxBackend) and service.journal is not None
    kept, kept_fd = service.lease(PEER, p.LeaseArgs(size_bytes=2 * MIB))
    ended, ended_fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    assert with_bytes(backend) == {**BEFORE, "dax0.2": 2 * MIB, "dax0.3": 4 * MIB}
    # Killed in the middle of a release: the lease left the journal, its teardown never ran.
    service.journal.remove(ended.lease_id)
    os.close(kept_fd)
    os.close(ended_fd)

    agent = restarted(service, guard, dev)
    try:
        assert agent.adopt() == (1, 0)  # its holder (this process) lives
        assert with_bytes(backend) == {**BEFORE, "dax0.2": 2 * MIB}
        assert ("dax_region/delete", "dax0.3") in kernel.writes
        assert agent.journal is not None
        assert [(r.sub_device, r.lease_id) for r in agent.journal.sub_devices()] == [
            ("dax0.2", kept.lease_id)
        ]
        # The ledger still has the ended lease active: reconcile orphans it, and poold's
        # reclaim goes through a scrub like any other.
        assert agent.reconcile() == 1
        assert agent.holdings()[1] == []
    finally:
        agent.close()


def test_a_re_adopted_lease_released_by_its_holder_is_scrubbed(
    devdax_agent: Agent,
    guarded: tuple[AgentService, RangeGuard],
    admin: PooldClient,
    ledger: Ledger,
) -> None:
    service, guard = guarded
    _service, kernel, dev = devdax_agent
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    os.close(fd)  # the old process's copy; the holder keeps its mapping across the restart
    agent = restarted(service, guard, dev)
    try:
        assert agent.adopt() == (1, 0)
        kernel.writes.clear()
        # The agent has no memory object for it, only the journalled sub-device; the
        # tenant's bytes are in the range all the same: never "released" unzeroed.
        released = agent.release(PEER, p.ReleaseArgs(lease_id=result.lease_id))
        assert released.state == "scrubbing"

        def reclaimed() -> bool:
            agent.link.flush()
            return admin.show_lease(result.lease_id).state == "reclaimed"

        wait_for(reclaimed)
        assert events_of(ledger, result.lease_id)[-2:] == ["lease.release_dirty", "lease.scrubbed"]
        start = BASE0 + 192 * MIB
        assert ("dax0.2/mapping", f"{start:#x}-{start + 4 * MIB - 1:#x}") in kernel.writes
    finally:
        agent.close()
