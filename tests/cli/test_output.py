"""Is poolctl's output whole when piped, and is `--format json` every view's `--json`?"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from cli.common import plain_lines
from cli.poolctl import main
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20
CXL = "cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"
ROOT = Path(__file__).resolve().parents[2]


def poolctl(api: ThreadedServer, *args: str, columns: int = 60) -> Result:
    # A narrow "terminal": rich would cut every long cell to fit it.
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": str(columns)}
    )


@pytest.fixture
def pool(api: ThreadedServer, admin: PooldClient) -> Iterator[list[str]]:
    """Two tenants' leases on a CXL device; yields the lease ids."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[1000]))
    admin.create_tenant(TenantSpec(name="t2", quota_bytes=1 << 30, allowed_uids=[1001]))
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=CXL,
                        kind="devdax",
                        media="ddr5",
                        capacity_bytes=512 * MiB,
                        local_name="dax_region0",
                        reserved_extents=[(0, 64 * MiB)],
                    )
                ]
            )
        )
        yield [
            agent.grant(GrantRequest(size_bytes=32 * MiB, uid=uid, pid=7, activate=True)).id
            for uid in (1000, 1001, 1000)
        ]


def test_piped_output_is_plain_and_whole(api: ThreadedServer, pool: list[str]) -> None:
    r = poolctl(api, "leases", "list", "--live")
    assert r.exit_code == 0, r.output
    for lease_id in pool:
        assert lease_id in r.output
    assert CXL in r.output and "…" not in r.output
    assert not set("┏┃┡│└─") & set(r.output)  # no box drawing in plain text
    r = poolctl(api, "devices")
    assert r.exit_code == 0 and CXL in r.output and "…" not in r.output
    header = r.output.splitlines()[1].split()
    assert header[:4] == ["id", "device", "kind", "media"]  # whole column names too
    r = poolctl(api, "status")
    assert r.exit_code == 0 and CXL in r.output and "…" not in r.output


def test_format_table_still_draws_rich_tables(api: ThreadedServer, pool: list[str]) -> None:
    r = poolctl(api, "--format", "table", "leases", "list", "--live")
    assert r.exit_code == 0, r.output
    assert "┃" in r.output or "│" in r.output
    assert "…" in r.output  # cut to the 60 columns, as on such a terminal
    r = poolctl(api, "--format", "plain", "leases", "list", "--live")
    assert all(lease_id in r.output for lease_id in pool)


VIEWS = [
    ["status"],
    ["devices"],
    ["devices", "show", "dax_region0"],
    ["devices", "map"],
    ["tenants", "list"],
    ["tenants", "show", "t1"],
    ["hosts", "list"],
    ["leases", "list"],
]


@pytest.mark.parametrize("view", VIEWS, ids=" ".join)
def test_format_json_is_the_views_json(
    api: ThreadedServer, pool: list[str], view: list[str]
) -> None:
    own = poolctl(api, *view, "--json")
    root = poolctl(api, "--format", "json", *view)
    assert own.exit_code == root.exit_code == 0, own.output + root.output
    assert json.loads(own.stdout) == json.loads(root.stdout)


def test_format_json_for_lease_show_accounting_and_audit(
    api: ThreadedServer, pool: list[str]
) -> None:
    lease_id = pool[0]
    for view in (["leases", "show", lease_id], ["accounting"], ["audit"]):
        own = poolctl(api, *view, "--json")
        root = poolctl(api, "--format", "json", *view)
        assert own.exit_code == root.exit_code, own.output + root.output
        a, b = json.loads(own.stdout), json.loads(root.stdout)
        assert a.keys() == b.keys()
    assert (
        json.loads(poolctl(api, "--format", "json", "leases", "show", lease_id).stdout)["id"]
        == lease_id
    )


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            if cmd.callback is not None and any(p.name == "as_json" for p in cmd.params):
                yield (*path, name)  # a group that is a view itself (`poolctl devices`)
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name)


def test_every_command_has_json() -> None:
    missing = []
    for path in _commands(main):
        cmd: click.Command = main
        for name in path:
            assert isinstance(cmd, click.Group)
            cmd = cmd.commands[name]
        if not any(p.name == "as_json" for p in cmd.params):
            missing.append(" ".join(path))
    assert missing == []
    assert ("devices", "map") in set(_commands(main)) and ("top",) in set(_commands(main))


def test_plain_lines_align_and_never_cut() -> None:
    lines = plain_lines(
        "t", ["name", "bytes"], [["a" * 70, "1 B"], ["b", "10.0 MiB"]], right={"bytes"}
    )
    assert lines == [
        "t",
        f"{'name':<70}  {'bytes':>8}",
        f"{'a' * 70}  {'1 B':>8}",
        f"{'b':<70}  10.0 MiB",
    ]


def _subprocess(api: ThreadedServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "POOLD_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "--url", api.url, "--token", ADMIN_TOKEN, *args],
        capture_output=True,  # stdout is a pipe, as in `poolctl ... | cat`
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_a_real_pipe_gets_whole_lease_ids_and_uids(api: ThreadedServer, pool: list[str]) -> None:
    out = _subprocess(api, "leases", "list", "--live")
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[2:] if ln.strip()]
    assert sorted(row[0] for row in rows) == sorted(pool)  # whole ids, first column
    assert {row[3] for row in rows} == {CXL}
    assert "…" not in out.stdout and out.stderr == ""
    out = _subprocess(api, "devices")
    assert out.returncode == 0 and CXL in out.stdout and "…" not in out.stdout
    assert "capacity" in out.stdout and "device" in out.stdout


def test_a_reader_that_stops_reading_ends_poolctl_quietly_with_0(
    api: ThreadedServer, pool: list[str]
) -> None:
    """`poolctl leases list | head -1` under `set -o pipefail` must not fail the script."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "POOLD_TOKEN")}
    base = [sys.executable, "-m", "cli", "--url", api.url, "--token", ADMIN_TOKEN]
    for args in (["leases", "list"], ["status", "--json"], ["--version"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before poolctl writes a byte
        try:
            out = subprocess.run(
                [*base, *args],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                cwd=ROOT,
                env=env,
                check=False,
            )
        finally:
            os.close(write_end)
        assert (out.returncode, out.stderr) == (0, ""), (args, out)
    # Through a shell, as a cron or a script would run it.
    script = f"set -o pipefail; {' '.join(base)} leases list | head -1"
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert out.returncode == 0 and out.stderr == "", out
    assert len(out.stdout.splitlines()) == 1
