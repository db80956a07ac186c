"""Properties of the compiled train step, read from XLA: one gradient all-reduce per
optimizer step, its dtype, ZeRO-1 memory, remat memory."""

import gc

import jax
import numpy as np
import optax
import pytest

from jdp.dryrun import hlo
from jdp.experiment import adapters
from jdp.models import ViT
from jdp.parallel import StepOptions, compiler_options, make_backend
from jdp.parallel.mesh import make_mesh
from jdp.task import classification
from runs import compiled_from_shapes, compiled_step, device_bytes, lowered_step

VIT = "experiments/vit.py"


@pytest.mark.parametrize("backend", ["pjit", "pmap"])
def test_accumulation_issues_one_gradient_all_reduce_outside_any_loop(backend):
    _, state, compiled = compiled_step(VIT, f"--config.parallel.backend={backend}",
                                       "--config.grad_accum_steps=4")
    reduces = hlo.all_reduces(compiled.as_text())
    assert len(reduces) == 1, reduces
    assert not reduces[0].in_loop
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert reduces[0].bytes >= param_bytes  # every gradient travels in it


def test_hlo_reader_sees_an_all_reduce_inside_a_loop():
    # The reader itself: a reduction per scan iteration must be reported as in a loop.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    @jax.jit
    def per_iteration_reduce(x):
        def body(carry, row):
            return carry + jax.lax.psum(row, "data"), None
        f = jax.shard_map(lambda x: jax.lax.scan(body, 0.0 * x[0], x)[0], mesh=mesh,
                          in_specs=jax.P("data"), out_specs=jax.P(), check_vma=False)
        return f(x)

    text = per_iteration_reduce.lower(np.ones((128, 4), np.float32)).compile().as_text()
    assert [r.in_loop for r in hlo.all_reduces(text)] == [True]


def test_fused_psum_sums_each_leaf_as_its_own_psum_in_one_all_reduce_per_buffer():
    """The CPU reduction's packing (reducers.fused_psum): mixed dtypes, a scalar, a leaf
    larger than a bucket; bitwise the sums of per-leaf psums, with an all-reduce per
    (dtype, bucket) instead of one operand per leaf."""
    from jdp.parallel.reducers import fused_psum

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(8, 3, 5)).astype(np.float32),
            "b": rng.normal(size=(8,)).astype(np.float32),  # a scalar on each device
            "c": rng.normal(size=(8, 32)).astype(jax.numpy.bfloat16),
            "d": rng.normal(size=(8, 40)).astype(np.float32),
            "e": rng.normal(size=(8, 2, 2)).astype(jax.numpy.bfloat16)}

    def program(psum):
        def device(t):
            return psum(jax.tree.map(lambda x: x[0], t))
        return jax.jit(jax.shard_map(device, mesh=mesh, in_specs=jax.P("data"),
                                     out_specs=jax.P(), check_vma=False))

    reference = program(lambda t: jax.lax.psum(t, "data"))
    # 100 bytes a bucket: a + b (64 bytes) share one, d (160 bytes) is one alone, and
    # c + e (72 bytes) travel in bfloat16.
    fused = program(lambda t: fused_psum(t, "data", bucket_bytes=100))
    expected, got = reference(tree), fused(tree)
    for name in tree:
        assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape
        np.testing.assert_array_equal(np.asarray(got[name], np.float32),
                                      np.asarray(expected[name], np.float32), err_msg=name)
    lowered = fused.lower(tree).as_text(dialect="hlo")
    reduces = hlo.all_reduces(lowered)
    assert sorted(r.bytes for r in reduces) == [64, 72, 160], reduces
    assert len(hlo.all_reduces(reference.lower(tree).as_text(dialect="hlo"))) == len(tree)


def _gradient_reduce_bytes(lowered_text):
    return sum(r.bytes for r in hlo.all_reduces(lowered_text))


