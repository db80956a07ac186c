"""An experiment's own periodic hooks (`build_hooks(config) -> [jdp.hooks.Hook]`): they
run at exactly their steps, also across a resume; what they write reaches the writers;
the state they read is that step's; a failing hook stops the run naming it; and a hook
that reads nothing costs the loop no device read."""

import json
import textwrap

import numpy as np
import pytest

from jdp.hooks import Hook
from runs import (
    REPO,
    checkpoint_arrays,
    main_command,
    read_metrics,
    run_main,
    run_two_processes,
    train,
)

TINY = ("--config.batch_size=32", "--config.total_steps=12", "--config.warmup_steps=2",
        "--config.log_every_steps=4", "--config.eval_batch_size=32")

# A user's experiment file: the shipped ViT with hooks of its own. Each hook appends
# what it saw to hooks.jsonl in the workdir (process 0), so tests read them back.
HOOKED_EXPERIMENT = '''
    import importlib.util
    import json
    import os

    import jax
    import numpy as np

    from jdp.hooks import Hook

    _spec = importlib.util.spec_from_file_location("shipped_vit", {vit!r})
    _vit = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_vit)


    def get_config(arg=None):
        config = _vit.get_config(arg)
        config.hook_every = 3
        return config


    build_model = _vit.build_model


    def _record(info, **values):
        if info.is_writer:
            with open(os.path.join(info.workdir, "hooks.jsonl"), "a") as f:
                f.write(json.dumps({{"step": info.step, **values}}) + "\\n")


    def build_hooks(config):
        def every_n(step, info):
            _record(info, hook="every_n")

        def probe(step, info):
            state = info.state
            kernel_sum = float(np.sum(jax.device_get(state.params["head"]["kernel"])))
            _record(info, hook="probe", state_step=int(jax.device_get(state.step)),
                    kernel_sum=kernel_sum)
            info.write({{"probe/kernel_sum": kernel_sum}})

        def fragile(step, info):  # fails at step 8 while the workdir holds a FAIL_AT_8 file
            if step == 8 and os.path.exists(os.path.join(info.workdir, "FAIL_AT_8")):
                raise RuntimeError("the probe's disk is full")

        return [Hook(every_n, every=config.hook_every), Hook(probe, every=4),
                Hook(fragile, every=1)]
'''


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    path = tmp_path_factory.mktemp("experiment") / "hooked.py"
    vit = str(REPO + "/experiments/vit.py")
    path.write_text(textwrap.dedent(HOOKED_EXPERIMENT.format(vit=vit)))
    return str(path)


def hook_records(workdir, hook: str) -> list[dict]:
    with open(workdir / "hooks.jsonl") as f:
        return [r for r in map(json.loads, f) if r["hook"] == hook]


@pytest.fixture(scope="module")
def run(experiment, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, *train(experiment, workdir, *TINY)


def test_a_hook_runs_after_exactly_its_steps(run):
    workdir, _, _ = run
    assert [r["step"] for r in hook_records(workdir, "every_n")] == [3, 6, 9, 12]
    assert [r["step"] for r in hook_records(workdir, "probe")] == [4, 8, 12]


def test_a_hook_that_reads_the_state_sees_the_state_of_its_step(run):
    workdir, result, _ = run
    probes = hook_records(workdir, "probe")
    assert [r["state_step"] for r in probes] == [4, 8, 12]
    final_kernel = result.state.params["head"]["kernel"]
    np.testing.assert_allclose(probes[-1]["kernel_sum"], float(np.sum(final_kernel)), rtol=1e-6)
    # Not the same value at every step: the state moves between the hook's calls.
    assert len({r["kernel_sum"] for r in probes}) == 3


def test_what_a_hook_writes_reaches_metrics_jsonl_and_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir, _, records = run
    written = {r["step"]: r["probe/kernel_sum"] for r in records if "probe/kernel_sum" in r}
    probes = {r["step"]: r["kernel_sum"] for r in hook_records(workdir, "probe")}
    assert written == pytest.approx(probes)
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("probe/kernel_sum")}
    assert scalars == pytest.approx(probes, rel=1e-6)


