"""DevdaxBackend.scrub's hooks: the sub-device named before it holds a byte, its deletion,
and the bytes zeroed so far. Same recorded tree and FakeDaxKernel as test_devdax.py."""

from __future__ import annotations

import errno

import pytest

from agent.backends.devdax import DevdaxBackend
from poold.errors import BackendFailed
from tests.agent.backends.test_devdax import (
    DRIVER,
    MIB,
    Setup,
    fresh_machine,
    partitioned,
)

__all__ = ["fresh_machine", "partitioned"]  # fixtures


def sub_devices_with_bytes(backend: DevdaxBackend) -> dict[str, int]:
    return {name: size for name, size in backend.sub_devices(0).items() if size}


def test_the_scrub_device_is_named_before_it_is_sized_and_reported_deleted(
    partitioned: Setup,
) -> None:
    backend, kernel, _root = partitioned
    events: list[tuple[str, object]] = []

    def carved(device: str) -> None:
        # Nothing of the range is taken yet: only the seed was made.
        assert kernel.writes == [("dax_region/create", "1")]
        assert backend.sub_devices(0)[device] == 0
        events.append(("carve", device))

    def deleted(device: str) -> None:
        assert device not in backend.sub_devices(0)
        events.append(("deleted", device))

    ok = backend.scrub(
        0,
        192 * MIB,
        6 * MIB,
        on_carve=carved,
        on_deleted=deleted,
        progress=lambda done: events.append(("zeroed", done)),
    )
    assert ok is True
    # One progress call per 2 MiB chunk, then the teardown.
    assert events == [
        ("carve", "dax0.2"),
        ("zeroed", 2 * MIB),
        ("zeroed", 4 * MIB),
        ("zeroed", 6 * MIB),
        ("deleted", "dax0.2"),
    ]


def test_a_failed_carve_names_the_device_but_never_says_deleted(partitioned: Setup) -> None:
    backend, kernel, _root = partitioned
    kernel.refuse["dax0.2/mapping"] = errno.ENOMEM  # the range is another device's
    seen: list[str] = []
    ok = backend.scrub(
        0, 192 * MIB, 2 * MIB, on_carve=seen.append, on_deleted=lambda d: seen.append("gone")
    )
    assert ok is False
    # Named, then undone by the carve's rollback: it holds nothing (the agent's sweep
    # drops such a record once it sees the sub-device empty).
    assert seen == ["dax0.2"]
    assert sub_devices_with_bytes(backend) == {"dax0.0": 128 * MIB, "dax0.1": 64 * MIB}


def test_a_failed_teardown_is_not_reported_deleted(partitioned: Setup) -> None:
    backend, kernel, _root = partitioned
    kernel.refuse[f"{DRIVER}/unbind"] = errno.EBUSY
    gone: list[str] = []
    assert backend.scrub(0, 192 * MIB, 2 * MIB, on_deleted=gone.append) is False
    assert gone == []  # left for the audit to find, with its record
    assert sub_devices_with_bytes(backend)["dax0.2"] == 2 * MIB


def test_a_carve_hook_that_fails_leaves_nothing_sized(partitioned: Setup) -> None:
    backend, kernel, _root = partitioned

    def journal_down(device: str) -> None:
        raise BackendFailed(f"cannot record {device}")

    with pytest.raises(BackendFailed, match=r"cannot record dax0\.2"):
        backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1", on_carve=journal_down)
    assert all(not rel.endswith("/mapping") for rel, _ in kernel.writes)
    assert sub_devices_with_bytes(backend) == {"dax0.0": 128 * MIB, "dax0.1": 64 * MIB}
    assert ("dax_region/delete", "dax0.2") in kernel.writes  # the seed it made goes again
