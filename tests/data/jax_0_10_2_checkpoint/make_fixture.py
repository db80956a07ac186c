"""Writes this folder's fixture with the jax that runs it, meant to be 0.10.2 (the lowest
jdp supports; README's Python 3.11 venv has it):

    .venv/bin/python tests/data/jax_0_10_2_checkpoint/make_fixture.py

It trains experiment.py's 12 steps as the tests' processes do (tests/conftest.py's set-up,
the train step compiled as tests/test_jax_versions.py compiles it), keeps the run's
config.json and step-4 checkpoint as `workdir/`, then continues a copy of that from step
4 and writes the losses of steps 5-12, and the versions that made them, to
`expected.json`. The continued losses must equal the uninterrupted run's, bitwise.
"""

import json
import os
import shutil
import sys
import tempfile
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/

import conftest  # noqa: E402, F401 - the tests' XLA flags, TFDS folder and compilation cache
from test_jax_versions import (  # noqa: E402
    EXPERIMENT,
    SAVED_STEP,
    TOTAL_STEPS,
    continue_run,
)

from runs import USERS_FUSION, losses, steps_compiled_with, train  # noqa: E402

VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole")
        with steps_compiled_with(USERS_FUSION):
            _, records = train(EXPERIMENT, whole)
        saved = os.path.join(scratch, "saved")
        os.makedirs(os.path.join(saved, "checkpoints"))
        shutil.copy(os.path.join(whole, "config.json"), saved)
        shutil.copytree(os.path.join(whole, "checkpoints", str(SAVED_STEP)),
                        os.path.join(saved, "checkpoints", str(SAVED_STEP)))
        _, continued = continue_run(saved, os.path.join(scratch, "continued"))
        steps = range(SAVED_STEP + 1, TOTAL_STEPS + 1)
        expected = {str(s): losses(continued)[s] for s in steps}
        if expected != {str(s): losses(records)[s] for s in steps}:
            raise SystemExit("the continued run differs from the uninterrupted one: "
                             "not writing a fixture")
        shutil.rmtree(os.path.join(HERE, "workdir"), ignore_errors=True)
        shutil.copytree(saved, os.path.join(HERE, "workdir"))
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"versions": {name: metadata.version(name) for name in VERSIONS},
                   "python": sys.version.split()[0], "losses": expected}, f, indent=1)
        f.write("\n")
    print(f"wrote {HERE}/workdir and expected.json: losses {expected}")


if __name__ == "__main__":
    main()
