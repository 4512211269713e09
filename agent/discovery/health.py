"""How healthy is each CXL memdev, and which of its ranges are poisoned?

sysfs does not carry device health, so this asks ndctl's ``cxl list -M -H`` (plus
``--media-errors`` where that cxl-cli has it, v80+). The tool is optional: a missing tool,
an unsupported flag or output that doesn't parse makes health "unknown", never an error.
The command runner is injectable so tests feed captured JSON.

Flags are detected from ``cxl list -h``, never ``--help``: ndctl's ``--help`` execs
``man`` (absent on most servers and in the QEMU guest, where it printed no flags), while
``-h`` prints the option list itself, on stderr, and exits 129 (ndctl's parse-options,
like git's). Neither exit status nor an empty help page decides anything: when the help
lists no options at all, the flags are tried directly, and a flag the tool rejects exits
129 again ("unknown option"), which only drops that flag.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

HealthState = Literal["ok", "warning", "critical", "unknown"]
# Runs an argument list, returns (exit status, stdout, stderr). Raises FileNotFoundError
# when the tool is not installed, subprocess.TimeoutExpired when it hangs.
CommandRunner = Callable[[Sequence[str]], tuple[int, str, str]]

CXL_TIMEOUT_S = 20.0  # get-poison-list walks the whole device; slow parts take seconds
# ndctl's parse-options exits 129 after printing usage: for -h, and for an unknown option.
USAGE_STATUS = 129


def system_runner(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run a real command; FileNotFoundError when it is not on PATH."""
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(argv[0])
    done = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        errors="replace",
        stdin=subprocess.DEVNULL,
        timeout=CXL_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


class MediaError(BaseModel):
    """One poisoned range from the device's poison list (CXL 3.1 Get Poison List)."""

    dpa: int | None = None  # device physical address ("offset" in some cxl-cli versions)
    hpa: int | None = None  # host physical address, when the range is mapped by a region
    length: int | None = None
    source: str | None = None  # External, Internal, Injected, Vendor Specific, Unknown


class MemdevHealth(BaseModel):
    """Health of one memdev, with the counters poold shows."""

    memdev: str
    serial: int | None = None
    state: HealthState = "unknown"
    life_used_percent: int | None = None
    temperature_c: int | None = None
    corrected_volatile_errors: int | None = None
    corrected_persistent_errors: int | None = None
    dirty_shutdowns: int | None = None
    media_errors: list[MediaError] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)


class HealthReport(BaseModel):
    """Health of every memdev the tool listed, keyed by memdev serial where known."""

    # missing: no cxl-cli; unsupported: one without --health; failed: it ran, and its
    # listing failed or did not parse. Device health is "unknown" in all three.
    tool: Literal["available", "missing", "unsupported", "failed", "skipped"] = "skipped"
    media_errors_supported: bool = False
    memdevs: list[MemdevHealth] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    def for_serial(self, serial: int | None) -> MemdevHealth | None:
        """Health entry for a memdev serial."""
        if serial is None:
            return None
        return next((h for h in self.memdevs if h.serial == serial), None)


