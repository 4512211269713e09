"""Does poolctl refuse a bad command line in one coded line, and explain token trouble?

The scheme is cli/common.py's: `usage` (exit 2) for what click refuses, `bad_request`
(exit 1) for values the wire's own types refuse, poold's code (exit 1) otherwise.
Commands refused before anything runs point at a closed port: had they reached for
poold, they would say `poold_unreachable` instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import poold
from cli.poolctl import main
from poold.api.client import PooldClient
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ADMIN_TOKEN, ThreadedServer

__all__ = ["agent"]  # the fixture, shared with the lifecycle commands' tests

NOWHERE = "http://127.0.0.1:9"  # nothing listens: reaching for poold would fail loudly


def offline(*args: str, **env: str | None) -> Result:
    return CliRunner().invoke(main, ["--url", NOWHERE, "--token", "t", *args], env=env)


def one_error_line(r: Result, code: str, exit_code: int) -> str:
    """The stderr line of a failure, checked against the scheme; its message."""
    assert r.exit_code == exit_code, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    prefix = f"poolctl: error[{code}]: "
    assert lines[0].startswith(prefix), lines[0]
    for never in ("Traceback", "pydantic", "validation error", "Usage:", "Error:"):
        assert never not in r.output
    assert r.stdout == ""
    return lines[0][len(prefix) :]


REFUSED = [
    pytest.param(
        ["hosts", "add", "bad host/.."], "bad_request", "not a valid host name", id="host"
    ),
    pytest.param(
        ["tenants", "add", "bad name", "--quota", "1GiB"],
        "bad_request",
        "' ' at position 4 is not allowed",
        id="tenant",
    ),
    pytest.param(["tenants", "show", "-dash"], "usage", "No such option", id="tenant-option"),
    pytest.param(["tenants", "show", "x" * 129], "bad_request", "more than 128", id="tenant-long"),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "1GiB", "--media", "DDR4"],
        "bad_request",
        "--media: 'DDR4' is not a valid media class",
        id="tenant-media",
    ),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "1GiB", "--host", "a/b"],
        "bad_request",
        "--host: 'a/b' is not a valid host name",
        id="tenant-host",
    ),
    pytest.param(
        ["devices", "annotate", "node3", "--media", "DDR 4"],
        "bad_request",
        "not a valid media class",
        id="media",
    ),
    pytest.param(
        ["devices", "annotate", "node3", "--media", "x" * 33],
        "bad_request",
        "more than 32",
        id="media-long",
    ),
    pytest.param(
        ["leases", "list", "--state", "bogus"], "usage", "'bogus' is not one of", id="state"
    ),
    pytest.param(
        ["leases", "list", "--tenant", "no such"], "bad_request", "tenant name", id="filter"
    ),
    pytest.param(
        ["leases", "list", "--live", "--state", "released"],
        "usage",
        "drop --live or that --state",
        id="live-ended",
    ),
    pytest.param(["leases", "list", "--limit", "0"], "usage", "--limit", id="limit"),
    pytest.param(["accounting", "--by", "rack"], "usage", "'rack' is not one of", id="by"),
    pytest.param(
        ["devices", "drain", "node3", "--deadline-s", "5", "--now"],
        "usage",
        "--deadline-s and --now exclude each other",
        id="device-drain",
    ),
    pytest.param(
        ["hosts", "drain", "h1", "--deadline-s", "5", "--now"],
        "usage",
        "--deadline-s and --now exclude each other",
        id="host-drain",
    ),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "0"],
        "usage",
        "delete the tenant",
        id="quota-0",
    ),
    pytest.param(
        ["tenants", "set-quota", "t1", "--bytes", "0GiB"],
        "usage",
        "0 bytes",
        id="set-quota-0",
    ),
    pytest.param(["tenants", "set-quota", "t1"], "usage", "nothing to change", id="set-nothing"),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "1GiB", "--uid", "-1"], "usage", "--uid", id="uid"
    ),
    pytest.param(["tenants", "add", "t1", "--quota", "lots"], "usage", "not a size", id="size"),
    pytest.param(["leases", "revoke", "x"], "usage", "--reason", id="missing"),
    pytest.param(["devices", "map", "--width", "0"], "usage", "--width", id="width"),
    pytest.param(["top", "--interval", "0"], "usage", "--interval", id="interval"),
    pytest.param(["frobnicate"], "usage", "No such command", id="command"),
    pytest.param(["leases", "list", "--jsno"], "usage", "--json", id="option"),
    pytest.param(["--format", "yaml", "status"], "usage", "'yaml' is not one of", id="format"),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "1GiB", "--max-leases", "0"],
        "usage",
        "delete the tenant",
        id="max-leases-0",
    ),
    pytest.param(
        ["tenants", "set-quota", "t1", "--leases", "0"], "usage", "0 leases", id="set-leases-0"
    ),
    pytest.param(
        ["tenants", "add", "t1", "--quota", "99999999999999999999P"],
        "usage",
        "more than the most poold takes",  # was bad_request, pydantic's "less than or equal"
        id="quota-huge",
    ),
    pytest.param(
        ["tenants", "set-quota", "t1", "--bytes", "1025PiB"],
        "usage",
        "more than the most poold takes",
        id="set-quota-huge",
    ),
]


@pytest.mark.parametrize(("args", "code", "said"), REFUSED)
def test_refused_before_anything_runs(args: list[str], code: str, said: str) -> None:
    message = one_error_line(offline(*args), code, 2 if code == "usage" else 1)
    assert said in message


def test_a_usage_error_points_at_the_help() -> None:
    message = one_error_line(offline("leases", "list", "--state", "bogus"), "usage", 2)
    assert message.endswith("(see 'poolctl leases list --help')")
    assert "'granted', 'active'" in message  # the lease states, from LeaseState


def test_a_custom_media_class_is_accepted(api: ThreadedServer, agent: PooldClient) -> None:
    r = poolctl(api, "devices", "annotate", "node3", "--media", "rack12-ddr4_v2")
    assert r.exit_code == 0, r.output
    assert "rack12-ddr4_v2" in r.output


def test_drains_take_a_deadline_or_now(api: ThreadedServer, agent: PooldClient) -> None:
    lease(agent)
    r = poolctl(api, "devices", "drain", "node3", "--now", "--json")
    assert r.exit_code == 0, r.output
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "60", "--json")
    assert r.exit_code == 0, r.output


def test_no_admin_token(tmp_path: Path) -> None:
    missing = tmp_path / "admin.token"
    r = CliRunner().invoke(
        main, ["--url", NOWHERE, "--token-file", str(missing), "status"], env={"POOLD_TOKEN": None}
    )
    message = one_error_line(r, "unauthorized", 1)
    assert message.startswith("no admin token: pass --token, set POOLD_TOKEN, or make ")
    assert str(missing) in message
    assert not missing.exists()


def test_a_refused_token_is_said_to_be_the_admin_token(api: ThreadedServer) -> None:
    r = CliRunner().invoke(main, ["--url", api.url, "--token", "nope", "tenants", "list"])
    message = one_error_line(r, "unauthorized", 1)
    assert f"poold at {api.url} refused the admin token from --token" in message
    r = CliRunner().invoke(main, ["--url", api.url, "tenants", "list"], env={"POOLD_TOKEN": "nope"})
    assert "refused the admin token from POOLD_TOKEN" in one_error_line(r, "unauthorized", 1)


def test_a_token_file_poold_refuses(api: ThreadedServer, tmp_path: Path) -> None:
    path = tmp_path / "admin.token"
    path.write_text("stale\n")
    r = CliRunner().invoke(
        main, ["--url", api.url, "--token-file", str(path), "status"], env={"POOLD_TOKEN": None}
    )
    assert f"refused the admin token from {path}" in one_error_line(r, "unauthorized", 1)


def test_an_agent_credential_is_not_the_admin_token(
    api: ThreadedServer, admin: PooldClient
) -> None:
    credential = admin.add_host("h9").credential
    r = CliRunner().invoke(main, ["--url", api.url, "--token", credential, "status"])
    assert "is not the admin token" in one_error_line(r, "forbidden", 1)


def test_poold_down_is_one_line() -> None:
    one_error_line(offline("status"), "poold_unreachable", 1)


def test_version() -> None:
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output == f"poolctl {poold.__version__}\n"


def test_help_still_exits_0() -> None:
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "--format" in r.output and "--version" in r.output
    r = CliRunner().invoke(main, ["devices", "map", "--help"])
    assert r.exit_code == 0 and "--width" in r.output


def test_server_errors_keep_their_code(api: ThreadedServer) -> None:
    r = CliRunner().invoke(main, ["--url", api.url, "--token", ADMIN_TOKEN, "tenants", "show", "t"])
    assert one_error_line(r, "unknown_tenant", 1) == "no tenant named 't'"


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://[::1", "is not a URL"),  # httpx's InvalidURL: a traceback before
        ("http://poold:abc", "is not a URL"),
        ("notaurl", "not an http(s) URL"),  # read as "poold unreachable" before
        ("ftp://poold:7340", "not an http(s) URL"),
        ("http://", "not an http(s) URL"),
        ("http://127.0.0.1:99999", "port 99999"),
    ],
)
def test_a_bad_url_is_refused_as_usage(url: str, said: str) -> None:
    r = CliRunner().invoke(main, ["--url", url, "--token", "t", "status"])
    assert said in one_error_line(r, "usage", 2)
    r = CliRunner().invoke(main, ["--token", "t", "status"], env={"POOLD_URL": url})
    assert said in one_error_line(r, "usage", 2)


@pytest.mark.parametrize(
    ("content", "said"),
    [("", "is empty"), ("\n", "is empty"), ("tok en", "spaces"), ("tok\x01en", "control")],
)
def test_a_token_no_token_could_be_is_unauthorized_before_any_request(
    tmp_path: Path, content: str, said: str
) -> None:
    # An empty file sent `Bearer ` and httpx refused it: "poold_unreachable" before.
    path = tmp_path / "admin.token"
    path.write_text(content)
    r = CliRunner().invoke(
        main, ["--url", NOWHERE, "--token-file", str(path), "status"], env={"POOLD_TOKEN": None}
    )
    message = one_error_line(r, "unauthorized", 1)
    assert said in message and str(path) in message and "refused" not in message
    r = CliRunner().invoke(main, ["--url", NOWHERE, "status"], env={"POOLD_TOKEN": "tök"})
    assert "from POOLD_TOKEN" in one_error_line(r, "unauthorized", 1)


def test_help_names_the_environment_variables() -> None:
    out = CliRunner().invoke(main, ["--help"], terminal_width=200).output
    for var in ("POOLD_URL", "POOLD_TOKEN", "POOLD_TOKEN_FILE"):
        assert f"env var: {var}" in out
    out = CliRunner().invoke(main, ["db", "current", "--help"], terminal_width=200).output
    assert "POOLD_DATABASE_URL" in out and "POOLD_STATE_DIR" in out


def test_a_lease_filter_naming_nothing_is_unknown(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient
) -> None:
    # An empty list for a typo'd tenant or host read as "it has no leases".
    r = poolctl(api, "leases", "list", "--tenant", "nosuch")
    assert "nosuch" in one_error_line(r, "unknown_tenant", 1)
    r = poolctl(api, "leases", "list", "--host", "nohost", "--json")
    assert "nohost" in one_error_line(r, "unknown_host", 1)
    admin.add_host("h2")
    r = poolctl(api, "leases", "list", "--host", "h2", "--json")  # a host with no lease
    assert r.exit_code == 0 and r.stdout.strip() == "[]", r.output
