"""How does LMCache (and vLLM or SGLang through it) store KV chunks in pool memory?

With :class:`PoolDaxBackend`, an LMCache storage plugin: LMCache's own DAX backend
(``lmcache.v1.storage_backend.plugins.dax_backend.DaxBackend`` and its ``DaxCore``, which
map ``dax.device_path`` MAP_SHARED in fixed slots) opened on a poold lease instead of a
device the operator carved by hand. The user's LMCache configuration::

    storage_plugins: ["pool"]
    extra_config:
      storage_plugin.pool.module_path: agent.engines.lmcache
      storage_plugin.pool.class_name: PoolDaxBackend
      dax.max_dax_size: 16          # GiB per rank (float): the lease's size
      pool.media: ddr5              # optional: media class
      pool.tenant: llm-a            # optional: the tenant (default: the uid's one)
      pool.shrinkable: true         # optional (default true): give memory back in place
      pool.populate: false          # optional: pages faulted in before LMCache starts
      pool.socket: /run/pool-agent/agent.sock   # optional: else $POOLD_AGENT_SOCKET
      pool.report_interval_s: 10    # optional: exclusive/replica accounting period

What the plugin does with the lease:

* **One lease per rank.** Each tensor-parallel worker process loads its own plugin and
  leases ``dax.max_dax_size`` GiB for its own shard of the KV cache (LMCache's keys carry
  the worker id, so ranks never share a chunk). LMCache's DaxBackend refuses TP > 1 only
  because its single arena would be shared by ranks; a lease per rank is not, so the
  plugin runs it with a one-rank view of the metadata. One shared lease would need
  cross-process slot allocation, which DaxCore does not have.
* ``dax.device_path`` is set to the lease's ``/proc/self/fd/N`` (``DaxCore`` reopens and
  maps it; a sealed memfd is never truncated by it), ``dax.max_dax_size`` to the length
  granted. The lease is renewed in the background by the tenant client.
* **shrink** (pool pressure, ``target_bytes`` asked back): the largest cut
  ``DaxCore.can_shrink_to`` allows at or above the size asked, ``DaxCore.remap`` to it
  (which waits for in-flight reads and writes), then ``Lease.shrink``.
* **revoke**: the backend is closed (``DaxBackend.close`` drains in-flight I/O and unmaps
  the arena), then the lease is released, before the deadline; from then on the plugin
  answers "not here" to every lookup and stores nothing. **lost** (expired, reclaimed):
  the same, without a release to send.
* **Accounting**: every ``pool.report_interval_s`` the plugin reports its live slots as
  used bytes, split into replicas (chunks LMCache's local CPU backend also holds) and
  exclusive copies (the rest).

The callbacks are the tenant client's (``on_shrink``, ``on_revoke``, ``on_lost``): they
fire the same whether the agent's events arrive with renewals or pushed on the session.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from agent.client import Lease, PoolClient
from agent.engines import GIB, gib_bytes

try:  # LMCache is an optional extra: pip install 'poold[lmcache]'
    from lmcache.v1.storage_backend.plugins.dax_backend import DaxBackend
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "agent.engines.lmcache needs LMCache: pip install 'poold[lmcache]' "
        "(scripts/engines-venv installs it with a CPU torch)"
    ) from err

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


def _flag(value: Any, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in _TRUE


class PoolDaxBackend(DaxBackend):  # type: ignore[misc]  # LMCache ships no type hints
    """LMCache's DAX storage backend on a poold lease (see the module docstring)."""

    def __init__(
        self,
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: Any = None,
        dst_device: str = "cpu",
    ) -> None:
        if config is None or metadata is None:
            raise ValueError("PoolDaxBackend requires LMCache's config and metadata")
        extra = dict(config.extra_config or {})
        size_gib = float(extra.get("dax.max_dax_size", 0) or 0)
        if size_gib <= 0:
            raise ValueError("extra_config['dax.max_dax_size'] (GiB per rank) must be > 0")
        self._lease_lock = threading.Lock()
        self._gone = False  # revoked or lost: no I/O from here on
        self._stop = threading.Event()
        self._client = PoolClient(extra.get("pool.socket") or None)
        rank = int(getattr(metadata, "worker_id", 0))
        try:
            self.lease: Lease = self._client.lease(
                gib_bytes(size_gib),
                ttl_s=int(extra.get("pool.ttl_s", 60)),
                media=extra.get("pool.media") or None,
                tenant=extra.get("pool.tenant") or None,
                labels={"engine": "lmcache", "rank": str(rank)},
                shrinkable=_flag(extra.get("pool.shrinkable"), True),
                populate=_flag(extra.get("pool.populate"), False),
                on_shrink=self._on_shrink,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        except BaseException:
            self._client.close()
            raise
        try:
            # LMCache's own backend, on the lease: its path and the length granted.
            extra["dax.device_path"] = f"/proc/self/fd/{self.lease.fd}"
            extra["dax.max_dax_size"] = self.lease.length_bytes / GIB
            lease_config = copy.copy(config)
            lease_config.extra_config = extra
            super().__init__(
                config=lease_config,
                metadata=self._one_rank(metadata),
                local_cpu_backend=local_cpu_backend,
                loop=loop,
                dst_device=dst_device,
            )
            self.metadata = metadata  # the real one, for everything past the TP check
        except BaseException:
            self.lease.release()
            self._client.close()
            raise
        interval_s = float(extra.get("pool.report_interval_s", 10))
        self._reporter = threading.Thread(
            target=self._report_loop, args=(interval_s,), name="pool-lmcache-report", daemon=True
        )
        if interval_s > 0:
            self._reporter.start()
        log.info(
            "LMCache rank %d on lease %s: %d bytes %s/%s, %d slots of %d bytes",
            rank,
            self.lease.lease_id,
            self.lease.length_bytes,
            self.lease.backend,
            self.lease.media,
            self._core.max_slots,
            self._core.slot_bytes,
        )

    def __str__(self) -> str:
        return "PoolDaxBackend"

    @staticmethod
    def _one_rank(metadata: Any) -> Any:
        """The metadata as DaxBackend's TP=1 check wants it: this rank's lease is its own."""
        if getattr(metadata, "world_size", 1) == 1:
            return metadata
        return dataclasses.replace(metadata, world_size=1)

    # --- what poold asks -------------------------------------------------------------
    def _on_shrink(self, lease: Lease, target_bytes: int, deadline_at: datetime) -> None:
        """Give back up to ``target_bytes``: as much as the live slots allow."""
        with self._lease_lock:
            if self._gone or not lease.shrinkable:
                log.info("lease %s: cannot shrink in place; nothing given back", lease.lease_id)
                return
            slot = self._core.slot_bytes
            current = self._core.max_slots
            wanted = max(1, (lease.length_bytes - target_bytes) // slot)
            new_slots = next(
                (n for n in range(wanted, current) if self._core.can_shrink_to(n)), current
            )
            # The agent cuts at its alignment: keep every whole slot the cut leaves.
            align = max(lease.alignment_bytes, lease.page_size_bytes, 1)
            length = -(-new_slots * slot // align) * align
            if new_slots >= current or length >= lease.length_bytes:
                log.info("lease %s: the live slots fill it; nothing given back", lease.lease_id)
                return
            self._core.remap(length // slot * slot)  # waits for in-flight reads and writes
            self._arena_bytes = self._core.arena_bytes
            self._max_slots = self._core.max_slots
            length = lease.shrink(length)
            log.info(
                "lease %s shrunk to %d bytes (%d slots) by %s",
                lease.lease_id,
                length,
                new_slots,
                deadline_at.isoformat(),
            )

    def _on_revoke(self, lease: Lease, deadline_at: datetime) -> None:
        log.warning(
            "lease %s revoked (memory goes at %s): closing LMCache's pool tier",
            lease.lease_id,
            deadline_at.isoformat(),
        )
        self._end(release=True)

    def _on_lost(self, lease: Lease) -> None:
        log.warning("lease %s lost: closing LMCache's pool tier", lease.lease_id)
        self._end(release=False)

    def _end(self, *, release: bool) -> None:
        """Drain in-flight I/O, unmap the arena, then (revoked) give the lease back."""
        with self._lease_lock:
            self._gone = True
        self._stop.set()
        DaxBackend.close(self)  # waits for active reads and writes, then unmaps
        if release:
            self.lease.release()

    # --- accounting ------------------------------------------------------------------
    def usage_bytes(self) -> tuple[int, int, int]:
        """(used, exclusive, replica) bytes: live slots, split by whether LMCache's local
        CPU backend holds the same chunk."""
        keys: Sequence[Any] = [] if self._gone else self._core.snapshot_keys()
        slot = self._core.slot_bytes
        cpu = self.local_cpu_backend
        replicas = sum(1 for k in keys if cpu is not None and cpu.contains(k))
        return len(keys) * slot, (len(keys) - replicas) * slot, replicas * slot

    def report(self) -> bool:
        """Send the exclusive/replica accounting now; True when the agent took it."""
        if self._gone or self.lease.released:
            return False
        used, exclusive, replica = self.usage_bytes()
        slot = self._core.slot_bytes
        return self.lease.report(
            used_bytes=used,
            exclusive_bytes=exclusive,
            replica_bytes=replica,
            exclusive_blocks=exclusive // slot,
            replica_blocks=replica // slot,
        )

    def _report_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.report()
            except Exception as err:
                log.warning("accounting report for lease %s failed: %s", self.lease.lease_id, err)

    # --- LMCache's interface, guarded once the memory is gone --------------------------
    def contains(self, key: Any, pin: bool = False) -> bool:
        return not self._gone and bool(super().contains(key, pin))

    def batched_contains(self, *args: Any, **kwargs: Any) -> Any:
        return 0 if self._gone else super().batched_contains(*args, **kwargs)

    def exists_in_put_tasks(self, key: Any) -> bool:
        return not self._gone and bool(super().exists_in_put_tasks(key))

    def batched_submit_put_task(self, keys: Any, objs: Any, *args: Any, **kwargs: Any) -> Any:
        if self._gone:
            return None  # LMCache keeps its own copy; the pool tier stores nothing now
        return super().batched_submit_put_task(keys, objs, *args, **kwargs)

    def get_blocking(self, key: Any) -> Any:
        return None if self._gone else super().get_blocking(key)

    def close(self) -> None:
        """LMCache shuts the backend down: unmap, release the lease, disconnect."""
        self._stop.set()
        with self._lease_lock:
            self._gone = True
        DaxBackend.close(self)
        self.lease.release()
        self._client.close()