def test_a_failing_hook_stops_the_run_naming_it_and_a_rerun_resumes_its_steps(experiment,
                                                                             tmp_path):
    settings = (f"--config={experiment}", f"--workdir={tmp_path}", *TINY,
                "--config.checkpoint.every_steps=6")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "FAIL_AT_8").touch()
    failed = run_main(*settings)
    assert failed.returncode == 1, failed.stderr[-3000:]
    error = [line for line in failed.stderr.splitlines() if line.startswith("jdp: error:")]
    assert len(error) == 1 and "hook build_hooks.<locals>.fragile" in error[0] \
        and "failed at step 8" in error[0] and "the probe's disk is full" in error[0], error
    assert "Traceback" not in failed.stderr
    # Nothing lost: the step-6 checkpoint and the metrics up to step 8 are there.
    assert checkpoint_arrays(tmp_path, 6)["step"] == 6
    assert 8 in {r["step"] for r in read_metrics(tmp_path)}

    (tmp_path / "FAIL_AT_8").unlink()  # the hook mended
    resumed = run_main(*settings)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Run 1 reached step 8 (hooks at 3 and 6), run 2 resumed at 6: none twice, none skipped.
    assert [r["step"] for r in hook_records(tmp_path, "every_n")] == [3, 6, 9, 12]


def test_a_hook_that_reads_nothing_adds_no_device_read(experiment, tmp_path, monkeypatch):
    """The loop reads device values only for its own reports (one step late) and saves;
    a hook run after every step adds none of those reads unless it asks for the state."""
    import jdp.experiment.loader as loader_lib
    from jdp.parallel.backends import Backend

    reads = {"fetch": 0, "to_global": 0}
    fetch, to_global = Backend.fetch, Backend.to_global

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            reads[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    def counts(hooks, workdir) -> dict:
        reads.update(fetch=0, to_global=0)
        with monkeypatch.context() as patch:
            patch.setattr(Backend, "fetch", counted("fetch", fetch))
            patch.setattr(Backend, "to_global", counted("to_global", to_global))
            original_load = loader_lib.load
            patch.setattr(loader_lib, "load", lambda path: _with_hooks(original_load(path), hooks))
            train(experiment, workdir, *TINY)
        return dict(reads)

    silent = Hook(lambda step, info: None, every=1)
    reader = Hook(lambda step, info: info.state, every=1)
    baseline = counts([], tmp_path / "none")
    assert counts([silent], tmp_path / "silent") == baseline
    assert counts([reader], tmp_path / "reader")["to_global"] == baseline["to_global"] + 12


def _with_hooks(experiment, hooks):
    import dataclasses

    return dataclasses.replace(experiment, build_hooks=lambda config: hooks)


@pytest.mark.slow
def test_hooks_that_issue_collectives_run_alike_on_two_processes(experiment, tmp_path):
    """A hook may issue a collective: every process runs it at the same steps."""
    collective = tmp_path / "collective.py"
    collective.write_text(textwrap.dedent(f'''
        import json, os
        import numpy as np
        from jax.experimental import multihost_utils
        from jdp.hooks import Hook

        exec(open({experiment!r}).read())

        def build_hooks(config):
            def gather(step, info):
                steps = multihost_utils.process_allgather(np.array([step]))
                with open(os.path.join(info.workdir, f"gather_{{os.environ['JDP_PROCESS_ID']}}"),
                          "a") as f:
                    f.write(json.dumps(np.asarray(steps).ravel().tolist()) + "\\n")
            return [Hook(gather, every=4)]
    '''))
    launched = run_two_processes(main_command(f"--config={collective}",
                                              f"--workdir={tmp_path / 'run'}", *TINY))
    assert launched.returncode == 0, launched.stderr[-3000:]
    for process in (0, 1):
        lines = (tmp_path / "run" / f"gather_{process}").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [[4, 4], [8, 8], [12, 12]]
