"""The agent reports dax devices it did not make as reserved extents, and poold never places
a lease on them (issue #4).

Sysfs is a private copy of a recorded QEMU machine; the kernel's side of the devdax
backend's writes is FakeDaxKernel (tests/agent/backends/test_devdax.py), here also making
the ``mapping0`` directory a real kernel shows for a carved device. poold is the real API
on SQLite and PostgreSQL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from agent.backends.devdax import DevdaxBackend, carved_sub_devices
from agent.config import AgentConfig
from agent.discovery import inventory as discovery
from agent.inventory import ScanRaced, host_inventory, journal_path, own_sub_devices, scan
from agent.journal import Entry, Journal, SubDevice
from poold.api.client import PooldClient
from poold.errors import BackendFailed, PoolError
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from tests.agent.backends.test_devdax import BASE0, REGION0, FakeDaxKernel, _add_write_only_attrs
from tests.conftest import ThreadedServer
from tests.fixtures.machines.loader import Machine

MIB = 1 << 20
HOST = "h1"
# qemu-single-03-partitioned: dax0.0 holds [0, 128 MiB), dax0.1 [128, 192 MiB) of 256 MiB.
PARTITIONED = [(0, 128 * MIB), (128 * MIB, 64 * MIB)]


class MappingKernel(FakeDaxKernel):
    """FakeDaxKernel that also shows a carved device's range as ``mapping0/``, as Linux does."""

    def __call__(self, path: Path, value: str) -> None:
        super().__call__(path, value)
        if path.name == "mapping" and value:
            start, end = (int(x, 16) for x in value.split("-"))
            mapping = path.parent / "mapping0"
            mapping.mkdir(exist_ok=True)
            for attr, number in (("start", start), ("end", end), ("page_offset", 0)):
                (mapping / attr).write_text(f"{number:#x}\n")


Setup = tuple[DevdaxBackend, MappingKernel, AgentConfig]


def config(root: Path, state_dir: Path) -> AgentConfig:
    return AgentConfig(host=HOST, sysfs_root=root, state_dir=state_dir, emulated=False, udev=False)


@pytest.fixture
def partitioned(tmp_path: Path) -> Setup:
    root = Machine("qemu-single-03-partitioned").extract(tmp_path / "machine")
    _add_write_only_attrs(root)
    dev = tmp_path / "dev"
    dev.mkdir()
    kernel = MappingKernel(root, dev)
    backend = DevdaxBackend(root, dev, apply=kernel, require_char_device=False)
    return backend, kernel, config(root, tmp_path / "state")


def reserved(cfg: AgentConfig) -> list[tuple[int, int]]:
    (device,) = host_inventory(cfg, {"devdax"})
    assert device.kind == "devdax" and device.local_name == "dax_region0"
    return device.reserved_extents


def admin_creates_device(kernel: MappingKernel, offset: int, length: int) -> str:
    """What ``daxctl create-device`` does, straight to the kernel: nothing the agent made."""
    region = kernel.root / REGION0
    kernel(region / "dax_region/create", "1")
    name = (region / "dax_region/seed").read_text()
    kernel(region / name / "size", "0")
    start = BASE0 + offset
    kernel(region / name / "mapping", f"{start:#x}-{start + length - 1:#x}")
    kernel(kernel.root / "bus/dax/drivers/device_dax/bind", name)
    return name


def test_foreign_devices_reported_own_lease_sub_device_not(partitioned: Setup) -> None:
    backend, kernel, cfg = partitioned
    assert reserved(cfg) == PARTITIONED
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-1")
    assert m.device == "dax0.2"
    assert reserved(cfg) == PARTITIONED  # the lease's own sub-device is not reserved
    name = admin_creates_device(kernel, 200 * MIB, 8 * MIB)
    assert name == "dax0.3"
    assert reserved(cfg) == [*PARTITIONED, (200 * MIB, 8 * MIB)]
    backend.release(m)
    assert "dax0.2" not in carved_sub_devices(cfg.sysfs_root)
    assert reserved(cfg) == [*PARTITIONED, (200 * MIB, 8 * MIB)]


def test_sub_device_is_own_from_the_moment_it_is_carved(partitioned: Setup) -> None:
    """A rescan between the carve's writes (or during a scrub) never sees it as foreign."""
    backend, kernel, cfg = partitioned
    seen: list[set[str]] = []
    apply = backend.apply
    assert apply is not None

    def watching(path: Path, value: str) -> None:
        apply(path, value)
        if path.name == "mapping":
            seen.append(own_sub_devices(cfg))

    backend.apply = watching
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-1")
    assert seen == [{"dax0.2"}]
    backend.release(m)
    # A carve that fails is undone and forgotten: the seed may be anyone's next.
    kernel.refuse["bus/dax/drivers/device_dax/new_id"] = 16  # EBUSY
    with pytest.raises(BackendFailed):
        backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-2")
    assert carved_sub_devices(cfg.sysfs_root) == set()


