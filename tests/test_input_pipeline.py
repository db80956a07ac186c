"""The input pipeline around the sampler. Worker processes (`data.num_workers`) prepare
exactly the batches threads prepare, from any step; they survive a SIGTERM meant for the
trainer, never outlive it, and what cannot be sent to them fails before training with one
line naming the field. A data's `device_preprocess` decides what the model is initialised
and traced with, and its mistakes are named before training."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jdp.data import images, streamed
from jdp.errors import ConfigError
from jdp.experiment import components, loader
from runs import REPO, load_config, main_env, wait_for

NUM_EXAMPLES = 40
# Padded random crops and flips: batches depend on the per-example generator too.
SPEC = images.ImageSpec(8, 3, (0.5,) * 3, (0.25,) * 3, crop_padding=2, flip=True)


def source():
    rng = np.random.default_rng(0)
    return [{"image": rng.integers(0, 256, (8, 8, 3), np.uint8), "label": i}
            for i in range(NUM_EXAMPLES)]


def train_batches(num_workers, start_step, num_steps, rows=slice(0, 8)):
    stream = streamed.example_stream(
        source(), images.make_preprocess(SPEC, train=True, augment=True), seed=7)
    batches = streamed.train_batches(stream, global_batch_size=8, rows=rows,
                                     start_step=start_step, num_steps=num_steps,
                                     num_threads=2, num_workers=num_workers)
    try:
        return list(batches)
    finally:
        batches.close()


def assert_same_batches(batches, reference):
    assert len(batches) == len(reference)
    for batch, ref in zip(batches, reference, strict=True):
        assert sorted(batch) == sorted(ref)
        for key in ref:
            assert batch[key].dtype == ref[key].dtype
            np.testing.assert_array_equal(batch[key], ref[key], err_msg=key)


def test_0_1_and_4_workers_give_bitwise_the_same_batches_from_a_middle_step():
    from_start = train_batches(0, start_step=0, num_steps=6)
    threads = train_batches(0, start_step=3, num_steps=3)
    assert_same_batches(threads, from_start[3:])
    assert threads[0]["image"].dtype == np.uint8
    for num_workers in (1, 4):  # 4 workers for 3 batches: one gets none
        assert_same_batches(train_batches(num_workers, start_step=3, num_steps=3), threads)


def test_closing_the_workers_frees_the_shared_memory_of_every_batch(monkeypatch):
    """Workers hand batches over in shared memory; grain kept the last one of each worker
    alive past close(), and Python warned at exit of "leaked shared_memory objects"."""
    from multiprocessing import shared_memory

    received = []  # the segments this process attached to: every batch handed over
    attach = shared_memory.SharedMemory.__init__

    def recording(self, name=None, create=False, size=0):
        attach(self, name, create, size)
        if not create:
            received.append(self.name)

    monkeypatch.setattr(shared_memory.SharedMemory, "__init__", recording)
    assert len(train_batches(2, start_step=0, num_steps=4)) == 4  # closed when it returns
    assert len(received) >= 4  # each batch's images at least (grain sends small arrays inline)

    def still_there() -> list[str]:
        return [name for name in received if os.path.exists(f"/dev/shm/{name}")]

    wait_for(lambda: not still_there(), 10, "the batches' shared memory to be unlinked")


def test_workers_give_the_same_eval_batches_padding_and_mask_included():
    preprocess = images.make_preprocess(SPEC, train=False, augment=False)

    def eval_batches(num_workers):
        return list(streamed.eval_batches(source()[:20], preprocess, global_batch_size=8,
                                          rows=slice(4, 8), num_workers=num_workers))

    threads = eval_batches(0)
    assert [b["mask"].tolist() for b in threads] == [[1] * 4, [1] * 4, [0] * 4]
    assert_same_batches(eval_batches(2), threads)


def worker_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def test_a_sigterm_to_the_workers_is_left_to_the_trainer_and_close_stops_them():
    """A preemption notice sent to the whole process group: the workers keep preparing
    batches (the trainer needs them to reach its preemption save)."""
    before = worker_pids()
    stream = streamed.example_stream(
        source(), images.make_preprocess(SPEC, train=True, augment=True), seed=7)
    batches = streamed.train_batches(stream, global_batch_size=8, rows=slice(0, 8),
                                     start_step=0, num_steps=50, num_workers=2)
    first = [next(batches) for _ in range(2)]  # one from each worker: both have started
    workers = worker_pids() - before
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    rest = [next(batches) for _ in range(10)]  # a dead worker would raise here
    assert first[0]["image"].shape == rest[-1]["image"].shape == (8, 8, 8, 3)
    batches.close()
    assert not worker_pids() & workers


ORPHAN = """
import os, sys
import numpy as np
from jdp.data import streamed
source = [{"x": np.float32(i)} for i in range(10)]
stream = streamed.example_stream(source, lambda example, rng: example, seed=0)
batches = streamed.train_batches(stream, global_batch_size=2, rows=slice(0, 2), start_step=0,
                                 num_steps=10**6, num_workers=1)
