"""Where does each of a daemon's settings come from: flag > environment > TOML file > default.

poold and pool-agent declare their settings as one pydantic-settings model each
(:class:`DaemonSettings` subclasses); this module layers the sources in that order,
says which one gave each value (``config show``), turns a refusal into one line with
a stable code, and builds each command-line option from its field, so the help of
every option names its environment variable and nothing is written twice.

Environment variables are ``<PREFIX><FIELD>`` (``POOLD_REAP_INTERVAL_S``); a field
that had another name before keeps it too, through ``validation_alias`` choices
(``POOLD_LISTEN`` for ``listen_host``). The TOML file uses the field names as keys.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_args

import click
from click.core import ParameterSource
from pydantic import AliasChoices, ValidationError, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from poold.click_main import OwnErrors
from poold.errors import ConfigInvalid

S = TypeVar("S", bound="DaemonSettings")
F = TypeVar("F", bound=Callable[..., Any])

REDACTED = "<redacted>"

# The TOML file the settings being built read, if any: set only around the
# construction in load_settings, so a plain `PooldSettings()` reads no file.
_config_file: ContextVar[Path | None] = ContextVar("poold_config_file", default=None)


def secret() -> dict[str, Any]:
    """``json_schema_extra`` marking a field whose value `config show` never prints."""
    return {"secret": True}


class DaemonSettings(BaseSettings):
    """Settings from keyword arguments (flags) > environment > the TOML file > defaults."""

    model_config = SettingsConfigDict(
        extra="forbid",
        populate_by_name=True,  # file keys and keyword arguments use field names
        env_ignore_empty=True,  # VAR= in a unit file means "not set", as it always did
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _config_file.get()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, path))

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """`listen_port = true` in a TOML file is a mistake, not port 1: pydantic's lax
        int and float take booleans as 1 and 0, so refuse them unless the field is one."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation is not bool and bool not in get_args(annotation):
                raise ValueError(f"{str(value).lower()} is not a value of this setting")
        return value

    def shown_value(self, name: str, value: Any) -> Any:
        """What `config show` prints for a field: secrets redacted; subclasses add more."""
        extra = type(self).model_fields[name].json_schema_extra
        if isinstance(extra, dict) and extra.get("secret") and value is not None:
            return REDACTED
        return value


def env_names(cls: type[DaemonSettings], name: str) -> list[str]:
    """The environment variables that set field ``name``, the preferred one first."""
    alias = cls.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    if isinstance(alias, str):
        return [alias]
    prefix = str(cls.model_config.get("env_prefix", ""))
    return [f"{prefix}{name}".upper()]


def _field_for_key(cls: type[DaemonSettings]) -> dict[str, str]:
    """Source key (field name or any alias, lower-cased) -> field name."""
    keys: dict[str, str] = {}
    for name in cls.model_fields:
        keys[name.lower()] = name
        for env in env_names(cls, name):
            keys[env.lower()] = name
    return keys


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ConfigInvalid(f"config file {path}: not TOML: {err}", path=str(path)) from None
    except OSError as err:
        raise ConfigInvalid(f"config file {path}: {err.strerror or err}", path=str(path)) from None


@contextmanager
def _reading(path: Path | None) -> Iterator[None]:
    token = _config_file.set(path)
    try:
        yield
    finally:
        _config_file.reset(token)


def sources(cls: type[S], config_file: Path | None, flags: Mapping[str, Any]) -> dict[str, str]:
    """Field -> where its value comes from: ``flag``, ``env VAR``, ``file PATH``, ``default``."""
    keys = _field_for_key(cls)
    environ = {key.upper(): key for key, value in os.environ.items() if value != ""}
    found: dict[str, str] = {}
    for flag in flags:
        found.setdefault(flag, "flag")
    for key in EnvSettingsSource(cls)():
        field = keys.get(key.lower())
        if field is not None and field not in found:
            var = next((env for env in env_names(cls, field) if env.upper() in environ), None)
            found[field] = f"env {var or env_names(cls, field)[0]}"
    if config_file is not None:
        for key in _read_toml(config_file):
            field = keys.get(key.lower())
            if field is not None and field not in found:
                found[field] = f"file {config_file}"
    return {name: found.get(name, "default") for name in cls.model_fields}


