"""How the shipped systemd unit templates become units for this installation.

``systemd/*.service`` (and the socket and timer) are templates: ``@POOLD@``,
``@POOL_AGENT@`` and ``@POOLCTL@`` stand for the command that runs each program and
``@DOCDIR@`` for where the README is installed. ``poold install-units`` fills them in
with the real paths of the console scripts (or ``python -m`` under the interpreter
running it, where the scripts are not installed), so the units verify wherever the
project was installed: a venv, /usr/local, a distribution prefix.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# Placeholder -> (console script, the module `python -m` runs instead).
PROGRAMS: Final = {
    "POOLD": ("poold", "poold"),
    "POOL_AGENT": ("pool-agent", "agent"),
    "POOLCTL": ("poolctl", "cli"),
}
_PLACEHOLDER: Final = re.compile(r"@[A-Z_]+@")
UNIT_SUFFIXES: Final = (".service", ".socket", ".timer")
EXTRA_FILES: Final = ("poold.sysusers.conf",)
DEFAULT_DEST: Final = Path("/etc/systemd/system")


def templates_dir() -> Path:
    """The shipped templates: the checkout's systemd/, or the copy a wheel installs."""
    candidates = [
        Path(__file__).resolve().parents[1] / "systemd",
        Path(sys.prefix) / "share" / "poold" / "systemd",
    ]
    for candidate in candidates:
        if (candidate / "poold.service").is_file():
            return candidate
    raise FileNotFoundError(
        "no systemd unit templates found (looked in " + ", ".join(map(str, candidates)) + ")"
    )


def default_bindir() -> Path:
    """Where this interpreter's console scripts are installed (a venv's bin, /usr/local/bin)."""
    return Path(sysconfig.get_path("scripts"))


@dataclass(frozen=True)
class Layout:
    """Where the programs and the README of this installation are."""

    bindir: Path
    docdir: Path

    @classmethod
    def resolve(cls, *, prefix: Path | None, bindir: Path | None, docdir: Path | None) -> Layout:
        """--bindir, else PREFIX/bin, else this interpreter's scripts dir; docdir alike."""
        bin_path = bindir or (prefix / "bin" if prefix else default_bindir())
        base = prefix or bin_path.parent
        return cls(bin_path.absolute(), (docdir or base / "share" / "doc" / "poold").absolute())

    def command(self, script: str, module: str) -> str:
        """The ExecStart= words that run a program: its script, else `python -m`."""
        path = self.bindir / script
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        return f"{Path(sys.executable).absolute()} -m {module}"

    def substitutions(self) -> dict[str, str]:
        subs = {f"@{key}@": self.command(*names) for key, names in PROGRAMS.items()}
        subs["@DOCDIR@"] = str(self.docdir)
        return subs


def render(text: str, layout: Layout) -> str:
    """A template with every placeholder filled in."""
    for placeholder, value in layout.substitutions().items():
        text = text.replace(placeholder, value)
    unknown = sorted(set(_PLACEHOLDER.findall(text)))
    if unknown:
        raise ValueError(f"unknown placeholders in a unit template: {', '.join(unknown)}")
    return text


def readme_text() -> str:
    """The README, from the installed package's metadata (or the checkout)."""
    try:
        body = importlib.metadata.metadata("poold").get_payload()  # type: ignore[attr-defined]
    except importlib.metadata.PackageNotFoundError:
        body = None
    if isinstance(body, str) and body.strip():
        return body
    return (Path(__file__).resolve().parents[1] / "README.md").read_text()


def install(dest: Path, layout: Layout, *, templates: Path | None = None) -> list[Path]:
    """Write the units into ``dest`` and the README into the layout's docdir; the paths."""
    source = templates or templates_dir()
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for template in sorted(source.iterdir()):
        if template.suffix not in UNIT_SUFFIXES and template.name not in EXTRA_FILES:
            continue
        target = dest / template.name
        target.write_text(render(template.read_text(), layout))
        target.chmod(0o644)
        written.append(target)
    layout.docdir.mkdir(parents=True, exist_ok=True)
    readme = layout.docdir / "README.md"
    readme.write_text(readme_text())
    readme.chmod(0o644)
    written.append(readme)
    return written
