"""Evaluating a trained run: `python -m jdp.evaluate --workdir=W [--step=N]
[--config.data.eval_text_files=...] [--config.eval_batch_size=...]`.

Loads the run's experiment file, config and the params (and model state: BatchNorm
statistics) of its newest or `--step` checkpoint, on this process's devices whatever
topology trained it, and evaluates the task on the run's eval split, or on what the
overrides name: for text, `data.eval_text_files` (tokenized by the run's tokenizer into
a store of its own, `W/eval_tokens/<digest>`); for images, any split or files the
experiment can open (`data.eval_split`, `data.eval_files`). The metrics are printed and
appended to `W/evaluations.jsonl` with what was evaluated; the run's own metrics,
checkpoints and token store are never changed.

Only what evaluation reads may be overridden: the data (`data.*`), `eval_batch_size`,
the backend and mesh layout (`parallel.backend`, `parallel.mesh`) and the compilation
cache. The gradient reduction does not apply and is evaluated flat on one host.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp

from jdp import trained_run
from jdp.checkpoint.init_from import load_fields
from jdp.config import paths
from jdp.data import splits
from jdp.data.text import lm
from jdp.errors import ConfigError
from jdp.experiment import components as components_lib
from jdp.experiment import optim
from jdp.parallel import mesh as mesh_lib
from jdp.parallel.factory import build_backend
from jdp.runtime import compile_cache
from jdp.train.evaluate import evaluate

EVALUATIONS_FILE = "evaluations.jsonl"  # in the workdir, one line per evaluation
EVAL_TOKENS_DIR = "eval_tokens"  # in the workdir: stores of the text evaluated on
# What an evaluation may change of the run's config (a key, or a section ending in ".").
CHANGEABLE = ("data.", "eval_batch_size", "parallel.backend", "parallel.mesh",
              "compile_cache_dir")


def check_changeable(keys) -> None:
    """Refuses, in one line, an override of what the trained params depend on."""
    for key in keys:
        if not any(key == name or (name.endswith(".") and key.startswith(name))
                   for name in CHANGEABLE):
            allowed = ", ".join(name + "*" if name.endswith(".") else name
                                for name in CHANGEABLE)
            raise ConfigError(
                f"--config.{key}: evaluation keeps the run's model and training settings; "
                f"only {allowed} may change. Fix: leave it out (to evaluate another model, "
                "point --workdir at its run).")


def evaluate_run(workdir: str, *, step: int | None = None, changes: dict | None = None,
                 devices=None) -> dict[str, float]:
    """The eval metrics of `workdir`'s checkpoint `step` (default: the newest) on `devices`
    (default: this process's), with the config `changes` ({dotted key: value}, checked by
    `check_changeable`); also appended to the run's evaluations.jsonl."""
    run = trained_run.open_run(workdir)
    config = run.config
    changes = dict(changes or {})
    check_changeable(changes)
    config.update_from_flattened_dict(changes)
    paths.make_absolute(config)
    # Gradients are not reduced here; one host, flat, data-parallel (the checkpoint holds
    # global arrays, whatever model axis it was trained with).
    config.parallel.update({"reduction": "flat", "hosts": 0, "cross_host_reduce": "float32",
                            "model_parallel": 1})
    compile_cache.enable(compile_cache.resolve_dir(config.get("compile_cache_dir", "")))
    step_dir = run.step_dir(step)
    devices = jax.local_devices() if devices is None else devices
    mesh = mesh_lib.make_mesh(config.parallel.mesh, devices, 0)
    eval_batch_size = config.eval_batch_size or config.batch_size
    if eval_batch_size % mesh.size:
        raise ConfigError(f"config.eval_batch_size={eval_batch_size}: does not divide over the "
                          f"{mesh.size} devices. Fix: pass --config.eval_batch_size="
                          f"{eval_batch_size - eval_batch_size % mesh.size or mesh.size}.")
    data, evaluated = _data(run, config, changes)
    components = components_lib.build(run.experiment, config, workdir=run.workdir, data=data)
    backend = build_backend(config, mesh, components, run.experiment.build_optimizer(
        config, optim.learning_rate_fn(config)))
    state = _restored_state(backend, components, config, step_dir)
    eval_split = splits.open_eval(components.data, setting=config.data.in_memory,
                                  num_threads=config.data.num_threads,
                                  num_workers=config.data.num_workers)
    metrics = evaluate(backend, backend.from_global(state, consume=True), eval_split,
                       global_batch_size=eval_batch_size,
                       rows=mesh_lib.process_rows(mesh, eval_batch_size))
    if jax.process_index() == 0:
        record = {"step": int(os.path.basename(step_dir)), "evaluated_unix_s": round(time.time()),
                  "devices": mesh.size, "evaluated": evaluated, **metrics}
        with open(os.path.join(run.workdir, EVALUATIONS_FILE), "a") as f:
            f.write(json.dumps(record) + "\n")
    return metrics


def _data(run: trained_run.TrainedRun, config, changes: dict):
    """(the data to evaluate on, or None for the experiment's own; what it is, in words)."""
    text = lm.uses_text(config.data)
    if text and "data.eval_text_files" in changes and config.data.eval_text_files:
        digest = hashlib.sha256(json.dumps(
            [config.data.eval_text_files, config.data.tokenizer]).encode()).hexdigest()[:16]
        data = lm.build_eval(config.data, run_token_dir=lm.token_dir(config.data, run.workdir),
                             directory=os.path.join(run.workdir, EVAL_TOKENS_DIR, digest))
        return data, {"data.eval_text_files": config.data.eval_text_files}
    described = {key: value for key, value in changes.items() if key.startswith("data.")}
    return None, described or "the run's eval split"


def _restored_state(backend, components, config, step_dir: str):
    """The train state with the checkpoint's params and model state (what evaluation
    reads); the optimizer state and the rest stay on disk and are zeros here."""
    abstract = backend.abstract_state(jax.random.key(config.seed), components.sample_inputs())
    read = load_fields(step_dir, {"params": abstract.params, "model_state": abstract.model_state})
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                         abstract.replace(params=None, model_state=None))
    return zeros.replace(**read)
