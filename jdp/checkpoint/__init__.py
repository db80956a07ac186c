"""Checkpoints of a run, with Orbax: saved from every process, atomic, restored onto any
topology.

`checkpointer` owns the directory of one run (saves, cadence, retention, restore),
`resume` decides the state a run starts from (its newest readable checkpoint, else a
fresh one, optionally with another run's params: `init_from`) and whether a workdir
may be resumed with this config, `layout` matches saved arrays against the model's,
`packing` saves the small arrays together (and `load_arrays` reads a checkpoint back
whole, for inspection). `saved_params` reads the params of a step on one host leaf by
leaf (for the export), `hf_import` the params of a `transformers` model
(`init_from=hf:DIR`), `tensor_file` the safetensors format one tensor at a time.
"""

from jdp.checkpoint.checkpointer import Checkpointer, WallTimeCadence, check_best_metric
from jdp.checkpoint.init_from import load_params
from jdp.checkpoint.layout import CheckpointError, CheckpointSaveError, DamagedCheckpointError
from jdp.checkpoint.packing import load_arrays

CHECKPOINT_DIR = "checkpoints"  # inside the workdir

__all__ = ["CHECKPOINT_DIR", "CheckpointError", "CheckpointSaveError", "Checkpointer",
           "DamagedCheckpointError", "WallTimeCadence", "check_best_metric", "load_arrays",
           "load_params"]