def test_bfloat16_gradient_reduction_halves_the_all_reduce_bytes():
    texts = {}
    for dtype in ("float32", "bfloat16"):
        _, _, lowered = lowered_step(VIT, f"--config.parallel.grad_reduce_dtype={dtype}")
        texts[dtype] = lowered.as_text(dialect="hlo")
    f32, bf16 = (_gradient_reduce_bytes(texts[d]) for d in ("float32", "bfloat16"))
    metrics_bytes = 4 * 4  # (sum, weight) of loss and accuracy stay float32
    assert bf16 - metrics_bytes == (f32 - metrics_bytes) // 2
    assert {"bf16"} <= set().union(*(r.dtypes for r in hlo.all_reduces(texts["bfloat16"])))


def _optimizer_state_bytes_on_one_device(state):
    return sum(device_bytes(leaf) for leaf in jax.tree.leaves(state.opt_state))


@pytest.fixture(scope="module")
def zero1_steps():
    """(state, compiled step) of the ViT replicated and with ZeRO-1, on 8 devices."""
    return {name: compiled_step(VIT, *overrides)[1:] for name, overrides in [
        ("replicated", ()), ("zero1", ("--config.parallel.shard_optimizer_state=true",))]}


def test_zero1_divides_per_device_optimizer_state_about_n_fold(zero1_steps):
    (replicated, full), (sharded, zero) = zero1_steps["replicated"], zero1_steps["zero1"]
    ratio = _optimizer_state_bytes_on_one_device(sharded) / \
        _optimizer_state_bytes_on_one_device(replicated)
    assert ratio < 1.5 / 8, ratio  # 1/8 plus the leaves too small to split
    saved = full.memory_analysis().argument_size_in_bytes - \
        zero.memory_analysis().argument_size_in_bytes
    assert saved > 0.8 * _optimizer_state_bytes_on_one_device(replicated)


def test_zero1_reduce_scatters_the_gradients_and_sends_what_data_parallelism_sends(
        zero1_steps):
    # Each device's optimizer state updates one shard, so it needs only that shard of
    # the reduced gradient: a reduce-scatter (half a ring all-reduce), then the
    # all-gather of the updated params (the other half). An all-reduce followed by
    # the all-gather sent 1.5x.
    def collectives(name):
        return hlo.collectives(zero1_steps[name][1].as_text())

    def sent(name):
        return sum(op.ring_bytes_sent(8) for op in collectives(name))

    (state, _) = zero1_steps["zero1"]
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(state.params))
    scattered = sum(op.operand_bytes or 8 * op.bytes for op in collectives("zero1")
                    if op.kind == "reduce-scatter")
    assert scattered > 0.9 * grad_bytes  # all but the leaves too small to split
    assert sent("zero1") <= 1.02 * sent("replicated"), (sent("zero1"), sent("replicated"))


def test_remat_lowers_the_compiled_temp_memory():
    # A deep, narrow ViT with 65 tokens, so activations (not parameters) dominate
    # the step's temporaries. Every variant is compiled with the same XLA options
    # (those jdp uses on CPU with remat), so the difference is remat's alone. Measured
    # temporaries, none / full / dots_saveable: jax 0.10.2 (memory-optimised schedule)
    # 37.8 / 20.2 / 24.2 MB; 0.12.1 (the default schedule, which from jaxlib 0.11.1 keeps
    # remat; the memory-optimised one gave 31.7 / 22.7 / 24.2 there) 37.5 / 8.4 / 22.8 MB.
    options = compiler_options("cpu", "full")
    temp = {}
    for policy in ("none", "full", "dots_saveable"):
        model = adapters.from_linen(ViT(num_classes=10, patch_size=1, hidden_size=64,
                                        num_layers=6, num_heads=4, mlp_dim=128, remat=policy))
        backend = make_backend("pjit", make_mesh(), model, classification(), optax.sgd(0.1),
                               StepOptions(compiler_options=options))
        _, compiled = _compiled_from_shapes(backend, global_batch_size=128)
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < 0.7 * temp["none"], temp
    assert temp["dots_saveable"] < 0.9 * temp["none"], temp


def _wide_vit_step(**options):
    """A wide, shallow ViT on 4 tokens with one example per device: params and optimizer
    state dominate the step's memory, as in a large model."""
    shard_params = options.get("shard_params", False)
    model = adapters.from_linen(ViT(num_classes=10, patch_size=4, hidden_size=256,
                                    num_layers=2, num_heads=4, mlp_dim=1024))
    backend = make_backend("pjit", make_mesh(), model, classification(), optax.adamw(1e-3),
                           StepOptions(compiler_options=compiler_options("cpu", "none",
                                                                         shard_params),
                                       **options))
    return _compiled_from_shapes(backend, global_batch_size=8)


