"""Fine-tuning from a `transformers` model: `checkpoint.init_from=hf:DIR`.

DIR (local or gs://) is what `save_pretrained` writes: config.json and model.safetensors
(or shards with an index). The config names the architecture (GPT-2, GPT-NeoX, Llama:
`jdp.models.hf`) and the shape of the model (`transformer_fields`, which experiments
use to build it); the tensors are read one at a time, converted, and placed with the
run's shardings leaf by leaf, so host memory holds one tensor at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jdp.checkpoint import layout, packing, tensor_file
from jdp.checkpoint.layout import CheckpointError, PyTree
from jdp.models import hf
from jdp.runtime import storage

SCHEME = "hf:"


def is_hf(init_from: str) -> bool:
    return str(init_from).startswith(SCHEME)


def path_of(init_from: str) -> str:
    """The directory of an `hf:DIR` spec, as given (local or gs://)."""
    return init_from[len(SCHEME):]


def _local_directory(init_from: str) -> str:
    path = path_of(init_from)
    if not path:
        raise CheckpointError("config.checkpoint.init_from='hf:' names no directory. Fix: "
                              "hf:DIR, a directory written by transformers' save_pretrained.")
    if storage.is_bucket(path):
        return storage.local_copy(path)
    return os.path.abspath(os.path.expanduser(path))


def read_config(init_from: str) -> dict:
    """The config.json of an `hf:DIR` spec."""
    directory = _local_directory(init_from)
    config_file = os.path.join(directory, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: {config_file} does "
                              "not exist. Fix: point hf: at a directory written by "
                              "transformers' save_pretrained (config.json, model.safetensors).")
    with open(config_file) as f:
        return json.load(f)


def transformer_fields(init_from: str) -> dict[str, Any]:
    """The `Transformer` fields of the model in `hf:DIR` (CheckpointError where jdp has no
    exact equivalent)."""
    try:
        return hf.transformer_fields(read_config(init_from))
    except hf.NoEquivalent as error:
        raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: {error}") from error


def _tensor_name(name: str, holders: dict) -> str | None:
    """`name` as the file spells it: transformers 5's alias, or without the base model's
    prefix (the original GPT-2 files say h.0.attn..., not transformer.h.0.attn...)."""
    for candidate in (name, hf.ALIASES.get(name), name.partition(".")[2]):
        if candidate in holders:
            return candidate
    return None


def load_params(init_from: str, abstract_params: PyTree) -> PyTree:
    """The params of the model in `hf:DIR`, converted to jdp's layout and placed like
    `abstract_params`, whose names and shapes they must match exactly."""
    fields = transformer_fields(init_from)
    model_type = read_config(init_from)["model_type"]
    directory = _local_directory(init_from)
    try:
        holders = tensor_file.open_directory(directory)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: cannot read its "
                              f"weights ({error}). Fix: save the model with save_pretrained "
                              "(safetensors).") from error
    links = hf.links(model_type, fields)
    wanted = packing.flat(abstract_params)
    layout.check_matches(_shapes(fields), {name: tuple(leaf.shape)
                                          for name, leaf in wanted.items()},
                         f"{init_from} (as jdp params)")
    placed = {}
    for link in links:
        name = _tensor_name(link.name, holders)
        if name is None:
            raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: the weights have "
                                  f"no tensor {link.name}. Fix: save the whole model with "
                                  "save_pretrained.")
        if holders[name].shape(name) != link.shape:
            raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: {name} is "
                                  f"{holders[name].shape(name)} in the weights but config.json "
                                  f"makes it {link.shape}. Fix: a consistent save_pretrained "
                                  "directory.")
        for leaf, value in zip(link.leaves, link.from_hf(holders[name].read(name)), strict=True):
            placed[leaf] = packing.place(value, wanted[leaf])
    for opened in set(holders.values()):
        opened.close()
    return jax.tree.unflatten(jax.tree.structure(abstract_params),
                              [placed[name] for name in wanted])


def _shapes(fields: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The jdp params' shapes of a Transformer with `fields`, by '/'-joined path."""
    from jdp.models.transformer import Transformer

    model = Transformer(**fields)
    tokens = np.zeros((1, 1), np.int32)
    shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens, train=False)))
    return {name: tuple(leaf.shape) for name, leaf in packing.flat(shapes["params"]).items()}
