"""The params of a saved step, read on one host leaf by leaf as numpy.

For programs that use a trained run outside training (the export to transformers): no
mesh, no devices, and only one leaf in memory at a time, whatever topology and sharding
mode (FSDP, ZeRO-1, host modes) saved it: a checkpoint holds global arrays.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_manager import DEFAULT_ITEM_NAME

from jdp.checkpoint import layout, packing
from jdp.checkpoint.layout import CheckpointError

_PARAMS = "params/"


def item_dir(path: str | epath.Path, step: int | None = None) -> epath.Path:
    """The item directory of step `step` of checkpoint directory `path`, or of its newest
    complete step; `path` may also be one step directory (then `step` is None)."""
    path = epath.Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Cannot load params: {path} does not exist. Point at a jdp checkpoint "
            "directory or one of its step directories.")
    if step is None and (path / DEFAULT_ITEM_NAME).is_dir() and ocp.step.is_path_finalized(path):
        return path / DEFAULT_ITEM_NAME
    steps = ocp.utils.checkpoint_steps(path)
    if not steps:
        raise CheckpointError(
            f"Cannot load params: {path} holds no complete checkpoint. Train the run first, "
            "or point at a jdp checkpoint directory or one of its step directories.")
    if step is not None and step not in steps:
        raise CheckpointError(
            f"Cannot load params: {path} has no complete checkpoint of step {step} (it has "
            f"steps {sorted(steps)}). Fix: pass one of those.")
    return path / str(max(steps) if step is None else step) / DEFAULT_ITEM_NAME


class SavedParams:
    """The params of one saved step: their shapes by '/'-joined path (`shapes`), each
    read on demand (`read`). Use as a context manager."""

    def __init__(self, path: str | epath.Path, step: int | None = None) -> None:
        self.item_dir = item_dir(path, step)
        self.step = int(self.item_dir.parent.name)
        saved, self._index = layout.saved_layout(self.item_dir)
        self.shapes = {name[len(_PARAMS):]: shape for name, shape in saved.items()
                       if name.startswith(_PARAMS)}
        self._handler = ocp.PyTreeCheckpointHandler()
        self._packed: dict[str, np.ndarray] | None = None

    def __enter__(self) -> SavedParams:
        return self

    def __exit__(self, *exc) -> None:
        self._handler.close()

    def _small(self) -> dict[str, np.ndarray]:
        """The small params saved in packs (all of them, a few KiB each), read once."""
        if self._packed is None:
            packs = {f"{packing.PACKED}/{dtype}": 0 for dtype in self._index or {}}
            read = self._restore(packs) if packs else {}
            self._packed = {}
            for dtype, members in (self._index or {}).items():
                for name, value in packing.unpacked(read[f"{packing.PACKED}/{dtype}"], members):
                    if name.startswith(_PARAMS):
                        self._packed[name[len(_PARAMS):]] = value
        return self._packed

    def _restore(self, names: dict[str, int]) -> dict[str, np.ndarray]:
        item = ocp.tree.from_flat_dict(names, sep="/")
        restore_args = ocp.tree.from_flat_dict(
            {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}, sep="/")
        try:
            return packing.flat(self._handler.restore(self.item_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True)))
        except Exception as error:
            raise layout.unreadable(self.item_dir, error) from error

    def read(self, name: str) -> np.ndarray:
        """The param at path `name` (`decoder_block_0/LayerNorm_0/scale`) as numpy."""
        if name not in self.shapes:
            raise CheckpointError(f"Checkpoint {self.item_dir} has no param {name}")
        packed = self._small()
        if name in packed:
            return packed[name]
        return self._restore({_PARAMS + name: 0})[_PARAMS + name]


def load_host_params(path: str | epath.Path, step: int | None = None) -> dict:
    """All params of a saved step as nested dicts of numpy arrays (one host, no mesh)."""
    with SavedParams(path, step) as saved:
        return ocp.tree.from_flat_dict({name: saved.read(name) for name in saved.shapes},
                                       sep="/")