def _compiled_from_shapes(backend, global_batch_size):
    """(abstract state, compiled train step) for 8x8 one-channel images."""
    example = {"image": np.zeros((8, 8, 1), np.float32), "label": np.zeros((), np.int32)}
    return compiled_from_shapes(backend, (example["image"][None],), example,
                                global_batch_size)


@pytest.fixture(scope="module")
def fsdp_and_replicated():
    return _wide_vit_step(shard_params=True), _wide_vit_step()


def test_fsdp_gathers_params_and_reduce_scatters_gradients(fsdp_and_replicated):
    (state, compiled), _ = fsdp_and_replicated
    ops = hlo.collectives(compiled.as_text())
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    kinds = {op.kind for op in ops}
    assert {"all-gather", "reduce-scatter"} <= kinds, kinds
    scattered = sum(op.operand_bytes for op in ops if op.kind == "reduce-scatter")
    assert scattered > 0.9 * param_bytes  # nearly every gradient leaves as a shard
    # No gradient is all-reduced whole: only the metric sums and the few leaves too
    # small to split (biases of the 10 classes) travel in all-reduces.
    all_reduced = sum(op.bytes for op in ops if op.kind == "all-reduce")
    assert all_reduced < 0.01 * param_bytes, all_reduced


def test_fsdp_step_needs_under_a_third_of_the_replicated_memory(fsdp_and_replicated):
    (_, fsdp), (_, replicated) = fsdp_and_replicated

    def per_device_bytes(compiled):
        memory = compiled.memory_analysis()
        return memory.argument_size_in_bytes + memory.temp_size_in_bytes

    ratio = per_device_bytes(fsdp) / per_device_bytes(replicated)
    assert ratio < 0.3, ratio  # 0.39 when params were sharded only between steps


def _live_bytes_on(device) -> int:
    """Bytes of the live buffers on `device`, each once (a global array and the
    single-device arrays it was assembled from share their buffers), after Python's cyclic
    garbage collector has run: arrays that earlier tests left in reference cycles are
    not the state's. Without it, a collection during the save freed 828,020 B (one
    TrainState and batch shard of an earlier test's ViT: 823,848 B of params, 12 of step
    and key, 4,160 of batch) that "before" had counted, so "after" came out smaller (jax
    0.11.2, the suite of 2026-12-01)."""
    gc.collect()
    buffers = {shard.data.unsafe_buffer_pointer(): shard.data.nbytes
               for array in jax.live_arrays() if not array.is_deleted()
               for shard in array.addressable_shards if shard.device == device}
    return sum(buffers.values())


def test_pmap_saves_without_a_second_copy_of_the_state():
    model = adapters.from_linen(ViT(num_classes=10, patch_size=4, hidden_size=128,
                                    num_layers=2, num_heads=4, mlp_dim=512))
    backend = make_backend("pmap", make_mesh(), model, classification(), optax.adamw(1e-3),
                           StepOptions())
    state = backend.from_global(
        backend.init_global(jax.random.key(0), (np.zeros((1, 8, 8, 1), np.float32),)),
        consume=True)
    device = jax.devices()[0]
    jax.block_until_ready(state)
    before = _live_bytes_on(device)
    largest_leaf = max(x.nbytes for x in jax.tree.leaves(state)) // 8
    seen = []

    def save(global_state):
        jax.block_until_ready(global_state)
        seen.append(_live_bytes_on(device))

    state = backend.with_global(state, save)
    jax.block_until_ready(state)
    # While saving, the canonical copy replaced the working one: at most one leaf was
    # ever held twice (converting all of it first used to hold the whole state twice).
    assert seen[0] <= before + largest_leaf, (seen, before)
    assert _live_bytes_on(device) == before
    batch = backend.put_batch({"image": np.zeros((8, 8, 8, 1), np.float32),
                               "label": np.zeros((8,), np.int32)})
    state, _ = backend.compiled_train_step(state, batch)(state, batch)  # still usable
