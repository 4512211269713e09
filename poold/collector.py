"""How a long-running pool process sets Python's garbage collector (poold and pool-agent).

Both make many short-lived objects per request, and CPython's defaults (a collection
every 700 net allocations, a full one whenever enough survived) scan the process's
whole heap again and again:

* poold: a 100,000-item heartbeat makes that many objects that live until its reply;
  with the defaults the collector scanned them again and again while pydantic held the
  GIL (validating the body: 0.3 s instead of 0.1 s) and `/v1/health` waited (p99 179 ms
  during the heartbeat, 75 ms with this; bench/scale.py, docs/benchmarks.md).
* pool-agent: in a lease+release loop at ~1,400 cycles a second, a full collection
  every ~3 s took 38-53 ms, each one a lease that waited as long (the largest stalls of
  its request path); with this, one stall over 20 ms in 20 s instead of nine
  (docs/benchmarks.md "A central grant reads twice…").

What the process made before serving (modules, routes, compiled statements, the
agent's backends) is frozen out of every collection, and a collection starts after
50,000 net allocations. Garbage that only a collection frees (cycles) waits a little
longer for it.
"""

from __future__ import annotations

import gc

# Collections start every THRESHOLDS[0] net allocations instead of CPython's 700.
THRESHOLDS = (50_000, 20, 100)


def tune() -> None:
    """Collect once, freeze what survives, and raise the thresholds: called once the
    process has made what it keeps for its life, just before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
