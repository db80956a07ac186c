"""A checkpoint that jax 0.10.2 wrote (tests/data/jax_0_10_2_checkpoint, made by its
make_fixture.py) restores on the jax running the tests and continues the float32
trajectory that 0.10.2 continued from it: the losses of the next 8 steps within rtol
1e-6."""

import json
import os
import shutil

import numpy as np
import pytest

from runs import REPO, USERS_FUSION, losses, steps_compiled_with, train

pytestmark = pytest.mark.slow

FIXTURE = os.path.join(REPO, "tests", "data", "jax_0_10_2_checkpoint")
EXPERIMENT = os.path.join(FIXTURE, "experiment.py")
SAVED_STEP, TOTAL_STEPS = 4, 12
# Equal losses, but for rounding: one wrong bit in a restored leaf or a changed update
# moves them far more.
RTOL = 1e-6


def continue_run(fixture_workdir: str, workdir: str):
    """Copies the run saved at SAVED_STEP and trains it on to TOTAL_STEPS, its train step
    compiled with users' fusion emitters, as jax 0.11.1 and later have only those (the
    tests' faster-compiling ones round differently); returns (TrainResult, records)."""
    shutil.copytree(fixture_workdir, workdir)
    with steps_compiled_with(USERS_FUSION):
        return train(EXPERIMENT, workdir)


def test_a_checkpoint_of_jax_0_10_2_continues_its_trajectory(tmp_path):
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        expected = json.load(f)
    assert expected["versions"]["jax"] == "0.10.2"
    _, records = continue_run(os.path.join(FIXTURE, "workdir"), str(tmp_path / "run"))
    continued = losses(records)
    steps = list(range(SAVED_STEP + 1, TOTAL_STEPS + 1))
    assert sorted(continued) == steps  # resumed at the checkpoint, not from scratch
    np.testing.assert_allclose([continued[s] for s in steps],
                               [expected["losses"][str(s)] for s in steps], rtol=RTOL)
