"""Decoder-only Transformer language model in Flax Linen.

Owns the causal LM, its standard sizes by name, `transformer(size, ...)`, the
rotary position embedding and the model-FLOPs count per token. Compute runs in
`dtype` while parameters stay in `param_dtype`; the logits are float32.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jdp.models.remat import maybe_remat, remat_policy
from jdp.models.vit import MlpBlock

TRANSFORMER_SIZES: dict[str, dict[str, int]] = {
    # For quick CPU runs on the built-in addition task.
    "nano": dict(hidden_size=64, num_layers=2, num_heads=4, mlp_dim=256),
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, mlp_dim=512),
    "small": dict(hidden_size=384, num_layers=6, num_heads=6, mlp_dim=1536),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
}

POSITIONS = ("rotary", "learned")

# The base of RoPE's geometric sequence of frequencies (Su et al., 2021).
_ROTARY_BASE = 10_000.0


def apply_rotary(x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """Rotary position embedding of `x` [..., length, heads, head_dim] at `positions` [length].

    Rotates the pairs (x[i], x[i + head_dim/2]) by the angle position * base^(-2i/head_dim),
    so the dot product of a rotated query and key depends only on their offset. The
    angles and rotation are computed in float32 (in bf16 the angles of later positions
    would be off by whole radians) and the result is cast back to x's dtype.
    """
    half = x.shape[-1] // 2
    inverse_frequencies = _ROTARY_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inverse_frequencies  # [length, half]
    # Broadcast over heads, which come between length and head_dim.
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def _causal_attention(
    query: jnp.ndarray,
    key: jnp.ndarray,
    value: jnp.ndarray,
    mask: jnp.ndarray,
    dtype: Any = None,
    rotary: bool = False,
) -> jnp.ndarray:
    """Masked dot-product attention, optionally with RoPE on queries and keys.

    The softmax runs in float32 and its weights are cast back to the value dtype, so
    both matmuls run in `dtype` (see vit._attention for why).
    """
    if rotary:
        positions = jnp.arange(query.shape[-3])
        query, key = apply_rotary(query, positions), apply_rotary(key, positions)
    weights = nn.dot_product_attention_weights(
        query, key, mask=mask, dtype=dtype, force_fp32_for_softmax=True
    )
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: x + CausalAttn(LN(x)), then x + MLP(LN(x))."""

    num_heads: int
    mlp_dim: int
    rotary: bool
    dropout_rate: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        # Position t attends to positions <= t; [1, 1, length, length] broadcasts over
        # batch and heads.
        causal_mask = nn.make_causal_mask(jnp.ones(x.shape[1], jnp.bool_))[None]
        y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention_fn=functools.partial(_causal_attention, rotary=self.rotary),
        )(y, y, mask=causal_mask)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        y = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, self.param_dtype)(y, train)
        return x + y


class Transformer(nn.Module):
    """Causal language model over int tokens [batch, length]; returns float32 logits.

    Logits at position t predict token t + 1 from tokens 0..t. `positions='rotary'`
    applies RoPE to queries and keys in every layer, `'learned'` adds a learned
    absolute embedding of up to `max_len` positions to the token embedding. `remat`
    names a policy from `REMAT_POLICIES`, applied to each block. Dropout needs
    `rngs={'dropout': key}` when `train`.
    """

    vocab_size: int
    max_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    positions: str = "rotary"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"

    def __post_init__(self) -> None:
        # Fail when the model is built from the config, not at the first trace.
        if self.positions not in POSITIONS:
            raise ValueError(
                f"Unknown positions={self.positions!r}. Set `positions` to one of: "
                f"{', '.join(POSITIONS)}"
            )
        remat_policy(self.remat)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}); change `hidden_size` or `num_heads`"
            )
        head_dim = self.hidden_size // self.num_heads
        if self.positions == "rotary" and head_dim % 2:
            raise ValueError(
                f"positions='rotary' rotates pairs of features, so the head dim "
                f"hidden_size / num_heads ({self.hidden_size} / {self.num_heads} = {head_dim}) "
                f"must be even; change `hidden_size` or `num_heads`, or set positions='learned'"
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens: jnp.ndarray, train: bool) -> jnp.ndarray:
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(
                f"Sequence length ({length}) exceeds max_len ({self.max_len}); "
                f"raise `max_len` or shorten the sequences"
            )
        x = nn.Embed(
            self.vocab_size,
            self.hidden_size,
            embedding_init=nn.initializers.normal(stddev=0.02),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="token_embedding",
        )(tokens)
        if self.positions == "learned":
            position_embedding = self.param(
                "position_embedding",
                nn.initializers.normal(stddev=0.02),
                (self.max_len, self.hidden_size),
                self.param_dtype,
            )
            x = x + position_embedding[:length].astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)

        # static_argnums=(2,): `train` (self is 0) switches dropout in Python.
        block_cls = maybe_remat(DecoderBlock, self.remat, static_argnums=(2,))
        for i in range(self.num_layers):
            x = block_cls(
                num_heads=self.num_heads,
                mlp_dim=self.mlp_dim,
                rotary=self.positions == "rotary",
                dropout_rate=self.dropout_rate,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=f"decoder_block_{i}",
            )(x, train)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="decoder_norm")(x)

        logits = nn.Dense(
            self.vocab_size, dtype=self.dtype, param_dtype=self.param_dtype, name="head"
        )(x)
        # The loss (log-softmax) is computed in float32 whatever the compute dtype.
        return logits.astype(jnp.float32)


def transformer(size: str, *, vocab_size: int, max_len: int, **kwargs: Any) -> Transformer:
    """The Transformer of a named size; `kwargs` set the other fields (and may override)."""
    if size not in TRANSFORMER_SIZES:
        raise ValueError(
            f"Unknown Transformer size: model.size={size!r}. Set `model.size` to one of: "
            f"{', '.join(TRANSFORMER_SIZES)}"
        )
    return Transformer(
        **{**TRANSFORMER_SIZES[size], **kwargs}, vocab_size=vocab_size, max_len=max_len
    )


def flops_per_token(
    *, hidden_size: int, num_layers: int, mlp_dim: int, vocab_size: int, length: int
) -> float:
    """Model FLOPs of one training step's forward and backward pass, per token.

    The standard count (Kaplan et al., 2020; PaLM's MFU): 6 * N + 12 * num_layers *
    hidden_size * length, where N = num_layers * (4 h^2 + 2 h mlp_dim) + h * vocab_size
    are the weights of the matmuls (q, k, v, out; the two MLP layers; the head; not the
    embedding lookups, biases or norms) at 2 FLOPs per multiply-add forward and 4 backward.
    The second term is the attention scores and weighted values, counted over the full
    length x length square though the causal mask makes half of it zero. It counts no
    remat recomputation: this is model FLOPs for MFU, not the hardware FLOPs done.
    """
    matmul_params = (
        num_layers * (4 * hidden_size**2 + 2 * hidden_size * mlp_dim) + hidden_size * vocab_size
    )
    return float(6 * matmul_params + 12 * num_layers * hidden_size * length)