next(batches)
import multiprocessing
print(*[p.pid for p in multiprocessing.active_children()], flush=True)
os._exit(0)  # as the watchdog ends a stuck trainer: no cleanup at all
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_of_a_trainer_that_died_without_cleanup_exit_by_themselves():
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=REPO, env=main_env(1),
                            stdout=subprocess.PIPE, text=True)
    with proc.stdout:  # read, not communicate(): an orphan would hold the pipe open
        pids = [int(pid) for pid in proc.stdout.readline().split()]
    assert proc.wait(timeout=120) == 0
    assert pids
    try:
        wait_for(lambda: not any(map(_running, pids)), 10, "the orphaned worker to exit")
    finally:
        for pid in filter(_running, pids):
            os.kill(pid, signal.SIGKILL)


USER_EXPERIMENT = '''
    import threading

    import flax.linen as nn
    import numpy as np

    from jdp.config import defaults
    from jdp.data import Data

    def get_config(arg=None):
        config = defaults()
        config.data.num_workers = 2
        config.mistake = arg or ""
        return config

    class Source:
        def __len__(self):
            return 8
        def __getitem__(self, index):
            return {"image": np.full((4,), index, np.float32), "label": np.int32(index % 2)}

    def double(example, rng):  # a function of this file: sent to the workers by value
        return {"image": 2 * example["image"], "label": example["label"]}

    def to_float(batch):  # on the device: "raw" uint8 -> the model's "image"
        return {"image": batch["raw"].astype(np.float32) / 255, "label": batch["label"]}

    def build_data(config):
        if config.mistake in ("device", "device_key"):
            def preprocess(example, rng):
                return {"raw": example["image"].astype(np.uint8), "label": example["label"]}

            device = to_float if config.mistake == "device" else lambda batch: batch["pixels"]
            return Data(train=Source(), eval=Source(), preprocess=preprocess, num_classes=2,
                        device_preprocess=device)
        if config.mistake == "lock":
            lock = threading.Lock()

            def preprocess(example, rng):
                with lock:
                    return double(example, rng)

            return Data(train=Source(), eval=Source(), preprocess=preprocess, num_classes=2)
        return Data(train=Source(), eval=Source(), preprocess=double, num_classes=2)

    class Model(nn.Module):
        num_classes: int

        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(self.num_classes)(x)

    def build_model(config, *, num_classes):
        return Model(num_classes)
'''


@pytest.fixture
def experiment_file(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(textwrap.dedent(USER_EXPERIMENT))
    return str(path)


def test_a_preprocess_that_cannot_be_pickled_fails_before_training_naming_the_field(
        experiment_file):
    config = load_config(f"{experiment_file}:lock")
    with pytest.raises(ConfigError, match=r"config\.data\.num_workers=2: the preprocess of "
                       r"build_data\(\) in .*user\.py cannot be sent to worker processes "
                       r"\(TypeError: .*lock.*Fix: .*--config\.data\.num_workers=0"):
        components.build(loader.load(experiment_file), config)


def test_the_experiment_files_own_preprocess_runs_in_the_workers(experiment_file):
    config = load_config(experiment_file)
    data = components.build(loader.load(experiment_file), config).data
    stream = streamed.example_stream(data.train, data.preprocess, seed=0)
    batches = streamed.train_batches(stream, global_batch_size=8, rows=slice(0, 8),
                                     start_step=0, num_steps=1, num_workers=1)
    try:
        images_ = next(batches)["image"]
    finally:
        batches.close()
    assert sorted(images_[:, 0].tolist()) == [2.0 * i for i in range(8)]


def test_the_model_is_initialised_with_what_device_preprocess_returns(experiment_file):
    parts = components.build(loader.load(experiment_file),
                             load_config(f"{experiment_file}:device"))
    assert parts.sample["raw"].dtype == np.uint8  # what the host ships
    (inputs,) = parts.sample_inputs()
    assert inputs.dtype == np.float32 and inputs.shape == (1, 4)


def test_a_device_preprocess_reading_a_missing_feature_is_named_before_training(
        experiment_file):
    with pytest.raises(ConfigError, match=r"the device_preprocess of build_data\(\) in "
                       r".*user\.py failed .*\['label', 'raw'\].*KeyError: 'pixels'.*Fix:"):
        components.build(loader.load(experiment_file),
                         load_config(f"{experiment_file}:device_key"))
