"""Recorded machines as sysfs roots: extracted once per session (read-only use), or fresh
per test for the cases that break the tree on purpose."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.machines.loader import Machine


@pytest.fixture(scope="session")
def machine_root(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``machine_root(name)`` -> the ``sys`` root of a recorded machine. Do not modify it."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = Machine(name).extract(tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture
def fresh_machine(tmp_path: Path) -> Callable[[str], Path]:
    """``fresh_machine(name)`` -> a private copy of a recorded machine, free to break."""

    def get(name: str) -> Path:
        return Machine(name).extract(tmp_path / name)

    return get
