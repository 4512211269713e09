"""How do inference engines use the pool without writing pool code?

Through adapters for the KV layers they already load by configuration (DESIGN.md
"Engines"): :mod:`agent.engines.lmcache` is an LMCache storage plugin (which vLLM and
SGLang reach through LMCache), :mod:`agent.engines.vllm` an offloading spec for vLLM's
own ``OffloadingConnector``, :mod:`agent.engines.sglang` a HiCache host allocator;
:mod:`agent.engines.mapping` maps a lease for the last two and moves their tier off it
on revocation. Each adapter imports its engine lazily: this package imports without any
engine installed, and an adapter says which extra to install when its engine is missing
(``pip install 'poold[lmcache]'``; scripts/engines-venv).
"""

from __future__ import annotations

GIB = 1 << 30


def gib_bytes(size_gib: float, alignment_bytes: int = 2 << 20) -> int:
    """An engine's GiB float size setting as a byte count, rounded up to whole 2 MiB
    (the agent's lease alignment, and a hugepage)."""
    if size_gib <= 0:
        raise ValueError(f"a size in GiB must be > 0, got {size_gib}")
    return -(-int(size_gib * GIB) // alignment_bytes) * alignment_bytes
