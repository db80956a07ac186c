"""model.safetensors (or its shards and index) of a Transformer, written tensor by tensor
from jdp params read one at a time (`read_leaf`), so host memory holds one tensor and
the leaves it is made of, never the model."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import numpy as np

from jdp.checkpoint import tensor_file
from jdp.models.hf import Link

# transformers 4's default max_shard_size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def write(out: str, links: list[Link], read_leaf: Callable[[str], np.ndarray], dtype,
          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> int:
    """Writes the tensors of `links` in `dtype` into directory `out`; returns their bytes."""
    dtype = np.dtype(dtype)
    sizes = [math.prod(link.shape) * dtype.itemsize for link in links]
    shards = tensor_file.split_into_shards(sizes, max_shard_bytes)
    names = tensor_file.shard_names(len(shards))

    def make(link: Link) -> np.ndarray:
        return np.asarray(link.to_hf(*(read_leaf(leaf) for leaf in link.leaves))).astype(dtype)

    for shard, file_name in zip(shards, names, strict=True):
        members = [links[i] for i in shard]
        tensor_file.write(os.path.join(out, file_name),
                          [(link.name, link.shape) for link in members], dtype,
                          lambda i, members=members: make(members[i]))
    total = sum(sizes)
    if len(shards) > 1:
        weight_map = {links[i].name: name for shard, name in zip(shards, names, strict=True)
                      for i in shard}
        with open(os.path.join(out, tensor_file.INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total
