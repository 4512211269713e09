"""In-guest setup: two CXL RAM regions made through the kernel's sysfs ABI.

* serial 1 -> a region left in device-DAX use. The kernel's dax0.0 claims all of it at
  creation; it is shrunk to the region's first part and bound to device_dax (what
  ``daxctl reconfigure-device --mode=devdax`` does), so it stays a device poold did not make,
  holding bytes, and the last FREE_BYTES are what leases can have. Bound before kmem is
  loaded: kmem would online an unbound dax0.0 as system-ram;
* serial 2 -> a region onlined by kmem as a new CPU-less NUMA node.

cxl-cli 76.1 cannot create RAM regions (it says so and exits 0), hence the sysfs writes;
the recipe is shared/cxl-qemu/guest/cxl_sysfs_region.py.

And ``poold serve`` for test_stack_in_guest.py, started before the first test (see
:func:`poold_process`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from poold import procs

CXL = "/sys/bus/cxl/devices"
DAX = "/sys/bus/dax/devices"


def rd(path: str) -> str:
    return Path(path).read_text().strip()


def wr(path: str, value: object) -> None:
    with open(path, "w") as attr:
        attr.write(str(value))


def memdev_by_serial(serial: int) -> str:
    for path in glob.glob(f"{CXL}/mem*"):
        if int(rd(f"{path}/serial"), 0) == serial:
            return os.path.basename(path)
    raise LookupError(f"no CXL memdev with serial {serial}")


def create_ram_region(memdev: str) -> str:
    """A 1-way RAM region over the whole RAM partition of ``memdev``; returns its name."""
    root = next(
        d for d in sorted(glob.glob(f"{CXL}/root0/decoder0.*")) if rd(f"{d}/cap_ram") == "1"
    )
    size = int(rd(f"{CXL}/{memdev}/ram/size"), 0)
    size -= size % (256 << 20)
    create = f"{root}/create_ram_region"
    name = rd(create)
    wr(create, name)
    region = f"{CXL}/{name}"
    wr(f"{region}/interleave_granularity", 4096)
    wr(f"{region}/interleave_ways", 1)
    wr(f"{region}/size", size)
    endpoint = next(
        e for e in glob.glob(f"{CXL}/endpoint*")
        if os.path.basename(os.path.realpath(f"{e}/uport")) == memdev
    )  # fmt: skip
    decoders = sorted(glob.glob(f"{endpoint}/decoder*.*"), key=lambda d: int(d.rsplit(".", 1)[1]))
    decoder = next(d for d in decoders if int(rd(f"{d}/dpa_size"), 0) == 0)
    wr(f"{decoder}/mode", "ram")
    wr(f"{decoder}/dpa_size", size)
    wr(f"{region}/target0", os.path.basename(decoder))
    wr(f"{region}/commit", 1)
    wr("/sys/bus/cxl/drivers/cxl_region/bind", name)
    return name


def wait_for(path: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)


# What dax0.0 leaves of the devdax region: room for every test's leases (the stack's tests
# hold at most a handful of 2 MiB ranges at once, live or scrubbing), small enough that
# filling it with leases and scrubbing them all takes seconds (emulated CXL memory runs at
# 10-20 MB/s).
FREE_BYTES = 16 << 20
DEVICE_DAX = "/sys/bus/dax/drivers/device_dax"


@dataclass(frozen=True)
class DaxDeviceState:
    """What a dax device holds, as sysfs shows it: compared before and after to prove a
    device untouched."""

    size_bytes: int
    driver: str | None
    mappings: tuple[tuple[int, int], ...]  # (start, end) host-physical, end inclusive


def dax_device_state(device: str) -> DaxDeviceState:
    """``device``'s size, driver and ``mappingN`` ranges (what ``daxctl list -DM`` prints)."""
    path = Path(DAX) / device
    driver = path / "driver"
    mappings = sorted(path.glob("mapping[0-9]*"), key=lambda m: int(m.name.removeprefix("mapping")))
    return DaxDeviceState(
        size_bytes=int(rd(f"{path}/size"), 0),
        driver=os.path.basename(os.readlink(driver)) if driver.is_symlink() else None,
        mappings=tuple((int(rd(f"{m}/start"), 0), int(rd(f"{m}/end"), 0)) for m in mappings),
    )


def resize_dax_device(device: str, size_bytes: int) -> None:
    """Unbind, resize and rebind ``device``, as an administrator would with daxctl (the
    kernel refuses to resize a bound device: EBUSY)."""
    wr(f"{DEVICE_DAX}/unbind", device)
    try:
        wr(f"{DAX}/{device}/size", size_bytes)
    finally:
        wr(f"{DEVICE_DAX}/bind", device)


@dataclass(frozen=True)
class GuestMachine:
    dax_region: int  # the devdax region: dax0.0 at its start, then free for leases
    dax_region_bytes: int
    numa_node: int  # CPU-less node onlined from the second device
    claimed_device: str  # the kernel's dax0.0, kept holding [0, free_offset_bytes)
    free_offset_bytes: int  # the region offset past dax0.0: where leases can go


