"""For every recorded machine state, discovery agrees with what cxl/daxctl/ndctl printed at
the same moment. Expected values are read from the captured JSON, never retyped."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agent.discovery.cli import inventory_command
from agent.discovery.inventory import Inventory, discover, to_wire
from agent.discovery.model import DEFAULT_NUMA_RESERVE_BYTES, numa_capacity_bytes
from tests.fixtures.machines.loader import Machine, machine_names

MACHINES = machine_names("qemu-")


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a cxl list tree."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def cxl_memdevs(machine: Machine) -> dict[str, dict[str, Any]]:
    """memdev objects of ``cxl list``, by name."""
    return {
        o["memdev"]: o
        for o in walk(machine.cxl_list())
        if isinstance(o.get("memdev"), str) and "serial" in o
    }


def cxl_regions(machine: Machine) -> dict[str, dict[str, Any]]:
    """region objects of ``cxl list``, by name."""
    return {o["region"]: o for o in walk(machine.cxl_list()) if "mappings" in o and "region" in o}


def cxl_endpoint_decoders(machine: Machine) -> dict[str, dict[str, Any]]:
    """endpoint decoder objects that have a region."""
    return {
        o["decoder"]: o
        for o in walk(machine.cxl_list())
        if isinstance(o.get("decoder"), str) and "dpa_resource" in o
    }


@pytest.fixture(params=MACHINES)
def recorded(
    request: pytest.FixtureRequest, machine_root: Callable[[str], Path]
) -> tuple[Machine, Inventory]:
    machine = Machine(request.param)
    return machine, discover(machine_root(machine.name))


def test_every_stage_is_recorded() -> None:
    assert len(machine_names("qemu-single-")) == 5
    assert len(machine_names("qemu-full-")) == 7


def test_no_warnings_on_a_healthy_tree(recorded: tuple[Machine, Inventory]) -> None:
    _, inv = recorded
    assert inv.warnings == []
    assert inv.health.tool == "skipped"  # a fixture tree never runs the host's cxl-cli


def test_memdevs_match_cxl_list(recorded: tuple[Machine, Inventory]) -> None:
    machine, inv = recorded
    expected = cxl_memdevs(machine)
    assert {m.memdev for m in inv.cxl.memdevs} == set(expected)
    for memdev in inv.cxl.memdevs:
        want = expected[memdev.memdev]
        assert memdev.serial == want["serial"]
        assert memdev.host == want["host"]
        # cxl list leaves out zero-sized partitions and an absent numa_node.
        assert (memdev.ram_size or None) == want.get("ram_size")
        assert (memdev.pmem_size or None) == want.get("pmem_size")
        assert memdev.numa_node == want.get("numa_node")
        assert memdev.ram_qos_class == want.get("ram_qos_class")


def test_regions_match_cxl_list(recorded: tuple[Machine, Inventory]) -> None:
    machine, inv = recorded
    expected = cxl_regions(machine)
    decoders = cxl_endpoint_decoders(machine)
    assert {r.region for r in inv.cxl.regions} == set(expected)
    for region in inv.cxl.regions:
        want = expected[region.region]
        for key in (
            "resource",
            "size",
            "interleave_ways",
            "interleave_granularity",
            "decode_state",
        ):
            assert getattr(region, key) == want[key], key
        got = {(m.position, m.memdev, m.decoder) for m in region.mappings}
        assert got == {(m["position"], m["memdev"], m["decoder"]) for m in want["mappings"]}
        # The region's mode is the mode of the endpoint decoders it was built from.
        assert {decoders[m["decoder"]]["mode"] for m in want["mappings"]} == {region.type}
        serials = {cxl_memdevs(machine)[m["memdev"]]["serial"] for m in want["mappings"]}
        assert {m.serial for m in region.mappings} == serials


def test_dax_matches_daxctl_list(recorded: tuple[Machine, Inventory]) -> None:
    machine, inv = recorded
    expected = {r["id"]: r for r in machine.daxctl_list()}
    assert {r.id for r in inv.dax.regions} == set(expected)
    for region in inv.dax.regions:
        want = expected[region.id]
        assert region.path == want["path"]
        assert region.size == want["size"]
        assert region.align == want["align"]
        # daxctl omits available_size when it is zero.
        assert (region.available_size or None) == want.get("available_size")
        want_devices = {d["chardev"]: d for d in want.get("devices", [])}
        assert {d.chardev for d in region.devices if d.size} == set(want_devices)
        for device in region.devices:
            if not device.size:
                continue  # a zero-sized seed device: daxctl hides it without -i
            wd = want_devices[device.chardev]
            for key in (
                "size",
                "target_node",
                "align",
                "mode",
                "online_memblocks",
                "total_memblocks",
                "movable",
            ):
                assert getattr(device, key) == wd.get(key), (device.chardev, key)
            assert [m.model_dump() for m in device.mappings] == wd["mappings"]


def test_dax_regions_tie_to_cxl_regions(recorded: tuple[Machine, Inventory]) -> None:
    machine, inv = recorded
    for region in inv.cxl.regions:
        if region.dax_region is None:
            continue
        dax_id = int(region.dax_region.removeprefix("dax_region"))
        paths = {r["id"]: r["path"] for r in machine.daxctl_list()}
        assert paths[dax_id].endswith(f"/{region.region}/{region.dax_region}")


def test_nd_devdax_namespaces_are_dax_devices(recorded: tuple[Machine, Inventory]) -> None:
    machine, inv = recorded
    chardevs = {d.chardev: d for d in inv.dax.devices()}
    for ns in walk(machine.ndctl_list()):
        if ns.get("mode") == "devdax" and "chardev" in ns:
            assert chardevs[ns["chardev"]].size == ns["size"]
            assert chardevs[ns["chardev"]].mode == "devdax"


def test_pool_devices_follow_the_dax_modes(recorded: tuple[Machine, Inventory]) -> None:
    """devdax pool per dax region with non-system-ram capacity; numa pool per CPU-less node
    that kmem onlined memory into; identities from the serials cxl list reports."""
    machine, inv = recorded
    memdevs = cxl_memdevs(machine)
    regions = cxl_regions(machine)
    expected_devdax: dict[str, int] = {}
    expected_numa: set[int] = set()
    for region in machine.daxctl_list():
        sysram = [d for d in region.get("devices", []) if d["mode"] == "system-ram"]
        capacity = region["size"] - sum(d["size"] for d in sysram)
        if capacity > 0:
            expected_devdax[f"dax_region{region['id']}"] = capacity
        expected_numa |= {d["target_node"] for d in sysram}
    got_devdax = {d.local_name: d for d in inv.devices if d.kind == "devdax"}
    got_numa = {d.numa_node: d for d in inv.devices if d.kind == "numa" and d.numa_node is not None}
    assert {k: d.capacity_bytes for k, d in got_devdax.items()} == expected_devdax
    assert set(got_numa) == expected_numa
    for device in inv.devices:
        assert not device.host_scoped  # everything here is CXL-backed
        for name in device.cxl_regions:
            want = regions[name]
            serials = sorted(memdevs[m["memdev"]]["serial"] for m in want["mappings"])
            assert f"serials={','.join(map(str, serials))}" in device.uid
            assert f"ways={want['interleave_ways']}" in device.uid
            assert f"size={want['size']}" in device.uid
            assert device.memdev_serials == sorted(set(device.memdev_serials) | set(serials))
    for node_id, device in got_numa.items():
        node = inv.numa.node(node_id)
        assert node is not None
        assert node.has_cpu is False
        # What the node can give less the reserve, never its MemTotal (issue 13).
        assert device.capacity_bytes == numa_capacity_bytes(node)
        assert node.mem_total_bytes is not None
        assert 0 < device.capacity_bytes <= node.mem_total_bytes - DEFAULT_NUMA_RESERVE_BYTES
        assert device.memory_tier == inv.tiers.tier_of(node_id)
        assert device.distance is not None


def test_wire_devices_validate(recorded: tuple[Machine, Inventory]) -> None:
    _, inv = recorded
    wire = to_wire(inv, "host-a")
    assert [w.uid for w in wire] == [d.uid for d in inv.devices]
    assert len({w.uid for w in wire}) == len(wire)


def test_cli_json_uses_cxl_list_names(
    recorded: tuple[Machine, Inventory], machine_root: Callable[[str], Path]
) -> None:
    machine, _ = recorded
    result = CliRunner().invoke(
        inventory_command, ["--sysfs-root", str(machine_root(machine.name)), "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    memdevs = cxl_memdevs(machine)
    for memdev in out["cxl"]["memdevs"]:
        want = memdevs[memdev["memdev"]]
        shared = set(memdev) & set(want) - {"ram_size", "pmem_size"}
        assert shared >= {"memdev", "serial", "host"}
        assert {k: memdev[k] for k in shared} == {k: want[k] for k in shared}
    daxctl = {r["id"]: r for r in machine.daxctl_list()}
    for region in out["dax"]["regions"]:
        want = daxctl[region["id"]]
        for key in ("id", "path", "size", "align"):
            assert region[key] == want[key]


def test_cli_table_lists_every_device(
    recorded: tuple[Machine, Inventory], machine_root: Callable[[str], Path]
) -> None:
    machine, inv = recorded
    result = CliRunner().invoke(
        inventory_command, ["--sysfs-root", str(machine_root(machine.name))]
    )
    assert result.exit_code == 0, result.output
    assert f"memdevs: {len(inv.cxl.memdevs)}" in result.output
