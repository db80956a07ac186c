"""Text from a trained language model: `python -m jdp.sample --workdir=W --prompt=...`.

Loads the run's own experiment file and config (as the workdir recorded them), its
tokenizer (`data.tokenizer`) and the newest (or `--step`) checkpoint's params, then
continues the prompt with the model's key/value cache (`jdp.models.decoding`):
`--temperature=0` is greedy, and a fixed `--seed` gives the same text every time.

Past the model's context (`max_len` tokens, prompt included) the text goes on with a
sliding window: the model rereads the last max_len / 2 tokens and writes up to
max_len / 2 + 1 more, again and again, so every new token sees at least half a context.
The params sit on one device, or, with `--shard_params` (and by itself when they take
more than half of one device's memory), split over all local devices. The decoding
programs are kept in the run's compilation cache (`compile_cache_dir`): they compile
once, and later samples read them back.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from jdp import trained_run
from jdp.checkpoint import load_params
from jdp.data.text import lm, tokenizers
from jdp.errors import ConfigError
from jdp.models import decoding
from jdp.models.transformer import Transformer
from jdp.parallel import mesh as mesh_lib
from jdp.runtime import compile_cache

# Params above this share of one device's memory are split over the local devices.
_SHARD_ABOVE_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Sampler:
    model: Transformer
    params: object
    tokenizer: tokenizers.Tokenizer

    def continuation(self, prompt: str, *, max_new_tokens: int, temperature: float = 1.0,
                     top_k: int = 0, seed: int = 0) -> str:
        """The text the model writes after `prompt` (without the prompt; it stops early at
        the end-of-document token), `max_new_tokens` of it at most, past the context by
        the sliding window of the module docstring."""
        ids = self.tokenizer.encode(prompt)
        if len(ids) == 0:  # an empty prompt starts a new document
            ids = np.asarray([self.tokenizer.eos_id], np.int32)
        max_len = self.model.max_len
        if len(ids) > max_len:
            raise ConfigError(f"--prompt has {len(ids)} tokens, more than the model's context "
                              f"({max_len}). Fix: shorten the prompt.")
        key = jax.random.key(seed)
        tokens = [int(i) for i in ids]
        context = list(tokens)
        new: list[int] = []
        for window in range(max_new_tokens):  # ends long before: each window adds >= 1
            room = max_len - len(context) + 1
            # The first window writes what is asked (one program per length); the later
            # ones always their full room, one program for all of them.
            wanted = min(max_new_tokens - len(new), room) if window == 0 else room
            written = decoding.generate(
                self.model, self.params, np.asarray(context, np.int32),
                max_new_tokens=wanted, temperature=temperature, top_k=top_k,
                key=jax.random.fold_in(key, window), eos_id=self.tokenizer.eos_id)
            written = [int(t) for t in written][:max_new_tokens - len(new)]
            new += written
            if len(new) >= max_new_tokens or written[-1] == self.tokenizer.eos_id:
                break
            context = (tokens + new)[-(max_len // 2):]
        return self.tokenizer.decode(new)


def sampler_for(config, build_model, params, workdir: str) -> Sampler:
    """A sampler of the model `build_model(config)` with `params` (host or device arrays,
    copied to the host: a training run's hook keeps its devices' memory), the run's
    tokenizer (a trained one is in its token dir, under `workdir`)."""
    return Sampler(_transformer(build_model(config)), jax.device_get(params),
                   lm.run_tokenizer(config.data, workdir))


def load(workdir: str, *, step: int | None = None, shard_params: bool | None = None) -> Sampler:
    """The sampler of a run: its experiment, config, tokenizer and the params of checkpoint
    `step` (default: the newest). `shard_params`: split them over the local devices (None:
    where they would take more than half of one device's memory)."""
    run = trained_run.open_run(workdir)
    config = run.config
    compile_cache.enable(compile_cache.resolve_dir(config.get("compile_cache_dir", "")))
    model = _transformer(run.experiment.build_model(config))
    tokens = np.zeros((1, min(config.data.seq_len, model.max_len)), np.int32)
    abstract = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens, train=False)))
    abstract_params = abstract["params"]
    if shard_params is None:
        shard_params = _too_big_for_one_device(abstract_params)
    devices = jax.local_devices() if shard_params else jax.local_devices()[:1]
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
            mesh, mesh_lib.sharded_over_data(x.shape, len(devices), "devices"))),
        abstract_params)
    params = load_params(run.step_dir(step), placed)
    return Sampler(model, params, run.tokenizer())


def _transformer(model) -> Transformer:
    if not isinstance(model, Transformer):
        raise ConfigError(f"sampling needs a jdp.models.transformer.Transformer; the experiment "
                          f"builds a {type(model).__name__}. Fix: sample with your own decoding.")
    return model


def _too_big_for_one_device(abstract_params) -> bool:
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params))
    return bool(limit) and size > _SHARD_ABOVE_FRACTION * limit