@pytest.fixture(scope="session")
def machine() -> GuestMachine:
    devdax_region = create_ram_region(memdev_by_serial(1))
    region_id = int(devdax_region.removeprefix("region"))
    wait_for(f"{DAX}/dax{region_id}.0")
    claimed = f"dax{region_id}.0"
    first = f"{DAX}/{claimed}"
    assert not os.path.exists(f"{first}/driver"), "dax device bound before kmem was loaded?"
    region_bytes = int(rd(f"{first}/size"), 0)  # all of it, as the kernel made it
    claimed_bytes = region_bytes - FREE_BYTES
    wr(f"{first}/size", claimed_bytes)  # shrinking keeps the start: [0, claimed_bytes)
    # new_id attaches it on its own; bind in case this kernel does not.
    wr(f"{DEVICE_DAX}/new_id", claimed)
    if not os.path.exists(f"{first}/driver"):
        wr(f"{DEVICE_DAX}/bind", claimed)
    subprocess.run(["modprobe", "kmem"], check=True)
    state = dax_device_state(claimed)
    assert (state.driver, state.size_bytes) == ("device_dax", claimed_bytes), state
    numa_region = create_ram_region(memdev_by_serial(2))
    numa_id = int(numa_region.removeprefix("region"))
    wait_for(f"{DAX}/dax{numa_id}.0/driver")
    node = int(rd(f"{DAX}/dax{numa_id}.0/target_node"))
    wait_for(f"/sys/devices/system/node/node{node}")
    attrs = glob.glob(f"/sys/bus/cxl/devices/{devdax_region}/dax_region{region_id}/dax_region")
    size = int(rd(f"{attrs[0]}/size"), 0) if attrs else 0
    return GuestMachine(
        dax_region=region_id,
        dax_region_bytes=size,
        numa_node=node,
        claimed_device=claimed,
        free_offset_bytes=claimed_bytes,
    )


@pytest.fixture
def lease_name() -> str:
    return f"poold-hw-{uuid.uuid4().hex[:8]}"


STACK_DIR = Path("/tmp/poold-stack")  # run.sh copies the *.log files here to /mnt/out
# Fast lifecycle: a quick reaper and a short grace, so orphans and scrubs settle in seconds.
POOLD_ENV = {"POOLD_REAP_INTERVAL_S": "0.5", "POOLD_EXPIRY_GRACE_S": "1"}


@dataclass
class PooldProcess:
    """`poold serve` on SQLite under STACK_DIR, listening on loopback (maybe still starting)."""

    child: procs.Child
    state_dir: Path
    url: str

    def wait_ready(self, timeout_s: float) -> None:
        """Return once /v1/health answers (what procs.start_poold waits for)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.child.alive():
                raise RuntimeError(f"poold exited at start:\n{self.child.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"poold did not answer within {timeout_s}s:\n{self.child.log_tail()}")


def spawn_poold(
    state_dir: Path,
    port: int,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> procs.Child:
    """`poold serve` on SQLite in ``state_dir`` (loopback ``port``), not waited for."""
    argv = [
        sys.executable, "-m", "poold", "serve", "--state-dir", str(state_dir),
        "--port", str(port), "--log-level", "warning", *(extra or []),
    ]  # fmt: skip
    return procs.Child("poold", argv, STACK_DIR / "poold.log", env={**POOLD_ENV, **(env or {})})


@pytest.fixture(scope="session", autouse=True)
def poold_process() -> Iterator[PooldProcess]:
    """`poold serve`, spawned before the first test without waiting for it.

    Under TCG its start (imports, migrations) takes most of a minute: the backend tests of
    test_in_guest.py run meanwhile, and test_stack_in_guest.py waits for it to answer.
    Spawned here rather than through procs.start_poold, which blocks until it answers.
    """
    shutil.rmtree(STACK_DIR, ignore_errors=True)
    STACK_DIR.mkdir()
    STACK_DIR.chmod(0o755)  # tenants of other uids must reach the agent socket below it
    port = procs.free_port()
    state_dir = STACK_DIR / "poold"
    process = PooldProcess(spawn_poold(state_dir, port), state_dir, f"http://127.0.0.1:{port}")
    try:
        yield process
    finally:
        process.child.stop()  # a chaos test may have replaced the first one


# The pmem namespace of the static dax tests: small, so that a scrub of it takes seconds.
STATIC_NAMESPACE_BYTES = 16 << 20


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: rc {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


@pytest.fixture
def static_dax_region() -> Iterator[int]:
    """A static dax region: a CXL pmem region over the persistent memdev (serial 3), a
    devdax namespace in it (what ``ndctl create-namespace -m devdax`` makes); its id.
    Destroyed again afterwards, so that the stack's tests never see it."""
    memdev = memdev_by_serial(3)
    root = next(
        d for d in sorted(glob.glob(f"{CXL}/root0/decoder0.*")) if rd(f"{d}/cap_pmem") == "1"
    )
    region = json.loads(
        _sh("cxl", "create-region", "-m", "-t", "pmem", "-d", os.path.basename(root), "-w",
            "1", memdev)
    )["region"]  # fmt: skip
    try:
        nd = ""
        deadline = time.monotonic() + 20
        while not nd and time.monotonic() < deadline:
            nd = next(iter(sorted(glob.glob("/sys/bus/nd/devices/region*"))), "")
            time.sleep(0.2)
        namespace = json.loads(
            _sh("ndctl", "create-namespace", "-m", "devdax", "-r", os.path.basename(nd),
                "-s", str(STATIC_NAMESPACE_BYTES))
        )  # fmt: skip
        dax_id = int(namespace["daxregion"]["id"])
        try:
            wait_for(f"{DAX}/dax{dax_id}.0/driver")
            yield dax_id
        finally:
            _sh("ndctl", "destroy-namespace", "-f", namespace["dev"])
    finally:
        _sh("cxl", "destroy-region", "-f", region)
