"""Specification of jdp.checkpoint: what a saved train state guarantees.

States are tiny pytrees shaped like the trainer's (params, BatchNorm-like model state, a
real adamw state after one update, step, PRNG key) on the 8 CPU devices of conftest.py.
"""

import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

from jdp.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    DamagedCheckpointError,
    load_arrays,
    load_params,
)
from jdp.checkpoint import checkpointer as checkpointer_module
from runs import free_port, stacks_then_kill, xla_flags

REPO_ROOT = Path(__file__).resolve().parents[1]

# A restore that fails on one array abandons the tensorstore reads of the others; when
# those are collected, their callbacks find Orbax's event loop closed. Harmless; the
# `abandoned_reads` fixture collects them before its test ends, so this filter applies.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. None[\s\S]*Event loop is closed"
    ":pytest.PytestUnraisableExceptionWarning"
)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    model_state: dict
    opt_state: optax.OptState
    rng: jax.Array


def make_params(seed: int = 0) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "Block_0": {
            "Dense_0": {
                "kernel": jax.random.normal(k1, (16, 8)),
                "bias": jax.random.normal(k2, (8,)),
            }
        },
        "head": {"kernel": jax.random.normal(k3, (8, 2))},
    }


def make_state(step: int = 7, seed: int = 0, model_state: dict | None = None) -> TrainState:
    params = make_params(seed)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    # One update, so the moments and the count are not all zeros.
    grads = jax.tree.map(lambda p: 0.1 * p, params)
    _, opt_state = tx.update(grads, opt_state, params)
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params=params,
        model_state={} if model_state is None else model_state,
        opt_state=opt_state,
        rng=jax.random.PRNGKey(seed + 100),
    )


def mesh_of(num_devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:num_devices]), ("data",))


def replicated(mesh: Mesh):
    return lambda leaf: NamedSharding(mesh, P())


def zero(mesh: Mesh):
    """ZeRO-1 style: leaves whose first axis divides over the mesh are sharded over it."""
    n = mesh.devices.size
    return lambda leaf: NamedSharding(
        mesh, P("data") if leaf.ndim and leaf.shape[0] % n == 0 else P()
    )


def placed(state, sharding_of):
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding_of(leaf)), state)


def abstract(state, sharding_of):
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_of(leaf)),
        state,
    )


def assert_same_state(actual, expected) -> None:
    """Same tree, dtypes, shapes and bits."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.dtype, a.shape) == (e.dtype, e.shape)
        assert a.tobytes() == e.tobytes(), f"{a} != {e}"


@pytest.fixture
def ckpt_dir(tmp_path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def open_checkpointer(ckpt_dir):
    """Opens Checkpointers on ckpt_dir (every step, keep all unless told) and closes them."""
    opened = []

    def open_(**options) -> Checkpointer:
        options = {"every_steps": 1, "max_to_keep": None, **options}
        checkpointer = Checkpointer(ckpt_dir, **options)
        opened.append(checkpointer)
        return checkpointer

    yield open_
    for checkpointer in opened:
        checkpointer.close()


def subprocess_env(**overrides: str) -> dict[str, str]:
    """This test process's environment (8 CPU devices), with jdp importable."""
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": python_path, **overrides}


def saved_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


# --- round trip ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_state",
    [None, {"BatchNorm_0": {"mean": jnp.arange(8.0), "var": jnp.ones(8)}}],
    ids=["no_model_state", "batch_stats"],
)
def test_round_trip_is_bitwise(open_checkpointer, model_state):
    sharding = replicated(mesh_of(8))
    state = placed(make_state(model_state=model_state), sharding)
    checkpointer = open_checkpointer()
    assert checkpointer.save(7, state)
    checkpointer.wait()
    restored = checkpointer.restore(7, abstract(state, sharding))
    assert_same_state(restored, state)
    assert isinstance(restored, TrainState)
    assert isinstance(restored.opt_state[0], optax.ScaleByAdamState)


