"""Where a run starts: its own newest readable checkpoint, else a fresh state (with
another run's params when fine-tuning); and whether a workdir may be resumed with
this config."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import logging

from jdp.checkpoint import CHECKPOINT_DIR, hf_import
from jdp.checkpoint.checkpointer import Checkpointer
from jdp.checkpoint.init_from import load_params
from jdp.checkpoint.layout import DamagedCheckpointError
from jdp.config import resume_differences
from jdp.errors import ConfigError
from jdp.runtime import distributed, storage


def initial_state(backend, checkpointer: Checkpointer, rng, sample_inputs, init_from: str):
    """The order matters: 1. resume this run's newest complete checkpoint, falling back
    past damaged ones, 2. else start fresh, with params from `init_from` when
    fine-tuning. `backend` gives the state's abstract form and a fresh one."""
    steps = checkpointer.steps()
    abstract = backend.abstract_state(rng, sample_inputs) if steps else None

    def fresh_residuals():  # the reducer's error-feedback residuals, on another topology
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                            abstract.residuals)

    for step in steps:
        try:
            state = checkpointer.restore(step, abstract, fresh={"residuals": fresh_residuals})
        except DamagedCheckpointError as error:
            # Left where it is: the damage may be transient (storage), or worth a look.
            logging.warning("skipping checkpoint step %d, which cannot be read; falling back "
                            "to an older one. %s", step, error)
            continue
        # Processes that disagree on the step would train on different states.
        distributed.check_same_across_processes({"resumed_step": str(step)})
        logging.info("resuming from %s/%d", checkpointer.directory, step)
        return state
    if steps:
        raise DamagedCheckpointError(
            f"none of the checkpoints in {checkpointer.directory} (steps {steps}) can be read; "
            "see the warnings above. Fix: restore them from a backup, or start a new --workdir.")
    params = None
    if init_from:
        # A run's workdir stands for its newest checkpoint.
        if not hf_import.is_hf(init_from) and storage.isdir(storage.join(init_from,
                                                                          CHECKPOINT_DIR)):
            init_from = storage.join(init_from, CHECKPOINT_DIR)
        logging.info("initialising params from %s", init_from)
        # Read against the abstract params, before the init is compiled and run: a
        # checkpoint of another model fails at once, not after the model's init.
        load = hf_import.load_params if hf_import.is_hf(init_from) else load_params
        params = load(init_from, backend.abstract_state(rng, sample_inputs).params)
    state = backend.init_global(rng, sample_inputs)
    return state if params is None else state.replace(params=params)


def check_resumable(workdir: str, config: dict) -> None:
    """A workdir with checkpoints resumes; it must hold a run of the same config."""
    saved_path = storage.join(workdir, "config.json")
    checkpoints = storage.join(workdir, CHECKPOINT_DIR)
    if not (storage.isdir(checkpoints) and storage.exists(saved_path)):
        return
    with storage.open_file(saved_path) as f:
        saved = json.load(f)
    differences = resume_differences(saved, config)
    if saved.get("total_steps") not in (None, config["total_steps"]):
        # Allowed (to extend a run), but the schedule's decay is laid over the new
        # length, so the learning rate jumps at the resumed step.
        logging.warning(
            "resuming with total_steps %s instead of %s: the warmup-cosine learning-rate "
            "schedule now decays to 0 at step %s, so the rate at the resumed step differs "
            "from the one the saved run would have used", config["total_steps"],
            saved["total_steps"], config["total_steps"])
    if differences:
        raise ConfigError(
            f"--workdir={workdir!r} holds checkpoints of a run with another config "
            f"({'; '.join(differences)}). Fix: use a new --workdir, or pass the same values "
            "to resume it.")
