"""Vision Transformer (Dosovitskiy et al., 2020) in Flax Linen.

Owns the ViT model, its standard sizes by name and `vit(size, ...)`. Compute
runs in `dtype` while parameters stay in `param_dtype`; the logits are float32.
The params carry the logical axis names of `axes.py` (heads and MLP units split
over the model axis with `parallel.model_parallel`).
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jdp.models import axes
from jdp.models.remat import maybe_remat, remat_policy

VIT_SIZES: dict[str, dict[str, int]] = {
    # For quick CPU runs on 8x8 digits.
    "nano": dict(hidden_size=64, num_layers=2, num_heads=4, mlp_dim=128),
    "tiny": dict(hidden_size=192, num_layers=12, num_heads=3, mlp_dim=768),
    "small": dict(hidden_size=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "base": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "large": dict(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}

POOLS = ("cls", "gap")


def _attention(
    query: jnp.ndarray, key: jnp.ndarray, value: jnp.ndarray, dtype: Any = None
) -> jnp.ndarray:
    """Dot-product attention with the softmax in float32 and both matmuls in `dtype`.

    A bf16 softmax loses the small attention weights. flax's `force_fp32_for_softmax`
    alone leaves the weights in float32, which would run the weights x values matmul
    in float32 and keep float32 weights for the backward pass; cast them back instead.
    """
    weights = nn.dot_product_attention_weights(query, key, dtype=dtype, force_fp32_for_softmax=True)
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


class MlpBlock(nn.Module):
    """Dense -> GELU -> Dense, with dropout after each; column- then row-parallel over the
    model axis (the hidden units split)."""

    mlp_dim: int
    dropout_rate: float
    dtype: Any
    param_dtype: Any
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        hidden_size = x.shape[-1]
        dense = functools.partial(nn.Dense, use_bias=self.use_bias, dtype=self.dtype,
                                  param_dtype=self.param_dtype)
        x = dense(self.mlp_dim, kernel_init=axes.kernel(axes.EMBED, axes.MLP),
                  bias_init=axes.bias(axes.MLP))(x)
        x = nn.gelu(x)  # the tanh approximation (GPT-2's "gelu_new")
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        x = dense(hidden_size, kernel_init=axes.kernel(axes.MLP, axes.EMBED),
                  bias_init=axes.bias(axes.EMBED))(x)
        return nn.Dropout(self.dropout_rate)(x, deterministic=not train)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        norm = functools.partial(nn.LayerNorm, dtype=self.dtype, param_dtype=self.param_dtype,
                                 **axes.norm_inits())
        y = norm()(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            attention_fn=_attention,
            kernel_init=axes.kernel(axes.EMBED, axes.HEADS, axes.HEAD_DIM),
            bias_init=axes.bias(axes.HEADS, axes.HEAD_DIM),
            out_kernel_init=axes.kernel(axes.HEADS, axes.HEAD_DIM, axes.EMBED),
            out_bias_init=axes.bias(axes.EMBED),
        )(y, y)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        x = x + y
        y = norm()(x)
        y = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, self.param_dtype)(y, train)
        return x + y


class ViT(nn.Module):
    """Vision Transformer classifier over NHWC images; returns float32 logits.

    `pool='cls'` classifies from a learned class token, `'gap'` from the mean of
    the patch tokens. `remat` names a policy from `REMAT_POLICIES`, applied to
    each encoder block. Dropout needs `rngs={'dropout': key}` when `train`.
    """

    num_classes: int
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    pool: str = "cls"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"

    def __post_init__(self) -> None:
        # Fail when the model is built from the config, not at the first trace.
        if self.pool not in POOLS:
            raise ValueError(
                f"Unknown pool={self.pool!r}. Set `pool` to one of: {', '.join(POOLS)}"
            )
        remat_policy(self.remat)
        super().__post_init__()

    @nn.compact
    def __call__(self, images: jnp.ndarray, train: bool) -> jnp.ndarray:
        batch_size, height, width, _ = images.shape
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"Image size {height}x{width} must be divisible by patch_size "
                f"({self.patch_size}); resize the images or pick another patch_size"
            )
        x = nn.Conv(
            self.hidden_size,
            kernel_size=(self.patch_size, self.patch_size),
            strides=(self.patch_size, self.patch_size),
            padding="VALID",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=axes.kernel(axes.PATCH, axes.PATCH, axes.PATCH, axes.EMBED),
            bias_init=axes.bias(axes.EMBED),
            name="patch_embedding",
        )(images)
        x = x.reshape(batch_size, -1, self.hidden_size)

        if self.pool == "cls":
            cls_token = self.param(
                "cls_token", axes.named(nn.initializers.zeros, None, None, axes.EMBED),
                (1, 1, self.hidden_size), self.param_dtype
            )
            cls_tokens = jnp.broadcast_to(cls_token, (batch_size, 1, self.hidden_size))
            x = jnp.concatenate([cls_tokens.astype(x.dtype), x], axis=1)
        position_embedding = self.param(
            "position_embedding",
            axes.named(nn.initializers.normal(stddev=0.02), None, axes.POSITION, axes.EMBED),
            (1, x.shape[1], self.hidden_size),
            self.param_dtype,
        )
        x = x + position_embedding.astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)

        # static_argnums=(2,): `train` (self is 0) switches dropout in Python.
        block_cls = maybe_remat(EncoderBlock, self.remat, static_argnums=(2,))
        for i in range(self.num_layers):
            x = block_cls(
                num_heads=self.num_heads,
                mlp_dim=self.mlp_dim,
                dropout_rate=self.dropout_rate,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=f"encoder_block_{i}",
            )(x, train)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="encoder_norm",
                         **axes.norm_inits())(x)

        x = x[:, 0] if self.pool == "cls" else x.mean(axis=1)
        logits = nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=axes.kernel(axes.EMBED, axes.CLASSES), bias_init=axes.bias(axes.CLASSES),
            name="head"
        )(x)
        # The loss (log-softmax) is computed in float32 whatever the compute dtype.
        return logits.astype(jnp.float32)


def vit(size: str, *, num_classes: int, patch_size: int, **kwargs: Any) -> ViT:
    """The ViT of a named size; `kwargs` set the other fields (and may override the size's)."""
    if size not in VIT_SIZES:
        raise ValueError(
            f"Unknown ViT size: model.size={size!r}. Set `model.size` to one of: "
            f"{', '.join(VIT_SIZES)}"
        )
    return ViT(**{**VIT_SIZES[size], **kwargs}, num_classes=num_classes, patch_size=patch_size)


def flops_per_example(model: ViT, *, image_size: int, channels: int) -> float:
    """Model FLOPs of one training example (forward + backward = 3 x forward).

    Forward: the patch embedding, per layer the q/k/v/out and MLP matmuls over all
    tokens plus the attention scores and weighted values (tokens^2 x hidden each),
    and the head, at 2 FLOPs per multiply-add. Norms, softmax and remat
    recomputation are not model FLOPs.
    """
    patches = (image_size // model.patch_size) ** 2
    tokens = patches + (1 if model.pool == "cls" else 0)
    hidden = model.hidden_size
    embedding = 2 * patches * model.patch_size**2 * channels * hidden
    per_layer = (2 * tokens * (4 * hidden**2 + 2 * hidden * model.mlp_dim)
                 + 2 * 2 * tokens**2 * hidden)
    head = 2 * hidden * model.num_classes
    return float(3 * (embedding + model.num_layers * per_layer + head))