def _int(value: Any) -> int | None:
    """cxl-cli prints numbers as ints, or as "0x5" strings with -u (human) output."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value, 0)
        except ValueError:
            return None
    return None


_CRITICAL_FLAGS = (
    "hw_replacement_needed",
    "media_data_lost",
    "media_persistence_lost",
    "media_data_loss_imminent",
    "media_persistence_loss_imminent",
    "media_not_ready",
)
_WARNING_FLAGS = ("maintenance_needed", "performance_degraded")
_EXT_FIELDS = (
    "ext_life_used",
    "ext_temperature",
    "ext_corrected_volatile",
    "ext_corrected_persistent",
)


def _media_errors(raw: Any) -> list[MediaError]:
    """Both shapes cxl-cli has printed: a list, or {"media_error_records": [...]}."""
    if isinstance(raw, dict):
        raw = raw.get("media_error_records", [])
    if not isinstance(raw, list):
        return []
    out: list[MediaError] = []
    for rec in raw:
        if isinstance(rec, dict):
            out.append(
                MediaError(
                    dpa=_int(rec.get("dpa", rec.get("offset"))),
                    hpa=_int(rec.get("hpa")),
                    length=_int(rec.get("length")),
                    source=str(rec["source"]) if "source" in rec else None,
                )
            )
    return out


def parse_memdev(obj: dict[str, Any]) -> MemdevHealth:
    """Turn one memdev object of ``cxl list -M -H [-L]`` into a health entry (pure)."""
    entry = MemdevHealth(memdev=str(obj.get("memdev", "?")), serial=_int(obj.get("serial")))
    entry.media_errors = _media_errors(obj.get("media_errors"))
    health = obj.get("health")
    if not isinstance(health, dict):
        if entry.media_errors:
            entry.state, entry.reasons = "warning", ["media errors"]
        return entry
    entry.life_used_percent = _int(health.get("life_used_percent"))
    entry.temperature_c = _int(health.get("temperature"))
    entry.corrected_volatile_errors = _int(health.get("volatile_errors"))
    entry.corrected_persistent_errors = _int(health.get("pmem_errors"))
    entry.dirty_shutdowns = _int(health.get("dirty_shutdowns"))
    critical = [f for f in _CRITICAL_FLAGS if health.get(f) is True]
    critical += [f"{f}=critical" for f in _EXT_FIELDS if health.get(f) == "critical"]
    warning = [f for f in _WARNING_FLAGS if health.get(f) is True]
    warning += [f"{f}=warning" for f in _EXT_FIELDS if health.get(f) == "warning"]
    if entry.media_errors:
        warning.append(f"{len(entry.media_errors)} media errors")
    if critical:
        entry.state, entry.reasons = "critical", critical + warning
    elif warning:
        entry.state, entry.reasons = "warning", warning
    else:
        entry.state = "ok"
    return entry


def parse_list(text: str) -> list[dict[str, Any]]:
    """``cxl list`` prints one object for one match, a list otherwise, nothing for none."""
    text = text.strip()
    if not text:
        return []
    data = json.loads(text)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise ValueError("not a JSON list")
    return [d for d in data if isinstance(d, dict) and "memdev" in d]


def _listed_flags(usage: str) -> set[str] | None:
    """The long options a usage text lists; None when it lists none (not a usage page)."""
    flags = {word.rstrip(",=") for word in usage.split() if word.startswith("--")}
    flags.discard("--")
    return flags or None


def _probe_flags(run: CommandRunner, report: HealthReport) -> set[str] | None:
    """``cxl list -h``'s long options; None when no help could be read (flags then tried).
    FileNotFoundError (no cxl-cli) propagates."""
    try:
        _, out, err = run(["cxl", "list", "-h"])
    except FileNotFoundError:
        raise
    except (OSError, subprocess.SubprocessError) as exc:
        report.warnings.append(f"cxl list -h: {exc}; trying the health flags directly")
        return None
    return _listed_flags(out + "\n" + err)


def read_health(run: CommandRunner = system_runner) -> HealthReport:
    """Ask cxl-cli for health; feature-detect flags from ``cxl list -h`` (module docstring)."""
    report = HealthReport()
    try:
        flags = _probe_flags(run, report)
    except FileNotFoundError:
        report.tool = "missing"
        return report
    if flags is not None and "--health" not in flags:
        report.tool = "unsupported"
        report.warnings.append("this cxl list has no --health: health unknown")
        return report
    attempts = [["cxl", "list", "-M", "-H"]]
    if flags is None or "--media-errors" in flags:
        attempts.insert(0, [*attempts[0], "--media-errors"])
    for argv in attempts:
        try:
            status, out, err = run(argv)
        except FileNotFoundError:
            report.tool = "missing"
            return report
        except (OSError, subprocess.SubprocessError) as exc:
            report.tool = "failed"
            report.warnings.append(f"{' '.join(argv)}: {exc}")
            return report
        if status == USAGE_STATUS and flags is None:
            continue  # a flag this cxl-cli does not have: try without it
        break
    else:
        report.tool = "unsupported"
        report.warnings.append("cxl list rejects --health: health unknown")
        return report
    if status != 0:
        report.tool = "failed"
        detail = err.strip().splitlines()[-1:] if err.strip() else []
        report.warnings.append(
            f"{' '.join(argv)}: exit status {status}" + (f" ({detail[0]})" if detail else "")
        )
        return report
    report.media_errors_supported = "--media-errors" in argv
    try:
        objects = parse_list(out)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        report.tool = "failed"
        report.warnings.append(f"{' '.join(argv)}: unparseable output ({exc})")
        return report
    report.tool = "available"
    report.memdevs = [parse_memdev(o) for o in objects]
    return report


def worst(states: Sequence[HealthState]) -> HealthState:
    """Health of something built from parts: the worst part; unknown if any is unknown."""
    if not states:
        return "unknown"
    order: dict[HealthState, int] = {"ok": 0, "unknown": 1, "warning": 2, "critical": 3}
    return max(states, key=lambda s: order[s])
