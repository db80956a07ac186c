"""What a checkpoint holds, by array path and shape, checked against what a model expects;
and the errors a checkpoint that cannot be used raises."""

from __future__ import annotations

import contextlib
import json
import os
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
    check_accessible(item_dir)
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


# tensorstore's statuses for files that do not hold what the checkpoint's own metadata says
# they hold: cut short, undecodable, or absent from a step that was committed whole.
_DAMAGE_STATUSES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")
_DAMAGE_TYPES = (json.JSONDecodeError, UnicodeDecodeError, EOFError, FileNotFoundError)


def check_accessible(item_dir: epath.Path) -> None:
    """Raises a CheckpointError, which does not call the checkpoint damaged, for a
    checkpoint that is not there or that this process may not read (local paths; a
    bucket's access shows only when it is read)."""
    path = os.fspath(item_dir)
    if "://" in path:
        return
    try:
        os.stat(path)
    except PermissionError:
        raise _permission_denied(path, "the way to it") from None
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint {path} does not exist. Fix: point at an existing "
                              "checkpoint directory or one of its step directories.") from None
    if not _may(path, os.R_OK | os.X_OK):
        raise _permission_denied(path, path)
    for directory, subdirectories, names in os.walk(path):
        for name in subdirectories:
            if not _may(os.path.join(directory, name), os.R_OK | os.X_OK):
                raise _permission_denied(path, os.path.join(directory, name))
        for name in names:
            if not _may(os.path.join(directory, name), os.R_OK):
                raise _permission_denied(path, os.path.join(directory, name))


def _may(path: str, mode: int) -> bool:
    # As the reads will be made: by the effective user (a process may have dropped root).
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _permission_denied(item_dir: str, where: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {item_dir} cannot be read: permission denied on {where} (this process "
        f"runs as uid {os.geteuid()}). The checkpoint is not known to be damaged. Fix: make "
        "its files readable by this user (chmod / chown), or run as their owner.")


def unreadable(item_dir: epath.Path, error: Exception) -> CheckpointError:
    """The error for a checkpoint whose read failed with `error`: a DamagedCheckpointError
    only where the checkpoint's own files failed to decode (or were missing from a committed
    step); any other cause (permissions, a missing module, a bug, another version) is a
    plain CheckpointError that says the checkpoint is not known to be damaged."""
    reason = first_line(error)
    described = f"{type(error).__name__}: {reason}"
    if isinstance(error, PermissionError) or "PERMISSION_DENIED" in reason:
        return _permission_denied(os.fspath(item_dir), described)
    if isinstance(error, ImportError):
        return CheckpointError(
            f"Checkpoint {item_dir} cannot be read: a module it needs is missing ({described}). "
            "The checkpoint is not known to be damaged. Fix: install the missing package.")
    if isinstance(error, _DAMAGE_TYPES) or reason.startswith(_DAMAGE_STATUSES):
        step_dir = item_dir.parent
        # Shown damaged by its own files: moving the step aside loses nothing readable.
        return DamagedCheckpointError(
            f"Checkpoint {item_dir} is damaged: its files fail to read ({described}). Fix: "
            f"move {step_dir} aside (e.g. to {step_dir}.damaged) to fall back to the previous "
            "checkpoint, or use another one.")
    return CheckpointError(
        f"Checkpoint {item_dir} could not be restored ({described}). Its files were not shown "
        "to be damaged: keep it. Fix: check that this jdp and its Orbax and jax versions can "
        "read it, and that the model and sharding match the run that saved it.")
