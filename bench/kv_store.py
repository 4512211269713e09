"""KV block store hot path against plain memcpy into the same mapping, in the same run.

On one memfd mapping (emulated backend, prefaulted, sealed; 256 MiB by default) with
1 MiB slots:

* put: ``store.put(key, block)`` for every slot, against ``mapping[a:b] = block`` at
  the same offsets (one memcpy each); "put new" puts a new key each time into the full
  store, so each put also evicts the LRU block (the steady state of an engine);
* get: ``store.get_into(key, out)`` (copy out into a caller buffer, what an engine does
  when it loads a block back towards the GPU), against ``out[:] = mapping[a:b]``;
* get-view: ``store.get(key)`` (zero-copy view) calls per second, for reference;
* mark: per-call cost of ``mark_replica(key, "gpu")`` and ``mark_exclusive(key)``.

Each throughput figure is the median of ``--runs`` pairs, each pair measuring the
baseline and the store back to back (in alternating order); the ratio is the median of
the per-pair ratios, so host noise hits both sides of a pair alike.

    .venv/bin/python bench/kv_store.py [--mib 256] [--runs 15] [--json]
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

from agent.backends.emulated import materialise  # noqa: E402
from agent.kv import KVStore  # noqa: E402

MARK_BATCH = 1000


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(
    baseline: Callable[[], None], store: Callable[[], None], runs: int
) -> tuple[list[float], list[float]]:
    """Seconds per run of each, measured in pairs with alternating order."""
    base_s: list[float] = []
    store_s: list[float] = []
    for i in range(runs):
        if i % 2:
            store_s.append(timed(store))
            base_s.append(timed(baseline))
        else:
            base_s.append(timed(baseline))
            store_s.append(timed(store))
    return base_s, store_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="mapping size (MiB)")
    ap.add_argument("--runs", type=int, default=15, help="paired runs per figure")
    ap.add_argument("--block-kib", type=int, default=1024, help="block (slot) size (KiB)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    length: int = args.mib << 20
    block_bytes: int = args.block_kib << 10
    fd = materialise(length, "poold-bench-kv")
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mm)
    store = KVStore(mm, "bench-lease", 1, block_bytes=block_bytes)
    spec = store.geometry.classes[0]
    offsets = [spec.region_offset + i * block_bytes for i in range(spec.slot_count)]
    keys = [f"prefix-{i:08d}".encode() for i in range(spec.slot_count)]
    block = os.urandom(block_bytes)
    out = bytearray(block_bytes)
    out_view = memoryview(out)
    total_bytes = block_bytes * len(keys)

    # Fault every page of the mapping in, and fill the store, before timing anything.
    for offset in offsets:
        mm[offset : offset + block_bytes] = block
    for key in keys:
        store.put(key, block)

    def base_put() -> None:
        for offset in offsets:
            mm[offset : offset + block_bytes] = block

    def kv_put() -> None:
        put = store.put
        for key in keys:
            put(key, block)

    fresh = iter(
        [[f"new-{r}-{i:08d}".encode() for i in range(len(keys))] for r in range(args.runs)]
    )

    def kv_put_new() -> None:
        put = store.put
        for key in next(fresh):  # every put a new key into a full store: one eviction each
            put(key, block)

    def base_get() -> None:
        for offset in offsets:
            out_view[:] = view[offset : offset + block_bytes]

    def kv_get() -> None:
        get_into = store.get_into
        for key in keys:
            get_into(key, out)

    def kv_view() -> None:
        get = store.get
        for key in keys:
            get(key)

    put_base, put_kv = paired(base_put, kv_put, args.runs)
    new_base, new_kv = paired(base_put, kv_put_new, args.runs)
    evictions = store.evictions
    for key in keys:  # the get keys back in the store
        store.put(key, block)
    get_base, get_kv = paired(base_get, kv_get, args.runs)
    view_s = [timed(kv_view) for _ in range(args.runs)]

    def gbps(seconds: list[float]) -> float:
        return total_bytes / statistics.median(seconds) / 1e9

    put_ratio = statistics.median(b / s for b, s in zip(put_base, put_kv, strict=True))
    new_ratio = statistics.median(b / s for b, s in zip(new_base, new_kv, strict=True))
    get_ratio = statistics.median(b / s for b, s in zip(get_base, get_kv, strict=True))

    mark_replica_us: list[float] = []
    mark_exclusive_us: list[float] = []
    mark_keys = (keys * (MARK_BATCH // len(keys) + 1))[:MARK_BATCH]
    mark_replica, mark_exclusive = store.mark_replica, store.mark_exclusive
    for _ in range(max(args.runs, 25)):
        t0 = time.perf_counter()
        for key in mark_keys:
            mark_replica(key, "gpu")
        t1 = time.perf_counter()
        for key in mark_keys:
            mark_exclusive(key)
        t2 = time.perf_counter()
        mark_replica_us.append((t1 - t0) / len(mark_keys) * 1e6)
        mark_exclusive_us.append((t2 - t1) / len(mark_keys) * 1e6)

    result = {
        "mapping_mib": args.mib,
        "block_bytes": block_bytes,
        "blocks": len(keys),
        "runs": args.runs,
        "memcpy_put_gbps": gbps(put_base),
        "kv_put_gbps": gbps(put_kv),
        "put_ratio": put_ratio,
        "kv_put_new_gbps": gbps(new_kv),
        "put_new_ratio": new_ratio,
        "put_new_evictions": evictions,
        "memcpy_get_gbps": gbps(get_base),
        "kv_get_gbps": gbps(get_kv),
        "get_ratio": get_ratio,
        "get_view_us_median": statistics.median(view_s) / len(keys) * 1e6,
        "mark_replica_us_median": statistics.median(mark_replica_us),
        "mark_exclusive_us_median": statistics.median(mark_exclusive_us),
        "mark_us_median": statistics.median(mark_replica_us + mark_exclusive_us),
    }
    view.release()
    store.close()
    mm.close()
    os.close(fd)

    if args.json:
        print(json.dumps(result))
        return 0
    rows = [
        ("put, memcpy (GB/s)", f"{result['memcpy_put_gbps']:.2f}"),
        ("put, kv store (GB/s)", f"{result['kv_put_gbps']:.2f}"),
        ("put ratio (target >= 0.85)", f"{put_ratio:.3f}"),
        ("put new key + evict, kv (GB/s)", f"{result['kv_put_new_gbps']:.2f}"),
        ("put new key + evict, ratio", f"{new_ratio:.3f}"),
        ("get, memcpy (GB/s)", f"{result['memcpy_get_gbps']:.2f}"),
        ("get_into, kv store (GB/s)", f"{result['kv_get_gbps']:.2f}"),
        ("get ratio (target >= 0.90)", f"{get_ratio:.3f}"),
        ("get zero-copy view (us/call)", f"{result['get_view_us_median']:.3f}"),
        ("mark_replica (us/call)", f"{result['mark_replica_us_median']:.3f}"),
        ("mark_exclusive (us/call)", f"{result['mark_exclusive_us_median']:.3f}"),
        ("mark median (target <= 5 us)", f"{result['mark_us_median']:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print(
        f"kv store bench: {args.mib} MiB memfd, {len(keys)} x {args.block_kib} KiB blocks, "
        f"{args.runs} runs"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
