"""What the agent offers poold: annotated discovery, kinds without a backend held back,
and hotplug rescans that reach poold through the next heartbeat (real poold API)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import inventory as agent_inventory
from agent.config import AgentConfig
from agent.discovery.annotations import AnnotationError, from_agent_config
from agent.discovery.hotplug import EventSource
from agent.inventory import InventoryWatcher, host_inventory
from agent.journal import GRANT_LOG_NAME, Entry, Journal
from agent.link import PooldLink
from poold.api.client import PooldClient
from poold.wire.admin import DeviceStatus
from tests.conftest import ThreadedServer
from tests.fixtures.machines.loader import extract_machine
from tests.fixtures.synthetic import write_synthetic_sysfs

HOST = "rack1-h7"
# qemu-full-06-interleave: memdev 1 -> region0 (devdax part + node1), 2 -> pmem region,
# 3+4 -> 2-way interleaved region onlined as node2.
NODE2 = "numa:cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"
PMEM = "cxl:pmem:serials=2:ways=1:gran=256:size=268435456"
REGION0 = "cxl:ram:serials=1:ways=1:gran=4096:size=268435456"


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = extract_machine(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def config(sysfs_root: Path, **kw: Any) -> AgentConfig:
    fields: dict[str, Any] = {
        "host": HOST,
        "sysfs_root": sysfs_root,
        "emulated": False,
        "udev": False,
        "rescan_interval_s": 0.05,
    }
    fields.update(kw)
    return AgentConfig(**fields)


# --- annotations ---------------------------------------------------------------------


def test_config_annotation_forms() -> None:
    notes = from_agent_config(
        {
            "3": {"media": "ddr4", "recycled": True},
            "0x4": {"media": "ddr4"},
            "memdev": {"5": {"cost_per_gib_month": 0.1}},
            "device": {"dax:resource=0x1:size=2": {"provenance": "hmem"}},
            f"{HOST}/numa:node9": {"media": "ddr5"},
            PMEM: {"provenance": "new"},
        },
        HOST,
    )
    assert set(notes.memdev) == {3, 4, 5}
    assert set(notes.device) == {"dax:resource=0x1:size=2", "numa:node9", PMEM}
    with pytest.raises(AnnotationError):
        from_agent_config({"3": {"colour": "red"}}, HOST)


def test_annotations_from_agent_config_travel_in_inventory(
    machines: Callable[[str], Path],
) -> None:
    cfg = config(
        machines("qemu-full-06-interleave"),
        annotations={
            "3": {
                "media": "ddr4",
                "recycled": True,
                "provenance": "retired from rack 12 host 7",
                "cost_per_gib_month": 0.4,
            },
            "4": {"media": "ddr4", "recycled": True, "cost_per_gib_month": 0.6},
            f"{HOST}/{PMEM}": {"media": "ddr5", "provenance": "new"},  # wire uid form
        },
    )
    by_uid = {d.uid: d for d in host_inventory(cfg, {"numa", "devdax"})}
    node2 = by_uid[NODE2]
    assert node2.media == "ddr4" and node2.recycled
    assert node2.provenance == "retired from rack 12 host 7"
    assert node2.cost_per_gib_month == pytest.approx(0.5)
    assert node2.memdev_serials == [3, 4] and node2.numa_node == 2
    assert node2.memory_tier is not None
    assert by_uid[PMEM].media == "ddr5" and by_uid[PMEM].provenance == "new"
    assert by_uid[REGION0].media == "unknown" and not by_uid[REGION0].recycled


def test_bad_annotations_are_logged_not_fatal(
    machines: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(machines("qemu-full-06-interleave"), annotations={"3": {"media": "DDR 4"}})
    with caplog.at_level(logging.ERROR, logger="pool_agent.inventory"):
        devices = host_inventory(cfg, {"numa"})
    assert {d.uid for d in devices} >= {NODE2}
    assert all(d.media == "unknown" for d in devices)
    assert "ignoring the agent config's [annotations]" in caplog.text


def test_annotations_reach_poold(
    api: ThreadedServer, admin: PooldClient, machines: Callable[[str], Path]
) -> None:
    cfg = config(
        machines("qemu-full-06-interleave"),
        annotations={"3": {"media": "ddr4", "recycled": True}, "4": {"media": "ddr4"}},
    )
    credential = admin.add_host(HOST).credential
    with PooldClient(api.url, credential) as client:
        PooldLink(client, "test").register(host_inventory(cfg, {"numa"}))
    row = {d.uid: d for d in admin.status().devices}[NODE2]
    assert row.media == "ddr4" and row.recycled and row.memdev_serials == [3, 4]
    assert row.kind == "numa" and row.numa_node == 2 and row.hosts == [HOST]


# --- kinds without a backend ------------------------------------------------------------


def test_devdax_not_offered_without_backend(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tree = write_synthetic_sysfs(tmp_path, memdevs=2, regions=2, dax_devices=2)
    assert tree.devdax_regions == [0, 1]
    cfg = config(tree.sys_root, emulated=None)
    with caplog.at_level(logging.WARNING, logger="pool_agent.inventory"):
        devices = host_inventory(cfg, {"emulated"})
    # Nothing discovered is offered; the host falls back to emulated memory.
    assert [d.kind for d in devices] == ["emulated"]
    skipped = [r for r in caplog.records if "not offering devdax device" in r.getMessage()]
    assert len(skipped) == 2
    assert all("no devdax backend" in r.getMessage() for r in skipped)
    assert "dax_region0" in skipped[0].getMessage()
    # With a devdax backend the same tree is offered (and no emulated device by default).
    offered = host_inventory(cfg, {"emulated", "devdax"})
    assert [d.kind for d in offered] == ["devdax", "devdax"]


# --- hotplug -------------------------------------------------------------------------


class SwitchableRoot:
    """A sysfs root that is a symlink, so a test can 'hotplug' by pointing it elsewhere."""

    def __init__(self, tmp_path: Path, target: Path) -> None:
        self.path = tmp_path / "sysroot"
        os.symlink(target, self.path)

    def switch(self, target: Path) -> None:
        tmp = self.path.with_name("sysroot.new")
        os.symlink(target, tmp)
        os.replace(tmp, self.path)


@pytest.fixture
def agent_client(api: ThreadedServer, admin: PooldClient) -> Iterator[PooldClient]:
    credential = admin.add_host(HOST).credential
    with PooldClient(api.url, credential) as client:
        yield client


def devices_by_uid(admin: PooldClient) -> dict[str, DeviceStatus]:
    return {d.uid: d for d in admin.status().devices}


def test_rescan_reaches_poold_in_next_heartbeat(
    tmp_path: Path,
    admin: PooldClient,
    agent_client: PooldClient,
    machines: Callable[[str], Path],
) -> None:
    root = SwitchableRoot(tmp_path, machines("qemu-full-06-interleave"))
    cfg = config(root.path)
    link = PooldLink(agent_client, "test")
    link.register(host_inventory(cfg, {"devdax"}))
    assert set(devices_by_uid(admin)) == {PMEM, REGION0}
    watcher = InventoryWatcher(cfg, {"emulated", "devdax"}, link)
    assert watcher.rescan() is False  # nothing changed: nothing to send

    # Hot-remove of the pmem region, and region0's dax device back to devdax in full.
    root.switch(machines("qemu-full-02-devdax"))
    assert watcher.rescan() is True
    assert devices_by_uid(admin)[PMEM].state == "online"  # not sent yet
    reply = link.heartbeat()
    assert reply is not None and not reply.want_inventory
    rows = devices_by_uid(admin)
    assert rows[PMEM].state == "missing"
    assert rows[REGION0].state == "online" and rows[REGION0].capacity_bytes == 256 << 20

    # The next heartbeat carries only the digest, and poold does not ask for more.
    reply = link.heartbeat()
    assert reply is not None and not reply.want_inventory


def test_running_watcher_and_heartbeat_threads(
    tmp_path: Path,
    admin: PooldClient,
    agent_client: PooldClient,
    machines: Callable[[str], Path],
) -> None:
    """The agent's threads as run.py starts them: periodic rescans without udev."""
    root = SwitchableRoot(tmp_path, machines("qemu-full-02-devdax"))
    cfg = config(root.path, rescan_interval_s=0.05)
    link = PooldLink(agent_client, "test")
    link.register(host_inventory(cfg, {"devdax"}))
    watcher = InventoryWatcher(cfg, {"emulated", "devdax"}, link)
    watcher.start()
    link.start(0.05)
    try:
        assert watcher.scheduler is not None and watcher.scheduler.periodic
        root.switch(machines("qemu-full-06-interleave"))
        deadline = time.monotonic() + 10
        while PMEM not in devices_by_uid(admin):
            assert time.monotonic() < deadline, "the hotplugged device never reached poold"
            time.sleep(0.05)
        assert devices_by_uid(admin)[REGION0].capacity_bytes == 128 << 20
    finally:
        watcher.stop()
        link.stop()


