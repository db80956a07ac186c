"""The small checks every config rule is made of: each raises `ConfigError` with one
line naming the field, the value and the fix."""

from __future__ import annotations

import ml_collections

from jdp.errors import ConfigError


def fail(field: str, value, why: str, fix: str) -> None:
    raise ConfigError(f"config.{field}={value!r}: {why}. Fix: {fix}.")


def get(config: ml_collections.ConfigDict, field: str):
    """The value at a dotted path such as 'parallel.backend'."""
    value = config
    for part in field.split("."):
        value = value[part]
    return value


def check_choice(config: ml_collections.ConfigDict, field: str, choices) -> None:
    value = get(config, field)
    if value not in choices:
        fail(field, value, "unknown value", f"use one of {', '.join(map(repr, choices))}")


def check_positive(config: ml_collections.ConfigDict, field: str, allow_zero=False) -> None:
    value = get(config, field)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        fail(field, value, f"must be {bound}", f"pass --config.{field}=<a value {bound}>")

