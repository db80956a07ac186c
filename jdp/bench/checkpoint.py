"""How long a checkpoint save stalls training: async against synchronous.

    python -m jdp.bench checkpoint --model=small [--directory=gs://BUCKET/PATH]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import uuid

import jax
import optax

from jdp.bench import steps
from jdp.checkpoint import Checkpointer
from jdp.experiment.task import classification
from jdp.parallel import StepOptions, make_backend
from jdp.parallel.mesh import make_mesh
from jdp.runtime import storage


def add_arguments(parser, name: str) -> None:
    steps.add_model_arguments(parser)
    parser.add_argument("--directory", default="",
                        help="save under this directory, e.g. gs://BUCKET/PATH (default: a "
                             "local temporary directory)")


def run(args) -> None:
    checkpoint(args)


def checkpoint(args) -> None:
    model, tx = steps.vit_model(args.model), optax.adamw(1e-3)
    backend = make_backend("pjit", make_mesh(), model, classification(), tx, StepOptions())
    state = backend.init_global(jax.random.key(0), (steps.random_batch(1)["image"],))
    size_mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    stalls = {}
    for mode in ("async", "sync"):
        with _save_directory(args.directory) as directory:
            checkpointer = Checkpointer(directory, every_steps=1, max_to_keep=2,
                                        async_save=mode == "async")
            stalls[mode] = []
            for step in range(1, args.repeats + 1):
                jax.block_until_ready(state)
                start = time.perf_counter()
                checkpointer.save(step, state)
                stalls[mode].append(time.perf_counter() - start)  # the loop waits this long
                checkpointer.wait()  # let the write finish before the next sample
            checkpointer.close()
        print(f"{mode:5s} save of {size_mib:.1f} MiB (ViT-{args.model} + AdamW): training "
              f"stalls a median {1000 * statistics.median(stalls[mode]):.1f} ms "
              f"over {args.repeats} saves")
    ratio = statistics.median(stalls["async"]) / statistics.median(stalls["sync"])
    print(f"checkpoint: async stall / synchronous stall = {ratio:.3f}")


def _save_directory(parent: str):
    """A fresh directory for one mode's saves: a temporary local one, or a new prefix
    under `parent` (a bucket's objects are left there)."""
    if not parent:
        return tempfile.TemporaryDirectory()
    storage.check_supported(parent, "--directory")
    storage.configure()
    return contextlib.nullcontext(storage.join(parent, f"bench-{uuid.uuid4().hex[:8]}"))
