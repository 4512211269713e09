"""poold's settings: flag > env > TOML file > default, each value's source, refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from poold import __version__
from poold.cli import main
from poold.daemon_config import REDACTED, load_settings, sources
from poold.errors import ConfigInvalid
from poold.settings import DEFAULT_MAX_BODY_BYTES, PooldSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("POOLD_LISTEN", "POOLD_PORT", "POOLD_LOG_LEVEL", "POOLD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for field in PooldSettings.model_fields:
        monkeypatch.delenv(f"POOLD_{field.upper()}", raising=False)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_flag_beats_env_beats_file_beats_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = write(
        tmp_path / "poold.toml",
        'listen_host = "10.0.0.1"\nlisten_port = 1111\nreap_interval_s = 5\n'
        'expiry_grace_s = 7\nmax_body_bytes = "1MiB"\n',
    )
    monkeypatch.setenv("POOLD_PORT", "2222")  # the old name still works
    monkeypatch.setenv("POOLD_REAP_INTERVAL_S", "3")
    flags = {"reap_interval_s": 0.5}
    settings = load_settings(PooldSettings, conf, flags)
    assert settings.listen_host == "10.0.0.1"  # file
    assert settings.listen_port == 2222  # env over file
    assert settings.reap_interval_s == 0.5  # flag over env
    assert settings.expiry_grace_s == 7  # file
    assert settings.max_body_bytes == 1 << 20  # a size, from the file
    assert settings.revoke_deadline_s == 30.0  # default
    origin = sources(PooldSettings, conf, flags)
    assert origin["listen_host"] == f"file {conf}"
    assert origin["listen_port"] == "env POOLD_PORT"
    assert origin["reap_interval_s"] == "flag"
    assert origin["revoke_deadline_s"] == "default"


def test_every_old_variable_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "POOLD_LISTEN": "10.1.2.3",
        "POOLD_MAX_BODY_BYTES": "1024",
        "POOLD_ACTIVATION_DEADLINE_S": "1.5",
        "POOLD_EXPIRY_GRACE_S": "2",
        "POOLD_REVOKE_DEADLINE_S": "3",
        "POOLD_HOST_SILENT_AFTER_S": "4",
        "POOLD_HOST_SILENT_GRACE_S": "5",
        "POOLD_PRESSURE_WATERMARK": "0.1",
        "POOLD_SHRINK_DEADLINE_S": "6",
        "POOLD_DDR5_COST_PER_GIB_MONTH": "7.5",
        "POOLD_STATE_DIR": "/tmp/poold-x",
        "POOLD_DATABASE_URL": "sqlite:///x.db",
        "POOLD_LOG_LEVEL": "WARNING",
    }.items():
        monkeypatch.setenv(name, value)
    s = PooldSettings()
    assert (s.listen_host, s.max_body_bytes, s.activation_deadline_s) == ("10.1.2.3", 1024, 1.5)
    assert (s.expiry_grace_s, s.revoke_deadline_s, s.host_silent_after_s) == (2, 3, 4)
    assert (s.host_silent_grace_s, s.pressure_watermark, s.shrink_deadline_s) == (5, 0.1, 6)
    assert s.ddr5_cost_per_gib_month == 7.5 and s.state_dir == Path("/tmp/poold-x")
    assert s.database_url == "sqlite:///x.db" and s.log_level == "warning"
    monkeypatch.setenv("POOLD_EXPIRY_GRACE_S", "")  # empty is unset, as before
    assert PooldSettings().expiry_grace_s == 30.0


def test_a_plain_construction_reads_no_file() -> None:
    assert PooldSettings().max_body_bytes == DEFAULT_MAX_BODY_BYTES


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("listen_port = 'x'\n", {}, "listen_port (from file"),
        ("", {"POOLD_PRESSURE_WATERMARK": "2"}, "pressure_watermark (from env"),
        ("bogus = 1\n", {}, "bogus"),
        ("max_body_bytes = '5gb'\n", {}, "ambiguous size"),
        ("listen_port = [\n", {}, "not TOML"),
    ],
)
def test_refusals_name_the_setting_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigInvalid, match=message.replace("(", r"\(")) as caught:
        load_settings(PooldSettings, write(tmp_path / "p.toml", text))
    assert caught.value.code == "config_invalid"


def test_a_named_file_must_exist(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["config", "show", "--config", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "poold: error[config_invalid]: config file" in result.output


def test_config_show_lists_every_value_with_its_source_secrets_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = write(tmp_path / "poold.toml", 'admin_token = "pt1.admin.s3cret"\n')
    monkeypatch.setenv("POOLD_DATABASE_URL", "postgresql://poold:hunter2@db/ledger")
    result = CliRunner().invoke(
        main, ["config", "show", "--config", str(conf), "--port", "9999", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output and "hunter2" not in result.output
    body = json.loads(result.output)
    rows = body["settings"]
    assert body["config_file"] == str(conf)
    assert set(rows) == set(PooldSettings.model_fields)
    assert rows["admin_token"] == {"value": REDACTED, "source": f"file {conf}"}
    assert rows["database_url"]["value"] == "postgresql://poold:***@db/ledger"
    assert rows["database_url"]["source"] == "env POOLD_DATABASE_URL"
    assert rows["listen_port"] == {"value": 9999, "source": "flag"}
    assert rows["reap_interval_s"] == {"value": 1.0, "source": "default"}
    text = CliRunner().invoke(main, ["config", "show", "--config", str(conf)])
    assert text.exit_code == 0 and "s3cret" not in text.output
    assert "listen_port" in text.output and "# default" in text.output


def test_help_names_each_options_environment_variable() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=400)
    assert result.exit_code == 0
    for var in (
        "POOLD_CONFIG",
        "POOLD_STATE_DIR",
        "POOLD_DATABASE_URL",
        "POOLD_LISTEN",
        "POOLD_PORT",
        "POOLD_UPGRADE_DB",
        "POOLD_MAX_BODY_BYTES",
        "POOLD_LOG_LEVEL",
        "POOLD_LOG_FORMAT",
    ):
        assert var in result.output, var
    options = [line for line in result.output.splitlines() if line.strip().startswith("--")]
    assert all("[env " in line for line in options if "--help" not in line), options


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"poold {__version__}\n"


@pytest.mark.parametrize(
    "text", ["listen_port = true", "reap_interval_s = true", "max_body_bytes = false"]
)
def test_a_boolean_is_no_number(tmp_path: Path, text: str) -> None:
    # pydantic's lax int and float read `true` as 1: port 1, a reap every second.
    with pytest.raises(ConfigInvalid) as caught:
        load_settings(PooldSettings, write(tmp_path / "p.toml", text))
    name = text.split(" ")[0]
    assert caught.value.message.startswith(f"{name} (from file ")
    assert "is not a value of this setting" in caught.value.message
    assert "Value error" not in caught.value.message  # pydantic's prefix, not ours
    settings = load_settings(PooldSettings, write(tmp_path / "b.toml", "upgrade_db = false"))
    assert settings.upgrade_db is False  # a boolean setting still takes one


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("not a url", "not a SQLAlchemy URL"),
        ("bogus://poold:s3cret@db/poold", "no usable driver for 'bogus'"),
        ("mysql://poold:s3cret@db/poold", "no usable driver for 'mysql'"),  # not installed
    ],
)
def test_an_unusable_database_url_is_refused_at_start(url: str, said: str) -> None:
    # poold serve went as far as engine or alembic setup and died with a traceback.
    result = CliRunner().invoke(main, ["config", "show", "--database-url", url])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("poold: error[config_invalid]: database_url (from flag): ")
    assert said in line and "s3cret" not in line
