"""vLLM's real offloading spec factory, CPU manager and offload region on a poold lease.

Real poold + agent processes (tests/e2e/conftest.py); vLLM 0.33.0's own modules from
scripts/engines-venv (installed without its CUDA dependencies, beside torch 2.13.0+cpu).
What a CPU cannot run: vLLM's ``CPUOffloadingWorker`` builds its transfer handlers on
CUDA streams (``assert gpu_tensor.is_cuda``), so the GPU<->CPU copies, the worker's
fence and its store counting are not exercised; everything up to that point is vLLM's
code on the lease (the factory, the manager, the region's views, ``pin_mmap_region``).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.e2e.conftest import Cluster

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.cpu.spec")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from agent.engines.mapping import PoolTier  # noqa: E402
from agent.engines.vllm import PoolOffloadingSpec, PoolOffloadRegion, chunk_usage  # noqa: E402

MIB = 1 << 20
LAYERS = 2
PAGE_BYTES = 16 * 4 * 64 * 2 * 2  # one layer's block: 16 tokens, 4 heads of 64, k+v, fp16


def user_extra_config(cluster: Cluster, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config README.md tells a user to write, parsed by vLLM itself."""
    text = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "PoolOffloadingSpec",
                "spec_module_path": "agent.engines.vllm",
                "cpu_bytes_to_use": 8 * MIB,
                "pool.socket": str(cluster.socket_path),
                "pool.ttl_s": 3,
                "pool.report_interval_s": 0,
                **extra,
            },
        }
    )
    return dict(KVTransferConfig(**json.loads(text)).kv_connector_extra_config)


def offloading_config(extra: dict[str, Any], world_size: int = 1, rank: int = 0) -> Any:
    """What vLLM's build_offloading_config hands the spec for a 2-layer model."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=True,
    )


def kv_caches(num_blocks: int = 8) -> Any:
    """The worker's canonical KV caches: one (blocks, page) tensor per layer."""
    tensors = [torch.zeros((num_blocks, PAGE_BYTES), dtype=torch.int8) for _ in range(LAYERS)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE_BYTES) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE_BYTES) for i in range(LAYERS)]
        ],
    )


def vllm_leases(cluster: Cluster) -> list[Any]:
    return [lease for lease in cluster.admin.list_leases() if lease.labels.get("engine") == "vllm"]


def test_vllm_loads_the_spec_and_its_manager_takes_no_lease(cluster: Cluster) -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(user_extra_config(cluster)))
    assert isinstance(spec, PoolOffloadingSpec)
    assert spec.replicated_layout is False  # one lease per rank: each keeps its copy
    assert spec.num_chunks == 8 * MIB // (LAYERS * PAGE_BYTES)
    assert spec.region_bytes() == spec.num_chunks * LAYERS * PAGE_BYTES
    # The scheduler side is vLLM's CPU manager, unchanged, and leases nothing.
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r1")
    keys = [make_offload_key(bytes([n]) * 16, 0) for n in range(3)]
    with manager.lock:
        manager.on_new_request(ctx)
        stored = manager.prepare_store(keys, ctx)
        assert stored is not None and len(stored.keys_to_store) == 3
        manager.complete_store(keys, ctx)
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
    time.sleep(0.5)
    assert vllm_leases(cluster) == []


def test_a_typo_in_the_pool_settings_fails_when_vllm_loads_the_spec(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match=r"pool\.medai"):
        OffloadingSpecFactory.create_spec(
            offloading_config(user_extra_config(cluster, **{"pool.medai": "ddr5"}))
        )


def test_the_worker_leases_its_share_and_vllm_fails_only_at_cuda(cluster: Cluster) -> None:
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(user_extra_config(cluster), world_size=2, rank=1)
    )
    assert spec.region_bytes() == spec.num_chunks * LAYERS * PAGE_BYTES  # its own page only
    # On a CPU vLLM's worker stops at its CUDA transfer handlers; the lease it took for
    # the region is given back (vLLM's rule: the spec owns the region until then).
    with pytest.raises(AssertionError):
        spec.create_worker(kv_caches())
    deadline = time.monotonic() + 10  # the agent tells poold in its next batch
    while True:
        leases = vllm_leases(cluster)
        if leases and {lease.state for lease in leases} == {"released"}:
            break
        assert time.monotonic() < deadline, f"the failed worker's lease stayed: {leases}"
        time.sleep(0.1)
    assert leases[0].labels["rank"] == "1"


