"""The logical axis names on the params of jdp's models, and the rules table that maps
them to the mesh's model axis (`parallel.model_parallel`).

Megatron-LM's layout (Shoeybi et al., 2019): the attention heads and the MLP's hidden
units are split over `model`, so the projections into a block split their output
(column-parallel) and those out of it their input (row-parallel), and each block
needs one all-reduce forward (of its output) and one backward (of its input's
gradient); the vocabulary of the embedding and the head is split too. Every other
dimension stays whole. The names are Flax's logical partitioning
(`nn.with_logical_partitioning`): they change no param's name, shape or value.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn

from jdp import MODEL_AXIS

VOCAB = "vocab"
EMBED = "embed"  # the model's width (the residual stream)
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (fewer than the query heads with grouped queries)
HEAD_DIM = "head_dim"
MLP = "mlp"  # the MLP's hidden units
POSITION = "position"  # learned position embeddings' positions
PATCH = "patch"  # a patch embedding's kernel height, width and channels
CLASSES = "classes"

# Logical name -> mesh axis (None: never split). A name with no rule is not split.
RULES: tuple[tuple[str, str | None], ...] = (
    (VOCAB, MODEL_AXIS), (HEADS, MODEL_AXIS), (KV_HEADS, MODEL_AXIS), (MLP, MODEL_AXIS),
    (EMBED, None), (HEAD_DIM, None), (POSITION, None), (PATCH, None), (CLASSES, None))


def named(init: Callable, *names: str | None) -> Callable:
    """`init` with the logical names of its param's dimensions."""
    return nn.with_logical_partitioning(init, names)


def kernel(*names: str | None) -> Callable:
    """Flax's default kernel initializer (Dense, DenseGeneral, Conv), named."""
    return named(nn.initializers.lecun_normal(), *names)


def bias(*names: str | None) -> Callable:
    """Flax's default bias initializer (zeros), named."""
    return named(nn.initializers.zeros_init(), *names)


def norm_inits(use_bias: bool = True) -> dict[str, Callable]:
    """A LayerNorm's (or, without the bias, an RMSNorm's) initializers, named."""
    inits = {"scale_init": named(nn.initializers.ones_init(), EMBED)}
    if use_bias:
        inits["bias_init"] = bias(EMBED)
    return inits
