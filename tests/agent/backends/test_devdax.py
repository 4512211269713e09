"""agent.backends.devdax against copies of recorded machines: the sysfs writes and their undo.

The tree is a private copy of a QEMU capture, so every write lands in a plain file under
it. The attributes the capture could not record (write-only: ``mapping``, ``delete``,
``new_id``, ``bind``...) are added as empty files, and :class:`FakeDaxKernel` plays the
kernel's side of each write (drivers/dax/bus.c): that is the only fake, at the sysfs
boundary. The real kernel runs the same code in tests/hw.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.backends import Backend
from agent.backends.devdax import DevdaxBackend, DevdaxMaterialised
from agent.backends.sysfs_write import SysfsTransaction, guarded_path
from poold.errors import BackendFailed, InvalidSize

MIB = 1 << 20
REGION0 = "devices/platform/ACPI0017:00/root0/decoder0.0/region0/dax_region0"
BASE0 = 0x490000000  # region0/resource in the capture
DRIVER = "bus/dax/drivers/device_dax"


class FakeDaxKernel:
    """What the kernel does after a dax sysfs write, on a plain-file tree; logs every write."""

    def __init__(self, root: Path, dev: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self.dev = dev
        self.writes: list[tuple[str, str]] = []
        self.attach_on_new_id = False
        self.refuse: dict[str, int] = {}  # relative path -> errno

    def rel(self, path: Path) -> str:
        rel = str(path.relative_to(self.root))
        return rel.replace(REGION0 + "/", "")

    def device_dir(self, name: str) -> Path:
        return self.root / "bus/dax/devices" / name

    def __call__(self, path: Path, value: str) -> None:
        rel = self.rel(path)
        self.writes.append((rel, value))
        if rel in self.refuse:
            raise OSError(self.refuse[rel], os.strerror(self.refuse[rel]))
        region = path.parent.parent  # .../dax_region0
        if rel == "dax_region/create":
            ids = [int(p.name.split(".")[1]) for p in region.glob("dax0.*")]
            name = f"dax0.{max(ids) + 1}"
            new = region / name
            new.mkdir()
            for attr, content in {"size": "0", "mapping": "", "dev": f"252:{max(ids) + 1}",
                                  "target_node": "1", "align": str(2 * MIB)}.items():  # fmt: skip
                (new / attr).write_text(content)
            os.symlink(os.path.relpath(new, self.root / "bus/dax/devices"),
                       self.root / "bus/dax/devices" / name)  # fmt: skip
            (region / "dax_region/seed").write_text(name)
        elif rel.endswith("/mapping"):
            start, end = (int(x, 16) for x in value.split("-"))
            path.with_name("size").write_text(str(end - start + 1))
        elif rel == f"{DRIVER}/bind" or (rel == f"{DRIVER}/new_id" and self.attach_on_new_id):
            self._bind(value)
        elif rel == f"{DRIVER}/unbind":
            device = Path(os.path.realpath(self.device_dir(value)))
            if not (device / "driver").is_symlink():
                raise OSError(errno.ENODEV, "not bound")
            (device / "driver").unlink()
            (self.dev / value).unlink()
        elif rel == "dax_region/delete":
            device = Path(os.path.realpath(self.device_dir(value)))
            if (device / "driver").is_symlink() or (device / "size").read_text() != "0":
                raise OSError(errno.EBUSY, "busy")
            shutil.rmtree(device)
            self.device_dir(value).unlink()
            seed = region / "dax_region/seed"
            if seed.read_text() == value:
                seed.write_text("")

    def _bind(self, name: str) -> None:
        device = Path(os.path.realpath(self.device_dir(name)))
        os.symlink(os.path.relpath(self.root / DRIVER, device), device / "driver")
        size = int((device / "size").read_text())
        with open(self.dev / name, "wb") as node:  # a plain file stands in for the chardev
            node.truncate(size)
        seed = device.parent / "dax_region/seed"
        if seed.exists() and seed.read_text() == name:
            seed.write_text("")


def _add_write_only_attrs(sys_root: Path) -> None:
    """The attributes a snapshot cannot read (mode 0200), present on the real kernel."""
    for attr in ("new_id", "remove_id", "bind", "unbind"):
        (sys_root / DRIVER / attr).write_text("")
    for region in (sys_root / "bus/dax/devices").iterdir():
        device = Path(os.path.realpath(region))
        if (device.parent / "dax_region/create").exists():
            (device.parent / "dax_region/delete").write_text("")
            (device / "mapping").write_text("")


Setup = tuple[DevdaxBackend, FakeDaxKernel, Path]


@pytest.fixture
def partitioned(fresh_machine: Callable[[str], Path], tmp_path: Path) -> Setup:
    """qemu-single-03-partitioned: dax0.0 (128 MiB) + dax0.1 (64 MiB), 64 MiB free at 192 MiB."""
    root = fresh_machine("qemu-single-03-partitioned")
    _add_write_only_attrs(root)
    dev = tmp_path / "dev"
    dev.mkdir()
    kernel = FakeDaxKernel(root, dev)
    backend = DevdaxBackend(root, dev, apply=kernel, require_char_device=False)
    return backend, kernel, root


@pytest.fixture
def fresh_machine(tmp_path: Path) -> Callable[[str], Path]:
    from tests.fixtures.machines.loader import Machine

    def get(name: str) -> Path:
        return Machine(name).extract(tmp_path / name)

    return get


def test_carves_a_sub_device_the_way_daxctl_does(partitioned: Setup) -> None:
    backend, kernel, _ = partitioned
    m = backend.materialise_at(0, 192 * MIB, 4 * MIB, "poold-lease-1")
    try:
        assert kernel.writes == [
            ("dax_region/create", "1"),
            ("dax0.2/size", "0"),
            ("dax0.2/mapping", f"{BASE0 + 192 * MIB:#x}-{BASE0 + 196 * MIB - 1:#x}"),
            (f"{DRIVER}/new_id", "dax0.2"),
            (f"{DRIVER}/bind", "dax0.2"),
        ]
        assert isinstance(m, DevdaxMaterialised)
        assert (m.device, m.region_id, m.offset_bytes, m.length_bytes) == (
            "dax0.2",
            0,
            192 * MIB,
            4 * MIB,
        )
        assert (m.backend, m.page_size_bytes, m.numa_node) == ("devdax", 2 * MIB, 1)
        assert os.fstat(m.fd).st_size == 4 * MIB  # the fd is /dev/dax0.2's
        assert backend.sub_devices(0) == {
            "dax0.0": 128 * MIB,
            "dax0.1": 64 * MIB,
            "dax0.2": 4 * MIB,
        }
    finally:
        backend.release(m)


def test_no_bind_write_when_new_id_attached_it(partitioned: Setup) -> None:
    backend, kernel, _ = partitioned
    kernel.attach_on_new_id = True
    m = backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    backend.release(m)
    assert (f"{DRIVER}/bind", "dax0.2") not in kernel.writes


def test_an_existing_seed_is_used_without_create(partitioned: Setup) -> None:
    backend, kernel, _ = partitioned
    first = backend.materialise_at(0, 192 * MIB, 2 * MIB, "a")
    kernel.writes.clear()
    # a size-0 seed left by an earlier create (what the kernel keeps after a delete)
    kernel(guarded_path(kernel.root, f"{REGION0}/dax_region/create"), "1")
    kernel.writes.clear()
    second = backend.materialise_at(0, 194 * MIB, 2 * MIB, "b")
    assert kernel.writes[0] == ("dax0.3/size", "0")
    backend.release(second)
    backend.release(first)


def test_release_unbinds_then_deletes(partitioned: Setup) -> None:
    backend, kernel, root = partitioned
    m = backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    kernel.writes.clear()
    backend.release(m)
    assert kernel.writes == [
        (f"{DRIVER}/unbind", "dax0.2"),
        (f"{DRIVER}/remove_id", "dax0.2"),
        ("dax0.2/size", "0"),
        ("dax_region/delete", "dax0.2"),
    ]
    assert not (root / "bus/dax/devices/dax0.2").exists()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(m.fd)


@pytest.mark.parametrize(
    ("broken", "undo"),
    [
        # bind is the last write: everything before it is undone, newest first
        (
            f"{DRIVER}/bind",
            [
                (f"{DRIVER}/remove_id", "dax0.2"),
                ("dax0.2/size", "0"),
                ("dax_region/delete", "dax0.2"),
            ],
        ),
        (f"{DRIVER}/new_id", [("dax0.2/size", "0"), ("dax_region/delete", "dax0.2")]),
        ("dax0.2/mapping", [("dax_region/delete", "dax0.2")]),
    ],
)
def test_a_failing_step_undoes_every_earlier_write(
    partitioned: Setup, broken: str, undo: list[tuple[str, str]]
) -> None:
    backend, kernel, root = partitioned
    before = backend.sub_devices(0)
    kernel.refuse[broken] = errno.EBUSY
    with pytest.raises(BackendFailed) as caught:
        backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    assert caught.value.code == "backend_failed"
    failed_at = [path for path, _ in kernel.writes].index(broken)
    assert kernel.writes[failed_at + 1 :] == undo
    assert backend.sub_devices(0) == before  # no sub-device left behind
    assert not (root / "bus/dax/devices/dax0.2").exists()


def test_a_missing_attribute_fails_and_undoes(partitioned: Setup) -> None:
    backend, _, root = partitioned
    (root / DRIVER / "bind").unlink()  # a kernel without it: open() gets ENOENT, never creates
    before = backend.sub_devices(0)
    with pytest.raises(BackendFailed, match="bind"):
        backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    assert not (root / DRIVER / "bind").exists()
    assert backend.sub_devices(0) == before


def test_a_device_node_that_cannot_be_opened_undoes_the_bind(partitioned: Setup) -> None:
    backend, kernel, _ = partitioned
    backend.dev_root = backend.dev_root / "missing"
    before = backend.sub_devices(0)
    with pytest.raises(BackendFailed, match="cannot open"):
        backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    assert kernel.writes[-4:] == [
        (f"{DRIVER}/unbind", "dax0.2"),
        (f"{DRIVER}/remove_id", "dax0.2"),
        ("dax0.2/size", "0"),
        ("dax_region/delete", "dax0.2"),
    ]
    assert backend.sub_devices(0) == before


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (192 * MIB + 4096, 2 * MIB),
        (192 * MIB, 3 * MIB),
        (192 * MIB, 0),
        (254 * MIB, 4 * MIB),
        (-2 * MIB, 2 * MIB),
    ],
)
def test_misaligned_or_outside_is_invalid_and_writes_nothing(
    partitioned: Setup, offset: int, length: int
) -> None:
    backend, kernel, _ = partitioned
    with pytest.raises(InvalidSize):
        backend.materialise_at(0, offset, length, "poold-lease-1")
    assert kernel.writes == []


def test_a_busy_seed_is_refused_without_writes(partitioned: Setup) -> None:
    backend, kernel, root = partitioned
    (root / REGION0 / "dax_region/seed").write_text("dax0.1")  # 64 MiB and bound
    with pytest.raises(BackendFailed, match="in use"):
        backend.materialise_at(0, 192 * MIB, 2 * MIB, "poold-lease-1")
    assert kernel.writes == []


def test_scrub_zeroes_through_a_fresh_sub_device(partitioned: Setup) -> None:
    backend, kernel, root = partitioned
    assert backend.scrub(0, 192 * MIB, 2 * MIB) is True
    assert ("dax0.2/mapping", f"{BASE0 + 192 * MIB:#x}-{BASE0 + 194 * MIB - 1:#x}") in kernel.writes
    assert kernel.writes[-1] == ("dax_region/delete", "dax0.2")
    assert not (root / "bus/dax/devices/dax0.2").exists()


def test_scrub_reports_failure(partitioned: Setup) -> None:
    backend, kernel, _ = partitioned
    kernel.refuse["dax0.2/mapping"] = errno.EBUSY  # the range is still someone's
    assert backend.scrub(0, 192 * MIB, 2 * MIB) is False
    assert backend.sub_devices(0) == {"dax0.0": 128 * MIB, "dax0.1": 64 * MIB}


def test_static_region_is_leased_whole_and_once(
    fresh_machine: Callable[[str], Path], tmp_path: Path
) -> None:
    root = fresh_machine("qemu-full-05-pmem")
    _add_write_only_attrs(root)
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "dax2.0").write_bytes(b"")
    kernel = FakeDaxKernel(root, dev)
    backend = DevdaxBackend(root, dev, apply=kernel, require_char_device=False)
    region = backend.region(2)
    assert region.static
    with pytest.raises(InvalidSize, match="leased whole"):
        backend.materialise_at(2, 0, 2 * MIB, "part")
    m = backend.materialise_at(2, 0, region.size_bytes, "whole")
    assert kernel.writes == []  # already bound to device_dax: nothing to carve
    assert isinstance(m, DevdaxMaterialised) and m.device == "dax2.0"
    with pytest.raises(BackendFailed, match="already leased"):
        backend.materialise_at(2, 0, region.size_bytes, "again")
    backend.release(m)  # revoke = unbind (unmaps everyone), never bind under open files
    assert [w[0] for w in kernel.writes] == [f"{DRIVER}/unbind"]
    # The next lease binds it again (tests/agent/backends/test_devdax_static.py).


def test_materialise_without_placement_is_refused(partitioned: Setup) -> None:
    backend: Backend = partitioned[0]
    assert backend.name == "devdax"
    with pytest.raises(BackendFailed, match="materialise_at"):
        backend.materialise(2 * MIB, "x")


def test_unknown_region(partitioned: Setup) -> None:
    with pytest.raises(BackendFailed, match="not found"):
        partitioned[0].region(7)


def test_writes_stay_under_the_sysfs_root(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    (root / "class").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_text("keep")
    os.symlink(outside, root / "class" / "escape")
    txn = SysfsTransaction(root)
    for rel in ("class/escape", "../outside", str(outside)):
        with pytest.raises(BackendFailed):
            txn.write(rel, "x")
    assert outside.read_text() == "keep"


def test_transaction_rolls_back_newest_first_and_keeps_going(tmp_path: Path) -> None:
    for name in ("a", "b", "undo_a", "undo_b"):
        (tmp_path / name).write_text("")
    txn = SysfsTransaction(tmp_path)
    txn.write("a", "1", undo=[("undo_a", "a")])
    txn.write("b", "1", undo=[("missing", "x"), ("undo_b", "b")])
    with pytest.raises(BackendFailed), txn:
        txn.write("missing", "1")
    assert [(w.path, w.value) for w in txn.done] == [("a", "1"), ("b", "1")]
    assert [(w.path, w.value) for w in txn.undone] == [("undo_b", "b"), ("undo_a", "a")]
    assert len(txn.undo_errors) == 1 and "missing" in txn.undo_errors[0]
    assert not (tmp_path / "missing").exists()
