"""What a checkpoint holds, by array path and shape, checked against what a model expects;
and the errors a checkpoint that cannot be used raises."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jdp.checkpoint import packing
from jdp.errors import first_line

PyTree = Any


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, damaged, or not matching the model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read (torn, truncated, bit rot)."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (disk full, permissions); the previous checkpoint is intact."""


def saved_layout(item_dir: epath.Path) -> tuple[dict[str, tuple[int, ...]], dict | None]:
    """(shape of every array of the state saved in a checkpoint item, by path
    (`params/Dense_0/kernel`), the packed small ones included; the item's pack index,
    None if it was saved without packing)."""
    try:
        with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
            metadata = handler.metadata(item_dir)
    except Exception as error:  # no or unreadable _METADATA although the step is complete
        raise unreadable(item_dir, error) from error
    index = packing.read_index(metadata)
    saved = {name: tuple(leaf.shape) for name, leaf in packing.flat(metadata.tree).items()}
    return packing.logical_shapes(saved, index), index


def expected_shapes(abstract: PyTree) -> dict[str, tuple[int, ...]]:
    # Orbax's own naming of the saved tree, so both sides spell paths the same way.
    return {name: _stored_shape(leaf) for name, leaf in packing.flat(abstract).items()}


def within(shapes: dict[str, tuple[int, ...]], field: str) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape in shapes.items() if name.split("/")[0] == field}


def without(shapes: dict[str, tuple[int, ...]], fields) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape in shapes.items() if name.split("/")[0] not in fields}


def check_matches(saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                   where: epath.Path) -> None:
    """Raises a CheckpointError naming every array whose name or shape differs."""
    problems = []
    if reshaped := [
        f"{name} is {saved[name]} in the checkpoint but {shape} in the model"
        for name, shape in sorted(expected.items())
        if name in saved and saved[name] != shape
    ]:
        problems.append(_some(reshaped))
    if missing := sorted(expected.keys() - saved.keys()):
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected := sorted(saved.keys() - expected.keys()):
        problems.append(f"in the checkpoint but not in the model: {_some(unexpected)}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {where} does not match the model: {'; '.join(problems)}. Use a "
            "checkpoint of the same model and optimizer, or configure the model to match it."
        )


def _stored_shape(leaf: Any) -> tuple[int, ...]:
    # Orbax stores a typed PRNG key as its key data: a () key<fry> is a (2,) uint32 array.
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(leaf.shape)


def _some(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def unreadable(item_dir: epath.Path, error: Exception) -> CheckpointError:
    reason = first_line(error)
    step_dir = item_dir.parent
    # Moving aside, not deleting: the reason may be ours (a sharding), not the files'.
    return DamagedCheckpointError(
        f"Checkpoint {item_dir} cannot be read ({type(error).__name__}: {reason}). If it is "
        f"damaged, move {step_dir} aside (e.g. to {step_dir}.damaged) to fall back to the "
        "previous checkpoint, or use another one."
    )
