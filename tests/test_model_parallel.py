"""A model axis beside the data axes (`parallel.model_parallel`): the GPT default and a ViT
train one float32 trajectory as data x model = 8x1, 4x2 and 2x4, with FSDP, with gradient
accumulation and on 2 processes; the compiled step's collectives are Megatron's (4
all-reduces a layer over the model axis, the gradients reduced over the data axes
only); a device holds 1/M of each split param and fewer temporaries; a run saved at 4x2
resumes at 8x1 and 2x4; a user's Linen or NNX model opts in with its names and rules;
the dry run and the tuner know the axis; every bad input fails in one line."""

import json
import shutil
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_text_lm import GPT, settings, write_corpus

from jdp import config as config_lib
from jdp import main as jdp_main
from jdp.dryrun import estimate, hlo
from jdp.errors import ConfigError
from jdp.experiment import adapters, components, loader, partitioning
from jdp.models import axes
from jdp.models.transformer import Transformer
from jdp.parallel import mesh as mesh_lib
from jdp.parallel.reducers import GRADIENT_SCOPE
from jdp.tune import result, space
from jdp.tune.search import Options, tune
from runs import (
    assert_same_trajectory,
    checkpoint_arrays,
    compiled_step,
    load_config,
    losses,
    main_command,
    read_metrics,
    run_main,
    run_two_processes,
    train,
)

VIT = "experiments/vit.py"
VIT_STEPS = ("--config.total_steps=12", "--config.warmup_steps=2", "--config.log_every_steps=3",
             "--config.eval_every_steps=0", "--config.batch_size=64")
# The byte tokenizer's 257 ids padded to a multiple of 8: every model_parallel splits it.
PADDED_VOCAB = "264"
# data x model on 8 devices -> the overrides (the reference is 8x1).
LAYOUTS = {
    "8x1": (),
    "4x2": ("--config.parallel.model_parallel=2",),
    "2x4": ("--config.parallel.model_parallel=4",),
    "4x2_fsdp": ("--config.parallel.model_parallel=2", "--config.parallel.shard_params=true"),
    "2x4_accum4": ("--config.parallel.model_parallel=4", "--config.grad_accum_steps=4"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def experiment_settings(experiment: str, corpus: str) -> tuple[str, ...]:
    if experiment == GPT:  # the default GPT's block (rotary, tied head), nano-sized
        return settings(corpus, **{"model.vocab_size": PADDED_VOCAB})
    return VIT_STEPS


@pytest.fixture(scope="module")
def layout_runs(corpus, tmp_path_factory):
    """(experiment, layout) -> (workdir, its run), each trained once; checkpoints at 6."""
    done = {}

    def run(experiment: str, layout: str):
        if (experiment, layout) not in done:
            workdir = tmp_path_factory.mktemp(layout)
            done[experiment, layout] = workdir, train(
                experiment, workdir, *experiment_settings(experiment, corpus),
                *LAYOUTS[layout], "--config.checkpoint.every_steps=6")
        return done[experiment, layout]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "8x1"])
@pytest.mark.parametrize("experiment", [GPT, VIT], ids=["gpt", "vit"])
def test_a_model_axis_follows_the_data_parallel_trajectory(layout_runs, experiment, layout):
    _, run = layout_runs(experiment, layout)
    _, reference = layout_runs(experiment, "8x1")
    assert_same_trajectory(run, reference)
    assert losses(reference[1])[12] < losses(reference[1])[3]  # the trajectory moved


