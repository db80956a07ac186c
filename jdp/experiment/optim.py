"""Learning-rate schedules and the default optimizer.

An experiment may build any Optax chain itself (`build_optimizer(config,
learning_rate_fn)`); these are the defaults and the pieces it can reuse.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from jdp.config import scaled_learning_rate


def peak_learning_rate(config) -> float:
    return scaled_learning_rate(
        config.learning_rate, config.lr_scaling, config.batch_size, config.base_batch_size)


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `peak`, then cosine decay to 0 at `total_steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=0.0)


def learning_rate_fn(config) -> optax.Schedule:
    return warmup_cosine(peak_learning_rate(config), config.warmup_steps, config.total_steps)


def adamw(config, learning_rate: Callable[[int], float]) -> optax.GradientTransformation:
    """AdamW with optional global-norm clipping; no weight decay on biases and norms."""
    tx = optax.adamw(learning_rate, weight_decay=config.weight_decay, mask=_is_matrix)
    if config.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
    return tx


def _is_matrix(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)