def test_typed_prng_key_round_trips(open_checkpointer):
    sharding = replicated(mesh_of(8))
    state = placed(make_state(), sharding).replace(rng=jax.random.key(5))
    checkpointer = open_checkpointer()
    checkpointer.save(7, state)
    restored = checkpointer.restore(7, abstract(state, sharding))
    assert restored.rng.dtype == state.rng.dtype
    assert_same_state(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))


def test_async_save_is_committed_by_wait(open_checkpointer, ckpt_dir):
    checkpointer = open_checkpointer(async_save=True)
    assert checkpointer.save(5, placed(make_state(), replicated(mesh_of(8))))
    checkpointer.wait()
    assert [p.name for p in ckpt_dir.iterdir() if "tmp" in p.name] == []
    assert (ckpt_dir / "5" / "commit_success.txt").exists()
    assert checkpointer.latest_step() == 5


def _with_large_leaves(state: TrainState) -> TrainState:
    """`state` with leaves too large to be packed (saved as arrays of their own)."""
    return state.replace(model_state={"stats": {"mean": jnp.arange(40_000.0),
                                                "count": jnp.arange(64 * 1024, dtype=jnp.int32)}})


@pytest.mark.parametrize("layout", [replicated, zero], ids=["replicated", "zero"])
@pytest.mark.parametrize("large", [False, True], ids=["small_leaves", "large_leaves"])
def test_state_may_be_donated_once_save_returns(open_checkpointer, monkeypatch, layout, large):
    """Deleted while Orbax's save is held right after its last copy to the host: all of
    what Orbax does next runs on a donated state."""
    watch, held, deleted = checkpointer_module._TRANSFERS, threading.Event(), threading.Event()
    reported = watch.on_transfer_end

    def then_held(keypath):
        reported(keypath)
        if watch._done is not None and watch._done.is_set():
            held.set()
            deleted.wait(timeout=60)

    monkeypatch.setattr(watch, "on_transfer_end", then_held)
    sharding = layout(mesh_of(8))
    state = placed(_with_large_leaves(make_state()) if large else make_state(), sharding)
    expected = jax.tree.map(np.asarray, state)
    checkpointer = open_checkpointer(async_save=True)
    checkpointer.save(3, state)
    for leaf in jax.tree.leaves(state):  # what donating the state to the next step does
        leaf.delete()
    deleted.set()
    checkpointer.wait()
    assert held.is_set()
    assert_same_state(checkpointer.restore(3, abstract(expected, sharding)), expected)


def test_an_async_save_returns_before_orbaxs_bookkeeping_and_the_next_call_joins_it(
        open_checkpointer, ckpt_dir, monkeypatch):
    """The caller waits for the copy to the host only; what Orbax's save does after that
    (here held up until the test lets it go) finishes on the checkpointer's thread, and
    the next call waits for it."""
    release, held, recorded = threading.Event(), threading.Event(), threading.Event()
    record = ocp.CheckpointManager._add_checkpoint_info

    def held_up(self, *args, **kwargs):
        held.set()
        release.wait(timeout=60)  # a save that waited for it fails below after this
        record(self, *args, **kwargs)
        recorded.set()

    monkeypatch.setattr(ocp.CheckpointManager, "_add_checkpoint_info", held_up)
    sharding = replicated(mesh_of(8))
    state = placed(_with_large_leaves(make_state()), sharding)
    expected = jax.tree.map(np.asarray, state)
    checkpointer = open_checkpointer(async_save=True)
    assert checkpointer.save(4, state)
    returned_while_held = not recorded.is_set()
    for leaf in jax.tree.leaves(state):
        leaf.delete()
    assert held.wait(timeout=60), "Orbax's save never reached its bookkeeping"
    release.set()
    assert returned_while_held
    checkpointer.wait()
    assert checkpointer.latest_step() == 4
    assert_same_state(checkpointer.restore(4, abstract(expected, sharding)), expected)


def test_synchronous_save_is_complete_on_return(open_checkpointer, ckpt_dir):
    checkpointer = open_checkpointer(async_save=False)
    assert checkpointer.save(2, placed(make_state(), replicated(mesh_of(8))))
    assert saved_steps(ckpt_dir) == [2]