@pytest.mark.slow
@pytest.mark.parametrize("devices, overrides", [
    # Each process a host of data 2 x model 2, the state split further over the 2 data
    # devices of each host (FSDP inside hosts).
    (4, ("--config.parallel.model_parallel=2", "--config.parallel.shard_params=host")),
    # One host of both processes (as with one process per GPU): the model group of 4
    # spans the processes, which both feed the batch's rows.
    (2, ("--config.parallel.model_parallel=4", "--config.parallel.hosts=1")),
], ids=["hybrid_fsdp", "a_model_group_across_processes"])
def test_two_processes_with_a_model_axis_follow_one_process(layout_runs, tmp_path, devices,
                                                            overrides):
    _, (reference_result, reference) = layout_runs(VIT, "8x1")
    proc = run_two_processes(main_command(
        f"--config={VIT}", f"--workdir={tmp_path}", *VIT_STEPS, *overrides,
        "--config.checkpoint.every_steps=12"), devices, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"'model': {overrides[0][-1]}" in proc.stderr  # the mesh as logged
    got, expected = losses(read_metrics(tmp_path)), losses(reference)
    assert sorted(got) == sorted(expected) == [3, 6, 9, 12]
    np.testing.assert_allclose([got[s] for s in (3, 6, 9, 12)],
                               [expected[s] for s in (3, 6, 9, 12)], rtol=1e-5)
    saved = checkpoint_arrays(tmp_path, 12)["params"]
    for (path, leaf), ref in zip(jax.tree_util.tree_flatten_with_path(saved)[0],
                                 jax.tree.leaves(jax.device_get(reference_result.state.params)),
                                 strict=True):
        if "['key']['bias']" not in jax.tree_util.keystr(path):  # see runs.assert_same_trajectory
            np.testing.assert_allclose(leaf, ref, rtol=1e-5, atol=1e-6)


# -- the compiled step ------------------------------------------------------------------

GPT_SHAPES = ("--config.data.tokenizer=bytes", "--config.data.seq_len=32",
              "--config.data.eval_fraction=0.3", "--config.model.size=nano",
              f"--config.model.vocab_size={PADDED_VOCAB}", "--config.eval.sample_prompt=")
PER_REPLICA = 4  # sequences each data replica computes on, at every model_parallel


@pytest.fixture(scope="module")
def gpt_steps(corpus, tmp_path_factory):
    """model_parallel -> (backend, abstract state, compiled GPT step) on 8 devices, each
    data replica computing on PER_REPLICA sequences, from shapes."""
    token_dir = tmp_path_factory.mktemp("tokens")
    common = (*GPT_SHAPES, f"--config.data.text_files={corpus}",
              f"--config.data.token_dir={token_dir}")
    return {m: compiled_step(GPT, *common, f"--config.parallel.model_parallel={m}",
                             global_batch_size=PER_REPLICA * 8 // m) for m in (1, 2, 4)}


@pytest.fixture(scope="module")
def vit_step():
    return compiled_step(VIT, "--config.parallel.model_parallel=2", global_batch_size=64)


def _per_layer_model_all_reduces(compiled, mesh, block: str, num_layers: int) -> list[int]:
    replica_of = mesh_lib.data_replica_of(mesh)
    ops = [op for op in hlo.collectives(compiled.as_text())
           if op.kind == "all-reduce" and estimate.over_model_axis(op, replica_of)]
    return [sum(f"{block}_{i}/" in op.op_name for op in ops) for i in range(num_layers)]


@pytest.mark.parametrize("model", ["gpt", "vit"])
def test_each_layer_all_reduces_over_the_model_axis_twice_forward_and_twice_backward(
        model, gpt_steps, vit_step):
    """Megatron-LM's pattern at 4x2: the sums of the row-parallel attention output and MLP
    output forward, of the column-parallel projections' input gradients backward."""
    backend, _, compiled = gpt_steps[2] if model == "gpt" else vit_step
    block = "decoder_block" if model == "gpt" else "encoder_block"
    assert _per_layer_model_all_reduces(compiled, backend.mesh, block, 2) == [4, 4]


@pytest.mark.parametrize("model", ["gpt", "vit"])
def test_the_gradients_reduce_once_over_the_data_axes_only(model, gpt_steps, vit_step):
    backend, state, compiled = gpt_steps[2] if model == "gpt" else vit_step
    replica_of = mesh_lib.data_replica_of(backend.mesh)
    ops = hlo.collectives(compiled.as_text())
    gradient = [op for op in ops if GRADIENT_SCOPE in op.op_name]
    assert [op.kind for op in gradient] == ["all-reduce"] and not gradient[0].in_loop
    # Each group: the 4 devices of one model position (position % 2), one per data replica.
    assert sorted(gradient[0].replica_groups) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    # It carries each device's model shard of every gradient, and nothing else but the
    # metric sums (a few floats).
    shard_values = sum(mesh_lib.device_bytes(leaf) // leaf.dtype.itemsize
                       for leaf in jax.tree.leaves(state.params))
    assert 0 < gradient[0].bytes - 4 * shard_values < 64
    # Every other collective stays inside a model group.
    assert all(estimate.over_model_axis(op, replica_of) for op in ops if op not in gradient)


def test_a_device_holds_one_mth_of_each_split_param_and_all_of_the_rest(gpt_steps):
    _, replicated, _ = gpt_steps[1]
    for model_parallel in (2, 4):
        _, state, _ = gpt_steps[model_parallel]
        split = {}
        for (path, leaf), whole in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                                       jax.tree.leaves(replicated.params), strict=True):
            name = jax.tree_util.keystr(path)
            split[name] = mesh_lib.splits_over_model(leaf.sharding.spec)
            whole_bytes = mesh_lib.device_bytes(whole)  # replicated at model_parallel=1
            expected = whole_bytes // model_parallel if split[name] else whole_bytes
            assert mesh_lib.device_bytes(leaf) == expected, name
        # What is split: the heads of q, k, v and out, the MLP's units, the vocabulary.
        assert {name for name, is_split in split.items() if is_split} == {
            name for name in split if any(part in name for part in (
                "['query']", "['key']", "['value']", "['out']['kernel']",
                "['Dense_0']", "['Dense_1']['kernel']", "['token_embedding']"))}


def test_the_step_needs_fewer_temporaries_as_the_model_axis_grows(gpt_steps):
    """At the same sequences per data replica, the activations of the split layers (the
    heads' attention, the MLP's units, the logits) shrink with M; the residual stream's
    do not. Measured (nano GPT, 4 x 32 tokens a replica): 2.46, 1.57, 1.12 MB."""
    temps = [gpt_steps[m][2].memory_analysis().temp_size_in_bytes for m in (1, 2, 4)]
    assert temps[0] > temps[1] > temps[2], temps


# -- resume on another mesh ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["4x2", "8x1", "2x4"])
def test_a_run_saved_at_4x2_resumes_on_another_mesh(layout_runs, layout, tmp_path):
    """The checkpoint holds global arrays: at 4x2 again the losses are bitwise the
    uninterrupted run's; at 8x1 and 2x4 the arithmetic differs at float32 rounding."""
    whole_dir, (_, whole) = layout_runs(VIT, "4x2")
    workdir = tmp_path / "resumed"
    shutil.copytree(whole_dir / "checkpoints" / "6", workdir / "checkpoints" / "6")
    shutil.copy(whole_dir / "config.json", workdir / "config.json")
    _, records = train(VIT, workdir, *VIT_STEPS, *LAYOUTS[layout],
                       "--config.checkpoint.every_steps=6")
    resumed, expected = losses(records), losses(whole)
    assert sorted(resumed) == [9, 12]
    if layout == "4x2":
        assert resumed == {step: expected[step] for step in (9, 12)}
    else:
        np.testing.assert_allclose([resumed[9], resumed[12]], [expected[9], expected[12]],
                                   rtol=1e-6)


# -- a user's own model -------------------------------------------------------------------

# Digits through an MLP whose hidden units the model axis splits, as the user names them.
USER_CONFIG = '''
    from jdp.config import defaults


    def get_config(arg=None):
        config = defaults()
        config.batch_size = 64
        config.learning_rate = 3e-3
        return config


    def axis_rules(config):
        return [("hidden", "model"), ("pixels", None)]
'''
USER_MODELS = {"linen": '''
    import flax.linen as nn


    class MLP(nn.Module):
        num_classes: int

        @nn.compact
        def __call__(self, images, train):
            x = images.reshape(images.shape[0], -1)
            x = nn.Dense(64, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("pixels", "hidden")))(x)
            return nn.Dense(self.num_classes, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("hidden", None)))(nn.relu(x))


    def build_model(config, *, num_classes):
        return MLP(num_classes)
''', "nnx": '''
    from flax import nnx


    class MLP(nnx.Module):
        def __init__(self, num_classes, rngs):
            init = nnx.initializers.lecun_normal()
            self.hidden = nnx.Linear(64, 64, rngs=rngs,
                                     kernel_init=nnx.with_partitioning(init, ("pixels", "hidden")))
            self.out = nnx.Linear(64, num_classes, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, ("hidden", None)))

        def __call__(self, images):
            return self.out(nnx.relu(self.hidden(images.reshape(images.shape[0], -1))))


    def build_model(config, *, num_classes, rngs):
        return MLP(num_classes, rngs)
'''}


@pytest.mark.slow
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_users_model_opts_in_with_its_names_and_rules(api, tmp_path):
    experiment = tmp_path / f"named_{api}_mlp.py"
    experiment.write_text(textwrap.dedent(USER_MODELS[api]) + textwrap.dedent(USER_CONFIG))
    experiment = str(experiment)
    steps = ("--config.total_steps=12", "--config.warmup_steps=2",
             "--config.log_every_steps=3", "--config.eval_every_steps=0")
    reference = train(experiment, tmp_path / "8x1", *steps)
    split = train(experiment, tmp_path / "4x2", *steps, "--config.parallel.model_parallel=2")
    assert_same_trajectory(split, reference)
    hidden = split[0].state.params["hidden" if api == "nnx" else "Dense_0"]["kernel"]
    assert hidden.sharding.spec == P(None, "model")


# -- the plan and the tuner ---------------------------------------------------------------


def test_the_dry_run_plans_the_model_axis(capsys):
    plan = jdp_main.run(load_config(VIT, "--config.parallel.model_parallel=2"), VIT,
                        "/nonexistent/never-written", dry_run=True)
    text = capsys.readouterr().out
    assert "mesh hosts=1, local=4, model=2" in text
    assert "4 data-parallel x 32 per device (each row on the 2 devices of its model group)" \
        in text
    assert "Model axis: groups of 2 devices" in text and "sent per device" in text
    inputs = plan.inputs
    # The gradient all-reduce carries what the plan expects: a device's model shard.
    gradients = estimate.gradient_all_reduce_bytes(inputs.collectives) - inputs.metric_bytes
    assert gradients == 4 * inputs.reduced_param_count < 4 * inputs.num_params
    model_ops = [c for c in inputs.collectives
                 if estimate.over_model_axis(c, inputs.data_replica_of)]
    assert len(model_ops) >= 4 * 2  # the per-layer all-reduces of the 2 layers, and more


def test_the_tuner_searches_model_parallel_inside_a_host():
    config = load_config(VIT)
    one_host = space.search_space(config, ("model_parallel",), space.Topology(8, 1, 1), False)
    assert one_host == [{"parallel.model_parallel": m} for m in (1, 2, 4, 8)]
    two_hosts = space.search_space(config, ("model_parallel",), space.Topology(8, 2, 2), False)
    assert two_hosts == [{"parallel.model_parallel": m} for m in (1, 2, 4)]


@pytest.mark.slow
def test_the_tuner_times_each_model_parallel_and_its_winner_keeps_the_trajectory(
        layout_runs, tmp_path):
    outcome = tune(load_config(VIT, *VIT_STEPS), VIT, str(tmp_path / "tune"),
                   Options(trial_steps=4, knobs=("model_parallel",)))
    by_m = {row.candidate.overrides["parallel.model_parallel"]: row for row in outcome.rows}
    assert sorted(by_m) == [1, 2, 4, 8]
    assert all(by_m[m].rate > 0 for m in (1, 2, 4))
    # 8 does not divide the ViT's 4 heads: refused in its compile, named in the table.
    assert by_m[8].status.startswith("not compiled: failed (ConfigError")
    assert "'heads'" in by_m[8].status
    saved = json.loads((tmp_path / "tune" / result.TUNE_FILE).read_text())
    assert saved["searched_keys"] == ["parallel.model_parallel"]
    tuned = train(VIT, tmp_path / "tuned", *VIT_STEPS,
                  f"--config.tune={tmp_path / 'tune' / result.TUNE_FILE}")
    assert_same_trajectory(tuned, layout_runs(VIT, "8x1")[1])


# -- bad input: one line naming the field and the fix ------------------------------------


@pytest.mark.parametrize("overrides, devices, processes, words", [
    (("--config.parallel.model_parallel=3",), 8, 1, "must divide the 8 devices of a host"),
    (("--config.parallel.model_parallel=4", "--config.parallel.hosts=4"), 8, 1,
     "must divide the 2 devices of a host"),
    (("--config.parallel.model_parallel=2", "--config.parallel.backend=pmap"), 8, 1,
     "--config.parallel.backend=pjit"),
    (("--config.parallel.model_parallel=2", "--config.parallel.hosts=2",
      "--config.parallel.reduction=two_level", "--config.parallel.cross_host_reduce=int8"),
     8, 1, "cross_host_reduce=float32"),
    (("--config.parallel.model_parallel=2", "--config.batch_size=6"), 8, 1,
     "data-parallel device count (8 devices / model_parallel 2 = 4)"),
    (("--config.parallel.model_parallel=0",), 8, 1, "whole number >= 1"),
], ids=["not_dividing", "not_dividing_a_host", "pmap", "compressed", "batch", "zero"])
def test_a_bad_model_axis_setting_is_refused_in_one_line(overrides, devices, processes, words):
    with pytest.raises(ConfigError, match="config.parallel.|config.batch_size") as error:
        config_lib.validate(load_config(VIT, *overrides), devices, processes)
    assert words in str(error.value) and "Fix:" in str(error.value)
    assert "\n" not in str(error.value)


def test_heads_the_model_axis_does_not_divide_are_named_with_the_fix():
    config = load_config(VIT, "--config.parallel.model_parallel=8")
    with pytest.raises(ConfigError, match=r"does not divide the 'heads' dimension \(4\).*Fix: "
                                          r"make num_heads a multiple of 8"):
        components.build(loader.load(VIT), config)


def test_an_mlp_width_the_model_axis_does_not_divide_is_named_with_the_fix():
    model = adapters.from_linen(Transformer(vocab_size=16, max_len=8, hidden_size=8,
                                            num_layers=1, num_heads=4, mlp_dim=6))
    inputs = (np.zeros((1, 8), np.int32),)
    with pytest.raises(ConfigError, match=r"'mlp' dimension \(6\).*make mlp_dim a multiple "
                                          r"of 4 \(e.g. 8\)"):
        partitioning.check_model(model, inputs, axes.RULES, 4)


def test_a_vocabulary_the_model_axis_does_not_divide_is_refused_naming_the_padding(corpus,
                                                                                   tmp_path):
    config = load_config(GPT, *settings(corpus), "--config.parallel.model_parallel=2",
                         f"--config.data.token_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"'vocab' dimension \(257\).*--config.model."
                                          r"vocab_size.*\(e.g. 258\)"):
        components.build(loader.load(GPT), config)


def test_a_model_without_axis_names_is_refused_at_start(tmp_path):
    workdir = tmp_path / "run"
    proc = run_main("--config=experiments/resnet.py", f"--workdir={workdir}",
                    "--config.parallel.model_parallel=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jdp: error:") and "name no logical axes" in last
    assert "axis_rules" in last and "Traceback" not in proc.stderr
    assert not workdir.exists()


def test_a_rule_naming_another_mesh_axis_is_refused():
    with pytest.raises(ConfigError, match=r"\('mlp', 'data'\) is not a rule"):
        partitioning.check_rules([("heads", "model"), ("mlp", "data")])