class OneEvent:
    """An event source that reports one uevent, then stays quiet."""

    def __init__(self) -> None:
        self.sent = False

    def poll(self, timeout_s: float) -> str | None:
        if not self.sent:
            self.sent = True
            return "add dax dax1.0"
        time.sleep(min(timeout_s, 0.01))
        return None


def test_udev_event_triggers_debounced_rescan(
    tmp_path: Path, machines: Callable[[str], Path]
) -> None:
    root = SwitchableRoot(tmp_path, machines("qemu-full-06-interleave"))
    cfg = config(root.path, udev=True, rescan_debounce_s=0.01, rescan_interval_s=60)
    link = PooldLink(PooldClient("http://127.0.0.1:9", "x"), "test")
    try:
        link.inventory = host_inventory(cfg, {"devdax"})
        root.switch(machines("qemu-full-02-devdax"))
        source: EventSource = OneEvent()
        watcher = InventoryWatcher(cfg, {"devdax"}, link, source=source)
        watcher.start()
        try:
            deadline = time.monotonic() + 10
            while PMEM in {d.uid for d in link.inventory}:
                assert time.monotonic() < deadline, "no rescan after the uevent"
                time.sleep(0.01)
            assert watcher.scheduler is not None and not watcher.scheduler.periodic
        finally:
            watcher.stop()
    finally:
        link.client.close()


