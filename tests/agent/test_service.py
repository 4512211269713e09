"""The agent service against a real poold API: devdax leases carved at the ledger's offset.

The kernel is faked only at the sysfs boundary (the recorded QEMU machine plus
the FakeDaxKernel of the devdax backend tests); poold, its ledger and the
agent's poold link are real.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from agent import protocol as p
from agent.backends.devdax import DevdaxBackend
from agent.link import PooldLink
from agent.memory import LocalDevice
from agent.peer import Peer
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Quarantine
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import InventoryDevice
from tests.agent.backends.test_devdax import BASE0, FakeDaxKernel, _add_write_only_attrs
from tests.agent.conftest import emulated_device, linked_agent
from tests.conftest import ThreadedServer
from tests.fixtures.machines.loader import Machine

MIB = 1 << 20
UID = "cxl:test-region0"


@pytest.fixture
def devdax_agent(
    api: ThreadedServer, admin: PooldClient, ledger: Ledger, tmp_path: Path
) -> Iterator[tuple[AgentService, FakeDaxKernel, Path]]:
    root = Machine("qemu-single-03-partitioned").extract(tmp_path / "machine")
    _add_write_only_attrs(root)
    dev = tmp_path / "dev"
    dev.mkdir()
    kernel = FakeDaxKernel(root, dev)
    backend = DevdaxBackend(root, dev, apply=kernel, require_char_device=False)
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t", quota_bytes=GIB, allowed_uids=[os.getuid()]))
    client = PooldClient(api.url, credential)
    link = PooldLink(client, "test")
    link.register(
        [
            InventoryDevice(
                uid=UID,
                kind="devdax",
                media="ddr5",
                capacity_bytes=256 * MIB,
                alignment_bytes=2 * MIB,
                local_name="dax_region0",
            )
        ]
    )
    with ledger.write() as s:
        device_id = s.scalar(select(Device.id).where(Device.uid == UID))
        # dax0.0 and dax0.1 already use the first 192 MiB: not ours to hand out.
        s.execute(
            insert(Quarantine).values(
                device_id=device_id,
                offset_bytes=0,
                length_bytes=192 * MIB,
                reason="in use",
                created_at=utcnow(),
            )
        )
    service = AgentService("h1", link, {"devdax": backend})  # type: ignore[dict-item]
    service.set_local_devices({UID: LocalDevice("devdax", dax_region_id=0)})
    yield service, kernel, dev
    service.close()
    client.close()


GIB = 1 << 30
PEER = Peer(connection_id=1, pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


def test_devdax_lease_is_its_own_sub_device_at_the_ledger_offset(
    devdax_agent: tuple[AgentService, FakeDaxKernel, Path], admin: PooldClient
) -> None:
    service, kernel, dev = devdax_agent
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    assert result.backend == "devdax" and result.offset_bytes == 192 * MIB
    # The fd is the new sub-device's node, sized exactly to the lease.
    assert os.path.samefile(f"/proc/self/fd/{fd}", dev / "dax0.2")
    assert os.fstat(fd).st_size == 4 * MIB
    start = BASE0 + 192 * MIB
    assert ("dax0.2/mapping", f"{start:#x}-{start + 4 * MIB - 1:#x}") in kernel.writes
    assert admin.show_lease(result.lease_id).state == "active"

    released = service.release(PEER, p.ReleaseArgs(lease_id=result.lease_id))
    assert released.state == "scrubbing"
    assert not (dev / "dax0.2").exists()  # the sub-device is gone
    deadline = time.monotonic() + 10
    while admin.show_lease(result.lease_id).state != "reclaimed":
        service.link.flush()
        assert time.monotonic() < deadline, admin.show_lease(result.lease_id).state
        time.sleep(0.05)


def test_devdax_failure_aborts_the_grant_and_leaves_no_sub_device(
    devdax_agent: tuple[AgentService, FakeDaxKernel, Path], admin: PooldClient
) -> None:
    service, kernel, dev = devdax_agent
    kernel.refuse["bus/dax/drivers/device_dax/new_id"] = 16  # EBUSY
    from poold.errors import BackendFailed

    with pytest.raises(BackendFailed):
        service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    assert list(dev.iterdir()) == []
    (lease,) = admin.list_leases()
    assert lease.state == "aborted"


# --- a host of memfd memory: granted active in one request ------------------------------


@pytest.fixture
def memfd_agent(api: ThreadedServer, admin: PooldClient) -> Iterator[AgentService]:
    with linked_agent(api.url, admin, emulated_device(256 * MIB), ["t"]) as linked:
        yield linked.service


def test_a_memfd_lease_is_recorded_active_by_its_grant_alone(
    memfd_agent: AgentService, admin: PooldClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No activation request: poold records the lease granted and active in the grant's
    transaction (both events), and the tenant's lease is the same as before."""

    def no_activation(lease_id: str) -> None:
        raise AssertionError(f"activation asked for {lease_id}")

    monkeypatch.setattr(memfd_agent.link.client, "activate", no_activation)
    result, _fd = memfd_agent.lease(PEER, p.LeaseArgs(size_bytes=2 * MIB, tenant="t"))
    lease = admin.show_lease(result.lease_id)
    assert lease.state == "active" and lease.activated_at is not None
    memfd_agent.release(PEER, p.ReleaseArgs(lease_id=result.lease_id))


def test_a_memfd_lease_whose_memory_cannot_be_made_is_released(
    memfd_agent: AgentService, admin: PooldClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded active with its grant, a lease whose memory fails is released (it never
    held bytes) before the tenant hears the refusal, as an abort was: not left active."""
    from poold.errors import BackendFailed

    def fail(*_args: object, **_kw: object) -> None:
        raise BackendFailed("no memory today")

    monkeypatch.setattr(memfd_agent.memory.backends["emulated"], "materialise_placed", fail)
    with pytest.raises(BackendFailed):
        memfd_agent.lease(PEER, p.LeaseArgs(size_bytes=2 * MIB, tenant="t"))
    (lease,) = admin.list_leases()
    assert lease.state == "released"
    assert memfd_agent.link.outbox_size() == 0  # nothing left to deliver
