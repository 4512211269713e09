"""In-guest setup: two CXL RAM regions made through the kernel's sysfs ABI.

* serial 1 -> a region left in device-DAX use, its dax0.0 shrunk to 0 so the whole
  region is free for leases (kmem is not loaded yet, so nothing onlines it);
* serial 2 -> a region onlined by kmem as a new CPU-less NUMA node.

cxl-cli 76.1 cannot create RAM regions (it says so and exits 0), hence the sysfs writes;
the recipe is shared/cxl-qemu/guest/cxl_sysfs_region.py.

And ``poold serve`` for test_stack_in_guest.py, started before the first test (see
:func:`poold_process`).
"""

from __future__ import annotations

import glob
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


@dataclass(frozen=True)
class GuestMachine:
    dax_region: int  # free for devdax leases
    dax_region_bytes: int
    numa_node: int  # CPU-less node onlined from the second device


@pytest.fixture(scope="session")
def machine() -> GuestMachine:
    devdax_region = create_ram_region(memdev_by_serial(1))
    region_id = int(devdax_region.removeprefix("region"))
    wait_for(f"{DAX}/dax{region_id}.0")
    first = f"{DAX}/dax{region_id}.0"
    assert not os.path.exists(f"{first}/driver"), "dax device bound before kmem was loaded?"
    wr(f"{first}/size", 0)  # the whole region becomes available for sub-devices
    subprocess.run(["modprobe", "kmem"], check=True)
    numa_region = create_ram_region(memdev_by_serial(2))
    numa_id = int(numa_region.removeprefix("region"))
    wait_for(f"{DAX}/dax{numa_id}.0/driver")
    node = int(rd(f"{DAX}/dax{numa_id}.0/target_node"))
    wait_for(f"/sys/devices/system/node/node{node}")
    attrs = glob.glob(f"/sys/bus/cxl/devices/{devdax_region}/dax_region{region_id}/dax_region")
    size = int(rd(f"{attrs[0]}/size"), 0) if attrs else 0
    return GuestMachine(dax_region=region_id, dax_region_bytes=size, numa_node=node)


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