def test_saves_every_n_steps_or_when_forced(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(every_steps=4)
    assert [step for step in range(1, 9) if checkpointer.save(step, state)] == [4, 8]
    assert checkpointer.save(9, state, force=True)
    assert not checkpointer.save(9, state, force=True)  # already saved: not saved again
    checkpointer.wait()
    assert saved_steps(ckpt_dir) == [4, 8, 9]


def test_every_steps_zero_saves_only_when_forced(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(every_steps=0)
    assert not any(checkpointer.save(step, state) for step in range(0, 5))
    assert checkpointer.save(5, state, force=True)
    checkpointer.wait()
    assert saved_steps(ckpt_dir) == [5]


# --- which checkpoint counts ---------------------------------------------------------


def test_latest_step_is_none_without_checkpoints(open_checkpointer):
    assert open_checkpointer().latest_step() is None


KILLED_AT_COMMIT = textwrap.dedent(
    """
    import os, signal, sys

    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity

    from jdp.checkpoint import Checkpointer

    async def sigkill(self):
        os.kill(os.getpid(), signal.SIGKILL)

    checkpointer = Checkpointer(sys.argv[1], every_steps=10, max_to_keep=1)
    state = {"params": {"w": jnp.arange(128.0).reshape(16, 8)}}
    checkpointer.save(10, state)
    checkpointer.wait()
    # Killed after every array of step 20 is written, at the moment Orbax would commit it.
    atomicity.AtomicRenameTemporaryPath.finalize = sigkill
    checkpointer.save(20, state)
    checkpointer.wait()
    """
)


def test_a_save_killed_before_its_commit_does_not_count(open_checkpointer, ckpt_dir):
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT_COMMIT, str(ckpt_dir)],
        env=subprocess_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # Orbax writes under a tmp name and renames to "20" as the commit, so the kill leaves
    # only the tmp directory, and step 10 (due for deletion: max_to_keep=1) is still there.
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("_")) == [
        "10",
        "20.orbax-checkpoint-tmp",
    ]

    resumed = open_checkpointer(every_steps=10, max_to_keep=1)
    assert resumed.latest_step() == 10
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh_of(8), P()))
    restored = resumed.restore(10, {"params": {"w": w}})
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(128.0).reshape(16, 8))
    # The rerun saves step 20 again; the leftover is gone.
    assert resumed.save(20, restored)
    assert resumed.latest_step() == 20
    assert saved_steps(ckpt_dir) == [20]
    assert not (ckpt_dir / "20.orbax-checkpoint-tmp").exists()


def test_a_killed_saves_leftover_is_gone_before_orbax_lists_the_steps(open_checkpointer,
                                                                      ckpt_dir, monkeypatch):
    """Every process decides from the directory alone whether to take part in process 0's
    broadcast of the steps; a leftover removed while they look (a gs:// directory holding
    only it then stops existing) would make two processes decide differently."""
    (ckpt_dir / "20.orbax-checkpoint-tmp" / "default").mkdir(parents=True)
    (ckpt_dir / "20.orbax-checkpoint-tmp" / "default" / "shard").write_bytes(b"half")
    seen_by_orbax = []
    orbax_init = ocp.CheckpointManager.__init__

    def listing_init(self, directory, *args, **kwargs):
        seen_by_orbax.append(sorted(os.listdir(directory)))
        orbax_init(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "__init__", listing_init)
    assert open_checkpointer().latest_step() is None
    assert seen_by_orbax == [[]]


