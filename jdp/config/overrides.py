"""Command-line overrides of a config (`--config.KEY=VALUE`): the one-line error for a key
the config does not have, at any depth, with the closest keys it has."""

from __future__ import annotations

import difflib
import json

from jdp.config.resume import flatten


def keys_of(config) -> dict:
    """The config as {dotted key: leaf value}."""
    return flatten(json.loads(config.to_json_best_effort()))


def unknown_key(key: str, known: dict) -> str | None:
    """Why `key` names no leaf or section of a config with leaves `known` (None if it does)."""
    sections = {name.rsplit(".", i)[0] for name in known for i in range(1, name.count(".") + 1)}
    if key in known or key in sections:
        return None
    leaf = next((key[:i] for i in range(len(key)) if key[i] == "." and key[:i] in known), None)
    if leaf:
        return f"unknown config key {key}: {leaf} is a value, not a section"
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    return f"unknown config key {key}; closest known keys: {', '.join(close) or 'none'}"


def override_keys(args: list[str]) -> list[tuple[str, str]]:
    """(key, argument) of each `--config.KEY[=VALUE]` in `args`."""
    return [(arg[len("--config."):].split("=", 1)[0], arg) for arg in args
            if arg.startswith("--config.")]
