"""A saved tuner result applied to a config (`--config.tune=FILE`, read by `jdp.main`
before validation), and the part of a config a result is bound to.

A result holds the winner's overrides, the keys that were searched, and the config's
fixed part: every key but the searched ones and those a result does not depend on
(`UNBOUND`). It applies only to a config with the same fixed part.
"""

from __future__ import annotations

import hashlib
import json

from jdp.config.resume import flatten
from jdp.errors import ConfigError

# Fields a tuned result does not depend on, so they may differ from the tuned config. The
# tuner times the train step; none of these changes its shapes or its program's work:
# - how long the run is and its warm-up, how it is logged, evaluated, checked and saved;
# - where its files live, and which examples it reads (the seed, the text files and the
#   held-out fraction, data paths and splits: the same shapes from another corpus);
# - how the host prepares batches (threads, worker processes, in memory or streamed) and
#   tokenizes text; where a run's records and exports go (trackers, export);
# - the learning rate's value and scaling (a number the step reads, not a shape).
# The tokenizer, model, batch, dtypes and every parallel setting stay bound.
UNBOUND = ("total_steps", "warmup_steps", "log_every_steps", "eval_every_steps",
           "eval_batch_size", "crash_on_nan", "skip_nonfinite_steps", "tensorboard",
           "profile", "watchdog_timeout_s", "checkpoint", "compile_cache_dir", "tune",
           "seed", "learning_rate", "lr_scaling", "base_batch_size",
           "data.data_dir", "data.token_dir", "data.rebuild_tokens", "data.text_files",
           "data.eval_text_files", "data.eval_fraction", "data.train_files", "data.eval_files",
           "data.train_split", "data.eval_split", "data.text_field", "data.num_threads",
           "data.num_workers", "data.in_memory", "data.tokenize_processes", "tracker", "export")


def _unbound(key: str) -> bool:
    return any(key == field or key.startswith(field + ".") for field in UNBOUND)


def fixed_part(config, searched_keys) -> dict:
    """The config as flat {key: value}, less the searched keys and the UNBOUND ones."""
    flat = flatten(json.loads(config.to_json_best_effort()))
    return {key: value for key, value in sorted(flat.items())
            if key not in searched_keys and not _unbound(key)}


def fingerprint(fixed: dict) -> str:
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def _read(path: str) -> dict:
    fix = "pass the tune.json that python -m jdp.tune wrote into its --workdir, or rerun it"
    try:
        with open(path) as f:
            saved = json.load(f)
        saved["winner"]["overrides"], saved["searched_keys"], saved["fixed"]  # noqa: B018
    except FileNotFoundError:
        raise ConfigError(f"config.tune={path!r}: no such file. Fix: {fix}.") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"config.tune={path!r}: not a readable tune result "
                          f"({type(e).__name__}: {e}). Fix: {fix}.") from None
    return saved


def _first_difference(saved: dict, current: dict) -> tuple[str, object, object]:
    absent = "<absent>"
    for key in sorted(saved.keys() | current.keys()):
        if saved.get(key, absent) != current.get(key, absent):
            return key, saved.get(key, absent), current.get(key, absent)
    raise AssertionError("fingerprints differ but no key does")


def apply(config) -> dict:
    """Applies the result named by `config.tune` (if any) to `config` in place, after
    checking that it was tuned for this config; returns the overrides applied. The
    searched keys are set to the winner's values, whatever they were."""
    path = config.get("tune", "")
    if not path:
        return {}
    saved = _read(path)
    current = fixed_part(config, saved["searched_keys"])
    if fingerprint(current) != saved["fingerprint"]:
        key, then, now = _first_difference(saved["fixed"], current)
        raise ConfigError(
            f"config.tune={path!r} was tuned for another config: {key} is {now!r} here but "
            f"was {then!r} when tuned. Fix: rerun python -m jdp.tune with this config, or "
            f"pass --config.{key}={then}.")
    overrides = saved["winner"]["overrides"]
    config.update_from_flattened_dict(overrides)
    return overrides
