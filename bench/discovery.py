"""Discovery latency over a generated sysfs tree (64 memdevs, 32 regions, 64 dax devices).

    .venv/bin/python bench/discovery.py [--runs 50] [--json]

Discovery runs on every hotplug rescan and before every heartbeat digest, so it must stay
cheap at rack-scale device counts. Target: median <= 50 ms.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.discovery.inventory import discover
from tests.fixtures.synthetic import write_synthetic_sysfs

TARGET_MEDIAN_MS = 50.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def files_discovery_reads(sys_root: Path) -> list[str]:
    """The attribute files one discover() opens (recorded by wrapping os.open once)."""
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: str, flags: int, *args: int, **kw: int) -> int:
        opened.append(path)
        return real_open(path, flags, *args, **kw)

    os.open = recording_open  # type: ignore[assignment]
    try:
        discover(sys_root)
    finally:
        os.open = real_open
    return opened


def read_files(paths: list[str]) -> int:
    """The floor: the same opens and reads discovery does, without listing or parsing."""
    total = 0
    for path in paths:
        try:  # discovery probes attributes a kernel may not have: same failed opens
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            total += len(os.read(fd, 4096))
        finally:
            os.close(fd)
    return total


@click.command()
@click.option("--runs", default=50, show_default=True, help="Timed discoveries.")
@click.option("--memdevs", default=64, show_default=True)
@click.option("--regions", default=32, show_default=True)
@click.option("--dax-devices", default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
def main(runs: int, memdevs: int, regions: int, dax_devices: int, as_json: bool) -> None:
    """Time discover() over a synthetic tree."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = write_synthetic_sysfs(
            Path(tmp), memdevs=memdevs, regions=regions, dax_devices=dax_devices
        )
        inv = discover(tree.sys_root)  # warm-up: page cache, imports
        if inv.warnings:
            raise SystemExit(f"synthetic tree produced warnings: {inv.warnings[:3]}")
        paths = files_discovery_reads(tree.sys_root)
        times_ms: list[float] = []
        floor_ms: list[float] = []
        for _ in range(runs):  # interleaved, so both see the same machine state
            start = time.perf_counter()
            read_files(paths)
            floor_ms.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            discover(tree.sys_root)
            times_ms.append((time.perf_counter() - start) * 1000)
    result = {
        "runs": runs,
        "median_ms": round(statistics.median(times_ms), 2),
        "p99_ms": round(percentile(times_ms, 99), 2),
        "floor_median_ms": round(statistics.median(floor_ms), 2),
        "floor_p99_ms": round(percentile(floor_ms, 99), 2),
        "over_floor": round(statistics.median(times_ms) / statistics.median(floor_ms), 2),
        "files_read": len(paths),
        "min_ms": round(min(times_ms), 2),
        "max_ms": round(max(times_ms), 2),
        "memdevs": len(inv.cxl.memdevs),
        "regions": len(inv.cxl.regions),
        "dax_devices": len(inv.dax.devices()),
        "nodes": len(inv.numa.nodes),
        "pool_devices": len(inv.devices),
        "target_median_ms": TARGET_MEDIAN_MS,
        "within_target": statistics.median(times_ms) <= TARGET_MEDIAN_MS,
    }
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title="discovery over a synthetic sysfs tree")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, str(value))
    Console().print(table)


if __name__ == "__main__":
    main()
