"""Build and boot the QEMU guest that runs tests/hw/guest (host side of the harness).

* ``scripts/hw/build-guest.sh`` makes ``vmlinuz`` + ``initramfs.cpio`` from Debian packages
  into the cache (``$POOLD_HW_CACHE`` or ``~/.cache/poold-hw``), installing QEMU from
  bookworm-backports when it is missing;
* what the guest runs (pytest, and poold's, pool-agent's and poolctl's dependencies: pure
  Python, or cp311 manylinux wheels for the compiled ones) goes into ``pylib.tar`` in the
  cache, every distribution of the dependency closure at the version this venv runs;
* the guest gets the repository read-only (``/mnt/repo``), the pylib (``/mnt/pylib``) and
  a writable ``/mnt/out`` over virtio-9p, and two volatile 256 MiB CXL Type-3 devices on
  one host bridge. It runs tests/hw/guest/run.sh and powers off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "hw" / "build-guest.sh"
# What the guest imports, beyond the stdlib: pytest for the tests, and what `poold serve`,
# `pool-agent serve` and `poolctl` need (pyproject's dependencies, less psycopg: the guest's
# ledger is SQLite; less pyudev: the guest has no libudev, the agent rescans periodically).
# Their dependency closure goes in too (guest_pins), each at the host venv's version.
GUEST_PACKAGES = (
    "pytest",
    "pydantic",
    "pydantic-settings",
    "click",
    "rich",
    "sqlalchemy",
    "alembic",
    "fastapi",
    "uvicorn",
    "httptools",
    "httpx",
    "psutil",
    "prometheus-client",
)
# The guest's interpreter (Debian bookworm's python3.11), for environment markers.
GUEST_MARKER_ENV = {"python_version": "3.11", "python_full_version": "3.11.2", "extra": ""}


class Unavailable(Exception):
    """This machine cannot run the guest (no QEMU and no way to install it)."""


def cache_dir() -> Path:
    return Path(os.environ.get("POOLD_HW_CACHE") or Path.home() / ".cache" / "poold-hw")


def build_image(cache: Path, log: Path) -> float:
    """vmlinuz + initramfs.cpio in ``cache`` (reused when up to date); seconds spent."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise Unavailable(
            f"the hw guest needs Linux on x86_64, this is {sys.platform}/{os.uname().machine}"
        )
    if shutil.which("qemu-system-x86_64") is None and (
        os.geteuid() != 0 or not shutil.which("apt-get")
    ):
        raise Unavailable("qemu-system-x86_64 is missing and apt-get cannot install it (not root)")
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            ["bash", str(BUILD_SCRIPT), str(cache)],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode == 3:
        raise Unavailable(log.read_text()[-2000:])
    if proc.returncode != 0:
        raise RuntimeError(
            f"building the guest failed (rc {proc.returncode}):\n{log.read_text()[-4000:]}"
        )
    return time.monotonic() - start


def guest_pins(roots: tuple[str, ...] = GUEST_PACKAGES) -> list[str]:
    """``name==version`` for ``roots`` and everything they require (no extras), as installed
    in this venv: pip then resolves nothing to a newer release than the host tests ran."""
    pins: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins:
            continue
        dist = importlib.metadata.distribution(name)
        pins[name] = dist.version
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(GUEST_MARKER_ENV):
                todo.append(req.name)
    return sorted(f"{name}=={version}" for name, version in pins.items())


def build_pylib(cache: Path) -> Path:
    """``cache/pylib-<key>/pylib.tar``: the guest's site-packages, built once per version set."""
    pins = guest_pins()
    key = hashlib.sha256(" ".join(pins).encode()).hexdigest()[:12]
    target = cache / f"pylib-{key}"
    tar = target / "pylib.tar"
    if tar.exists():
        return target
    staging = target / "site"
    shutil.rmtree(target, ignore_errors=True)
    staging.mkdir(parents=True)
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--target", str(staging),
            # The guest runs Debian's CPython 3.11 (glibc 2.36): compiled wheels must be
            # cp311 manylinux x86_64, whatever this host's interpreter is.
            "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
            "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:",
            *pins,
        ],
        check=True,
    )  # fmt: skip
    with tarfile.open(tar.with_suffix(".tmp"), "w") as out:
        out.add(staging, arcname=".")
    tar.with_suffix(".tmp").rename(tar)
    shutil.rmtree(staging)
    return target


