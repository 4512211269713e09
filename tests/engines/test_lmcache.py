"""LMCache's real storage-plugin loader and DAX backend on a poold lease (CPU only).

Real poold + agent processes (tests/e2e/conftest.py), LMCache 0.5.x and a CPU torch from
scripts/engines-venv: the plugin is loaded by LMCache's own `CreateStorageBackends` from
the configuration a user writes, stores and loads KV chunks through `DaxCore` on the
lease's /proc/self/fd path, and answers shrink and revoke.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.e2e.conftest import Cluster

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache.v1.storage_backend.plugins.dax_backend")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402

from agent.engines.lmcache import PoolDaxBackend  # noqa: E402

MIB = 1 << 20
CHUNK = 16  # tokens per chunk
KV_SHAPE = (2, 2, CHUNK, 4, 64)  # layers, k/v, tokens, heads, head size: 32 KiB chunks


def user_config(cluster: Cluster, size_gib: float, **extra: Any) -> Any:
    """The LMCache configuration README.md tells a user to write."""
    return LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": 0.05,
            "storage_plugins": ["pool"],
            "extra_config": {
                "storage_plugin.pool.module_path": "agent.engines.lmcache",
                "storage_plugin.pool.class_name": "PoolDaxBackend",
                "dax.max_dax_size": size_gib,
                "pool.socket": str(cluster.socket_path),
                "pool.ttl_s": 3,  # renewals (and the events they carry) every second
                "pool.report_interval_s": 0.2,
                "dax.retrieve_staging_slab_bytes": 4 * MIB,
                "dax.restore_workers": 1,
                **extra,
            },
        }
    )


def metadata(world_size: int = 1, worker_id: int = 0) -> Any:
    return LMCacheMetadata(
        model_name="tiny",
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.float16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def start(cluster: Cluster, loop: Any, size_gib: float, md: Any = None, **extra: Any) -> Any:
    backends = CreateStorageBackends(
        user_config(cluster, size_gib, **extra), md or metadata(), loop, dst_device="cpu"
    )
    assert "pool" in backends, f"LMCache did not load the plugin: {list(backends)}"
    return backends


def key(n: int, md: Any = None) -> Any:
    md = md or metadata()
    return CacheEngineKey("tiny", md.world_size, md.worker_id, n, torch.float16)


def chunk(backends: Any, fill: float) -> Any:
    cpu = backends["LocalCPUBackend"]
    obj = cpu.allocate(torch.Size(KV_SHAPE), torch.float16)
    assert obj is not None
    obj.tensor.fill_(fill)
    return obj


def put(plugin: PoolDaxBackend, backends: Any, n: int) -> None:
    obj = chunk(backends, float(n))
    futures = plugin.batched_submit_put_task([key(n)], [obj])
    for f in futures or []:
        f.result(10)
    obj.ref_count_down()


def close(backends: Any) -> None:
    for backend in reversed(list(backends.values())):
        backend.close()


def test_lmcache_stores_and_loads_chunks_in_the_lease(
    cluster: Cluster, loop: asyncio.AbstractEventLoop
) -> None:
    backends = start(cluster, loop, 8 / 1024)  # 8 MiB
    plugin = backends["pool"]
    try:
        assert isinstance(plugin, PoolDaxBackend)
        lease = plugin.lease
        assert plugin.device_path == f"/proc/self/fd/{lease.fd}"
        assert lease.length_bytes == 8 * MIB and lease.shrinkable
        for n in range(4):
            put(plugin, backends, n)
        for n in range(4):
            assert plugin.contains(key(n))
            got = plugin.get_blocking(key(n))
            assert got is not None and bool((got.tensor == float(n)).all())
            got.ref_count_down()
        assert not plugin.contains(key(99))
        # The bytes really are in the lease's memory: another mapping of its fd sees them.
        mm = lease.mmap()
        try:
            slot = plugin.slot_bytes
            assert sum(1 for i in range(4) if mm[i * slot : (i + 1) * slot].strip(b"\0")) == 3
        finally:
            mm.close()
        used, exclusive, replica = plugin.usage_bytes()
        assert used == 4 * plugin.slot_bytes and exclusive + replica == used
        assert plugin.report()
        lease_id = lease.lease_id
    finally:
        close(backends)
    assert plugin.lease.released
    assert cluster.wait_state(lease_id, "released") == "released"


def test_shrink_gives_back_free_slots_and_keeps_live_ones(
    cluster: Cluster, loop: asyncio.AbstractEventLoop
) -> None:
    backends = start(cluster, loop, 8 / 1024)
    plugin = backends["pool"]
    try:
        for n in range(3):
            put(plugin, backends, n)
        lease = plugin.lease
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        # What the client calls when poold's shrink hint arrives (renewal or push).
        lease.on_shrink(lease, 6 * MIB, deadline)
        assert lease.length_bytes < 8 * MIB
        assert plugin._core.arena_bytes <= lease.length_bytes
        wait_until = time.monotonic() + 10  # the agent tells poold in its next batch
        while cluster.admin.show_lease(lease.lease_id).length_bytes != lease.length_bytes:
            assert time.monotonic() < wait_until, "poold never heard of the shrink"
            time.sleep(0.1)
        for n in range(3):  # the live chunks stayed
            got = plugin.get_blocking(key(n))
            assert got is not None and bool((got.tensor == float(n)).all())
            got.ref_count_down()
        # Asked for everything: only what the live slots allow goes.
        lease.on_shrink(lease, lease.length_bytes, deadline)
        assert plugin._core.max_slots >= 3
    finally:
        close(backends)


def test_revocation_closes_the_tier_and_releases_before_the_deadline(
    cluster: Cluster, loop: asyncio.AbstractEventLoop
) -> None:
    backends = start(cluster, loop, 4 / 1024)
    plugin = backends["pool"]
    try:
        put(plugin, backends, 1)
        lease = plugin.lease
        revoked_at = datetime.now(UTC)
        cluster.admin.revoke(lease.lease_id, reason="failing DIMM", deadline_s=10)
        deadline = time.monotonic() + 10
        while not lease.released:  # the plugin hears of it with a renewal (or a push)
            assert time.monotonic() < deadline, "the plugin never let go of the lease"
            time.sleep(0.05)
        assert datetime.now(UTC) - revoked_at < timedelta(seconds=10)
        # No I/O after release: lookups miss, stores are dropped, nothing is mapped.
        assert not plugin.contains(key(1))
        assert plugin.get_blocking(key(1)) is None
        assert plugin.batched_submit_put_task([key(2)], [chunk(backends, 2.0)]) is None
        assert plugin._core.mmap_obj is None
        assert cluster.wait_state(lease.lease_id, "reclaimed") == "reclaimed"
    finally:
        close(backends)


def test_tensor_parallel_ranks_each_lease_their_own(
    cluster: Cluster, loop: asyncio.AbstractEventLoop
) -> None:
    ranks = [start(cluster, loop, 2 / 1024, md=metadata(2, rank)) for rank in range(2)]
    try:
        leases = [r["pool"].lease for r in ranks]
        assert len({lease.lease_id for lease in leases}) == 2
        assert [lease.labels["rank"] for lease in leases] == ["0", "1"]
        assert all(r["pool"].metadata.world_size == 2 for r in ranks)
    finally:
        for r in ranks:
            close(r)