def test_journalled_sub_devices_are_not_reserved(partitioned: Setup) -> None:
    """After a restart the backend remembers nothing; the journal names the agent's own."""
    _, _, cfg = partitioned
    journal = Journal(journal_path(cfg))
    journal.add(
        Entry(
            lease_id="l-1",
            device_uid="cxl:x",
            backend="devdax",
            offset_bytes=128 * MIB,
            length_bytes=64 * MIB,
            epoch=1,
            holder_pid=os.getpid(),
            holder_uid=os.getuid(),
            holder_start=None,
            ttl_s=60,
            sub_device="dax0.1",
            region_id=0,
            lease_json="{}",
        )
    )
    journal.close()
    assert reserved(cfg) == [(0, 128 * MIB)]


def test_leftover_sub_device_of_an_ended_lease_is_not_reserved(partitioned: Setup) -> None:
    """A restart with no live lease: the journal still names the sub-device it made."""
    _, _, cfg = partitioned
    journal = Journal(journal_path(cfg))
    journal.note_sub_device(SubDevice(0, "dax0.0", "l-ended", 128 * MIB, 0.0))
    journal.close()
    assert reserved(cfg) == [(128 * MIB, 64 * MIB)]


def test_no_journal_is_not_created_by_a_scan(partitioned: Setup) -> None:
    _, _, cfg = partitioned
    assert reserved(cfg) == PARTITIONED
    assert not cfg.state_dir.exists()


# --- through poold: placement never lands on reserved bytes ---------------------------------


def register(
    api: ThreadedServer, admin: PooldClient, inventory: list[InventoryDevice]
) -> PooldClient:
    credential = admin.add_host(HOST).credential
    agent = PooldClient(api.url, credential)
    agent.register(Heartbeat(inventory=inventory))
    admin.create_tenant(TenantSpec(name="t", quota_bytes=1 << 30, allowed_uids=[1000]))
    return agent


def grant(agent: PooldClient, size: int) -> Any:
    return agent.grant(GrantRequest(tenant="t", size_bytes=size, uid=1000, pid=1))


def test_grant_lands_only_on_unreserved_bytes(
    api: ThreadedServer, admin: PooldClient, tmp_path: Path
) -> None:
    root = Machine("qemu-single-03-partitioned").extract(tmp_path / "machine")
    inventory = host_inventory(config(root, tmp_path / "state"), {"devdax"})
    with register(api, admin, inventory) as agent:
        leases = [grant(agent, 16 * MIB) for _ in range(4)]
        for lease in leases:
            assert lease.offset_bytes >= 192 * MIB  # dax0.0 and dax0.1 hold the rest
        with pytest.raises(PoolError) as err:
            grant(agent, 2 * MIB)
        assert err.value.code == "no_capacity"
        assert err.value.detail is not None and err.value.detail["largest_free_bytes"] == 0
    (row,) = admin.status().devices
    assert row.reserved_bytes == 192 * MIB and row.free_bytes == 0
    assert row.reserved_extents == PARTITIONED


def test_region_claimed_whole_by_dax0_0_takes_no_lease(
    api: ThreadedServer, admin: PooldClient, tmp_path: Path
) -> None:
    root = Machine("qemu-single-02-devdax").extract(tmp_path / "machine")
    inventory = host_inventory(config(root, tmp_path / "state"), {"devdax"})
    with register(api, admin, inventory) as agent, pytest.raises(PoolError) as err:
        grant(agent, 2 * MIB)
    assert err.value.code == "no_capacity"
    assert err.value.detail == {
        "largest_free_bytes": 0,
        "free_by_device": {inventory[0].uid: 0},
    }


# --- sub-devices carved or released while discovery reads sysfs -----------------------------


def test_sub_device_released_during_discovery_is_not_reserved(
    partitioned: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease ends between the sysfs reading (its sub-device sized) and the naming of the
    agent's own: that reading is dropped, not sent with the sub-device as reserved."""
    backend, _, cfg = partitioned
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-1")
    read = discovery.discover
    readings: list[discovery.Inventory] = []

    def discover_then_release(*args: Any, **kwargs: Any) -> discovery.Inventory:
        readings.append(read(*args, **kwargs))
        if len(readings) == 1:
            backend.release(m)
        return readings[-1]

    monkeypatch.setattr(discovery, "discover", discover_then_release)
    assert reserved(cfg) == PARTITIONED
    assert len(readings) == 2
    assert [d.chardev for d in readings[0].dax.devices() if d.size] == [
        "dax0.0",
        "dax0.1",
        m.device,
    ]


def test_scan_fails_while_sub_devices_keep_changing(
    partitioned: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease carved and released during every reading: no inventory rather than a wrong
    one (a rescan then keeps the last)."""
    backend, _, cfg = partitioned
    read = discovery.discover

    def discover_while_leasing(*args: Any, **kwargs: Any) -> discovery.Inventory:
        inventory = read(*args, **kwargs)
        backend.release(backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-1"))
        return inventory

    monkeypatch.setattr(discovery, "discover", discover_while_leasing)
    with pytest.raises(ScanRaced):
        scan(cfg, {"devdax"})
