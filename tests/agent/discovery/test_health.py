"""Health from cxl-cli, fed through an injected runner."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from agent.discovery.health import HealthReport, parse_memdev, read_health, worst

NEW_USAGE = "usage: cxl list [<options>]\n    -H, --health ...\n    -L, --media-errors ...\n"
OLD_USAGE = "usage: cxl list [<options>]\n    -H, --health ...\n"

HEALTHY: dict[str, Any] = {
    "maintenance_needed": False,
    "performance_degraded": False,
    "hw_replacement_needed": False,
    "media_normal": True,
    "media_data_lost": False,
    "ext_life_used": "normal",
    "ext_temperature": "normal",
    "ext_corrected_volatile": "normal",
    "ext_corrected_persistent": "normal",
    "life_used_percent": 15,
    "temperature": 25,
    "dirty_shutdowns": 0,
    "volatile_errors": 20,
    "pmem_errors": 30,
}


Runner = Callable[[Sequence[str]], tuple[int, str]]


def runner(usage: str, listing: object, status: int = 0) -> Runner:
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str]:
        calls.append(list(argv))
        if "--help" in argv:
            return 129, usage
        return status, listing if isinstance(listing, str) else json.dumps(listing)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_healthy_memdevs_with_counters() -> None:
    listing = [
        {"memdev": "mem0", "serial": 3, "health": HEALTHY, "media_errors": []},
        {"memdev": "mem1", "serial": "0x4", "health": HEALTHY, "media_errors": []},
    ]
    run = runner(NEW_USAGE, listing)
    report = read_health(run)
    assert report.tool == "available"
    assert report.media_errors_supported
    assert run.calls[-1] == ["cxl", "list", "-M", "-H", "--media-errors"]  # type: ignore[attr-defined]
    mem1 = report.for_serial(4)
    assert mem1 is not None
    assert mem1.state == "ok"
    assert (mem1.life_used_percent, mem1.temperature_c) == (15, 25)
    assert (mem1.corrected_volatile_errors, mem1.corrected_persistent_errors) == (20, 30)


def test_old_cxl_cli_without_media_errors() -> None:
    run = runner(OLD_USAGE, {"memdev": "mem0", "serial": 1, "health": HEALTHY})
    report = read_health(run)
    assert not report.media_errors_supported
    assert run.calls[-1] == ["cxl", "list", "-M", "-H"]  # type: ignore[attr-defined]
    assert [m.memdev for m in report.memdevs] == ["mem0"]  # a single object, not a list


def test_poison_and_critical_flags() -> None:
    warn = parse_memdev(
        {
            "memdev": "mem0",
            "serial": 1,
            "health": HEALTHY,
            "media_errors": [
                {"dpa": 0, "length": 64, "source": "Internal"},
                {
                    "decoder": "decoder10.0",
                    "hpa": 1035355557888,
                    "dpa": 1073741824,
                    "length": 64,
                    "source": "External",
                },
            ],
        }
    )
    assert warn.state == "warning"
    assert len(warn.media_errors) == 2
    assert warn.media_errors[1].hpa == 1035355557888
    crit = parse_memdev(
        {"memdev": "mem1", "serial": 2, "health": {**HEALTHY, "ext_temperature": "critical"}}
    )
    assert crit.state == "critical"
    assert "ext_temperature=critical" in crit.reasons
    # The older draft shape, and -u hex strings.
    old = parse_memdev(
        {
            "memdev": "mem2",
            "serial": "0x5",
            "media_errors": {
                "nr_media_errors": 1,
                "media_error_records": [
                    {"offset": "0x40000000", "length": 64, "source": "Injected"}
                ],
            },
        }
    )
    assert old.serial == 5
    assert old.media_errors[0].dpa == 0x40000000
    assert old.state == "warning"


def test_tool_missing_or_failing_is_unknown_not_error() -> None:
    def missing(argv: Sequence[str]) -> tuple[int, str]:
        raise FileNotFoundError(argv[0])

    def timeout(argv: Sequence[str]) -> tuple[int, str]:
        raise subprocess.TimeoutExpired(list(argv), 20)

    assert read_health(missing).tool == "missing"
    assert read_health(timeout).tool == "failed"
    assert read_health(runner("usage: cxl list\n", [])).tool == "failed"  # no --health
    assert read_health(runner(NEW_USAGE, [], status=1)).tool == "failed"
    garbage = read_health(runner(NEW_USAGE, "{not json"))
    assert garbage.tool == "failed"
    assert garbage.warnings
    assert read_health(runner(NEW_USAGE, "")).memdevs == []  # nothing listed


def test_worst() -> None:
    assert worst(["ok", "ok"]) == "ok"
    assert worst(["ok", "unknown"]) == "unknown"
    assert worst(["unknown", "warning", "ok"]) == "warning"
    assert worst([]) == "unknown"
    assert HealthReport().tool == "skipped"
