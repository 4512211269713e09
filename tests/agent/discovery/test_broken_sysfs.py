"""A broken or changing sysfs never crashes discovery: the field is unknown and a warning
says why. Tests run as root, so unreadable files are made with a directory or a dangling
symlink where a file belongs rather than chmod."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.discovery import dax as dax_module
from agent.discovery.inventory import discover
from agent.discovery.model import DEFAULT_NUMA_RESERVE_BYTES
from agent.discovery.sysfs import SysfsReader

MACHINE = "qemu-full-06-interleave"


def memdev_dir(root: Path, name: str) -> Path:
    return (root / "bus/cxl/devices" / name).resolve()


def test_garbage_values_are_unknown(fresh_machine: Callable[[str], Path]) -> None:
    root = fresh_machine(MACHINE)
    (memdev_dir(root, "mem0") / "serial").write_text("not-a-number\n")
    (memdev_dir(root, "mem1") / "ram" / "size").write_bytes(b"\xff\xfe\n")
    (root / "devices/system/node/node1/distance").write_text("20 ten 20\n")
    (root / "devices/system/node/online").write_text("0-x\n")
    inv = discover(root)
    mem0 = inv.cxl.memdev("mem0")
    mem1 = inv.cxl.memdev("mem1")
    assert mem0 is not None
    assert mem0.serial is None
    assert mem1 is not None
    assert mem1.ram_size is None
    node1 = inv.numa.node(1)
    assert node1 is not None
    assert node1.distance is None
    assert node1.online is None
    joined = "\n".join(inv.warnings)
    assert "mem0/serial: not an integer" in joined
    assert "ram/size: not text" in joined
    assert "node1/distance" in joined
    # Region1 interleaves mem0 (serial unknown): its identity falls back to the host range
    # and says so, instead of inventing a serial.
    region1 = next(d for d in inv.devices if "region1" in d.cxl_regions)
    assert region1.host_scoped
    assert "resource=0x590000000" in region1.uid


def test_missing_attributes_are_unknown(fresh_machine: Callable[[str], Path]) -> None:
    root = fresh_machine(MACHINE)
    region = (root / "bus/cxl/devices/region1").resolve()
    (region / "size").unlink()
    (memdev_dir(root, "mem2") / "firmware_version").unlink()  # probed: no warning
    dax1 = (root / "bus/dax/devices/dax1.0").resolve()
    (dax1 / "target_node").unlink()
    inv = discover(root)
    reg = next(r for r in inv.cxl.regions if r.region == "region1")
    assert reg.size is None
    mem2 = inv.cxl.memdev("mem2")
    assert mem2 is not None
    assert mem2.firmware_version is None
    dev = next(d for d in inv.dax.devices() if d.chardev == "dax1.0")
    assert dev.target_node is None
    assert any("region1/size: missing" in w for w in inv.warnings)
    assert not any("firmware_version" in w for w in inv.warnings)


def test_unreadable_attributes_are_unknown(fresh_machine: Callable[[str], Path]) -> None:
    root = fresh_machine(MACHINE)
    serial = memdev_dir(root, "mem3") / "serial"
    serial.unlink()
    serial.mkdir()  # EISDIR on read: what an unreadable attribute looks like to us
    meminfo = root / "devices/system/node/node2/meminfo"
    meminfo.unlink()
    meminfo.symlink_to("../../../../nowhere/meminfo")  # dangling
    inv = discover(root)
    mem3 = inv.cxl.memdev("mem3")
    assert mem3 is not None
    assert mem3.serial is None
    node2 = inv.numa.node(2)
    assert node2 is not None
    assert node2.mem_total_bytes is None
    assert any("mem3/serial: unreadable" in w for w in inv.warnings)
    assert any("node2/meminfo: missing" in w for w in inv.warnings)
    # node2's capacity falls back to what kmem onlined there.
    numa2 = next(d for d in inv.devices if d.local_name == "node2")
    assert numa2.capacity_bytes == (512 << 20) - DEFAULT_NUMA_RESERVE_BYTES  # less the reserve


def test_dangling_bus_link_is_a_vanished_device(fresh_machine: Callable[[str], Path]) -> None:
    root = fresh_machine(MACHINE)
    shutil.rmtree(memdev_dir(root, "mem1"))  # the bus link now dangles
    inv = discover(root)
    assert inv.cxl.memdev("mem1") is None
    assert any("mem1: vanished during scan" in w for w in inv.warnings)
    region1 = next(r for r in inv.cxl.regions if r.region == "region1")
    assert [m.serial for m in region1.mappings if m.memdev == "mem1"] == [None]


def test_device_vanishing_mid_scan(
    fresh_machine: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """dax1.0 is listed, then removed (daxctl destroy-device) before we read it."""
    root = fresh_machine(MACHINE)
    real_read = dax_module.read_dax_device

    def vanish_then_read(r: SysfsReader, path: Path) -> dax_module.DaxDevice:
        if path.name == "dax1.0":
            shutil.rmtree(path)
        return real_read(r, path)

    monkeypatch.setattr(dax_module, "read_dax_device", vanish_then_read)
    inv = discover(root)
    dev = next(d for d in inv.dax.devices() if d.chardev == "dax1.0")
    assert dev.size is None
    assert dev.mode == "unbound"
    assert any("dax1.0/size: missing" in w for w in inv.warnings)


def test_listing_failure_is_a_warning(fresh_machine: Callable[[str], Path]) -> None:
    root = fresh_machine(MACHINE)
    tiers = root / "devices/virtual/memory_tiering"
    shutil.rmtree(tiers)
    tiers.mkdir()
    os.rmdir(tiers)
    tiers.write_text("not a directory\n")
    inv = discover(root)
    assert not inv.tiers.present
    assert all(d.memory_tier is None for d in inv.devices)


def test_empty_root_is_an_empty_inventory(tmp_path: Path) -> None:
    inv = discover(tmp_path)
    assert not inv.cxl.present
    assert not inv.dax.present
    assert not inv.numa.present
    assert inv.devices == []
    assert inv.warnings == []


def test_reader_helpers(tmp_path: Path) -> None:
    r = SysfsReader(tmp_path)
    (tmp_path / "hex").write_text("0x10\n")
    (tmp_path / "bare_hex").write_text("8000000\n")
    (tmp_path / "list").write_text("0-2,5\n")
    assert r.read_int(tmp_path / "hex") == 16
    assert r.read_hex(tmp_path / "bare_hex") == 128 << 20
    assert r.read_list(tmp_path / "list") == [0, 1, 2, 5]
    assert r.read_int(tmp_path / "absent", probe=True) is None
    assert r.warnings == []
    assert r.link_name(tmp_path / "hex") is None
    assert r.warnings
    assert "not a link" in r.warnings[0]