def test_failed_rescan_keeps_last_inventory(
    machines: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = config(machines("qemu-full-06-interleave"))
    link = PooldLink(PooldClient("http://127.0.0.1:9", "x"), "test")
    try:
        link.inventory = before = host_inventory(cfg, {"devdax"})
        watcher = InventoryWatcher(cfg, {"devdax"}, link)

        def broken(*_a: object) -> None:
            raise OSError("sysfs went away")

        monkeypatch.setattr(agent_inventory, "scan", broken)
        with caplog.at_level(logging.ERROR, logger="pool_agent.inventory"):
            assert watcher.rescan() is False
        assert link.inventory is before
        assert "rescan failed; keeping the last inventory" in caplog.text
    finally:
        link.client.close()


def test_skipped_kinds_logged_once_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tree = write_synthetic_sysfs(tmp_path, memdevs=2, regions=2, dax_devices=2)
    cfg = config(tree.sys_root, emulated=None)
    link = PooldLink(PooldClient("http://127.0.0.1:9", "x"), "test")
    try:
        watcher = InventoryWatcher(cfg, {"emulated"}, link)
        with caplog.at_level(logging.WARNING, logger="pool_agent.inventory"):
            assert watcher.rescan() is True  # [] -> the emulated device
            assert watcher.rescan() is False
            assert watcher.rescan() is False
        assert caplog.text.count("not offering devdax device") == 2  # two devices, once each
        assert [d.kind for d in link.inventory] == ["emulated"]
    finally:
        link.client.close()


class Quiet:
    """A udev-like source with no events: each poll blocks for its whole timeout."""

    def poll(self, timeout_s: float) -> str | None:
        time.sleep(timeout_s)
        return None


def test_watcher_stops_promptly_while_polling(machines: Callable[[str], Path]) -> None:
    cfg = config(machines("qemu-full-02-devdax"), udev=True, rescan_interval_s=60)
    link = PooldLink(PooldClient("http://127.0.0.1:9", "x"), "test")
    try:
        watcher = InventoryWatcher(cfg, {"devdax"}, link, source=Quiet())
        watcher.start()
        time.sleep(0.05)
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 1.0
        assert watcher._thread is not None and not watcher._thread.is_alive()
    finally:
        link.client.close()


# --- the journal, read beside the running agent -----------------------------------------


def _local_entry(lease_id: str, sub_device: str | None = None) -> Entry:
    return Entry(lease_id, "dev-1", "devdax", 0, 2 << 20, 1, 1, 0, None, 60, sub_device, 0, "{}")


def _grant(lease_id: str, epoch: int) -> str:
    return json.dumps({"lease_id": lease_id, "reservation_id": "res-1", "epoch": epoch})


def test_a_rescan_reads_the_running_agents_journal_and_never_rewrites_it(
    machines: Callable[[str], Path], tmp_path: Path
) -> None:
    """A rescan, or any process reading the journal beside the running agent, names its
    sub-devices without writing a byte: the agent's later appends still land in the
    file a restart replays. (A reader that opened a second Journal compacted the grant
    log by renaming a new file over it, and the agent went on appending to the old one:
    after a crash every local lease granted since that rescan was lost.)"""
    cfg = config(machines("qemu-full-06-interleave"), state_dir=tmp_path / "state")
    path = agent_inventory.journal_path(cfg)
    journal = Journal(path)
    try:
        first = _local_entry("local-1", "dax0.1")
        journal.add_local(first, _grant("local-1", 1), "res-1", 1, False)
        log_file = path.parent / GRANT_LOG_NAME
        inode = log_file.stat().st_ino
        size = log_file.stat().st_size

        assert "dax0.1" in agent_inventory.own_sub_devices(cfg)  # read from the files
        assert "dax0.1" in agent_inventory.own_sub_devices(cfg, journal)  # the live one's
        agent_inventory.scan(cfg, {"devdax"})
        assert (log_file.stat().st_ino, log_file.stat().st_size) == (inode, size)

        journal.add_local(_local_entry("local-2"), _grant("local-2", 2), "res-1", 2, False)
    finally:
        journal.close()
    again = Journal(path)  # the restart
    try:
        assert set(again.local.state.entries) == {"local-1", "local-2"}
    finally:
        again.close()
