"""Health from cxl-cli, fed through an injected runner."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from agent.discovery.health import (
    USAGE_STATUS,
    HealthReport,
    parse_memdev,
    read_health,
    system_runner,
    worst,
)

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


Runner = Callable[[Sequence[str]], tuple[int, str, str]]


def runner(usage: str, listing: object, status: int = 0) -> Runner:
    """cxl-cli as ndctl builds it: ``-h`` prints usage on stderr and exits 129; ``--help``
    needs man, which this host lacks (the QEMU guest's answer)."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str, str]:
        calls.append(list(argv))
        if "-h" in argv:
            return 129, "", usage
        if "--help" in argv:
            return 1, "", "failed to exec 'man': No such file or directory\n"
        return status, listing if isinstance(listing, str) else json.dumps(listing), ""

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
    def missing(argv: Sequence[str]) -> tuple[int, str, str]:
        raise FileNotFoundError(argv[0])

    def timeout(argv: Sequence[str]) -> tuple[int, str, str]:
        raise subprocess.TimeoutExpired(list(argv), 20)

    assert read_health(missing).tool == "missing"
    assert read_health(timeout).tool == "failed"
    no_health = read_health(runner("usage: cxl list [<options>]\n    -v, --verbose\n", []))
    assert no_health.tool == "unsupported"
    assert read_health(runner(NEW_USAGE, [], status=1)).tool == "failed"
    garbage = read_health(runner(NEW_USAGE, "{not json"))
    assert garbage.tool == "failed"
    assert garbage.warnings
    assert read_health(runner(NEW_USAGE, "")).memdevs == []  # nothing listed


def test_help_needs_no_man_and_exit_129_is_the_usage_page() -> None:
    """The QEMU guest's cxl-cli: ``--help`` fails for want of man, ``-h`` lists the flags."""
    run = runner(NEW_USAGE, [{"memdev": "mem0", "serial": 1, "health": HEALTHY}])
    report = read_health(run)
    assert (report.tool, report.warnings) == ("available", [])
    assert run.calls == [  # type: ignore[attr-defined]
        ["cxl", "list", "-h"],
        ["cxl", "list", "-M", "-H", "--media-errors"],
    ]


def test_unreadable_help_tries_the_flags_and_drops_a_rejected_one() -> None:
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str, str]:
        calls.append(list(argv))
        if "-h" in argv:
            return 1, "", "help is broken on this build\n"
        if "--media-errors" in argv:
            return 129, "", "  error: unknown option `media-errors'\n usage: cxl list\n"
        return 0, json.dumps({"memdev": "mem0", "serial": 1, "health": HEALTHY}), ""

    report = read_health(run)
    assert report.tool == "available"
    assert not report.media_errors_supported
    assert [m.state for m in report.memdevs] == ["ok"]
    assert calls[1:] == [
        ["cxl", "list", "-M", "-H", "--media-errors"],
        ["cxl", "list", "-M", "-H"],
    ]


def test_a_cxl_cli_that_rejects_every_health_flag_is_unsupported() -> None:
    def run(argv: Sequence[str]) -> tuple[int, str, str]:
        if "-h" in argv:
            raise subprocess.TimeoutExpired(list(argv), 20)
        return 129, "", "  error: unknown switch `H'\n"

    report = read_health(run)
    assert report.tool == "unsupported"
    assert report.memdevs == []


def test_a_hung_listing_is_failed_not_a_crash() -> None:
    def run(argv: Sequence[str]) -> tuple[int, str, str]:
        if "-h" in argv:
            return 129, "", NEW_USAGE
        raise subprocess.TimeoutExpired(list(argv), 20)

    report = read_health(run)
    assert report.tool == "failed"
    assert "timed out" in report.warnings[0]


@pytest.mark.skipif(shutil.which("cxl") is None, reason="no cxl-cli on this host")
def test_this_hosts_cxl_cli_answers_the_probe() -> None:
    """The real cxl-cli (without man, where it is missing here): -h lists --health."""
    status, out, err = system_runner(["cxl", "list", "-h"])
    assert status == USAGE_STATUS
    assert "--health" in out + err


def test_worst() -> None:
    assert worst(["ok", "ok"]) == "ok"
    assert worst(["ok", "unknown"]) == "unknown"
    assert worst(["unknown", "warning", "ok"]) == "warning"
    assert worst([]) == "unknown"
    assert HealthReport().tool == "skipped"
