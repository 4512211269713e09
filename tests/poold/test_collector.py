"""How a pool process sets the garbage collector (poold/collector.py: poold and
pool-agent call it before they serve)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from poold import collector


@pytest.fixture
def restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


@pytest.mark.usefixtures("restored")
def test_the_collector_is_tuned_and_what_was_made_before_serving_frozen() -> None:
    kept = [[i] for i in range(10)]  # made before serving (lists: objects the GC tracks)
    gc.unfreeze()
    collector.tune()
    assert gc.get_threshold() == collector.THRESHOLDS
    frozen = gc.get_freeze_count()
    assert frozen >= len(kept)
    young = {id(o) for o in gc.get_objects(0)}
    assert all(gc.is_tracked(k) and id(k) not in young for k in kept)
    # Garbage in a cycle is still collected, by the next collection.
    a: list[object] = []
    a.append(a)
    ref_count_before = len(gc.get_objects())
    del a
    assert gc.collect() >= 1
    assert len(gc.get_objects()) <= ref_count_before
