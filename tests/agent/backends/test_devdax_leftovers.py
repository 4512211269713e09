"""agent.leftovers against a copy of a recorded machine: a sub-device left behind is reported.

Same setup as the devdax backend tests (tests/agent/backends/test_devdax.py): the
recorded QEMU tree, with FakeDaxKernel playing the kernel's side of each write. The
journal is a real SQLite file; the clock of the sweep is the only thing moved by hand.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agent.journal import Entry, Journal
from agent.leftovers import LeftoverSweep
from poold.errors import BackendFailed
from poold.wire.agent import LeftoverSubDevice
from tests.agent.backends.test_devdax import (
    DRIVER,
    MIB,
    Setup,
    fresh_machine,
    partitioned,
)

__all__ = ["fresh_machine", "partitioned"]  # fixtures


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def journal_lease(journal: Journal, lease_id: str, device: str, length: int) -> None:
    """What AgentService._journal writes when a devdax lease's fd leaves the agent."""
    journal.add(
        Entry(
            lease_id=lease_id,
            device_uid="cxl:test-region0",
            backend="devdax",
            offset_bytes=192 * MIB,
            length_bytes=length,
            epoch=1,
            holder_pid=os.getpid(),
            holder_uid=os.getuid(),
            holder_start=None,
            ttl_s=60,
            sub_device=device,
            region_id=0,
            lease_json="{}",
        )
    )


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "state" / "journal.db")


def test_a_sub_device_whose_teardown_failed_is_reported_then_deleted(
    partitioned: Setup, journal: Journal
) -> None:
    backend, kernel, root = partitioned
    clock = Clock()
    sweep = LeftoverSweep(backend, settle_s=10, clock=clock)
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-a")
    assert m.device == "dax0.2"
    journal_lease(journal, "lease-a", m.device, 4 * MIB)
    tied = {(0, "dax0.2"): ("lease-a", 4 * MIB)}
    # Held: never a leftover, and no sysfs read is needed to say so.
    assert sweep.sweep(journal, tied) == []

    # The lease ends, but the kernel refuses the unbind: the sub-device stays.
    journal.remove("lease-a")
    kernel.refuse[f"{DRIVER}/unbind"] = errno.EBUSY
    with pytest.raises(BackendFailed):
        backend.release(m)
    assert (root / "bus/dax/devices/dax0.2").exists()
    assert sweep.sweep(journal, {}) == []  # seen, but a teardown may still be running
    clock.now += 11
    leftover = LeftoverSubDevice(
        sub_device="dax0.2", region_id=0, size_bytes=4 * MIB, lease_id="lease-a"
    )
    assert sweep.sweep(journal, {}) == [leftover]
    # The journal keeps it across an agent restart.
    journal.close()
    journal = Journal(journal.path)
    restarted = LeftoverSweep(backend, settle_s=0)
    assert restarted.sweep(journal, {}) == [leftover]

    # poold revokes the ended lease's id: the leftover goes, the way a revoke does it.
    assert restarted.delete(journal, ["lease-a"], {}) == []  # still refused: kept, logged
    assert restarted.sweep(journal, {}) == [leftover]
    del kernel.refuse[f"{DRIVER}/unbind"]
    assert restarted.delete(journal, ["other-lease"], {}) == []
    assert restarted.delete(journal, ["lease-a"], {}) == ["dax0.2"]
    assert not (root / "bus/dax/devices/dax0.2").exists()
    assert restarted.sweep(journal, {}) == [] and journal.sub_devices() == []


def test_a_torn_down_sub_device_is_forgotten_and_a_reused_name_is_not_touched(
    partitioned: Setup, journal: Journal
) -> None:
    backend, _kernel, root = partitioned
    sweep = LeftoverSweep(backend, settle_s=0)
    first = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-a")
    journal_lease(journal, "lease-a", first.device, 4 * MIB)
    journal.remove("lease-a")
    backend.release(first)  # a normal teardown
    assert sweep.sweep(journal, {}) == [] and journal.sub_devices() == []

    # The kernel reuses the name for the next lease: the old record never claims it.
    journal_lease(journal, "lease-a", "dax0.2", 4 * MIB)  # a stale record, as after a crash
    second = backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-b")
    assert second.device == "dax0.2"
    assert sweep.sweep(journal, {}) == []  # another size: not lease-a's device
    assert sweep.delete(journal, ["lease-a"], {}) == []
    assert (root / "bus/dax/devices/dax0.2").exists()
    tied = {(0, "dax0.2"): ("lease-b", 2 * MIB)}
    assert sweep.sweep(journal, tied) == []
    assert [(s.sub_device, s.lease_id) for s in journal.sub_devices()] == [("dax0.2", "lease-b")]
    assert sweep.delete(journal, ["lease-b"], tied) == []  # held: never deleted
    assert (root / "bus/dax/devices/dax0.2").exists()
    backend.release(second)


def test_without_a_journal_the_sweep_remembers_held_sub_devices(partitioned: Setup) -> None:
    backend, kernel, _root = partitioned
    sweep = LeftoverSweep(backend, settle_s=0)
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-a")
    assert sweep.sweep(None, {(0, m.device): ("lease-a", 4 * MIB)}) == []
    kernel.refuse[f"{DRIVER}/unbind"] = errno.EBUSY
    with pytest.raises(BackendFailed):
        backend.release(m)
    [leftover] = sweep.sweep(None, {})
    assert (leftover.sub_device, leftover.lease_id) == ("dax0.2", "lease-a")
    assert LeftoverSweep(None).sweep(None, {}) == []  # no devdax backend: no sub-devices
