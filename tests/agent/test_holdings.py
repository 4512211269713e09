"""What the agent reports in each heartbeat (holders, sub-devices, scrubs, leftovers), end to end.

poold's API, its ledger (SQLite and PostgreSQL) and the agent's poold link are real;
the kernel is faked only at the sysfs boundary (the recorded QEMU machine and the
FakeDaxKernel of the devdax backend tests), as in tests/agent/test_service.py.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, update

from agent import protocol as p
from agent.backends.devdax import DevdaxBackend
from agent.journal import Journal
from agent.memory import LocalDevice
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.ledger import audit
from poold.ledger.db import Ledger
from poold.ledger.models import Host
from poold.ledger.reaper import ReaperPolicy
from poold.ledger.types import utcnow
from tests.agent.backends.test_devdax import DRIVER, FakeDaxKernel
from tests.agent.test_service import MIB, PEER, UID, devdax_agent

__all__ = ["devdax_agent"]  # the fixture

Agent = tuple[AgentService, FakeDaxKernel, Path]


def wait_for(what: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def stored_report(ledger: Ledger) -> object:
    with ledger.read() as s:
        return s.scalar(select(Host.agent_leases).where(Host.name == "h1"))


def test_heartbeat_reports_holder_and_sub_device(devdax_agent: Agent, ledger: Ledger) -> None:
    service, _kernel, _dev = devdax_agent
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    os.close(fd)
    held, leftovers = service.holdings()
    [entry] = held
    assert (entry.lease_id, entry.state, entry.sub_device) == (result.lease_id, "held", "dax0.2")
    [holder] = entry.holders
    assert holder.pid == os.getpid()
    assert holder.start_time == pytest.approx(psutil.Process().create_time())
    assert leftovers == []

    assert service.link.heartbeat() is not None
    stored = stored_report(ledger)
    assert isinstance(stored, dict)
    assert stored["leases"][0]["sub_device"] == "dax0.2"
    report = audit.run_audit(ledger, ReaperPolicy())
    assert report.agents.available and report.exit_code == 0
    assert report.agents.holder_mismatches == [] and report.agents.stale == []


def test_a_leftover_sub_device_is_reported_and_deleted_on_audit_reclaim(
    devdax_agent: Agent, ledger: Ledger, admin: PooldClient, tmp_path: Path
) -> None:
    service, kernel, dev = devdax_agent
    journal_path = tmp_path / "state" / "journal.db"
    service.journal = Journal(journal_path)
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    os.close(fd)
    lease_id = result.lease_id

    # The agent restarts; the tenant keeps its mapping and the agent re-adopts the lease.
    link, backend = service.link, service.backends["devdax"]
    service.close()
    agent = AgentService("h1", link, {"devdax": backend})
    agent.set_local_devices({UID: LocalDevice("devdax", dax_region_id=0)})
    agent.journal = Journal(journal_path)
    agent.leftovers.settle_s = 0  # report at first sight (the default waits 10 s)
    try:
        assert agent.adopt() == (1, 0)
        # poold revokes it, but the kernel refuses the unbind: the agent confirms the
        # revocation (it holds the lease no more) and the sub-device stays behind.
        kernel.refuse[f"{DRIVER}/unbind"] = errno.EBUSY
        admin.revoke(lease_id, "maintenance", deadline_s=0)
        link.heartbeat()
        del kernel.refuse[f"{DRIVER}/unbind"]
        assert admin.show_lease(lease_id).state == "scrubbing"
        assert (dev / "dax0.2").exists()
        link.heartbeat()  # the scrub order; the range is zeroed through a fresh sub-device

        def reclaimed() -> bool:
            link.flush()
            return admin.show_lease(lease_id).state == "reclaimed"

        wait_for(reclaimed)
        held, leftovers = agent.holdings()
        assert held == []
        [leftover] = leftovers
        assert (leftover.sub_device, leftover.region_id, leftover.lease_id) == (
            "dax0.2",
            0,
            lease_id,
        )
        assert leftover.size_bytes == 4 * MIB

        link.heartbeat()
        report = audit.run_audit(ledger, ReaperPolicy())
        [item] = [i for i in report.agents.leaked if i.kind == "leftover_sub_device"]
        assert (item.lease_id, item.sub_device, item.state) == (lease_id, "dax0.2", "reclaimed")
        assert report.exit_code == 1
        fixed = audit.run_audit(ledger, ReaperPolicy(), reclaim_safe=True)
        assert [i.action for i in fixed.agents.leaked] == ["delete_ordered"]

        # The next heartbeat's reply revokes the lease id; the agent deletes the leftover.
        link.heartbeat()
        assert not (dev / "dax0.2").exists()
        assert agent.holdings() == ([], [])
        link.heartbeat()
        assert audit.run_audit(ledger, ReaperPolicy()).agents.leaked == []
    finally:
        agent.close()


def test_a_running_scrub_is_reported_and_a_lost_one_is_reissued(
    devdax_agent: Agent, ledger: Ledger, admin: PooldClient
) -> None:
    service, kernel, _dev = devdax_agent
    link = service.link
    backend = service.backends["devdax"]
    assert isinstance(backend, DevdaxBackend)
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=4 * MIB))
    os.close(fd)
    lease_id = result.lease_id

    # Hold the scrub at its first sysfs write, to see it reported while it runs.
    gate, entered = threading.Event(), threading.Event()

    def slow_kernel(path: Path, value: str) -> None:
        kernel(path, value)
        if path.name == "mapping":
            entered.set()
            gate.wait(10)

    backend.apply = slow_kernel
    assert service.release(PEER, p.ReleaseArgs(lease_id=lease_id)).state == "scrubbing"
    assert entered.wait(10)
    [entry] = service.holdings()[0]
    assert (entry.lease_id, entry.state) == (lease_id, "scrubbing")
    assert entry.scrub is not None and entry.scrub.bytes_done == 0  # nothing zeroed yet
    assert utcnow() - entry.scrub.started_at < timedelta(seconds=10)
    link.flush()  # release_dirty: the ledger says scrubbing
    link.heartbeat()
    late = utcnow() + timedelta(seconds=audit.SCRUB_STUCK_AFTER_S + 30)
    with ledger.write() as s:  # the agent keeps reporting, late into the scrub
        s.execute(update(Host).values(agent_leases_at=late, last_heartbeat_at=late))
    report = audit.run_audit(ledger, ReaperPolicy(), now=late)
    assert report.agents.unfinished_scrubs == []  # running, however long it takes

    # The scrub ends, but its verdict is lost (the agent dies before delivering it;
    # here the queued op is taken out of the outbox).
    gate.set()
    wait_for(lambda: link.outbox_size() == 1 and service.holdings()[0] == [])
    link.ops.delivered(link.ops.take(None))  # taken and never sent
    assert link.outbox_size() == 0
    creates = kernel.writes.count(("dax_region/create", "1"))
    link.heartbeat()  # the plain order again: the agent did this scrub, it does not redo it
    time.sleep(0.2)
    assert kernel.writes.count(("dax_region/create", "1")) == creates
    assert admin.show_lease(lease_id).state == "scrubbing"

    with ledger.write() as s:
        s.execute(update(Host).values(agent_leases_at=late, last_heartbeat_at=late))
    report = audit.run_audit(ledger, ReaperPolicy(), reclaim_safe=True, now=late)
    [item] = report.agents.unfinished_scrubs
    assert (item.lease_id, item.action) == (lease_id, "scrub_reissued")
    # The re-issued order: the agent scrubs again, once.
    link.heartbeat()
    wait_for(lambda: link.outbox_size() == 1 and service.holdings()[0] == [])
    assert kernel.writes.count(("dax_region/create", "1")) == creates + 1
    link.heartbeat()  # the same re-issue again (the verdict is not delivered yet)
    time.sleep(0.2)
    assert kernel.writes.count(("dax_region/create", "1")) == creates + 1
    link.flush()
    assert admin.show_lease(lease_id).state == "reclaimed"
