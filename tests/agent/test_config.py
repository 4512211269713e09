"""pool-agent's config: flag > env (POOL_AGENT_*) > agent.toml > default, shown with sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.config import AgentConfig, load
from poold import __version__
from poold.daemon_config import REDACTED, sources
from poold.errors import ConfigInvalid


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POOL_AGENT_SOCKET", raising=False)
    monkeypatch.delenv("POOL_AGENT_CONFIG", raising=False)
    for field in AgentConfig.model_fields:
        monkeypatch.delenv(f"POOL_AGENT_{field.upper()}", raising=False)


def test_flag_beats_env_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "agent.toml"
    conf.write_text(
        'host = "from-file"\npoold_url = ["http://a:1"]\nheartbeat_interval_s = 9\n'
        'warm_pool_bytes = "1GiB"\nsocket_mode = 0o600\n'
        '[annotations.serial-1]\nmedia = "ddr4"\n'
    )
    monkeypatch.setenv("POOL_AGENT_HOST", "from-env")
    monkeypatch.setenv("POOL_AGENT_HEARTBEAT_INTERVAL_S", "2")
    monkeypatch.setenv("POOL_AGENT_SOCKET", "/tmp/from-env.sock")  # the old name
    config = load(conf, heartbeat_interval_s=0.5, emulated_capacity_bytes="64MiB", host=None)
    assert config.host == "from-env"
    assert config.heartbeat_interval_s == 0.5
    assert config.poold_url == ["http://a:1"]
    assert config.warm_pool_bytes == 1 << 30
    assert config.emulated_capacity_bytes == 64 << 20
    assert config.socket_mode == 0o600
    assert config.socket_path == Path("/tmp/from-env.sock")
    assert config.annotations == {"serial-1": {"media": "ddr4"}}
    origin = sources(AgentConfig, conf, {"heartbeat_interval_s": 0.5})
    assert origin["host"] == "env POOL_AGENT_HOST"
    assert origin["socket_path"] == "env POOL_AGENT_SOCKET"
    assert origin["heartbeat_interval_s"] == "flag"
    assert origin["warm_pool_bytes"] == f"file {conf}"
    assert origin["udev"] == "default"


def test_environment_lists_modes_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOL_AGENT_POOLD_URL", "http://a:1, http://b:2")
    monkeypatch.setenv("POOL_AGENT_SOCKET_MODE", "0640")
    monkeypatch.setenv("POOL_AGENT_METRICS_LISTEN", "127.0.0.1:9464")
    monkeypatch.setenv("POOL_AGENT_CREDENTIAL", "pt1.agent.x")
    config = AgentConfig()
    assert config.poold_url == ["http://a:1", "http://b:2"]
    assert config.socket_mode == 0o640
    assert config.metrics_listen == "127.0.0.1:9464"
    assert config.resolved_credential() == "pt1.agent.x"
    assert AgentConfig(metrics_listen="").metrics_listen == ""


def test_bad_values_are_refused_with_their_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_AGENT_POOLD_URL", "ftp://nope")
    with pytest.raises(ConfigInvalid, match=r"poold_url \(from env POOL_AGENT_POOLD_URL\)"):
        load(None)
    monkeypatch.delenv("POOL_AGENT_POOLD_URL")
    conf = tmp_path / "agent.toml"
    conf.write_text('hugepages = "always"\n')
    with pytest.raises(ConfigInvalid, match=r"hugepages \(from file"):
        load(conf)
    with pytest.raises(ConfigInvalid, match="ambiguous size"):
        load(None, emulated_capacity_bytes="64mb")
    # httpx cannot parse it: a traceback at the first request before.
    with pytest.raises(ConfigInvalid, match=r"poold_url \(from flag\): not a poold URL"):
        load(None, poold_url="http://[::1")


def test_cli_config_show_json(tmp_path: Path) -> None:
    conf = tmp_path / "agent.toml"
    conf.write_text('credential = "pt1.agent.s3cret"\nhost = "h1"\n')
    result = CliRunner().invoke(
        main,
        [
            "config",
            "show",
            "--config",
            str(conf),
            "--emulated-capacity",
            "64GiB",
            "--poold-url",
            "http://a:1,http://b:2",
            "--poold-url",
            "http://c:3",
            "--metrics-listen",
            "127.0.0.1:9464",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output
    rows = json.loads(result.output)["settings"]
    assert rows["credential"] == {"value": REDACTED, "source": f"file {conf}"}
    assert rows["host"] == {"value": "h1", "source": f"file {conf}"}
    assert rows["emulated_capacity_bytes"] == {"value": 64 << 30, "source": "flag"}
    assert rows["poold_url"]["value"] == ["http://a:1", "http://b:2", "http://c:3"]
    assert rows["metrics_listen"] == {"value": "127.0.0.1:9464", "source": "flag"}


def test_cli_refuses_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["config", "show", "--emulated-capacity", "lots"])
    assert result.exit_code == 2
    assert result.output.startswith("pool-agent: error[config_invalid]: emulated_capacity_bytes")
    assert len(result.output.strip().splitlines()) == 1


def test_help_names_each_options_environment_variable() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=400)
    assert result.exit_code == 0
    for var in (
        "POOL_AGENT_CONFIG",
        "POOL_AGENT_HOST",
        "POOL_AGENT_POOLD_URL",
        "POOL_AGENT_CREDENTIAL_FILE",
        "POOL_AGENT_SOCKET",
        "POOL_AGENT_METRICS_LISTEN",
        "POOL_AGENT_LOG_LEVEL",
        "POOL_AGENT_LOG_FORMAT",
    ):
        assert var in result.output, var


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"pool-agent {__version__}\n"


def test_discovery_and_backend_knobs_take_sizes_and_reach_their_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.inventory import numa_reserve_bytes

    monkeypatch.setenv("POOL_AGENT_NUMA_RESERVE_BYTES", "128MiB")
    monkeypatch.setenv("POOL_AGENT_DEVDAX_HOLDER_WAIT_S", "5")
    config = AgentConfig()
    assert numa_reserve_bytes(config) == 128 << 20
    assert config.devdax_holder_wait_s == 5.0


def test_socket_and_in_flight_limits_default_to_what_their_modules_say() -> None:
    from agent.admission import InFlightLimits
    from agent.server import SocketLimits

    config = AgentConfig()
    for name in SocketLimits.__dataclass_fields__:
        assert getattr(config, f"socket_{name}") == getattr(SocketLimits(), name), name
    for name in InFlightLimits.__dataclass_fields__:
        assert getattr(config, f"in_flight_{name}") == getattr(InFlightLimits(), name), name


def test_an_empty_credential_file_is_refused(tmp_path: Path) -> None:
    # It went out as `Bearer `: httpx refused each request, logged as "poold unreachable".
    path = tmp_path / "credential"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        AgentConfig(credential_file=path).resolved_credential()
    path.write_text("pt1.h1.x\n")
    assert AgentConfig(credential_file=path).resolved_credential() == "pt1.h1.x"