def load_settings(
    cls: type[S], config_file: Path | None = None, flags: Mapping[str, Any] | None = None
) -> S:
    """The settings from all sources; ConfigInvalid naming the field and its source if refused."""
    given = dict(flags or {})
    if config_file is not None:
        _read_toml(config_file)  # a missing or broken file says so plainly, first
    try:
        with _reading(config_file):
            return cls(**given)
    except ValidationError as err:
        origin = sources(cls, config_file, given)
        problems = []
        for problem in err.errors(include_url=False, include_input=False):
            key = str(problem["loc"][0]) if problem["loc"] else ""
            name = _field_for_key(cls).get(key.lower(), key)
            where = origin.get(name, "")
            label = f"{name} (from {where})" if where and where != "default" else name or "?"
            # A validator's ValueError reads "Value error, <its words>": keep its words.
            message = str(problem["msg"]).removeprefix("Value error, ")
            problems.append(f"{label}: {message}")
        raise ConfigInvalid("; ".join(problems)) from None


def shown(settings: DaemonSettings, origin: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Field -> {value, source} for `config show`, JSON-ready, secrets redacted."""
    values = settings.model_dump(mode="json")
    return {
        name: {"value": settings.shown_value(name, values[name]), "source": origin[name]}
        for name in type(settings).model_fields
    }


# --- the command line -----------------------------------------------------------


def setting_option(cls: type[DaemonSettings], name: str, *decls: str, **kwargs: Any) -> Any:
    """A click option for field ``name``: help from its description, naming its env variable.

    The option defaults to nothing, so an option not given leaves the environment, the
    file and the field's default to decide (:func:`given_flags` picks what was typed).
    """
    info = cls.model_fields[name]
    text = info.description or name.replace("_", " ")
    envs = " or ".join(env_names(cls, name))
    plain = not (info.is_required() or info.default_factory or info.default is None)
    default = f"; default {info.default}" if plain else ""
    return click.option(
        *decls, name, default=None, help=f"{text} [env {envs}; file key {name}{default}]", **kwargs
    )


def given_flags(ctx: click.Context, cls: type[DaemonSettings]) -> dict[str, Any]:
    """The settings typed on the command line (not click defaults, not unset options)."""
    return {
        name: value
        for name, value in ctx.params.items()
        if name in cls.model_fields
        and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    }


def config_file(explicit: Path | None, default: Path) -> Path | None:
    """The file to read: the one named (which must exist), else ``default`` if it exists."""
    if explicit is not None:
        return explicit
    return default if default.is_file() else None


def refuse(program: str, err: ConfigInvalid) -> NoReturn:
    """One line on stderr with the stable code, exit 2 (as click refuses a command line)."""
    message = " ".join(err.message.split())
    click.echo(f"{program}: error[{err.code}]: {message}", err=True)
    raise SystemExit(2)


class DaemonGroup(OwnErrors, click.Group):
    """A daemon's root group (`poold`, `pool-agent`): a refused command line is one line,
    `PROG: error[usage]: ... (see 'PROG serve --help')`, exit 2, as poolctl's is, never
    click's multi-line Usage:/Error: block (journald shows it line by line)."""

    def failed(self, exc: BaseException, program: str) -> NoReturn:
        if isinstance(exc, click.ClickException):  # BadParameter, NoSuchOption, FileError...
            ctx = getattr(exc, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            message = " ".join((exc.format_message() + hint).split())
            click.echo(f"{program}: error[usage]: {message}", err=True)
            raise SystemExit(2) from None
        if isinstance(exc, click.Abort):
            raise SystemExit(130) from None
        raise exc


def print_settings(
    settings: DaemonSettings,
    config_file: Path | None,
    flags: Mapping[str, Any],
    as_json: bool,
) -> None:
    """`config show`: every effective setting with its source."""
    import json

    rows = shown(settings, sources(type(settings), config_file, flags))
    if as_json:
        body = {"config_file": str(config_file) if config_file else None, "settings": rows}
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(f"# config file: {config_file or '(none)'}")
    width = max(len(name) for name in rows)
    for name, row in rows.items():
        click.echo(f"{name:<{width}} = {json.dumps(row['value'])}  # {row['source']}")
