"""A simulated inference engine offloading KV blocks to far memory through agent.kv.

Multi-turn agent sessions share a system prompt and grow a conversation prefix, turn by
turn, with tool-call pauses in between. The engine keeps a small GPU cache (LRU, in
blocks) and writes every computed block through to the far-memory store as a *replica*
(the copy in GPU memory still exists); when the GPU evicts a block, the far copy becomes
the only one (``mark_exclusive``); when a later turn reuses a prefix that only far
memory holds, the engine loads it back (``get``) and it is a replica again. Every few
steps the example prints the store's exclusive ratio; at the end it applies pressure
and shows replicas going first: on a pool lease (``--socket``) the store gives half of
its used bytes back to the pool (``give_back``: the lease itself shrinks), on a bare
memfd it drops blocks (``shrink``).

    python examples/kv_engine.py                      # on a memfd, no agent needed
    python examples/kv_engine.py --socket PATH        # on a lease from a pool agent
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.kv import KVStore

MIB = 1 << 20


@dataclass
class Session:
    name: str
    blocks: list[bytes] = field(default_factory=list)  # keys of its prefix, in order
    paused_until: int = 0
    turns: int = 0


@dataclass
class Engine:
    store: KVStore
    gpu_blocks: int
    block_bytes: int
    gpu: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    computed: int = 0
    loaded: int = 0
    gpu_hits: int = 0

    def _to_gpu(self, key: bytes) -> None:
        self.gpu[key] = None
        self.gpu.move_to_end(key)
        while len(self.gpu) > self.gpu_blocks:
            dropped, _ = self.gpu.popitem(last=False)
            self.store.mark_exclusive(dropped)  # far memory now holds the only copy

    def ensure(self, key: bytes, payload: bytearray) -> None:
        """Make ``key`` resident in the GPU: hit, load from far memory, or recompute."""
        if key in self.gpu:
            self.gpu_hits += 1
            self.gpu.move_to_end(key)
            return
        view = self.store.get(key)
        if view is not None:
            self.loaded += 1  # a real engine would DMA the view into GPU memory here
            self.store.mark_replica(key, "gpu")
        else:
            self.computed += 1
            payload[:32] = hashlib.sha256(key).digest()
            self.store.put(key, payload, replica_of="gpu")  # write-through offload
        self._to_gpu(key)


def chain(parent: bytes, salt: str) -> bytes:
    return hashlib.sha256(parent + salt.encode()).digest()[:16]


def run(store: KVStore, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible workload, not a secret
    engine = Engine(store, gpu_blocks=args.gpu_blocks, block_bytes=args.block_kib << 10)
    payload = bytearray(engine.block_bytes)
    system_prompt = [chain(b"", f"system-{i}") for i in range(8)]
    sessions = [Session(f"agent-{i}", list(system_prompt)) for i in range(args.sessions)]
    print(f"{'step':>4} {'used MiB':>9} {'excl MiB':>9} {'repl MiB':>9} {'excl ratio':>10}")
    for step in range(args.steps):
        if step % args.every == 0 or step == args.steps - 1:
            now = store.stats()
            print(
                f"{step:>4} {now.used_bytes / MIB:>9.1f} {now.exclusive_bytes / MIB:>9.1f} "
                f"{now.replica_bytes / MIB:>9.1f} {now.exclusive_ratio:>10.2f}"
            )
        active = [s for s in sessions if s.paused_until <= step]
        if not active:
            continue  # everyone is waiting on a tool call
        session = rng.choice(active)
        # A turn: re-read the whole prefix (prefix caching), then append new blocks.
        for key in session.blocks:
            engine.ensure(key, payload)
        for _ in range(rng.randint(2, 6)):
            key = chain(session.blocks[-1], f"{session.name}-{session.turns}-{len(session.blocks)}")
            session.blocks.append(key)
            engine.ensure(key, payload)
        session.turns += 1
        if rng.random() < 0.4:  # a tool call: the session waits, its GPU blocks age out
            session.paused_until = step + rng.randint(3, 12)
        if session.turns >= args.turns:  # conversation over: a new one, same system prompt
            session.blocks, session.turns = list(system_prompt), 0
    s = store.stats()
    print(
        f"computed {engine.computed}, loaded from far memory {engine.loaded}, "
        f"GPU hits {engine.gpu_hits}, far-memory evictions {s.evictions}"
    )

    # Pressure: the pool asks for half of the used bytes back; replicas go first.
    want = s.used_bytes // 2
    before = store.stats()
    lease = store.lease
    if lease is not None and lease.shrinkable:
        leased = lease.length_bytes
        freed = store.give_back(want)
        print(f"lease {lease.lease_id}: {leased / MIB:.0f} -> {lease.length_bytes / MIB:.0f} MiB")
    else:
        freed = store.shrink(want)
    after = store.stats()
    print(
        f"pressure: asked {want / MIB:.1f} MiB, freed {freed / MIB:.1f} MiB; "
        f"replicas {before.replica_bytes / MIB:.1f} -> {after.replica_bytes / MIB:.1f} MiB, "
        f"exclusive {before.exclusive_bytes / MIB:.1f} -> {after.exclusive_bytes / MIB:.1f} MiB"
    )
    replica_bytes = before.replica_bytes
    lost_exclusive = before.exclusive_bytes - after.exclusive_bytes
    assert lost_exclusive == 0 or after.replica_bytes == 0, "exclusive dropped before replicas"
    if lost_exclusive == 0:
        print(
            f"no exclusive block was dropped ({replica_bytes / MIB:.1f} MiB of replicas sufficed)"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--socket", help="lease from the pool agent at this socket instead")
    ap.add_argument("--mib", type=int, default=64, help="far memory to use (MiB)")
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--gpu-blocks", type=int, default=48, help="simulated GPU cache (blocks)")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="print every N steps")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    length = args.mib * MIB
    block_bytes = args.block_kib << 10

    if args.socket:
        from agent.client import PoolClient

        with (
            PoolClient(args.socket) as pool,
            pool.lease(length, ttl_s=60, shrinkable=True) as lease,
        ):
            print(f"lease {lease.lease_id} epoch {lease.epoch}: {lease.length_bytes} bytes")
            with KVStore.open(lease, block_bytes=block_bytes, report_interval_s=0.5) as store:
                run(store, args)
                reporter = store.reporter
                if reporter is not None:
                    reporter.flush()
                    print(f"reports sent to the agent: {reporter.sent}")
        return 0

    from agent.backends.emulated import materialise

    fd = materialise(length, "kv-engine-example")
    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        with KVStore(mm, "example-lease", 1, block_bytes=block_bytes) as store:
            run(store, args)
    finally:
        mm.close()
        os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
