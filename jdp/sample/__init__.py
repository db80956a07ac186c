"""Text from a trained language model: `python -m jdp.sample --workdir=W --prompt=...`.

Loads the run's own experiment file and config (as the workdir recorded them), its
tokenizer (`data.tokenizer`) and the newest checkpoint's params, then continues the
prompt with the model's key/value cache (`jdp.models.decoding`): `--temperature=0` is
greedy, and a fixed `--seed` gives the same text every time. Runs on one device,
with the run's compilation cache (`compile_cache_dir`): the decoding programs compile
once, and later samples read them back.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np

from jdp.checkpoint import CHECKPOINT_DIR, load_params
from jdp.data.text import lm, tokenizers
from jdp.errors import ConfigError
from jdp.experiment import loader
from jdp.models import decoding
from jdp.models.transformer import Transformer
from jdp.runtime import compile_cache

RUN_FILE = "run.json"  # in the workdir: which experiment file trained it


@dataclasses.dataclass(frozen=True)
class Sampler:
    model: Transformer
    params: object
    tokenizer: tokenizers.Tokenizer

    def continuation(self, prompt: str, *, max_new_tokens: int, temperature: float = 1.0,
                     top_k: int = 0, seed: int = 0) -> str:
        """The text the model writes after `prompt` (without the prompt; it stops early at
        the end-of-document token)."""
        ids = self.tokenizer.encode(prompt)
        if len(ids) == 0:  # an empty prompt starts a new document
            ids = np.asarray([self.tokenizer.eos_id], np.int32)
        room = self.model.max_len - len(ids) + 1
        if room < 1:
            raise ConfigError(f"--prompt has {len(ids)} tokens, more than the model's maximum "
                              f"length ({self.model.max_len}). Fix: shorten the prompt.")
        new = decoding.generate(self.model, self.params, ids,
                                max_new_tokens=min(max_new_tokens, room),
                                temperature=temperature, top_k=top_k, seed=seed,
                                eos_id=self.tokenizer.eos_id)
        return self.tokenizer.decode(np.asarray(new).tolist())


def sampler_for(config, build_model, params, workdir: str) -> Sampler:
    """A sampler of the model `build_model(config)` with `params` (host or device arrays);
    the run's tokenizer (a trained one is in its token dir, under `workdir`)."""
    model = build_model(config)
    if not isinstance(model, Transformer):
        raise ConfigError(f"sampling needs a jdp.models.transformer.Transformer; the experiment "
                          f"builds a {type(model).__name__}. Fix: sample with your own decoding.")
    token_dir = lm.token_dir(config.data, workdir)
    return Sampler(model, jax.device_get(params),
                   tokenizers.from_spec(config.data.tokenizer, "data.tokenizer", token_dir))


def load(workdir: str) -> Sampler:
    """The sampler of a run: its experiment, config, tokenizer and newest params."""
    run_file, config_file = (os.path.join(workdir, name) for name in (RUN_FILE, "config.json"))
    for path in (run_file, config_file):
        if not os.path.isfile(path):
            raise ConfigError(f"--workdir={workdir!r} has no {os.path.basename(path)}. Fix: "
                              "point --workdir at the workdir of a jdp training run.")
    with open(run_file) as f:
        experiment = loader.load(json.load(f)["experiment_file"])
    with open(config_file) as f:
        config = ml_collections.ConfigDict(json.load(f))
    compile_cache.enable(compile_cache.resolve_dir(config.get("compile_cache_dir", "")))
    model = experiment.build_model(config)
    tokens = np.zeros((1, min(config.data.seq_len, model.max_len)), np.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, train=False))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = load_params(os.path.join(workdir, CHECKPOINT_DIR), jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
        abstract["params"]))
    return sampler_for(config, experiment.build_model, params, workdir)