def test_max_to_keep_keeps_the_newest(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(max_to_keep=2)
    for step in range(1, 6):
        checkpointer.save(step, state)
    checkpointer.wait()
    assert saved_steps(ckpt_dir) == [4, 5]
    assert checkpointer.latest_step() == 5


def test_failed_save_deletes_nothing_and_does_not_count(open_checkpointer, ckpt_dir, monkeypatch):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(max_to_keep=1)
    checkpointer.save(1, state)
    checkpointer.wait()

    async def disk_full(self):
        raise OSError("No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    checkpointer.save(2, state)  # max_to_keep=1 makes step 1 due for deletion
    with pytest.raises(CheckpointSaveError, match=r"No space left.*intact \(steps \[1\]\)"):
        checkpointer.wait()
    monkeypatch.undo()
    checkpointer.close()

    assert saved_steps(ckpt_dir) == [1]
    resumed = open_checkpointer()
    assert resumed.latest_step() == 1
    assert_same_state(resumed.restore(1, abstract(state, replicated(mesh_of(8)))), state)


def test_keep_best_keeps_the_best_n_and_the_newest(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(max_to_keep=2, best_metric="accuracy", best_mode="max")
    for step, accuracy in zip(range(1, 6), [0.5, 0.9, None, 0.8, 0.6], strict=True):
        metrics = None if accuracy is None else {"accuracy": accuracy, "loss": 1.0}
        checkpointer.save(step, state, metrics=metrics)  # None: e.g. saved at preemption
    checkpointer.wait()
    assert saved_steps(ckpt_dir) == [2, 4, 5]  # best two, plus the newest to resume from
    checkpointer.close()

    # The metrics are read back after a restart.
    resumed = open_checkpointer(max_to_keep=2, best_metric="accuracy", best_mode="max")
    resumed.save(6, state, metrics={"accuracy": jnp.float32(0.95)})
    resumed.wait()
    assert saved_steps(ckpt_dir) == [2, 6]


def test_keep_best_in_min_mode_keeps_the_lowest(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer(max_to_keep=1, best_metric="loss", best_mode="min")
    for step, loss in zip(range(1, 5), [3.0, 1.0, 2.0, 4.0], strict=True):
        checkpointer.save(step, state, metrics={"loss": loss})
    checkpointer.wait()
    assert saved_steps(ckpt_dir) == [2, 4]


def test_keep_best_rejects_metrics_without_the_best_metric(open_checkpointer):
    checkpointer = open_checkpointer(max_to_keep=1, best_metric="accuracy")
    with pytest.raises(ValueError, match="'accuracy' is not among the metrics passed to save"):
        checkpointer.save(1, placed(make_state(), replicated(mesh_of(8))), metrics={"loss": 1.0})


# --- restoring onto another topology -------------------------------------------------


@pytest.mark.parametrize(
    "save_layout, restore_layout, restore_devices",
    [
        (replicated, replicated, 4),
        (replicated, zero, 4),
        (replicated, zero, 8),
        (zero, replicated, 8),
        (zero, zero, 4),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_restore_places_the_state_with_the_given_shardings(
    open_checkpointer, save_layout, restore_layout, restore_devices
):
    state = placed(make_state(), save_layout(mesh_of(8)))
    checkpointer = open_checkpointer()
    checkpointer.save(7, state)
    target = abstract(state, restore_layout(mesh_of(restore_devices)))
    restored = checkpointer.restore(7, target)
    assert_same_state(restored, state)
    for leaf, wanted in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert leaf.sharding == wanted.sharding
    kernel = restored.params["Block_0"]["Dense_0"]["kernel"]
    sharded = restore_layout is zero
    assert kernel.sharding.spec == (P("data") if sharded else P())
    assert len(kernel.addressable_shards) == restore_devices


def _saved_arrays(item_dir: Path) -> dict:
    """The arrays Orbax holds for a checkpoint item, by name, as plain Orbax lists them."""
    with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
        return ocp.tree.to_flat_dict(handler.metadata(item_dir).tree, sep="/")


def test_small_replicated_leaves_are_saved_together_and_read_back_in_place(open_checkpointer,
                                                                            ckpt_dir):
    # The (16, 8) kernel and its Adam moments split over 8 devices, so they stay arrays
    # of their own; every other param and moment is small and replicated, and goes into
    # a pack of its dtype (Adam's count into int32's). The step and the key are never
    # packed.
    mesh = mesh_of(8)
    state = placed(make_state(), lambda leaf: NamedSharding(
        mesh, P("data") if leaf.shape == (16, 8) else P()))
    checkpointer = open_checkpointer()
    checkpointer.save(7, state)
    checkpointer.wait()
    item_dir = ckpt_dir / "7" / "default"
    kernel = "Block_0/Dense_0/kernel"
    assert sorted(_saved_arrays(item_dir)) == sorted([
        f"params/{kernel}", f"opt_state/0/mu/{kernel}", f"opt_state/0/nu/{kernel}",
        "packed/float32", "packed/int32", "step", "rng"])
    # Read back whole (with the packs unpacked into their places), and restored onto
    # replicated shardings, both bitwise the state that was saved.
    on_disk = load_arrays(item_dir)
    expected = jax.tree.map(np.asarray, state)
    for name, leaf in ocp.tree.to_flat_dict(expected, sep="/").items():
        got = ocp.tree.to_flat_dict(on_disk, sep="/")[name]
        assert (got.dtype, got.tobytes()) == (leaf.dtype, leaf.tobytes()), name
    assert_same_state(checkpointer.restore(7, abstract(state, replicated(mesh_of(4)))), state)


def test_a_checkpoint_saved_without_packing_still_restores(ckpt_dir, open_checkpointer):
    # Saved as plain Orbax saved the state before small arrays were packed: every leaf
    # an array of its own, no index in the item's metadata.
    state = placed(make_state(), replicated(mesh_of(8)))
    with contextlib.closing(ocp.CheckpointManager(ckpt_dir)) as manager:
        manager.save(7, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
    assert "packed/float32" not in _saved_arrays(ckpt_dir / "7" / "default")
    checkpointer = open_checkpointer()
    assert_same_state(checkpointer.restore(7, abstract(state, zero(mesh_of(8)))), state)
    assert_same_state(load_params(ckpt_dir, abstract(state.params, replicated(mesh_of(2)))),
                      state.params)


# --- errors --------------------------------------------------------------------------


@pytest.fixture
def abandoned_reads():
    """For tests whose restore fails: lets the reads it left finish, and collects them."""
    yield
    time.sleep(0.2)
    gc.collect()


def save_one_checkpoint(open_checkpointer, step: int = 7) -> TrainState:
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer()
    checkpointer.save(step, state)
    checkpointer.close()
    return state


def truncate_array_data(item_dir: Path) -> None:
    for data_file in (item_dir / "d").iterdir():
        data_file.write_bytes(b"")


@pytest.mark.parametrize(
    "damage",
    [
        truncate_array_data,
        lambda item_dir: (item_dir / "manifest.ocdbt").unlink(),
        lambda item_dir: (item_dir / "_METADATA").unlink(),
    ],
    ids=["truncated_data", "missing_manifest", "missing_metadata"],
)
@pytest.mark.usefixtures("abandoned_reads")
def test_restore_of_a_damaged_checkpoint_names_it(open_checkpointer, ckpt_dir, damage):
    state = save_one_checkpoint(open_checkpointer)
    item_dir = ckpt_dir / "7" / "default"
    damage(item_dir)
    checkpointer = open_checkpointer()
    assert checkpointer.latest_step() == 7  # it claims to be complete
    with pytest.raises(DamagedCheckpointError, match="is damaged") as error:
        checkpointer.restore(7, abstract(state, replicated(mesh_of(8))))
    message = str(error.value)
    assert str(item_dir) in message and f"move {item_dir.parent} aside" in message
    assert "\n" not in message


def test_a_damaged_step_moved_aside_falls_back_to_the_previous_one(open_checkpointer, ckpt_dir):
    state = placed(make_state(), replicated(mesh_of(8)))
    checkpointer = open_checkpointer()
    checkpointer.save(5, state)
    checkpointer.save(7, state)
    checkpointer.close()
    truncate_array_data(ckpt_dir / "7" / "default")
    (ckpt_dir / "7").rename(ckpt_dir / "7.damaged")  # what the error message advises

    resumed = open_checkpointer()
    assert resumed.latest_step() == 5
    assert_same_state(resumed.restore(5, abstract(state, replicated(mesh_of(8)))), state)
    assert (ckpt_dir / "7.damaged").exists()  # kept for inspection


def test_restore_of_an_absent_step_lists_the_saved_ones(open_checkpointer):
    state = save_one_checkpoint(open_checkpointer)
    with pytest.raises(CheckpointError, match=r"No complete checkpoint for step 8 .*\[7\]"):
        open_checkpointer().restore(8, abstract(state, replicated(mesh_of(8))))


def test_restore_into_a_different_model_names_the_differences(open_checkpointer):
    save_one_checkpoint(open_checkpointer)
    other = make_state()
    other = other.replace(
        params={**other.params, "head": {"kernel": jnp.zeros((8, 3))}},
        model_state={"BatchNorm_0": {"mean": jnp.zeros(8)}},
    )
    with pytest.raises(CheckpointError) as error:
        open_checkpointer().restore(7, abstract(other, replicated(mesh_of(8))))
    message = str(error.value)
    assert "params/head/kernel is (8, 2) in the checkpoint but (8, 3) in the model" in message
    assert "missing from the checkpoint: model_state/BatchNorm_0/mean" in message
    assert "\n" not in message


def test_load_params_takes_only_the_params_of_the_newest_step(open_checkpointer, ckpt_dir):
    checkpointer = open_checkpointer()
    checkpointer.save(1, placed(make_state(seed=1), replicated(mesh_of(8))))
    checkpointer.save(2, placed(make_state(seed=2), replicated(mesh_of(8))))
    checkpointer.close()
    target = abstract(make_params(), zero(mesh_of(4)))

    params = load_params(ckpt_dir, target)
    assert_same_state(params, make_params(seed=2))
    kernel = params["Block_0"]["Dense_0"]["kernel"]
    assert kernel.sharding == target["Block_0"]["Dense_0"]["kernel"].sharding
    # A step directory names that step.
    assert_same_state(load_params(ckpt_dir / "1", target), make_params(seed=1))


def test_load_params_from_nowhere_names_the_path(tmp_path):
    target = abstract(make_params(), replicated(mesh_of(8)))
    missing = tmp_path / "no_such_run"
    with pytest.raises(CheckpointError, match="does not exist") as error:
        load_params(missing, target)
    assert str(missing) in str(error.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint") as error:
        load_params(empty, target)
    assert str(empty) in str(error.value)


def test_load_params_into_a_different_model_names_paths_and_shapes(open_checkpointer, ckpt_dir):
    save_one_checkpoint(open_checkpointer)
    params = make_params()
    params["Block_0"]["Dense_0"]["kernel"] = jnp.zeros((16, 4))
    params["Block_0"]["Dense_0"]["bias"] = jnp.zeros((4,))
    params["Block_1"] = params.pop("head")
    with pytest.raises(CheckpointError) as error:
        load_params(ckpt_dir, abstract(params, replicated(mesh_of(8))))
    message = str(error.value)
    assert str(ckpt_dir / "7" / "default") in message
    assert "params/Block_0/Dense_0/kernel is (16, 8) in the checkpoint but (16, 4)" in message
    assert "params/Block_0/Dense_0/bias is (8,) in the checkpoint but (4,)" in message
    assert "missing from the checkpoint: params/Block_1/kernel" in message
    assert "in the checkpoint but not in the model: params/head/kernel" in message
    assert "opt_state" not in message
    assert "\n" not in message


@pytest.mark.usefixtures("abandoned_reads")
def test_load_params_of_a_damaged_checkpoint_names_it(open_checkpointer, ckpt_dir):
    save_one_checkpoint(open_checkpointer)
    truncate_array_data(ckpt_dir / "7" / "default")
    with pytest.raises(DamagedCheckpointError, match="is damaged") as error:
        load_params(ckpt_dir, abstract(make_params(), replicated(mesh_of(8))))
    assert str(ckpt_dir / "7" / "default") in str(error.value)


@contextlib.contextmanager
def as_unprivileged_user():
    """Reads made inside run as an ordinary user (root reads any file, whatever its mode)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)  # nobody; the saved uid stays root, so it can be taken back
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def write_garbage(item_dir: Path) -> None:
    for name in ("_METADATA", "manifest.ocdbt"):
        (item_dir / name).write_bytes(b"this is not an Orbax checkpoint\n" * 4)


@pytest.mark.usefixtures("abandoned_reads")
@pytest.mark.parametrize("failure", ["missing_path", "permission_denied", "truncated_file",
                                     "wrong_format"])
def test_only_a_checkpoint_whose_own_files_fail_is_called_damaged(failure):
    # Under a directory every user may enter, so that an unprivileged reader gets as far
    # as the checkpoint's own files.
    root = Path(tempfile.mkdtemp(prefix="jdp-ckpt-access-"))
    try:
        root.chmod(0o755)
        ckpt_dir = root / "checkpoints"
        checkpointer = Checkpointer(ckpt_dir, every_steps=1, max_to_keep=None)
        checkpointer.save(7, placed(make_state(), replicated(mesh_of(8))))
        checkpointer.close()
        for path in [ckpt_dir, *ckpt_dir.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        item_dir = ckpt_dir / "7" / "default"
        target = ckpt_dir
        if failure == "missing_path":
            target = root / "no_such_run" / "checkpoints" / "7"
        elif failure == "permission_denied":
            (item_dir / "_METADATA").chmod(0o000)
        elif failure == "truncated_file":
            truncate_array_data(item_dir)
        else:
            write_garbage(item_dir)
        with as_unprivileged_user(), pytest.raises(CheckpointError) as error:
            load_params(target, abstract(make_params(), replicated(mesh_of(8))))
        message = str(error.value)
        damaged = isinstance(error.value, DamagedCheckpointError)
        assert damaged == (failure in ("truncated_file", "wrong_format")), message
        assert ("aside" in message) == damaged, message  # no advice to move what is readable
        assert "\n" not in message
        expected = {"missing_path": "does not exist", "permission_denied": "permission denied",
                    "truncated_file": "is damaged", "wrong_format": "is damaged"}[failure]
        assert expected in message
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- preemption ----------------------------------------------------------------------


def test_sigterm_reaches_the_preemption_point_in_a_single_process():
    from jdp.runtime.preemption import PreemptionNotice

    handler_before = signal.getsignal(signal.SIGTERM)
    notice = PreemptionNotice()
    assert not notice.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert notice.reached(2)
    notice.close()
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_ctrl_c_is_a_notice_like_sigterm_and_leaves_the_handlers_as_they_were():
    from jdp.runtime.preemption import PreemptionNotice

    handler_before = signal.getsignal(signal.SIGINT)
    notice = PreemptionNotice()
    assert not notice.reached(1)
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a notice instead
    assert notice.reached(2) and notice.interrupted
    notice.close()
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_a_second_ctrl_c_exits_at_once_with_status_130():
    code = textwrap.dedent("""
        import os, signal, sys, time
        from jdp.runtime.preemption import PreemptionNotice
        notice = PreemptionNotice()
        os.kill(os.getpid(), signal.SIGINT)
        assert notice.reached(1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # never reached: the second Ctrl-C ends the process
        sys.exit(5)
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("jdp: interrupted again")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_wall_time_saves_are_due_at_checked_steps_once_the_time_has_passed():
    from jdp.checkpoint.checkpointer import WallTimeCadence

    clock, asked = FakeClock(), []

    def agree(key, decision):
        asked.append(key)
        return decision

    cadence = WallTimeCadence(2.0, check_every_steps=5, clock=clock, agree=agree)
    assert not cadence.due(1)  # the clock starts at the first step
    clock.now += 119
    assert [cadence.due(step) for step in (2, 5)] == [False, False]  # 119 s < 120 s
    clock.now += 1
    assert not cadence.due(7)  # not a checked step
    assert cadence.due(10)
    assert [key.rsplit("/", 1)[1] for key in asked] == ["5", "10"]  # checked steps only
    assert len({key.rsplit("/", 1)[0] for key in asked}) == 1
    other = WallTimeCadence(2.0, check_every_steps=5, clock=clock, agree=agree)
    assert not other.due(1)
    clock.now += 200
    assert other.due(5) and asked[-1] != asked[0]  # another run: its own keys
    cadence.saved()
    clock.now += 60
    assert not cadence.due(15)
    clock.now += 60
    assert cadence.due(20)
    assert not WallTimeCadence(0.0, 1, clock=clock, agree=agree).due(5)  # 0: off


def test_the_checkpointer_saves_when_the_wall_time_cadence_says_so(ckpt_dir):
    from jdp.checkpoint.checkpointer import WallTimeCadence

    clock = FakeClock()
    cadence = WallTimeCadence(1.0, check_every_steps=1, clock=clock,
                              agree=lambda key, decision: decision)
    checkpointer = Checkpointer(ckpt_dir, every_steps=0, max_to_keep=None, wall_time=cadence)
    state = placed(make_state(), replicated(mesh_of(8)))
    try:
        assert not checkpointer.save(1, state)
        clock.now += 61
        assert checkpointer.save(2, state)
        assert not checkpointer.save(3, state)  # the clock restarted at the save
        clock.now += 30
        assert checkpointer.save(4, state, force=True)  # any save restarts it
        clock.now += 45
        assert not checkpointer.save(5, state)
        assert checkpointer.latest_step() == 4
    finally:
        checkpointer.close()


# --- several processes ---------------------------------------------------------------

TWO_PROCESS_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    process_id, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=60,
    )
    from jdp.checkpoint import Checkpointer
    from jdp.runtime.preemption import PreemptionNotice

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("data",))
    kernel = np.arange(128, dtype=np.float32).reshape(16, 8)
    bias = np.arange(8, dtype=np.float32)

    def global_array(value, spec):
        return jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, spec), lambda index: value[index]
        )

    # Each process holds only its 4 devices' rows of the kernel.
    state = {"params": {"kernel": global_array(kernel, P("data")),
                        "bias": global_array(bias, P())}}
    checkpointer = Checkpointer(directory, every_steps=10, max_to_keep=2)
    notice = PreemptionNotice()
    for step in range(1, 1000):
        if notice.reached(step):
            checkpointer.save(step, state, force=True)
            break
        checkpointer.save(step, state)
        if step == 3 and process_id == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to one process only
        time.sleep(0.01)
    print("stopped at", step, "latest", checkpointer.latest_step(), flush=True)
    checkpointer.close()
    jax.distributed.shutdown()
    """
)


@pytest.mark.slow
def test_two_processes_stop_at_one_step_and_save_what_one_process_restores(
    open_checkpointer, ckpt_dir
):
    env = subprocess_env(XLA_FLAGS=xla_flags(4))
    port = str(free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_PROCESS_WORKER, str(i), port, str(ckpt_dir)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    except subprocess.TimeoutExpired:
        stacks_then_kill(*workers)
        printed = [f"process {i}:\n{worker.communicate()[0][-3000:]}"
                   for i, worker in enumerate(workers)]
        pytest.fail("the two processes did not stop within 120 s; they printed\n"
                    + "\n".join(printed))
    finally:
        for worker in workers:
            worker.kill()
    stops = []
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
        stops += re.findall(r"^stopped at (\d+) latest (\d+)$", output, re.MULTILINE)
    # Both processes stopped at the same step, after the notice, and saved it.
    assert len(stops) == 2 and stops[0] == stops[1]
    stop, latest = map(int, stops[0])
    assert 3 < stop < 999 and latest == stop
    saves = [*range(10, stop, 10), stop]
    assert saved_steps(ckpt_dir) == saves[-2:]  # max_to_keep=2

    expected = {
        "params": {
            "kernel": np.arange(128, dtype=np.float32).reshape(16, 8),
            "bias": np.arange(8, dtype=np.float32),
        }
    }
    target = abstract(expected, zero(mesh_of(8)))
    restored = open_checkpointer().restore(stop, target)
    assert_same_state(restored, expected)
    assert restored["params"]["kernel"].sharding == target["params"]["kernel"].sharding
