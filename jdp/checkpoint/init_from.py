"""Reading part of a checkpoint: the params of another run's for fine-tuning
(`checkpoint.init_from`), or the fields an evaluation or a sampler needs."""

from __future__ import annotations

import contextlib
import os

import orbax.checkpoint as ocp

from jdp.checkpoint import layout, packing, saved_params
from jdp.checkpoint.layout import PyTree
from jdp.runtime import storage


def load_params(path: str | os.PathLike, abstract_params: PyTree) -> PyTree:
    """Only the params of a checkpoint (for fine-tuning), placed like `abstract_params`.

    `path` is a checkpoint directory (its newest complete step is used) or one step
    directory in it. Names and shapes must match the model's exactly.
    """
    return load_fields(path, {"params": abstract_params})["params"]


def load_fields(path: str | os.PathLike, abstract: dict[str, PyTree]) -> dict[str, PyTree]:
    """The named top-level fields of a checkpoint's state (`{"params": ..., "model_state":
    ...}`), each placed like its abstract tree; the other fields stay on disk. Reads only:
    a run still training may write the same directory meanwhile."""
    item_dir = saved_params.item_dir(storage.absolute(path))  # Orbax wants it absolute
    shapes, index = layout.saved_layout(item_dir)
    saved = {name: shape for name, shape in shapes.items() if name.split("/")[0] in abstract}
    layout.check_matches(saved, layout.expected_shapes(abstract), item_dir)
    try:
        with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
            if index is not None:  # the optimizer state and the rest stay on disk
                return packing.restore(handler, item_dir, abstract, index)
            return handler.restore(item_dir, args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                partial_restore=True))
    except Exception as error:
        raise layout.unreadable(item_dir, error) from error
