"""How do we read one sysfs attribute without letting a broken or changing tree crash discovery?

Every reader goes through :class:`SysfsReader`. A missing attribute means "this kernel
(or this device) doesn't have it" and reads as ``None``; an unreadable file or a value that
doesn't parse also reads as ``None`` but leaves a warning, which discovery reports as data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

# Readers pass plain strings on hot paths: pathlib's "/" costs more than the read itself.
StrPath = str | os.PathLike[str]
_READ_CHUNK = 8192  # sysfs text attributes are at most PAGE_SIZE


def parse_cpulist(text: str) -> list[int]:
    """Expand a kernel cpulist/nodelist ("0-2,5") into ids; raises ValueError on garbage."""
    ids: list[int] = []
    text = text.strip()
    if not text:
        return ids
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if sep:
            ids.extend(range(int(lo), int(hi) + 1))
        else:
            ids.append(int(lo))
    return ids


class SysfsReader:
    """Reads attributes under one sysfs root and collects warnings instead of raising."""

    def __init__(self, root: Path = Path("/sys")) -> None:
        self.root = Path(root)
        self.warnings: list[str] = []

    def path(self, *parts: str) -> Path:
        """A path under the root; parts are relative to it ("bus", "cxl", ...)."""
        return self.root.joinpath(*parts)

    def rel(self, path: StrPath) -> str:
        """Path as the kernel would name it (``/sys/...``), for warnings."""
        try:
            return "/sys/" + str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)

    def warn(self, message: str) -> None:
        """Record a problem that made a field unknown."""
        self.warnings.append(message)

    # -- raw reads -------------------------------------------------------------------------

    def read_str(self, path: StrPath, *, probe: bool = False) -> str | None:
        """Stripped contents, or None. ``probe=True``: a missing file is expected, no warning."""
        try:
            # os.open/os.read: a third of the cost of open().read(); discovery reads thousands.
            fd = os.open(path, os.O_RDONLY)
            try:
                raw = os.read(fd, _READ_CHUNK)
                while len(raw) % _READ_CHUNK == 0 and raw:
                    more = os.read(fd, _READ_CHUNK)
                    if not more:
                        break
                    raw += more
            finally:
                os.close(fd)
        except FileNotFoundError:
            if not probe:
                self.warn(f"{self.rel(path)}: missing")
            return None
        except OSError as exc:  # EACCES, EIO (PCI resourceN), EISDIR on a broken tree
            self.warn(f"{self.rel(path)}: unreadable ({exc.strerror or exc})")
            return None
        try:
            return raw.decode("ascii").strip()
        except UnicodeDecodeError:
            self.warn(f"{self.rel(path)}: not text")
            return None

    def read_int(self, path: StrPath, *, base: int = 0, probe: bool = False) -> int | None:
        """Integer attribute; base 0 accepts both "0x10000000" and "268435456"."""
        text = self.read_str(path, probe=probe)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            self.warn(f"{self.rel(path)}: not an integer: {text[:40]!r}")
            return None

    def read_hex(self, path: StrPath, *, probe: bool = False) -> int | None:
        """Hex attribute that may lack the 0x prefix (memory/block_size_bytes)."""
        return self.read_int(path, base=16, probe=probe)

    def read_bool(self, path: StrPath, *, probe: bool = False) -> bool | None:
        """0/1 attribute."""
        value = self.read_int(path, probe=probe)
        return None if value is None else value != 0

    def read_list(self, path: StrPath, *, probe: bool = False) -> list[int] | None:
        """cpulist/nodelist attribute ("0-2,5")."""
        text = self.read_str(path, probe=probe)
        if text is None:
            return None
        try:
            return parse_cpulist(text)
        except ValueError:
            self.warn(f"{self.rel(path)}: not a list: {text[:40]!r}")
            return None

    def link_name(self, path: StrPath) -> str | None:
        """Basename of a symlink's target ("driver" -> "kmem"), None when absent."""
        try:
            return os.path.basename(os.readlink(path))
        except FileNotFoundError:
            return None
        except OSError as exc:  # EINVAL: a file where a link belongs
            self.warn(f"{self.rel(path)}: not a link ({exc.strerror or exc})")
            return None

    def listdir(self, path: StrPath) -> list[str]:
        """Sorted entries, [] when the directory is absent (subsystem not on this kernel)."""
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.warn(f"{self.rel(path)}: cannot list ({exc.strerror or exc})")
            return []

    def resolve(self, path: StrPath) -> Path | None:
        """Follow a /sys/bus/*/devices link to the device directory; None if it vanished.

        sysfs links are relative and point straight at real directories, so joining the
        link text lexically is exact, and 10x cheaper than realpath's lstat per component.
        """
        try:
            target = os.readlink(path)
        except FileNotFoundError:
            self.warn(f"{self.rel(path)}: vanished during scan")
            return None
        except OSError:  # not a link: a plain directory is fine (some test trees)
            target = str(path)
        real = Path(os.path.normpath(os.path.join(os.path.dirname(path), target)))
        if not os.path.isdir(real):
            if os.path.lexists(real):
                self.warn(f"{self.rel(path)}: not a device directory")
            else:
                self.warn(f"{self.rel(path)}: vanished during scan")
            return None
        return real


def natural_key(name: str) -> tuple[str, tuple[int, ...]]:
    """Sort "mem10" after "mem9" and "decoder2.10" after "decoder2.9"."""
    stem = name.rstrip("0123456789.")
    digits = name[len(stem) :]
    numbers: Iterable[str] = (p for p in digits.split(".") if p)
    try:
        return stem, tuple(int(p) for p in numbers)
    except ValueError:
        return name, ()


def numbered(names: Iterable[str], prefix: str) -> list[str]:
    """Names of the form <prefix><digits>[.<digits>] in natural order."""
    out = [n for n in names if n.startswith(prefix) and n[len(prefix) :][:1].isdigit()]
    return sorted(out, key=natural_key)
