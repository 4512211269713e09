"""Engine suites run only where the engine imports (scripts/engines-venv test)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import any_cluster, cluster, pg_cluster  # noqa: F401  # the fixtures


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/" in str(item.fspath):
            item.add_marker(pytest.mark.engines)