def region_on_a_lease(cluster: Cluster, spec: Any, **fence: Any) -> tuple[PoolTier, Any]:
    tier = PoolTier(
        spec.pool_settings, spec.region_bytes(), {"engine": "vllm", "rank": "0"}, **fence
    )
    return tier, PoolOffloadRegion(tier, spec.num_chunks, spec.cpu_page_size_per_worker)


def test_the_region_vllm_copies_into_is_the_lease(cluster: Cluster) -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(user_extra_config(cluster)))
    tier, region = region_on_a_lease(cluster, spec)
    try:
        lease = tier.lease
        assert lease.populated and not lease.shrinkable
        # What CPUOffloadingWorker does with the region before its CUDA handlers:
        pin_mmap_region(region, worker_slot_only=True)  # no CUDA here: stays pageable
        assert not region.is_pinned
        views = [region.create_next_worker_view(PAGE_BYTES) for _ in range(LAYERS)]
        assert all(v.shape == (spec.num_chunks, PAGE_BYTES) for v in views)
        # A store of block b into chunk c is a copy into row c of every layer's view.
        for chunk in (0, 5):
            for layer, view in enumerate(views):
                view[chunk].fill_(chunk * 10 + layer + 1)
        mm = lease.mmap()  # another mapping of the lease's fd sees the same bytes
        try:
            row = region._row_stride
            assert mm[5 * row] == 51 and mm[5 * row + PAGE_BYTES] == 52
            assert mm[row : 2 * row].strip(b"\0") == b""
        finally:
            mm.close()
        # vLLM's secondary tiers read it zero-copy through this view.
        assert region.create_kv_memoryview()[5, PAGE_BYTES] == 52
        tier.usage = lambda: chunk_usage(2, region._row_stride)
        assert tier.report()
        lease_id = lease.lease_id
        del views
        region.cleanup()
    finally:
        tier.close()
    assert cluster.wait_state(lease_id, "released") == "released"


def test_revocation_moves_the_region_off_the_pool_and_keeps_vllm_s_blocks(
    cluster: Cluster,
) -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(user_extra_config(cluster)))
    fenced: list[str] = []

    class Fence:
        def __enter__(self) -> None:
            fenced.append("stopped")

        def __exit__(self, *exc: object) -> None:
            fenced.append("resumed")

    tier, region = region_on_a_lease(cluster, spec, fence=Fence)
    try:
        views = [region.create_next_worker_view(PAGE_BYTES) for _ in range(LAYERS)]
        views[0][3].fill_(7)
        lease = tier.lease
        address = region._base.data_ptr()
        assert _maps_memfd(address)
        revoked_at = datetime.now(UTC)
        cluster.admin.revoke(lease.lease_id, reason="failing DIMM", deadline_s=10)
        deadline = time.monotonic() + 10
        while not lease.released:
            assert time.monotonic() < deadline, "the tier never let go of the lease"
            time.sleep(0.05)
        assert datetime.now(UTC) - revoked_at < timedelta(seconds=10)
        assert fenced == ["stopped", "resumed"]  # the move ran with transfers stopped
        # vLLM's tensors are where they were, with what they held, in private memory.
        assert region._base.data_ptr() == address and not _maps_memfd(address)
        assert bool((views[0][3] == 7).all()) and bool((views[1][3] == 0).all())
        views[1][3].fill_(1)  # and still writable
        assert tier.gone and not tier.report()
        assert cluster.wait_state(lease.lease_id, "reclaimed") == "reclaimed"
        del views
        region.cleanup()
    finally:
        tier.close()


def _maps_memfd(address: int) -> bool:
    """Whether the mapping at ``address`` is a memfd (the lease) in /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, rest = line.partition(" ")
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return "memfd:" in rest
    raise AssertionError(f"{address:#x} is not mapped")
