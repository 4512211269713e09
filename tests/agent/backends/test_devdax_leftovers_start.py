"""agent.leftovers: records written before their sub-device is sized, and the clean start.

Same setup as test_devdax_leftovers.py (recorded QEMU tree, FakeDaxKernel, a real journal).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.backends.sysfs_write import guarded_path
from agent.journal import Journal, SubDevice
from agent.leftovers import LeftoverSweep
from tests.agent.backends.test_devdax import (
    MIB,
    REGION0,
    Setup,
    fresh_machine,
    partitioned,
)

__all__ = ["fresh_machine", "partitioned"]  # fixtures


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "state" / "journal.db")


def test_an_empty_sub_device_with_a_young_record_is_being_carved(
    partitioned: Setup, journal: Journal
) -> None:
    backend, kernel, _root = partitioned
    kernel(guarded_path(kernel.root, f"{REGION0}/dax_region/create"), "1")  # seed dax0.2
    sweep = LeftoverSweep(backend, settle_s=10)
    # A scrub (or lease) named the seed and will size it next: its record stays.
    carving = SubDevice(0, "dax0.2", "lease-s", 2 * MIB, time.time())
    sweep.record(journal, carving)
    assert sweep.sweep(journal, {}) == [] and journal.sub_devices() == [carving]
    assert sweep.delete(journal, ["lease-s"], {}) == [] and journal.sub_devices() == [carving]
    # Once the record is older than settle_s, an empty sub-device is a finished teardown.
    old = SubDevice(0, "dax0.2", "lease-s", 2 * MIB, time.time() - 11)
    sweep.record(journal, old)
    assert sweep.sweep(journal, {}) == [] and journal.sub_devices() == []


def test_the_clean_start_destroys_every_untied_sub_device(
    partitioned: Setup, journal: Journal
) -> None:
    backend, kernel, root = partitioned
    held = backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-held")
    left = backend.materialise_at(0, 194 * MIB, 4 * MIB, "poold-scrub")
    assert (held.device, left.device) == ("dax0.2", "dax0.3")
    now = time.time()
    sweep = LeftoverSweep(backend)  # the default settle_s: 10 s
    sweep.record(journal, SubDevice(0, "dax0.2", "lease-held", 2 * MIB, now))
    sweep.record(journal, SubDevice(0, "dax0.3", "lease-scrubbed", 4 * MIB, now))
    # A record whose carve never sized its sub-device (the seed, still empty): at start
    # nothing is being carved, so it goes at once however young it is.
    kernel(guarded_path(kernel.root, f"{REGION0}/dax_region/create"), "1")  # seed dax0.4
    sweep.record(journal, SubDevice(0, "dax0.4", "lease-other", 2 * MIB, now))
    tied = {(0, "dax0.2"): ("lease-held", 2 * MIB)}

    assert sweep.clean_start(journal, tied) == ["dax0.3"]
    assert not (root / "bus/dax/devices/dax0.3").exists()
    assert (root / "bus/dax/devices/dax0.2").exists()  # held: never touched
    assert [(r.sub_device, r.lease_id) for r in journal.sub_devices()] == [("dax0.2", "lease-held")]
    assert LeftoverSweep(None).clean_start(journal, {}) == []  # no devdax backend
    backend.release(held)
    os.close(left.fd)  # its sub-device went with the clean start
