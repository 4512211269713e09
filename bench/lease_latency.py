"""End-to-end lease latency through the agent socket, against the memfd floor.

Starts `poold serve` (SQLite) and `pool-agent serve` as separate processes,
then runs N cycles of: lease 2 MiB -> mmap -> touch every page -> munmap ->
release. The floor, measured in the same run, is the in-process
memfd_create + ftruncate + mmap + munmap + close of the same size (the issue's
definition); "floor+touch" adds the same page touching, for reference.

    .venv/bin/python bench/lease_latency.py [--iterations 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.client import PoolClient  # noqa: E402
from poold import procs  # noqa: E402

SIZE = 2 << 20
PAGE = mmap.PAGESIZE


def touch(mm: mmap.mmap) -> None:
    for off in range(0, len(mm), PAGE):
        mm[off] = 1


def floor_once(with_touch: bool) -> float:
    t0 = time.perf_counter()
    fd = os.memfd_create("floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    if with_touch:
        touch(mm)
    mm.close()
    os.close(fd)
    return time.perf_counter() - t0


def cycle_once(client: PoolClient) -> float:
    t0 = time.perf_counter()
    lease = client.lease(SIZE, ttl_s=60, renew=False)
    mm = lease.mmap()
    touch(mm)
    mm.close()
    lease.release()
    return time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": pct(ms, 0.99),
        "mean_ms": statistics.fmean(ms),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    floor: list[float] = []
    floor_touch: list[float] = []
    cycles: list[float] = []
    with procs.local_pool() as (_admin, sock), PoolClient(sock) as client:
        for _ in range(args.warmup):
            cycle_once(client)
            floor_once(True)
        # Interleave so that both see the same machine state.
        for _ in range(args.iterations):
            floor.append(floor_once(False))
            floor_touch.append(floor_once(True))
            cycles.append(cycle_once(client))

    f, ft, c = summary(floor), summary(floor_touch), summary(cycles)
    result = {
        "iterations": args.iterations,
        "lease_bytes": SIZE,
        "database": "sqlite",
        "p50_ms": c["p50_ms"],
        "p99_ms": c["p99_ms"],
        "floor_p50_ms": f["p50_ms"],
        "floor_p99_ms": f["p99_ms"],
        "floor_touch_p50_ms": ft["p50_ms"],
        "floor_touch_p99_ms": ft["p99_ms"],
        "p50_over_floor_ms": c["p50_ms"] - f["p50_ms"],
        "p99_over_floor_ms": c["p99_ms"] - f["p99_ms"],
        "target_p50_over_floor_ms": 1.5,
        "target_p99_over_floor_ms": 5.0,
    }
    result["meets_target"] = (
        result["p50_over_floor_ms"] <= 1.5 and result["p99_over_floor_ms"] <= 5.0
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"lease cycle of {SIZE >> 20} MiB, {args.iterations} iterations (SQLite ledger)")
    print(f"{'':28}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, s in (("floor (memfd+mmap)", f), ("floor + touch", ft), ("lease cycle", c)):
        print(f"{name:28}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}")
    print(
        f"{'cycle - floor':28}{result['p50_over_floor_ms']:>10.3f}"
        f"{result['p99_over_floor_ms']:>10.3f}"
    )
    print(
        f"target: p50 <= floor + 1.5 ms, p99 <= floor + 5 ms -> "
        f"{'MET' if result['meets_target'] else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
