"""Administrator annotations from TOML, merged onto pool devices."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent.discovery.annotations import (
    AnnotationError,
    Annotations,
    load_annotations,
    merge_for_device,
)
from agent.discovery.inventory import discover, to_wire

CONFIG = """
[annotations.memdev.3]
media = "ddr4"
recycled = true
provenance = "db-17 DIMMs, 2019"
cost_per_gib_month = 0.4

[annotations.memdev."0x4"]
media = "ddr4"
recycled = false
cost_per_gib_month = 0.6

[annotations.memdev.1]
media = "ddr5"

[annotations.device."cxl:pmem:serials=2:ways=1:gran=256:size=268435456"]
media = "ddr5"
provenance = "new"
"""


def test_load_and_merge(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(CONFIG)
    notes = load_annotations(path)
    assert set(notes.memdev) == {1, 3, 4}
    merged = merge_for_device(notes, "x", [3, 4])
    assert merged.media == "ddr4"
    assert merged.recycled is True
    assert merged.cost_per_gib_month == pytest.approx(0.5)
    assert merged.provenance == "db-17 DIMMs, 2019"
    mixed = merge_for_device(notes, "x", [1, 3])
    assert mixed.media == "mixed"
    assert mixed.cost_per_gib_month is None  # serial 1 has no cost


def test_applied_to_recorded_machine(tmp_path: Path, machine_root: Callable[[str], Path]) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(CONFIG)
    inv = discover(machine_root("qemu-full-06-interleave"), annotations=load_annotations(path))
    by_name = {d.local_name: d for d in inv.devices}
    assert by_name["node2"].media == "ddr4"
    assert by_name["node2"].recycled  # serials 3+4
    assert by_name["dax_region2"].media == "ddr5"
    assert by_name["dax_region2"].provenance == "new"
    wire = {w.local_name: w for w in to_wire(inv, "h1")}
    assert wire["node2"].cost_per_gib_month == pytest.approx(0.5)
    assert wire["node1"].media == "ddr5"


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[memdev.1]\nmedia = "DDR 4"\n')
    with pytest.raises(AnnotationError):
        load_annotations(path)
    path.write_text("[memdev.1\n")
    with pytest.raises(AnnotationError):
        load_annotations(path)
    path.write_text("[memdev.1]\ncolour = 'red'\n")
    with pytest.raises(AnnotationError):
        load_annotations(path)
    assert load_annotations(tmp_path / "absent.toml") == Annotations()
