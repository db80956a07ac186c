"""Fine-tuning: only the params of another run's checkpoint (`checkpoint.init_from`)."""

from __future__ import annotations

import contextlib
import os

import orbax.checkpoint as ocp

from jdp.checkpoint import layout, packing, saved_params
from jdp.checkpoint.layout import PyTree


def load_params(path: str | os.PathLike, abstract_params: PyTree) -> PyTree:
    """Only the params of a checkpoint (for fine-tuning), placed like `abstract_params`.

    `path` is a checkpoint directory (its newest complete step is used) or one step
    directory in it. Names and shapes must match the model's exactly.
    """
    item_dir = saved_params.item_dir(path)
    shapes, index = layout.saved_layout(item_dir)
    saved = {name: shape for name, shape in shapes.items() if name.startswith("params/")}
    target = {"params": abstract_params}
    layout.check_matches(saved, layout.expected_shapes(target), item_dir)
    try:
        with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
            if index is not None:  # the optimizer state and the rest stay on disk
                return packing.restore(handler, item_dir, target, index)["params"]
            return handler.restore(item_dir, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))["params"]
    except Exception as error:
        raise layout.unreadable(item_dir, error) from error
