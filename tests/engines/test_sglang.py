"""SGLang's real plugin hooks and HiCache host pool base on poold leases (CPU only).

Real poold + agent processes (tests/e2e/conftest.py); SGLang 0.5.23's own modules from
scripts/engines-venv. What a CPU venv cannot import: ``sglang.srt.mem_cache.pool_host``'s
package ``__init__`` reaches SGLang's model configs, which import torchvision, and no
torchvision loads beside torch 2.13.0+cpu. So these tests load that package's real
``common.py`` and ``base.py`` modules without its ``__init__`` (:func:`_pool_host`) and
build a host pool on SGLang's real ``HostKVCache`` base (its sizing, buffer allocation
through ``alloc_with_host_register``, slot alloc/free) in a two-layer MHA-shaped
subclass; SGLang's own MHA/MLA pools, its HiCache controller, CUDA registration and
GPU transfers are not run.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.e2e.conftest import Cluster

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.plugins.hook_registry")


def _pool_host() -> None:
    """Make ``sglang.srt.mem_cache.pool_host`` importable without its ``__init__``."""
    import sglang.srt.mem_cache as mem_cache

    name = "sglang.srt.mem_cache.pool_host"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [f"{next(iter(mem_cache.__path__))}/pool_host"]
        package.__package__ = name
        sys.modules[name] = package


_pool_host()
from sglang.srt.mem_cache.pool_host import base, common  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from agent.engines import sglang as adapter  # noqa: E402

MIB = 1 << 20
LAYERS, HEADS, HEAD_DIM = 2, 4, 64


class TinyHostPool(base.HostKVCache):  # type: ignore[misc]
    """An MHA-shaped host pool on SGLang's base: K and V of every layer, layer first."""

    def __init__(self, tokens: int, **kwargs: Any) -> None:
        self.layer_num = self.target_layer_num = LAYERS
        self.head_num, self.head_dim = HEADS, HEAD_DIM
        super().__init__(
            dtype=torch.float16,
            device_capacity_tokens=tokens // 2,
            size_per_token=self.get_size_per_token(),
            start_layer=0,
            end_layer=LAYERS,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=16,
            layout="layer_first",
            pin_memory=False,
            device="cpu",
            **kwargs,
        )

    def get_size_per_token(self) -> int:
        return 2 * LAYERS * HEADS * HEAD_DIM * 2

    def init_kv_buffer(self) -> Any:
        # What SGLang's MHA host pool does: one buffer for K and V, through the allocator.
        dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        return common.alloc_with_host_register(
            dims, dtype=self.dtype, device="cpu", pin_memory=False, allocator=self.allocator
        )

    def load_to_device_per_layer(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError  # GPU transfers: not on a CPU

    def backup_from_device_all_layer(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self.kv_buffer[:, :, index : index + self.page_size]

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros((2, LAYERS, self.page_size, HEADS, HEAD_DIM), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.kv_buffer[:, :, index : index + self.page_size] = data_page


@pytest.fixture
def plugin(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The environment README.md tells a user to set, then SGLang's plugin loading."""
    monkeypatch.setenv("POOLD_HICACHE", "1")
    monkeypatch.setenv("POOLD_AGENT_SOCKET", str(cluster.socket_path))
    monkeypatch.setenv("POOLD_HICACHE_TTL_S", "3")
    monkeypatch.setenv("POOLD_HICACHE_REPORT_INTERVAL_S", "0")
    original = common.get_allocator_from_storage
    init, destroy = base.HostKVCache.__init__, base.HostKVCache.destroy
    assert adapter.register()
    yield
    # Undo SGLang's patches so other tests see its own allocator (HookRegistry.reset
    # forgets the hooks, not the patched attributes).
    HookRegistry.reset()
    common.get_allocator_from_storage = base.get_allocator_from_storage = original
    base.HostKVCache.__init__, base.HostKVCache.destroy = init, destroy


def pool(tokens: int = 1024) -> TinyHostPool:
    with base.host_memory_budget_scope(1 << 30):
        return TinyHostPool(tokens)


def test_register_is_inert_without_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POOLD_HICACHE", raising=False)
    assert adapter.register() is False
    assert type(common.get_allocator_from_storage("default")) is common.HostTensorAllocator


def test_a_bad_setting_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLD_HICACHE", "1")
    monkeypatch.setenv("POOLD_HICACHE_HUGEPAGES", "always")
    with pytest.raises(ValueError, match="hugepages"):
        adapter.register()


def test_hicache_host_buffers_are_leases(cluster: Cluster, plugin: None) -> None:
    # SGLang's own selection now hands out the adapter for its default allocator only.
    assert isinstance(base.get_allocator_from_storage("default"), adapter.PoolHostTensorAllocator)
    assert not isinstance(common.get_allocator_from_storage("shm"), adapter.PoolHostTensorAllocator)
    host = pool()
    allocator = host.allocator
    assert isinstance(allocator, adapter.PoolHostTensorAllocator)
    assert allocator.host_pool is host  # attached by the __init__ hook
    [tier] = allocator.tiers
    lease = tier.lease
    assert lease.labels["engine"] == "sglang" and lease.populated and not lease.shrinkable
    nbytes = host.kv_buffer.numel() * host.kv_buffer.element_size()
    assert nbytes == host.size * host.size_per_token
    assert lease.length_bytes >= nbytes
    # SGLang's slot allocator over it, and the bytes land in the lease.
    slots = host.alloc(32)
    assert slots is not None
    page = torch.full((2, LAYERS, 16, HEADS, HEAD_DIM), 3.0, dtype=torch.float16)
    host.set_from_flat_data_page(16, page)
    mm = lease.mmap()
    try:
        token_bytes = HEADS * HEAD_DIM * 2
        at = 16 * token_bytes  # K of layer 0, token 16
        assert torch.frombuffer(mm, dtype=torch.float16, count=1, offset=at).item() == 3.0
    finally:
        del mm  # the frombuffer view goes with it
    used, exclusive, replica, pages, _ = allocator.usage(nbytes)
    assert used == nbytes * 32 // host.size and exclusive == used and replica == 0 and pages == 2
    assert tier.report()
    host.free(slots)
    lease_id = lease.lease_id
    host.destroy()  # SGLang tears the pool down: the leases go back
    assert lease.released
    assert cluster.wait_state(lease_id, "released") == "released"


def test_revocation_moves_the_host_pool_off_the_pool(cluster: Cluster, plugin: None) -> None:
    host = pool()
    [tier] = host.allocator.tiers
    lease = tier.lease
    page = torch.full((2, LAYERS, 16, HEADS, HEAD_DIM), 5.0, dtype=torch.float16)
    host.set_from_flat_data_page(32, page)
    address = host.kv_buffer.data_ptr()
    revoked_at = datetime.now(UTC)
    cluster.admin.revoke(lease.lease_id, reason="failing DIMM", deadline_s=10)
    deadline = time.monotonic() + 10
    while not lease.released:
        assert time.monotonic() < deadline, "the allocator never let go of the lease"
        time.sleep(0.05)
    assert datetime.now(UTC) - revoked_at < timedelta(seconds=10)
    # SGLang's buffer is where it was, with what it held, in private memory.
    assert host.kv_buffer.data_ptr() == address and tier.mappings[0].evacuated
    assert bool((host.get_data_page(32) == 5.0).all())
    assert host.alloc(16) is not None  # the pool goes on working
    assert cluster.wait_state(lease.lease_id, "reclaimed") == "reclaimed"
    host.destroy()
