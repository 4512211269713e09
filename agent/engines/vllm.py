"""How does vLLM's KV offloading (its CPU tier) live in pool memory?

Through :class:`PoolOffloadingSpec`, an out-of-tree spec for vLLM's own
``OffloadingConnector``, loaded by its ``OffloadingSpecFactory`` from
``kv_connector_extra_config`` (``spec_name`` + ``spec_module_path``). The user's
configuration (``cpu_bytes_to_use`` means what it means for vLLM's CPU spec: the tier's
size summed over the workers)::

    vllm serve MODEL --kv-transfer-config '{
      "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "PoolOffloadingSpec", "spec_module_path": "agent.engines.vllm",
        "cpu_bytes_to_use": 68719476736,
        "pool.media": "ddr5", "pool.tenant": "llm-a"}}'

It is vLLM's ``CPUOffloadingSpec`` with one thing changed, the memory: where vLLM
creates ``/dev/shm/vllm_offload_<engine>.mmap``, ftruncates it, maps and prefaults it,
each worker here leases its share from the agent and :class:`PoolOffloadRegion` (a
``SharedOffloadRegion``) maps the lease's fd (sealed: never truncated; the agent
prefaults it, ``pool.populate``). vLLM's scheduler-side manager (block table, LRU/ARC
eviction) and worker (``CPUOffloadingWorker``: GPU<->CPU copies, ``cudaHostRegister`` of
the region) are vLLM's, unchanged; no vLLM code is patched.

* **One lease per worker** (labels ``engine=vllm``, ``rank``): each rank's slots are its
  own (``num_chunks`` rows of its page), so ranks share nothing and vLLM's single-copy
  ``replicated_layout`` is turned off (every rank keeps its copy of a replicated block).
* **Accounting**: the tier mirrors GPU blocks (vLLM offloads what the GPU computed, and
  reloads it from here), so every chunk slot written is reported as a replica block.
* **revoke / lost**: vLLM cannot drop a tier at run time (the scheduler process owns the
  block table, and a failed transfer is an assertion), so the worker stops taking
  transfers, waits for those in flight, and moves the region into private memory at the
  same address (:meth:`agent.engines.mapping.LeaseMapping.evacuate`, re-registering it
  with CUDA), then releases the lease before the deadline. vLLM keeps running with its
  cache intact; the pool has its memory back. **shrink**: not offered (the lease is
  granted not ``shrinkable``): vLLM's manager has a fixed number of chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
from collections.abc import Iterator
from typing import Any

from agent.engines.mapping import LeaseMapping, PoolSettings, PoolTier, Usage, round_up

try:  # vLLM is an optional extra: pip install 'poold[vllm]'
    import torch
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, pin_mmap_region
    from vllm.v1.kv_offload.cpu.host_register import host_unregister
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "agent.engines.vllm needs vLLM: pip install 'poold[vllm]' "
        "(scripts/engines-venv installs its offloading modules with a CPU torch)"
    ) from err

log = logging.getLogger(__name__)


class PoolOffloadRegion(SharedOffloadRegion):  # type: ignore[misc]  # vLLM ships no stubs
    """vLLM's offload region over one worker's lease instead of a /dev/shm file.

    Only the constructor differs: the attributes vLLM's ``SharedOffloadRegion`` methods
    read (views per tensor, ``iter_worker_slot_ranges``, ``cleanup``, and
    ``pin_mmap_region``'s ``cudaHostRegister`` of it) are set to a one-rank region whose
    rows are this worker's page, on the lease's mapping.
    """

    def __init__(self, tier: PoolTier, num_chunks: int, cpu_page_size: int) -> None:
        self.page_size = mmap.PAGESIZE
        self.num_chunks = num_chunks
        self.cpu_page_size = cpu_page_size
        self._row_stride = round_up(cpu_page_size, self.page_size)
        self.total_size_bytes = num_chunks * self._row_stride
        self.mmap_path = f"pool lease {tier.lease.lease_id}"  # what vLLM's logs name it
        self._segments: list[tuple[str, int, int]] = []  # no file to unlink
        self._creator = False
        self.rank = 0  # the region is this worker's alone
        self._worker_offset = 0
        self._worker_area_end = cpu_page_size
        self.fd = None  # the lease owns its fd; cleanup() must not close it
        self.mapping: LeaseMapping = tier.map(self.total_size_bytes)
        self.mmap_obj = self.mapping  # cleanup() closes it (BufferError: kept mapped)
        self._base = torch.frombuffer(self.mapping.buffer(), dtype=torch.int8)
        self._views: list[Any] = []
        self._canonical_offset = 0
        self.is_pinned = False
        self.pinned_addresses: list[int] = []

    def unpin(self) -> None:
        """Undo vLLM's cudaHostRegister of the region (before its pages move)."""
        for address in reversed(self.pinned_addresses):
            host_unregister(address)
        self.pinned_addresses.clear()

    def repin(self) -> None:
        """Register the region again, as vLLM's worker did when it was built."""
        if self.is_pinned:
            self.is_pinned = False
            pin_mmap_region(self, worker_slot_only=True)
            if not self.is_pinned:
                log.error(
                    "%s: cudaHostRegister failed after the move; transfers may be slower",
                    self.mmap_path,
                )


class PoolOffloadingWorker(CPUOffloadingWorker):  # type: ignore[misc]
    """vLLM's CPU offloading worker, fenced for an evacuation and counting what it stores."""

    def __init__(self, *args: Any, tier: PoolTier, region: PoolOffloadRegion, **kwargs: Any):
        self._tier = tier
        self._region = region
        self._submit = threading.Lock()  # held by an evacuation: no transfer starts
        self._in_flight: set[int] = set()
        self._written: set[int] = set()  # chunk slots that hold a block
        super().__init__(*args, mmap_region=region, **kwargs)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """No transfer starts, every one in flight has finished, the region is unpinned."""
        with self._submit:
            self.wait(set(self._in_flight))
            self._region.unpin()
            try:
                yield
            finally:
                self._region.repin()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        with self._submit:
            self._in_flight.add(job_id)
            self._written.update(int(b) for b in getattr(dst_spec, "block_ids", ()))
            return bool(super().submit_store(job_id, src_spec, dst_spec))

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        with self._submit:
            self._in_flight.add(job_id)
            return bool(super().submit_load(job_id, src_spec, dst_spec, expedited))

    def get_finished(self) -> list[Any]:
        results = list(super().get_finished())
        for result in results:
            self._in_flight.discard(result.job_id)
        return results

    def usage(self) -> Usage:
        return chunk_usage(len(self._written), self._region._row_stride)

    def shutdown(self) -> None:
        try:
            super().shutdown()  # drains both directions, cleans the region up
        finally:
            self._tier.close()


def chunk_usage(chunks: int, chunk_bytes: int) -> Usage:
    """Every chunk stored mirrors blocks the GPU computed: all replicas."""
    return chunks * chunk_bytes, 0, chunks * chunk_bytes, 0, chunks


class PoolOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU offloading spec whose worker memory is a poold lease (module docstring)."""

    def __init__(self, config: Any) -> None:
        if config.replicated_layout:  # one copy shared by ranks needs one shared region
            config = dataclasses.replace(config, replicated_layout=False)
        super().__init__(config)
        self.pool_settings = PoolSettings.from_config(self.extra_config)  # fails early on typos

    def region_bytes(self) -> int:
        """What this worker leases: its page of every chunk, page-aligned."""
        return int(self.num_chunks) * round_up(int(self.cpu_page_size_per_worker), mmap.PAGESIZE)

    def create_worker(self, kv_caches: Any) -> PoolOffloadingWorker:
        if self.num_chunks <= 0:
            raise ValueError("cpu_bytes_to_use is smaller than one chunk of KV: nothing to lease")
        parallel = self.config.parallel
        tier = PoolTier(
            self.pool_settings,
            self.region_bytes(),
            {"engine": "vllm", "rank": str(parallel.rank), "vllm_engine": self.config.engine_id},
        )
        region: PoolOffloadRegion | None = None
        try:
            region = PoolOffloadRegion(tier, self.num_chunks, self.cpu_page_size_per_worker)
            worker = PoolOffloadingWorker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                tier=tier,
                region=region,
            )
        except BaseException:
            # vLLM's rule: the caller owns the region until the worker is built.
            if region is not None:
                region.cleanup()
            tier.close()
            raise
        tier.fence = worker.fenced
        tier.usage = worker.usage
        tier.start_reports()
        log.info(
            "vLLM rank %d offloads to lease %s: %d chunks of %d bytes (%s/%s)",
            parallel.rank,
            tier.lease.lease_id,
            self.num_chunks,
            region._row_stride,
            tier.lease.backend,
            tier.lease.media,
        )
        return worker
