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

import jax
import numpy as np

from jdp import trained_run
from jdp.data.text import lm, tokenizers
from jdp.errors import ConfigError
from jdp.models import decoding
from jdp.models.transformer import Transformer
from jdp.runtime import compile_cache


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
    run = trained_run.open_run(workdir)
    compile_cache.enable(compile_cache.resolve_dir(run.config.get("compile_cache_dir", "")))
    return sampler_for(run.config, run.experiment.build_model,
                       run.params(run.experiment.build_model(run.config)), run.workdir)
