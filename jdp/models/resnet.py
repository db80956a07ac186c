"""ResNet (He et al., 2015) with BatchNorm, in Flax Linen.

Owns the ResNet model, its residual blocks, the standard depths by name and
`resnet(size, ...)`. BatchNorm statistics are reduced over `bn_axis_name`
when it is set, so that data-parallel training normalises over the global batch.
"""

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jdp.models.remat import maybe_remat, remat_policy

RESNET_SIZES: dict[str, dict[str, Any]] = {
    # For quick CPU runs on 8x8 digits (use with small_inputs=True).
    "tiny": dict(stage_sizes=(1, 1), block_cls="basic", num_filters=16),
    "18": dict(stage_sizes=(2, 2, 2, 2), block_cls="basic"),
    "34": dict(stage_sizes=(3, 4, 6, 3), block_cls="basic"),
    "50": dict(stage_sizes=(3, 4, 6, 3), block_cls="bottleneck"),
}


def _conv_and_norm(
    dtype: Any, param_dtype: Any, bn_axis_name: str | None, train: bool
) -> tuple[Any, Any]:
    """The conv and BatchNorm constructors every layer of the network shares."""
    conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype, param_dtype=param_dtype)
    norm = functools.partial(
        nn.BatchNorm,
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=dtype,
        param_dtype=param_dtype,
        axis_name=bn_axis_name,
    )
    return conv, norm


class _ResidualBlock(nn.Module):
    """Fields shared by both block types; `strides` apply to the block's first spatial conv."""

    filters: int
    strides: tuple[int, int]
    dtype: Any
    param_dtype: Any
    bn_axis_name: str | None

    def shortcut(self, x: jnp.ndarray, y: jnp.ndarray, conv: Any, norm: Any) -> jnp.ndarray:
        """`x`, projected by a strided 1x1 conv when the block changes its shape."""
        if x.shape == y.shape:
            return x
        x = conv(y.shape[-1], (1, 1), self.strides, name="conv_proj")(x)
        return norm(name="norm_proj")(x)


class BasicBlock(_ResidualBlock):
    """Two 3x3 convs (ResNet-18/34)."""

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        conv, norm = _conv_and_norm(self.dtype, self.param_dtype, self.bn_axis_name, train)
        y = conv(self.filters, (3, 3), self.strides)(x)
        y = nn.relu(norm()(y))
        y = conv(self.filters, (3, 3))(y)
        # Zero-init the last scale: each block starts as the identity (Goyal et al., 2017).
        y = norm(scale_init=nn.initializers.zeros)(y)
        return nn.relu(self.shortcut(x, y, conv, norm) + y)


class BottleneckBlock(_ResidualBlock):
    """1x1 reduce, 3x3, 1x1 expand to 4x filters (ResNet-50 and deeper)."""

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        conv, norm = _conv_and_norm(self.dtype, self.param_dtype, self.bn_axis_name, train)
        y = conv(self.filters, (1, 1))(x)
        y = nn.relu(norm()(y))
        y = conv(self.filters, (3, 3), self.strides)(y)
        y = nn.relu(norm()(y))
        y = conv(self.filters * 4, (1, 1))(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        return nn.relu(self.shortcut(x, y, conv, norm) + y)


BLOCKS: dict[str, type[_ResidualBlock]] = {"basic": BasicBlock, "bottleneck": BottleneckBlock}


class ResNet(nn.Module):
    """ResNet classifier over NHWC images; returns float32 logits.

    Running BatchNorm statistics live in the 'batch_stats' collection: apply with
    `mutable=['batch_stats']` when `train`. With `bn_axis_name` set, a training
    forward pass must run where that axis is bound (pmap, or shard_map under jit);
    `init` with `train=False` needs no axis. `remat` names a policy from
    `REMAT_POLICIES`, applied to each residual block.
    """

    stage_sizes: Sequence[int]
    block_cls: str
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "none"
    bn_axis_name: str | None = None
    # 3x3 stride-1 stem without max-pool, for 8x8 digits and 32x32 CIFAR images.
    small_inputs: bool = False

    def __post_init__(self) -> None:
        # Fail when the model is built from the config, not at the first trace.
        if self.block_cls not in BLOCKS:
            raise ValueError(
                f"Unknown block_cls={self.block_cls!r}. Set `block_cls` to one of: "
                f"{', '.join(BLOCKS)}"
            )
        remat_policy(self.remat)
        super().__post_init__()

    @nn.compact
    def __call__(self, images: jnp.ndarray, train: bool) -> jnp.ndarray:
        conv, norm = _conv_and_norm(self.dtype, self.param_dtype, self.bn_axis_name, train)
        if self.small_inputs:
            x = conv(self.num_filters, (3, 3), name="conv_init")(images)
        else:
            x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(
                images
            )
        x = nn.relu(norm(name="bn_init")(x))
        if not self.small_inputs:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")

        # static_argnums=(2,): `train` (self is 0) picks batch or running statistics.
        block_cls = maybe_remat(BLOCKS[self.block_cls], self.remat, static_argnums=(2,))
        for stage, num_blocks in enumerate(self.stage_sizes):
            for block in range(num_blocks):
                # Each stage after the first halves the resolution in its first block.
                strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
                x = block_cls(
                    filters=self.num_filters * 2**stage,
                    strides=strides,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    bn_axis_name=self.bn_axis_name,
                    name=f"stage{stage}_block{block}",
                )(x, train)

        x = jnp.mean(x, axis=(1, 2))
        logits = nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head"
        )(x)
        # The loss (log-softmax) is computed in float32 whatever the compute dtype.
        return logits.astype(jnp.float32)


def resnet(size: str, *, num_classes: int, **kwargs: Any) -> ResNet:
    """The ResNet of a named size; `kwargs` set the other fields (and may override the size's)."""
    if size not in RESNET_SIZES:
        raise ValueError(
            f"Unknown ResNet size: model.size={size!r}. Set `model.size` to one of: "
            f"{', '.join(RESNET_SIZES)}"
        )
    return ResNet(**{**RESNET_SIZES[size], **kwargs}, num_classes=num_classes)
