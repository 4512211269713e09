"""How does the agent change sysfs without leaving a half-configured device behind?

Through a :class:`SysfsTransaction` (STYLE.md pattern 7): every write goes to an
attribute *under the injected sysfs root* (never outside it, symlinks resolved), is
logged, and may register the writes that undo it. If a later step fails, the undo
writes run newest first, so whatever the transaction created is destroyed again.

An attribute is written with a single ``write(2)`` on a file opened without ``O_CREAT``:
the kernel parses one write per store, and a missing attribute means "this kernel (or
this device) doesn't have it", never a file to create. Tests point the root at a copy of
a recorded machine, where the writes land in plain files; they may pass an ``apply``
hook that plays the kernel's side effects (a new seed device, a driver link) after each
write, which is the only place the fake sits.

Only writes are here: the backends read sysfs through discovery's
:class:`~agent.discovery.sysfs.SysfsReader`, like every other reader of the agent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from poold.errors import BackendFailed

log = logging.getLogger(__name__)

# Called after each successful write with (absolute path, value): the test fake's kernel.
ApplyHook = Callable[[Path, str], None]


@dataclass(frozen=True, slots=True)
class SysfsWrite:
    """One write: the attribute (relative to the sysfs root) and the value written."""

    path: str
    value: str


def guarded_path(root: Path, rel: str | Path) -> Path:
    """``root/rel`` with symlinks resolved; refuses anything that lands outside ``root``."""
    if Path(rel).is_absolute():
        raise BackendFailed(f"sysfs path {rel} must be relative to the sysfs root")
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root / rel))
    if target != real_root and real_root not in target.parents:
        raise BackendFailed(
            f"sysfs path {rel} resolves to {target}, outside the sysfs root {real_root}"
        )
    return target


def write_attr(root: Path, rel: str | Path, value: str, apply: ApplyHook | None = None) -> None:
    """One guarded, logged write of ``value`` to the attribute ``root/rel``."""
    target = guarded_path(root, rel)
    data = value.encode()
    log.info("sysfs write %s <- %r", target, value)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
        if apply is not None:
            apply(target, value)
    except OSError as err:
        log.warning("sysfs write %s <- %r failed: %s", target, value, err.strerror)
        raise BackendFailed(
            f"writing {value!r} to {rel} failed: {err.strerror}",
            path=str(rel),
            value=value,
            errno=err.errno,
        ) from err
    if written != len(data):
        raise BackendFailed(f"short write of {value!r} to {rel}", path=str(rel), value=value)


@dataclass
class SysfsTransaction:
    """Guarded sysfs writes that are undone, newest first, unless :meth:`commit` is called.

    Use as a context manager: an exception inside the block rolls back, then propagates.
    """

    root: Path
    apply: ApplyHook | None = None
    done: list[SysfsWrite] = field(default_factory=list)
    undone: list[SysfsWrite] = field(default_factory=list)
    undo_errors: list[str] = field(default_factory=list)
    _undo: list[list[SysfsWrite]] = field(default_factory=list)
    _open: bool = True

    def write(self, rel: str | Path, value: str, undo: list[tuple[str | Path, str]] = []) -> None:  # noqa: B006 (never mutated)
        """Write ``value`` to ``rel``; on rollback, write each ``undo`` pair in order."""
        if not self._open:
            raise RuntimeError("sysfs transaction already finished")
        write_attr(self.root, rel, value, self.apply)
        self.done.append(SysfsWrite(str(rel), value))
        self._undo.append([SysfsWrite(str(p), v) for p, v in undo])

    def on_rollback(self, rel: str | Path, value: str) -> None:
        """Register an undo write for something that happened without a write of ours
        (a driver the kernel bound on its own, a seed device it created)."""
        self._undo.append([SysfsWrite(str(rel), value)])

    def commit(self) -> None:
        """Keep every write; nothing will be undone."""
        self._open = False
        self._undo.clear()

    def rollback(self) -> list[str]:
        """Run the undo writes newest first; every failure is logged and returned, none stops it."""
        self._open = False
        while self._undo:
            for step in self._undo.pop():
                try:
                    write_attr(self.root, step.path, step.value, self.apply)
                    self.undone.append(step)
                except BackendFailed as err:
                    log.error("sysfs undo %s <- %r failed: %s", step.path, step.value, err)
                    self.undo_errors.append(f"{step.path} <- {step.value!r}: {err}")
        return list(self.undo_errors)

    def __enter__(self) -> SysfsTransaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and self._open:
            self.rollback()
