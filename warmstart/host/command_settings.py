"""The settings of a long-running command (the agent, the operator) as one pydantic model: each field is one
setting with its type, bounds, default, environment variable and command-line flag.

A flag given wins over its environment variable, which wins over the default (pydantic-settings' order). Every
problem is reported at once, each naming the flag and the variable, before the command does anything.

A variable set to "" counts as unset (a pod spec cannot unset what a chart sets), except for the settings
whose help says that empty means none (`setting(..., empty_means_none=True)`): there it means none. An empty
flag is a value like any other, refused where it is not one.
"""

from __future__ import annotations

import argparse
import functools
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from warmstart.host.env import checked_seconds

S = TypeVar("S", bound="CommandSettings")


class SettingsError(ValueError):
    """Settings that cannot be used; the message names every problem."""


EMPTY_MEANS_NONE = "empty_means_none"
MAX_COUNT = 4096  # things done at once, threads, retries: past it a setting is a mistake, not a wish
MAX_BYTES = (1 << 63) - 1  # what the kernel's interfaces take


class _Environment(EnvSettingsSource):
    """The variables by their exact names; one set to "" is unset, unless its setting lets it mean none."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        value, key, complex_value = super().get_field_value(field, field_name)
        if isinstance(value, str) and not value.strip() and not _empty_means_none(field):
            return None, key, complex_value
        return value, key, complex_value


class CommandSettings(BaseSettings):
    model_config = SettingsConfigDict(
        case_sensitive=True, validate_by_name=True, extra="forbid", env_ignore_empty=False, frozen=True
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
        return init_settings, _Environment(settings_cls)  # the flags given, then the environment


def setting(default: Any, env: str, help: str, *, empty_means_none: bool = False, **bounds: Any) -> Any:
    """A field of a CommandSettings model, read from `env` when its flag is not given."""
    extra = {EMPTY_MEANS_NONE: True} if empty_means_none else None
    return Field(default, validation_alias=env, description=help, json_schema_extra=extra, **bounds)


def _empty_means_none(field: FieldInfo) -> bool:
    return isinstance(field.json_schema_extra, dict) and bool(field.json_schema_extra.get(EMPTY_MEANS_NONE))


def _no_nul(text: str) -> str:
    if "\0" in text:
        raise ValueError("must not hold a NUL character")
    return text


# A duration (`host.env.checked_seconds`): finite, more than 0 seconds, at most ten years.
Seconds = Annotated[float, BeforeValidator(checked_seconds)]
# The same, where 0 means none.
SecondsOrZero = Annotated[float, BeforeValidator(functools.partial(checked_seconds, zero=True))]
# How many of something at once (captures, workers): 1 to MAX_COUNT.
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
# A size in bytes, 0 meaning none.
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
# A TCP port, 0 meaning none.
Port = Annotated[int, Field(ge=0, le=65535)]
# A file or directory name, a command line, an address: text the system takes.
Text = Annotated[str, AfterValidator(_no_nul)]
# The same, never empty (an empty flag is refused, not taken for the default).
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]


def _comma_separated(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# A list setting: its flag repeats, its variable separates the items with commas.
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_comma_separated)]


def add_arguments(
    parser: argparse.ArgumentParser | Any,
    model: type[CommandSettings],
    short: dict[str, str] | None = None,
    groups: dict[str, Any] | None = None,
) -> None:
    """One flag per setting (`--max-restores` for `max_restores`), its help naming the variable and the
    default. Flags default to None, so that `load` can tell the ones given. `short`: extra names, by field;
    `groups`: where a field's flag goes instead of `parser` (e.g. a mutually exclusive group), by field."""
    short, groups = short or {}, groups or {}
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        names = [short[name], flag] if name in short else [flag]
        repeated = get_origin(field.annotation) is list or field.annotation is list
        shown = ",".join(field.default) if repeated else field.default
        default = "" if shown in (None, "") else f", default {shown}"
        groups.get(name, parser).add_argument(
            *names,
            dest=name,
            default=None,
            action="append" if repeated else "store",
            metavar=_metavar(name, field.annotation),
            help=f"{field.description} [{field.validation_alias}{default}]",
        )


def load(model: type[S], args: argparse.Namespace | None = None) -> S:
    """The settings from the flags given in `args`, else the environment, else the defaults."""
    given = {
        name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None
    }
    try:
        return model(**given)
    except ValidationError as exc:
        raise SettingsError(describe(exc, model)) from None


def describe(error: ValidationError, model: type[CommandSettings]) -> str:
    """Each problem as `--flag / VARIABLE: what is wrong (got ...)`: pydantic names a setting by its field
    when the value came from a flag, by its variable when it came from the environment."""
    fields = model.model_fields
    names = {key: name for name, field in fields.items() for key in (name, field.validation_alias)}
    problems = []
    for item in error.errors(include_url=False):
        name = names.get(str(item["loc"][0])) if item["loc"] else None
        message = item["msg"].removeprefix("Value error, ")
        if name is None:  # the settings together (a model validator)
            problems.append(message)
        else:
            where = f"--{name.replace('_', '-')} / {fields[name].validation_alias}"
            problems.append(f"{where}: {message} (got {item.get('input')!r})")
    return "; ".join(problems)


def _metavar(name: str, annotation: Any) -> str:
    """The choices of a Literal setting (or of an optional one), else the name's last word."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Literal:
            return "{" + ",".join(map(str, get_args(candidate))) + "}"
    return name.split("_")[-1].upper()
