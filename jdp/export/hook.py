"""`export.hf_every_steps`: exports of a live run, beside its checkpoints.

Every N steps the params are gathered to the host of every process (leaf by leaf, a
collective that every process takes part in; a leaf sharded over processes is assembled
whole), and process 0 writes <workdir>/hf/<step> from them, checked like any export
(`jdp.export`): the hook holds one host copy of the params while it runs. The newest
`checkpoint.max_to_keep` exports are kept.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from jdp.data.text import lm
from jdp.hooks import Hook

HF_DIR = "hf"  # inside the workdir, beside checkpoints/


def hf_export_hook(config, build_model) -> Hook | None:
    """The hook of `config.export.hf_every_steps` (None where it is 0 or absent)."""
    every = config.get("export", {}).get("hf_every_steps", 0)
    if not every:
        return None

    def export(step, info) -> None:
        from jax.experimental import multihost_utils

        from jdp.checkpoint import packing
        from jdp.export.directory import CHECK_LENGTH, CHECK_SEQUENCES, write_directory

        leaves = {name: np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
                  for name, leaf in packing.flat(info.state.params).items()}
        if not info.is_writer:
            return
        model = build_model(config)
        root = os.path.join(info.workdir, HF_DIR)
        held_out = lm.eval_store(config.data, info.workdir).tokens
        write_directory(os.path.join(root, str(step)), model, leaves.__getitem__,
                        lm.run_tokenizer(config.data, info.workdir),
                        held_out[:CHECK_SEQUENCES * CHECK_LENGTH], overwrite=True,
                        log=lambda line: None)
        keep = config.checkpoint.max_to_keep
        steps = sorted(int(name) for name in os.listdir(root) if name.isdigit())
        for old in steps[:-keep] if keep else []:
            shutil.rmtree(os.path.join(root, str(old)))

    return Hook(export, every=every, at_end=True, name="export.hf_every_steps")
