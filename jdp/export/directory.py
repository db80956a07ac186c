"""Writing a Transformer as a transformers model directory (`write_directory`), checked;
the export of a trained run (`export_run`). See the package's docstring."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdp.data.text import tokenizers
from jdp.errors import ConfigError
from jdp.export import tokenizer_files, verify, weights
from jdp.models import hf
from jdp.models.transformer import Transformer

DTYPES = ("float32", "bfloat16")
# The self-check compares the logits of this many sequences of up to CHECK_LENGTH tokens
# of held-out text: at GPT-2's vocabulary each sequence's logits take 51 MB.
CHECK_SEQUENCES = 2
CHECK_LENGTH = 256
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Export:
    out: str
    architecture: str  # transformers' class
    num_tensors: int
    tensor_bytes: int
    max_abs_diff: float | None  # None: not verified (transformers is not installed)
    seconds: float


def check_model(model) -> str:
    """The transformers model_type of an experiment's model; ConfigError where none fits."""
    if not isinstance(model, Transformer):
        raise ConfigError(f"the experiment builds a {type(model).__name__}; the export writes "
                          "jdp.models.transformer.Transformer models. Fix: export a language "
                          "model run (experiments/gpt.py).")
    try:
        return hf.architecture(model)
    except hf.NoEquivalent as error:
        raise ConfigError(f"{error} (no exact transformers equivalent, so no export)") from error


def check_out(out: str, overwrite: bool) -> None:
    """--out must be a new or empty directory, unless --overwrite."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out={out!r} is a file. Fix: pass a directory.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"--out={out!r} exists and is not empty. Fix: pass a new directory, "
                          "or --overwrite to replace it.")


def check_tokenizer(tokenizer: tokenizers.Tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"data.tokenizer={tokenizer.spec!r} has {tokenizer.vocab_size} ids but "
                          f"the model embeds {vocab_size} (model.vocab_size): the vocabulary "
                          "does not match the tokenizer. Fix: export a run whose model embeds "
                          "every id of its tokenizer.")


def check_sequences(tokens: np.ndarray, length: int) -> np.ndarray:
    """Up to CHECK_SEQUENCES consecutive sequences of `length` tokens of held-out text."""
    count = min(CHECK_SEQUENCES, len(tokens) // length)
    if count == 0:
        length, count = len(tokens), 1
    return np.asarray(tokens[:count * length], np.int32).reshape(count, length)


def jdp_logits(model: Transformer, read_leaf: Callable[[str], np.ndarray], names: list[str],
               tokens: np.ndarray, dtype) -> np.ndarray:
    """`model`'s float32 logits on `tokens` on the CPU, with its params as exported (rounded
    to `dtype`), read leaf by leaf straight onto the device."""
    cpu = jax.devices("cpu")[0]
    flat = {name: jax.device_put(np.asarray(read_leaf(name)).astype(dtype).astype(np.float32), cpu)
            for name in names}
    params = {}
    for name, value in flat.items():
        node = params
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    del flat
    model = model.clone(dtype=jnp.float32, param_dtype=jnp.float32, dropout_rate=0.0)
    with jax.default_device(cpu):
        logits = jax.jit(lambda p, t: model.apply({"params": p}, t, train=False))(params, tokens)
    return np.asarray(logits)


def write_directory(out: str, model: Transformer, read_leaf: Callable[[str], np.ndarray],
                    tokenizer: tokenizers.Tokenizer, held_out: np.ndarray, *,
                    dtype: str = "float32", overwrite: bool = False,
                    max_shard_bytes: int = weights.DEFAULT_MAX_SHARD_BYTES,
                    log: Callable[[str], None] = print) -> Export:
    """Exports `model` with params `read_leaf(name)` ('/'-joined paths) and `tokenizer`
    into `out`, checked on `held_out` tokens (1-D); see the module docstring."""
    start = time.monotonic()
    model_type = check_model(model)
    check_out(out, overwrite)
    check_tokenizer(tokenizer, model.vocab_size)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r}. Fix: one of {', '.join(DTYPES)}.")
    numpy_dtype = np.dtype(jnp.dtype(dtype))
    links = hf.links(model_type, hf.model_fields(model))
    partial = f"{out.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        tensor_bytes = weights.write(partial, links, read_leaf, numpy_dtype, max_shard_bytes)
        config = hf.hf_config(model, eos_id=tokenizer.eos_id, dtype=dtype)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(partial, GENERATION_CONFIG), "w") as f:
            json.dump({"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id,
                       "pad_token_id": tokenizer.eos_id}, f, indent=2)
        tokenizer_files.write(tokenizer, partial, max_len=model.max_len)
        difference = None
        if verify.available():
            tokens = check_sequences(held_out, min(model.max_len, CHECK_LENGTH, len(held_out)))
            names = [leaf for link in links for leaf in link.leaves]
            ours = jdp_logits(model, read_leaf, names, tokens, numpy_dtype)
            difference = verify.check(partial, tokens, ours)
        else:
            log(f"jdp.export: not verified: transformers is not installed. Fix: "
                f"{verify.INSTALL_HINT}, then export again to check it.")
        _move_into_place(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Export(out, hf.ARCHITECTURES[model_type], len(links), tensor_bytes, difference,
                  time.monotonic() - start)


def _move_into_place(partial: str, out: str) -> None:
    """`partial` renamed to `out`; an `out` already there (empty, or --overwrite) goes."""
    if os.path.isdir(out):
        old = f"{out.rstrip(os.sep)}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(partial, out)
        shutil.rmtree(old)
    else:
        os.rename(partial, out)


def export_run(workdir: str, out: str, *, step: int | None = None, dtype: str = "float32",
               overwrite: bool = False,
               max_shard_bytes: int = weights.DEFAULT_MAX_SHARD_BYTES,
               log: Callable[[str], None] = print) -> Export:
    """The export of the run in `workdir` at checkpoint `step` (default: the newest)."""
    from jdp import trained_run

    run = trained_run.open_run(workdir)
    model = run.model()
    check_model(model)
    check_out(os.path.abspath(out), overwrite)
    with run.saved_params(step) as saved:
        held_out = run.eval_store().tokens
        return write_directory(os.path.abspath(out), model, saved.read, run.tokenizer(),
                               held_out[:CHECK_SEQUENCES * CHECK_LENGTH], dtype=dtype,
                               overwrite=overwrite, max_shard_bytes=max_shard_bytes, log=log)
