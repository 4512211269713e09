"""How does SGLang's HiCache host pool (its L2 tier) live in pool memory?

Through :class:`PoolHostTensorAllocator`, a ``HostTensorAllocator`` (SGLang's interface
for host KV buffers, ``sglang.srt.mem_cache.pool_host.common``) whose ``allocate``
returns a tensor over a poold lease's mapping: one lease per buffer (each host pool
allocates its K and V, or its single KV, buffer through it; each TP rank in its own
process), sized to the buffer, labelled ``engine=sglang``.

SGLang picks a host pool's allocator from ``--hicache-storage-backend`` only
(``get_allocator_from_storage``: mooncake, mori, shm, tensorcast, else its default):
there is no setting that names an allocator class. So the one unavoidable patch is
:func:`register`, a *general plugin* of SGLang's own plugin framework (entry point
``sglang.srt.plugins`` = ``poold_hicache``, loaded by every SGLang process at start): it
registers, with SGLang's ``HookRegistry``, an AROUND hook on
``get_allocator_from_storage`` (SGLang's default allocator becomes this one; mooncake,
mori, shm and tensorcast allocators, which own their memory, are left alone) and AFTER
hooks on ``HostKVCache.__init__`` (the allocator learns its pool, for accounting) and
``HostKVCache.destroy`` (the leases are released). It does nothing unless
``POOLD_HICACHE=1`` is in the environment. The user's configuration::

    POOLD_HICACHE=1 POOLD_HICACHE_MEDIA=ddr5 \\
        python -m sglang.launch_server --model-path MODEL \\
        --enable-hierarchical-cache --hicache-size 64      # GB per rank: the leases' size

(also ``POOLD_HICACHE_TENANT``, ``_POPULATE``, ``_HUGEPAGES``, ``_NUMA_NODE``,
``_TTL_S``, ``_REPORT_INTERVAL_S``, and ``POOLD_AGENT_SOCKET``).

* **Accounting**: the pool's occupied slots (its ``available_size``) as used bytes, all
  reported exclusive: the allocator cannot tell which host pages the GPU still holds.
* **revoke / lost**: SGLang cannot drop a host pool at run time, so the allocator waits
  for the device (``torch.cuda.synchronize``), holds the pool's lock (no host slot is
  taken or freed), unregisters the buffer from CUDA, moves it into private memory at the
  same address (:meth:`agent.engines.mapping.LeaseMapping.evacuate`), registers it
  again, and releases the lease. A transfer SGLang's HiCache controller starts on its
  own threads during the copy is not fenced (no hook sees it): see docs/engines.md.
  **shrink**: not offered (the pool's size is fixed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

from agent.engines.mapping import PoolSettings, PoolTier, Usage

try:  # SGLang is an optional extra: pip install 'poold[sglang]'
    import torch
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "agent.engines.sglang needs SGLang: pip install 'poold[sglang]' "
        "(scripts/engines-venv installs it with a CPU torch)"
    ) from err

log = logging.getLogger(__name__)

ENABLE_ENV = "POOLD_HICACHE"
_SETTINGS_ENV = {
    "POOLD_AGENT_SOCKET": "pool.socket",
    "POOLD_HICACHE_MEDIA": "pool.media",
    "POOLD_HICACHE_TENANT": "pool.tenant",
    "POOLD_HICACHE_TTL_S": "pool.ttl_s",
    "POOLD_HICACHE_POPULATE": "pool.populate",
    "POOLD_HICACHE_HUGEPAGES": "pool.hugepages",
    "POOLD_HICACHE_NUMA_NODE": "pool.numa_node",
    "POOLD_HICACHE_REPORT_INTERVAL_S": "pool.report_interval_s",
}
# Allocators that are SGLang's plain host memory; the others own what they hand out.
REPLACED_ALLOCATORS = frozenset({"default"})
_TARGET = "sglang.srt.mem_cache.pool_host.common.get_allocator_from_storage"
_HOST_POOL = "sglang.srt.mem_cache.pool_host.base.HostKVCache"


def settings_from_env(environ: Mapping[str, str] | None = None) -> PoolSettings:
    """The leases' settings from ``POOLD_HICACHE_*`` (inherited by SGLang's processes)."""
    env = os.environ if environ is None else environ
    return PoolSettings.from_config(
        {_SETTINGS_ENV[k]: v for k, v in env.items() if k in _SETTINGS_ENV}
    )


class PoolHostTensorAllocator(host_common.HostTensorAllocator):  # type: ignore[misc]
    """SGLang's host buffer allocator on poold leases (module docstring)."""

    def __init__(self, settings: PoolSettings | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else settings_from_env()
        self.tiers: list[PoolTier] = []
        self.buffers: list[Any] = []  # the tensors handed out, for (un)registration
        self.host_pool: Any = None  # the HostKVCache this allocator serves, once built

    def allocate(self, dims: tuple[int, ...], dtype: Any, device: str) -> Any:
        if device != "cpu":
            raise ValueError(f"PoolHostTensorAllocator allocates host memory, not {device!r}")
        self.dtype = dtype
        self.dims = dims
        numel = math.prod(dims)
        size_bytes = numel * torch.empty((), dtype=dtype).element_size()
        label = getattr(self.host_pool, "pool_label", None) or "kv"
        tier = PoolTier(
            self.settings,
            size_bytes,
            {"engine": "sglang", "pool": str(label), "pid": str(os.getpid())},
            fence=self.fenced,
            usage=lambda: self.usage(size_bytes),
        )
        try:
            mapping = tier.map(size_bytes)
            buffer = torch.frombuffer(mapping.buffer(), dtype=dtype, count=numel).view(dims)
        except BaseException:
            tier.close()
            raise
        self.tiers.append(tier)
        self.buffers.append(buffer)
        tier.start_reports()
        log.info(
            "HiCache host buffer %s (%d bytes) on lease %s (%s/%s)",
            tuple(dims),
            size_bytes,
            tier.lease.lease_id,
            tier.lease.backend,
            tier.lease.media,
        )
        return buffer

    # --- what poold asks -------------------------------------------------------------
    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """The device idle, no host slot taken or freed, the buffers unregistered."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        lock = getattr(self.host_pool, "lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            registered = [self._unpin(b) for b in self.buffers]
            try:
                yield
            finally:
                for buffer, ranges in zip(self.buffers, registered, strict=True):
                    self._repin(buffer, ranges)

    @staticmethod
    def _unpin(buffer: Any) -> list[tuple[int, int]]:
        ranges = list(getattr(buffer, host_common._CUDA_HOST_REGISTERED_RANGES_ATTR, None) or [])
        if ranges:
            host_common._cuda_host_unregister(buffer)
        return ranges

    @staticmethod
    def _repin(buffer: Any, ranges: list[tuple[int, int]]) -> None:
        if not ranges:
            return
        cudart = torch.cuda.cudart()
        for ptr, size in ranges:  # same addresses: the move kept them
            rc = int(cudart.cudaHostRegister(ptr, size, 0))
            if rc != 0:
                log.error("cudaHostRegister failed (rc=%d) after the move: transfers slower", rc)
        setattr(buffer, host_common._CUDA_HOST_REGISTERED_RANGES_ATTR, ranges)

    # --- accounting ------------------------------------------------------------------
    def usage(self, size_bytes: int) -> Usage:
        """The pool's occupied share of this buffer, all exclusive (see the docstring)."""
        pool = self.host_pool
        if pool is None or not getattr(pool, "logical_size", 0):
            return 0, 0, 0, 0, 0
        used_slots = pool.logical_size - pool.available_size()
        used = size_bytes * used_slots // pool.logical_size
        pages = used_slots // max(int(getattr(pool, "logical_page_size", 1)), 1)
        return used, used, 0, pages, 0

    def close(self) -> None:
        """Release every lease (SGLang destroyed the pool, or the process ends)."""
        self.buffers.clear()
        for tier in self.tiers:
            tier.close()


# --- the one patch --------------------------------------------------------------------
def _allocator(original: Any, allocator_type: str = "default", *args: Any, **kwargs: Any) -> Any:
    if allocator_type in REPLACED_ALLOCATORS:
        return PoolHostTensorAllocator()
    return original(allocator_type, *args, **kwargs)


def _attach(result: Any, host_pool: Any, *args: Any, **kwargs: Any) -> None:
    allocator = getattr(host_pool, "allocator", None)
    if isinstance(allocator, PoolHostTensorAllocator):
        allocator.host_pool = host_pool


def _destroyed(result: Any, host_pool: Any, *args: Any, **kwargs: Any) -> None:
    allocator = getattr(host_pool, "allocator", None)
    if isinstance(allocator, PoolHostTensorAllocator):
        allocator.close()


def register() -> bool:
    """SGLang general plugin (entry point ``sglang.srt.plugins``: ``poold_hicache``):
    HiCache host pools allocate from poold. Inert without ``POOLD_HICACHE=1``; True
    when the hooks were registered and applied."""
    if os.environ.get(ENABLE_ENV, "").strip().lower() not in {"1", "true", "yes", "on"}:
        return False
    settings_from_env()  # a bad POOLD_HICACHE_* value fails at start, not at allocation
    HookRegistry.register(_TARGET, _allocator, HookType.AROUND)
    HookRegistry.register(f"{_HOST_POOL}.__init__", _attach, HookType.AFTER)
    HookRegistry.register(f"{_HOST_POOL}.destroy", _destroyed, HookType.AFTER)
    HookRegistry.apply_hooks()  # idempotent; load_plugins() applies them too
    log.info("HiCache host pools allocate from poold (%s)", ENABLE_ENV)
    return True
