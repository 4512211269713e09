"""A 4 GiB prefaulted lease end to end, and the bandwidth of its mapping, against floors.

Starts `poold serve` (SQLite) and `pool-agent serve --emulated` as separate processes,
then runs paired, interleaved rounds (the order inside a pair alternates):

* **lease time**: `PoolClient.lease(4 GiB)` until it returns the fd (agent: memfd,
  ftruncate, posix_fallocate prefault, seals; grant+activate in poold; SCM_RIGHTS),
  against the floor of an in-process `memfd_create` + `ftruncate` + `posix_fallocate`
  of 4 GiB: the prefault method the emulated backend uses (agent/backends/emulated.py).
  The agent's warm pool holds only leases up to 16 MiB, so it plays no part here.
* **bandwidth**: one memcpy (`mm[0:n] = src`, a 1 GiB bytes source) into the lease's
  MAP_SHARED mapping against the same copy into private anonymous memory
  (`mmap.mmap(-1, n, MAP_PRIVATE)`). Both mappings are new in each pair; the first copy
  into each takes the page faults ("first touch"), the next `--copies` copies are the
  steady state that `bandwidth_ratio` reports. Anonymous memory with MADV_NOHUGEPAGE is
  measured too, for reference (this host has THP on for anonymous memory, off for shmem).
* **numa** (node 0, this host's only node, which has CPUs: the issue's
  numa-on-local-node path where there is no CXL): the backend's own cost, in process,
  not through poold: `NumaBackend().materialise_on(0, 4 GiB)` (node capacity check,
  posix_fallocate with the calling thread bound by set_mempolicy(MPOL_BIND), mbind of a
  throwaway mapping that leaves MPOL_BIND on the memfd as its shared policy, move_pages
  check of a ~1,026-page sample, seals), against the same fallocate floor and, for
  reference, against memfd + mmap + MADV_POPULATE_WRITE (the prefault this backend used
  before); then the same bandwidth comparison on its mapping. `numa_over_floor_min` and
  `numa_over_floor_max` give the spread of the per-pair ratios.

Each ratio is the median of per-pair ratios. Releases and closes happen between runs,
so at most ~7 GiB is held at once (a 4 GiB lease, the 1 GiB source, two 1 GiB anon maps).

* **populated** (pin-ready leases): `lease(4 GiB, populate=True, hugepages=off|prefer)`
  against memfd + `MADV_POPULATE_WRITE` of 4 GiB in process (`floor_populate`); the
  agent populates in parallel slices (one thread per GiB, up to the CPUs) and replies
  with `populated` and the page size it got (`prefer` falls back to 4 KiB pages on a
  host with no 2 MiB hugetlb pool).

    .venv/bin/python bench/lease_size.py [--pairs 5] [--copies 3] [--no-numa]
        [--no-populated] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.backends import numa_sys  # noqa: E402
from agent.backends.numa import NumaBackend  # noqa: E402
from agent.client import PoolClient  # noqa: E402
from poold import procs  # noqa: E402

GIB = 1 << 30
LEASE_BYTES = 4 * GIB
COPY_BYTES = 1 * GIB
NODE = 0
TARGET_LEASE_OVER_FLOOR = 1.10
TARGET_BANDWIDTH_RATIO = 0.97
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", numa_sys.MADV_POPULATE_WRITE)


def floor_fallocate() -> float:
    """memfd_create + ftruncate + posix_fallocate of LEASE_BYTES, as the emulated backend."""
    t0 = time.perf_counter()
    fd = os.memfd_create("floor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, LEASE_BYTES)
    os.posix_fallocate(fd, 0, LEASE_BYTES)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return elapsed


def floor_populate() -> float:
    """memfd_create + ftruncate + mmap + MADV_POPULATE_WRITE + munmap: the numa backend's
    previous prefault, kept for reference."""
    t0 = time.perf_counter()
    fd = os.memfd_create("floor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, LEASE_BYTES)
    address = numa_sys.map_shared(fd, LEASE_BYTES)
    numa_sys.madvise(address, LEASE_BYTES, numa_sys.MADV_POPULATE_WRITE)
    numa_sys.unmap(address, LEASE_BYTES)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return elapsed


def timed_copy(mm: mmap.mmap, src: bytes) -> float:
    """Seconds for one memcpy of ``src`` into the start of ``mm``."""
    t0 = time.perf_counter()
    mm[0 : len(src)] = src
    return time.perf_counter() - t0


def anon(huge: bool) -> mmap.mmap:
    mm = mmap.mmap(-1, COPY_BYTES, flags=mmap.MAP_PRIVATE)
    if not huge:
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return mm


class Bandwidth:
    """Per-pair copy times into a memory under test and into anonymous memory."""

    def __init__(self) -> None:
        self.first: list[tuple[float, float]] = []  # (memory, anon) first touch
        self.steady: list[tuple[float, float]] = []  # (memory, anon THP as the host has it)
        self.steady_nothp: list[tuple[float, float]] = []  # (memory, anon MADV_NOHUGEPAGE)

    def run(self, target: mmap.mmap, src: bytes, copies: int, memory_first: bool) -> None:
        a, b = anon(huge=True), anon(huge=False)
        try:
            if memory_first:
                m = timed_copy(target, src)
                x = timed_copy(a, src)
            else:
                x = timed_copy(a, src)
                m = timed_copy(target, src)
            self.first.append((m, x))
            b.madvise(MADV_POPULATE_WRITE)  # fault it in (faster than a copy); not compared
            for i in range(copies):
                order: list[Callable[[], float]] = [
                    lambda: timed_copy(target, src),
                    lambda: timed_copy(a, src),
                    lambda: timed_copy(b, src),
                ]
                if (i + int(memory_first)) % 2:
                    order.reverse()
                times = [f() for f in order]
                if (i + int(memory_first)) % 2:
                    times.reverse()
                m, x, y = times
                self.steady.append((m, x))
                self.steady_nothp.append((m, y))
        finally:
            a.close()
            b.close()

    @staticmethod
    def gbps(pairs: list[tuple[float, float]], side: int) -> float:
        return statistics.median(COPY_BYTES / p[side] / 1e9 for p in pairs)

    @staticmethod
    def ratio(pairs: list[tuple[float, float]]) -> float:
        """Median of per-pair bandwidth ratios (memory / anon) = anon time / memory time."""
        return statistics.median(x / m for m, x in pairs)

    def summary(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}bandwidth_ratio": self.ratio(self.steady),
            f"{prefix}bandwidth_gbps": self.gbps(self.steady, 0),
            f"{prefix}anon_gbps": self.gbps(self.steady, 1),
            f"{prefix}bandwidth_ratio_vs_anon_nothp": self.ratio(self.steady_nothp),
            f"{prefix}anon_nothp_gbps": self.gbps(self.steady_nothp, 1),
            f"{prefix}first_touch_ratio": self.ratio(self.first),
            f"{prefix}first_touch_gbps": self.gbps(self.first, 0),
            f"{prefix}anon_first_touch_gbps": self.gbps(self.first, 1),
        }


def ms_median(values: list[float]) -> float:
    return statistics.median(values) * 1000


def pair_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a / b for a, b in pairs)


def run_lease(client: PoolClient, src: bytes, args: argparse.Namespace) -> dict[str, float]:
    timing: list[tuple[float, float]] = []  # (lease, floor)
    bw = Bandwidth()

    def lease_and_copy(pair: int) -> float:
        t0 = time.perf_counter()
        lease = client.lease(LEASE_BYTES, ttl_s=600, renew=False)
        elapsed = time.perf_counter() - t0
        try:
            if lease.length_bytes != LEASE_BYTES or lease.backend != "emulated":
                raise RuntimeError(f"unexpected lease: {lease.length_bytes} {lease.backend}")
            if pair >= 0:
                mm = lease.mmap()
                try:
                    bw.run(mm, src, args.copies, memory_first=pair % 2 == 0)
                finally:
                    mm.close()
        finally:
            lease.release()
        return elapsed

    for _ in range(args.warmup):
        lease_and_copy(-1)
        floor_fallocate()
    for pair in range(args.pairs):
        if pair % 2 == 0:
            t_lease = lease_and_copy(pair)
            t_floor = floor_fallocate()
        else:
            t_floor = floor_fallocate()
            t_lease = lease_and_copy(pair)
        timing.append((t_lease, t_floor))
        log(
            args,
            f"  lease pair {pair}: lease {t_lease * 1000:.0f} ms, floor {t_floor * 1000:.0f} ms",
        )
    return {
        "lease_ms": ms_median([t for t, _ in timing]),
        "floor_ms": ms_median([f for _, f in timing]),
        "lease_over_floor": pair_ratio(timing),
        "lease_minus_floor_ms": statistics.median(t - f for t, f in timing) * 1000,
        **bw.summary(""),
    }


def run_populated(client: PoolClient, hugepages: str, args: argparse.Namespace) -> dict[str, float]:
    """A pin-ready lease: `lease(4 GiB, populate=True, hugepages=...)`, every page faulted
    in by the agent before it replies, against the floor of memfd + MADV_POPULATE_WRITE
    of the same size in this process (`floor_populate`), pairs interleaved."""
    timing: list[tuple[float, float]] = []
    page_bytes: list[int] = []

    def lease_once() -> float:
        t0 = time.perf_counter()
        lease = client.lease(
            LEASE_BYTES, ttl_s=600, renew=False, populate=True, hugepages=hugepages
        )
        elapsed = time.perf_counter() - t0
        try:
            if not lease.populated or lease.length_bytes != LEASE_BYTES:
                raise RuntimeError(f"lease not populated: {lease}")
            page_bytes.append(lease.page_size_bytes)
        finally:
            lease.release()
        return elapsed

    for _ in range(args.warmup):
        lease_once()
        floor_populate()
    for pair in range(args.pairs):
        if pair % 2 == 0:
            t_lease, t_floor = lease_once(), floor_populate()
        else:
            t_floor = floor_populate()
            t_lease = lease_once()
        timing.append((t_lease, t_floor))
        log(
            args,
            f"  populated ({hugepages}) pair {pair}: lease {t_lease * 1000:.0f} ms, "
            f"floor {t_floor * 1000:.0f} ms",
        )
    key = f"populated_{hugepages}"
    return {
        f"{key}_ms": ms_median([t for t, _ in timing]),
        f"{key}_floor_ms": ms_median([f for _, f in timing]),
        f"{key}_over_floor": pair_ratio(timing),
        f"{key}_page_bytes": float(max(page_bytes)),
    }


def run_numa(src: bytes, args: argparse.Namespace) -> dict[str, float]:
    backend = NumaBackend()
    timing: list[tuple[float, float, float]] = []  # (numa, fallocate floor, populate floor)
    bw = Bandwidth()
    for _ in range(args.warmup):
        backend.release(backend.materialise_on(NODE, LEASE_BYTES, "bench-numa-warmup"))
    for pair in range(args.pairs):
        steps: list[str] = ["numa", "fallocate", "populate"]
        if pair % 2:
            steps.reverse()
        got: dict[str, float] = {}
        for step in steps:
            if step == "fallocate":
                got[step] = floor_fallocate()
            elif step == "populate":
                got[step] = floor_populate()
            else:
                t0 = time.perf_counter()
                memory = backend.materialise_on(NODE, LEASE_BYTES, "bench-numa")
                got[step] = time.perf_counter() - t0
                try:
                    mm = mmap.mmap(
                        memory.fd,
                        LEASE_BYTES,
                        flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    )
                    try:
                        bw.run(mm, src, args.copies, memory_first=pair % 2 == 0)
                    finally:
                        mm.close()
                finally:
                    backend.release(memory)
        timing.append((got["numa"], got["fallocate"], got["populate"]))
        log(
            args,
            f"  numa pair {pair}: numa {got['numa'] * 1000:.0f} ms, "
            f"fallocate floor {got['fallocate'] * 1000:.0f} ms, "
            f"populate floor {got['populate'] * 1000:.0f} ms",
        )
    return {
        "numa_ms": ms_median([n for n, _, _ in timing]),
        "numa_floor_ms": ms_median([f for _, f, _ in timing]),
        "numa_populate_floor_ms": ms_median([p for _, _, p in timing]),
        "numa_over_floor": pair_ratio([(n, f) for n, f, _ in timing]),
        "numa_over_floor_min": min(n / f for n, f, _ in timing),
        "numa_over_floor_max": max(n / f for n, f, _ in timing),
        "numa_over_populate_floor": pair_ratio([(n, p) for n, _, p in timing]),
        **bw.summary("numa_"),
    }


def log(args: argparse.Namespace, line: str) -> None:
    if not args.json:
        print(line, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--copies", type=int, default=3, help="steady-state copies per pair")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-numa", action="store_true")
    ap.add_argument("--no-populated", action="store_true", help="skip the pin-ready leases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    started = time.perf_counter()
    src = b"\xa5" * COPY_BYTES  # real pages, not the shared zero page
    # Ledger capacity only; a release reaches poold on the next grant, so the
    # previous lease may still count while the next one is granted.
    pool = procs.local_pool(
        tenant_quota_bytes=1 << 35,
        tenant_quota_leases=1000,
        emulated_capacity_bytes=4 * LEASE_BYTES,
    )
    with pool as (_admin, sock), PoolClient(sock) as client:
        result: dict[str, object] = {
            "pairs": args.pairs,
            "copies_per_pair": args.copies,
            "lease_bytes": LEASE_BYTES,
            "copy_bytes": COPY_BYTES,
            "database": "sqlite",
            "prefault": "posix_fallocate (emulated backend's method)",
        }
        result.update(run_lease(client, src, args))
        if not args.no_populated:
            for mode in ("off", "prefer"):
                result.update(run_populated(client, mode, args))
                over = float(result[f"populated_{mode}_over_floor"])  # type: ignore[arg-type]
                result[f"populated_{mode}_meets_target"] = over <= TARGET_LEASE_OVER_FLOOR
    if not args.no_numa:
        result["numa_node"] = NODE
        result.update(run_numa(src, args))
    result["target_lease_over_floor"] = TARGET_LEASE_OVER_FLOOR
    result["target_bandwidth_ratio"] = TARGET_BANDWIDTH_RATIO
    lof, bwr = float(result["lease_over_floor"]), float(result["bandwidth_ratio"])  # type: ignore[arg-type]
    result["meets_lease_target"] = lof <= TARGET_LEASE_OVER_FLOOR
    result["meets_bandwidth_target"] = bwr >= TARGET_BANDWIDTH_RATIO
    result["meets_target"] = bool(result["meets_lease_target"] and result["meets_bandwidth_target"])
    if not args.no_numa:
        result["numa_meets_lease_target"] = (
            float(result["numa_over_floor"]) <= TARGET_LEASE_OVER_FLOOR  # type: ignore[arg-type]
        )
        result["numa_meets_bandwidth_target"] = (
            float(result["numa_bandwidth_ratio"]) >= TARGET_BANDWIDTH_RATIO  # type: ignore[arg-type]
        )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result))
        return 0
    print_table(result, args)
    return 0


def print_table(r: dict[str, object], args: argparse.Namespace) -> None:
    def row(name: str, value: object, fmt: str = ".3f") -> None:
        text = format(value, fmt) if isinstance(value, float) else str(value)
        print(f"  {name:44}{text:>12}")

    def verdict(ok: object) -> str:
        return "MET" if ok else "MISSED"

    print(
        f"lease size bench: {LEASE_BYTES >> 30} GiB lease, {COPY_BYTES >> 30} GiB copies, "
        f"{args.pairs} pairs x {args.copies} steady copies (SQLite ledger)"
    )
    print("emulated lease through poold + pool-agent (prefault: posix_fallocate)")
    row("floor memfd+fallocate (ms, median)", r["floor_ms"], ".0f")
    row("lease() call (ms, median)", r["lease_ms"], ".0f")
    row("lease - floor (ms, median of pairs)", r["lease_minus_floor_ms"], ".0f")
    row(f"lease / floor (target <= {TARGET_LEASE_OVER_FLOOR})", r["lease_over_floor"])
    row("  ->", verdict(r["meets_lease_target"]))
    row("anon memcpy (GB/s)", r["anon_gbps"], ".2f")
    row("lease mapping memcpy (GB/s)", r["bandwidth_gbps"], ".2f")
    row(f"bandwidth ratio (target >= {TARGET_BANDWIDTH_RATIO})", r["bandwidth_ratio"])
    row("  ->", verdict(r["meets_bandwidth_target"]))
    row("anon, MADV_NOHUGEPAGE (GB/s)", r["anon_nothp_gbps"], ".2f")
    row("ratio vs anon without THP", r["bandwidth_ratio_vs_anon_nothp"])
    row("first touch: anon (GB/s)", r["anon_first_touch_gbps"], ".2f")
    row("first touch: lease mapping (GB/s)", r["first_touch_gbps"], ".2f")
    row("first touch ratio", r["first_touch_ratio"])
    for mode in ("off", "prefer"):
        if f"populated_{mode}_ms" not in r:
            continue
        print(f"pin-ready lease: populate=True, hugepages={mode} (MADV_POPULATE_WRITE)")
        row("floor memfd+MADV_POPULATE_WRITE (ms)", r[f"populated_{mode}_floor_ms"], ".0f")
        row("lease(populate) call (ms, median)", r[f"populated_{mode}_ms"], ".0f")
        row("page size got (bytes)", int(r[f"populated_{mode}_page_bytes"]))  # type: ignore[call-overload]
        row(
            f"lease / floor (target <= {TARGET_LEASE_OVER_FLOOR})",
            r[f"populated_{mode}_over_floor"],
        )
        row("  ->", verdict(r[f"populated_{mode}_meets_target"]))
    if "numa_ms" not in r:
        return
    print(f"numa backend in process, node {NODE} (prefault: fallocate under MPOL_BIND)")
    row("floor memfd+fallocate (ms, median)", r["numa_floor_ms"], ".0f")
    row("memfd+MADV_POPULATE_WRITE (old prefault, ms)", r["numa_populate_floor_ms"], ".0f")
    row("materialise_on (ms, median)", r["numa_ms"], ".0f")
    row(f"numa / fallocate floor (target <= {TARGET_LEASE_OVER_FLOOR})", r["numa_over_floor"])
    row("  ->", verdict(r["numa_meets_lease_target"]))
    row("  per-pair min", r["numa_over_floor_min"])
    row("  per-pair max", r["numa_over_floor_max"])
    row("numa / MADV_POPULATE_WRITE", r["numa_over_populate_floor"])
    row("anon memcpy (GB/s)", r["numa_anon_gbps"], ".2f")
    row("numa mapping memcpy (GB/s)", r["numa_bandwidth_gbps"], ".2f")
    row(f"bandwidth ratio (target >= {TARGET_BANDWIDTH_RATIO})", r["numa_bandwidth_ratio"])
    row("  ->", verdict(r["numa_meets_bandwidth_target"]))
    row("ratio vs anon without THP", r["numa_bandwidth_ratio_vs_anon_nothp"])
    row("first touch ratio", r["numa_first_touch_ratio"])
    print(f"wall time {r['wall_s']} s")


if __name__ == "__main__":
    raise SystemExit(main())
