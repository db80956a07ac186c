"""Rematerialisation (activation checkpointing) by name.

Owns the mapping from the config field `remat` to a `jax.checkpoint` policy
and the one helper models use to wrap a block class in `nn.remat`.
"""

from collections.abc import Callable

import flax.linen as nn
import jax

_cp = jax.checkpoint_policies

# 'full' saves nothing inside the block and recomputes it all on the backward
# pass. `nothing_saveable` is what jax.checkpoint uses for `policy=None`.
_POLICIES: dict[str, Callable[..., bool]] = {
    "full": _cp.nothing_saveable,
    # Keep matmul outputs, recompute the cheap elementwise ops around them.
    "dots_saveable": _cp.dots_saveable,
    # Keep only weight matmuls (no batch dimension), recompute attention scores.
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
}

REMAT_POLICIES: tuple[str, ...] = ("none", *_POLICIES)
# From the policy that saves the most activations (none: no recomputation, the most
# memory) to the one that saves nothing (full: the least memory, the most recomputation).
REMAT_BY_STRENGTH: tuple[str, ...] = (
    "none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")
assert sorted(REMAT_BY_STRENGTH) == sorted(REMAT_POLICIES)


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The `policy` for `nn.remat` named by `name`, or None for 'none' (no remat)."""
    if name == "none":
        return None
    if name not in _POLICIES:
        raise ValueError(
            f"Unknown remat policy: remat={name!r}. Set `remat` to one of: "
            f"{', '.join(REMAT_POLICIES)}"
        )
    return _POLICIES[name]


def maybe_remat(
    module_cls: type[nn.Module], name: str, static_argnums: tuple[int, ...] = ()
) -> type[nn.Module]:
    """`module_cls` wrapped in `nn.remat` with the policy `name`, unchanged for 'none'.

    `static_argnums` counts `self` as 0, as `nn.remat` does; arguments that steer
    Python control flow (a `train` flag) must be listed.
    """
    policy = remat_policy(name)
    if policy is None:
        return module_cls
    return nn.remat(module_cls, policy=policy, static_argnums=static_argnums)