@dataclass(frozen=True)
class GuestRun:
    rc: int  # the guest script's exit status (99: it never wrote one)
    console: str
    wall_s: float
    out: Path


def boot(cache: Path, pylib: Path, out: Path, run: str, timeout_s: float) -> GuestRun:
    """Boot the guest, run ``run`` (a path inside the guest), wait for poweroff."""
    out.mkdir(parents=True, exist_ok=True)
    backing = out.with_name(out.name + "-pmem")  # the pmem device's media and label area
    shutil.rmtree(backing, ignore_errors=True)  # a fresh, empty device for every boot
    backing.mkdir()
    args = [
        "qemu-system-x86_64",
        "-M", "q35,cxl=on", "-m", "2G,maxmem=8G,slots=8", "-smp", "2",
        "-nographic", "-no-reboot",
        # TCG only (KVM does not work on these hosts). -hypervisor is mandatory: with the
        # hypervisor CPUID bit the kernel refuses to commit CXL regions
        # ("Failed to synchronize CPU cache state", drivers/cxl/core/region.c).
        "-accel", "tcg,thread=multi", "-cpu", "max,-hypervisor",
        "-kernel", str(cache / "vmlinuz"), "-initrd", str(cache / "initramfs.cpio"),
        "-append", f"console=ttyS0 loglevel=4 panic=-1 poold.run={run}",
        # two volatile Type-3 devices (serials 1 and 2) and a persistent one with a label
        # area (serial 3: a pmem region, a devdax namespace, a static dax region) behind
        # one host bridge
        "-object", "memory-backend-ram,id=vmem0,share=on,size=256M",
        "-object", "memory-backend-ram,id=vmem1,share=on,size=256M",
        "-object", f"memory-backend-file,id=pmem0,share=on,mem-path={backing}/pmem0.raw,size=256M",
        "-object", f"memory-backend-file,id=lsa0,share=on,mem-path={backing}/lsa0.raw,size=1M",
        "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
        "-device", "cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=2",
        "-device", "cxl-rp,port=1,bus=cxl.1,id=rp1,chassis=0,slot=3",
        "-device", "cxl-rp,port=2,bus=cxl.1,id=rp2,chassis=0,slot=4",
        "-device", "cxl-type3,bus=rp0,volatile-memdev=vmem0,id=cxl-vmem0,sn=0x1",
        "-device", "cxl-type3,bus=rp1,volatile-memdev=vmem1,id=cxl-vmem1,sn=0x2",
        "-device", "cxl-type3,bus=rp2,persistent-memdev=pmem0,lsa=lsa0,id=cxl-pmem0,sn=0x3",
        "-M", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G",
    ]  # fmt: skip
    # 9p must sit on pcie.0 explicitly: -virtfs would land on the pxb-cxl bus and fail.
    for tag, path, readonly in (("repo", REPO, True), ("pylib", pylib, True), ("out", out, False)):
        fsdev = f"local,id=fs{tag},path={path},security_model=none" + (
            ",readonly=on" if readonly else ""
        )
        args += [
            "-fsdev",
            fsdev,
            "-device",
            f"virtio-9p-pci,fsdev=fs{tag},mount_tag={tag},bus=pcie.0",
        ]
    (out / "guest-rc").unlink(missing_ok=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            args,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
        console = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        console = f"{exc.stdout!r}\nTIMEOUT after {timeout_s}s"
    wall = time.monotonic() - start
    rc_file = out / "guest-rc"
    rc = int(rc_file.read_text()) if rc_file.exists() else 99
    (out / "console.log").write_text(console)
    shutil.rmtree(backing, ignore_errors=True)
    return GuestRun(rc=rc, console=console, wall_s=wall, out=out)
