"""The pre-flight plan: collectives read from real compiled HLO, the ring all-reduce and
scaling arithmetic, the plan's text and the out-of-memory check."""

import dataclasses

import jax
import numpy as np
import pytest

from jdp.dryrun import estimate, hlo

# 8 devices x an (8, 16) float32 block each: 512 bytes per device.
GLOBAL = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
BLOCK_BYTES = 8 * 16 * 4
ALL_EIGHT = ((0, 1, 2, 3, 4, 5, 6, 7),)
RING = [(i, (i + 1) % 8) for i in range(8)]
REPLICATED, BY_DATA = jax.P(), jax.P("data")


def _mesh(shape=(8,), names=("data",)):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _compiled_hlo(fn, out_spec=REPLICATED, mesh=None, in_spec=BY_DATA) -> str:
    mesh = mesh or _mesh()
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    return jax.jit(mapped).lower(GLOBAL).compile().as_text()


def test_psum_is_one_all_reduce_of_the_block_bytes_over_all_eight_devices():
    [op] = hlo.collectives(_compiled_hlo(lambda x: jax.lax.psum(x, "data")))
    assert (op.kind, op.bytes, op.dtypes, op.in_loop) == ("all-reduce", BLOCK_BYTES, {"f32"}, False)
    assert op.replica_groups == ALL_EIGHT
    assert op.group_size == 8


def test_a_tuple_all_reduce_counts_every_result_and_its_scalars():
    text = _compiled_hlo(lambda x: jax.lax.psum((x, x.sum()), "data"))
    [op] = hlo.collectives(text)
    assert op.shapes == (("f32", (8, 16)), ("f32", ()))
    assert (op.bytes, op.scalar_bytes) == (BLOCK_BYTES + 4, 4)
    assert [r.bytes for r in hlo.all_reduces(text)] == [BLOCK_BYTES + 4]


@pytest.mark.parametrize("kind, fn, out_spec, result_bytes, operand_bytes", [
    ("all-gather", lambda x: jax.lax.all_gather(x, "data"), jax.P(), 8 * BLOCK_BYTES, BLOCK_BYTES),
    ("reduce-scatter", lambda x: jax.lax.psum_scatter(x, "data", tiled=True), jax.P("data"),
     BLOCK_BYTES // 8, BLOCK_BYTES),
    ("collective-permute", lambda x: jax.lax.ppermute(x, "data", RING), jax.P("data"),
     BLOCK_BYTES, BLOCK_BYTES),
    ("all-to-all", lambda x: jax.lax.all_to_all(x, "data", 0, 0, tiled=True), jax.P("data"),
     BLOCK_BYTES, BLOCK_BYTES),
])
def test_each_collective_kind_is_found_with_its_result_and_operand_bytes(
        kind, fn, out_spec, result_bytes, operand_bytes):
    [op] = hlo.collectives(_compiled_hlo(fn, out_spec))
    assert (op.kind, op.bytes, op.operand_bytes) == (kind, result_bytes, operand_bytes)
    assert hlo.all_reduces(_compiled_hlo(fn, out_spec)) == []


def test_collective_permute_has_no_replica_groups_and_others_have_all_eight():
    permute = hlo.collectives(_compiled_hlo(lambda x: jax.lax.ppermute(x, "data", RING),
                                            jax.P("data")))
    gather = hlo.collectives(_compiled_hlo(lambda x: jax.lax.all_gather(x, "data")))
    assert permute[0].replica_groups is None
    assert gather[0].replica_groups == ALL_EIGHT


def test_the_lowered_program_is_read_too():
    fn = jax.shard_map(lambda x: jax.lax.psum_scatter(x, "data", tiled=True), mesh=_mesh(),
                       in_specs=jax.P("data"), out_specs=jax.P("data"), check_vma=False)
    [op] = hlo.collectives(jax.jit(fn).lower(GLOBAL).as_text(dialect="hlo"))
    assert (op.kind, op.bytes, op.operand_bytes) == ("reduce-scatter", 64, BLOCK_BYTES)


def test_a_collective_inside_a_scan_is_reported_in_a_loop():
    def gather_per_row(x):
        step = lambda carry, row: (carry + jax.lax.all_gather(row, "data").sum(), None)
        return jax.lax.scan(step, 0.0, x)[0]

    [op] = hlo.collectives(_compiled_hlo(gather_per_row))
    assert (op.kind, op.in_loop) == ("all-gather", True)


@pytest.mark.parametrize("axis, groups", [
    ("b", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("a", ((0, 4), (1, 5), (2, 6), (3, 7))),
])
def test_replica_groups_follow_the_reduced_mesh_axis(axis, groups):
    text = _compiled_hlo(lambda x: jax.lax.psum(x, axis), jax.P(("a", "b")),
                         mesh=_mesh((2, 4), ("a", "b")), in_spec=jax.P(("a", "b")))
    assert hlo.collectives(text)[0].replica_groups == groups


def test_partitioner_replica_groups_are_expanded_whatever_form_xla_prints():
    # Rows sharded over mesh axes a and c, result replicated: the sum runs over a and c,
    # in groups of the devices that share b (device id = 4a + 2b + c).
    sharding = jax.NamedSharding(_mesh((2, 2, 2), ("a", "b", "c")), jax.P(("a", "c")))
    text = jax.jit(lambda x: x.sum(0), in_shardings=sharding).lower(GLOBAL).compile().as_text()
    [op] = hlo.collectives(text)
    assert op.kind == "all-reduce"
    assert sorted(map(sorted, op.replica_groups)) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("attribute, groups", [
    ("replica_groups={{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("replica_groups=[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['x'=2,'y'=4] {'x'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'x'}",
     ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups={}", None),
    ("source_target_pairs={{0,1},{1,0}}", None),
])
def test_replica_group_forms_are_expanded(attribute, groups):
    assert hlo.parse_replica_groups(attribute + ", channel_id=1") == groups


# The async forms XLA's GPU backend prints; the CPU backend emits none. A -start's result
# also holds its operand (and permute scratch), so sizes must come from the -done. The
# reduce-scatter's operand carries its type inline, as some printers write it.
ASYNC_HLO = "\n".join([
    "HloModule step, is_scheduled=true, num_partitions=8",
    "",
    "%add (x: f32[], y: f32[]) -> f32[] {",
    "  %x = f32[] parameter(0)",
    "  %y = f32[] parameter(1)",
    "  ROOT %sum = f32[] add(%x, %y)",
    "}",
    "",
    "%async_rs (param_0: f32[8,16]) -> f32[1,16] {",
    "  %param_0 = f32[8,16]{1,0} parameter(0)",
    "  ROOT %rs = f32[1,16]{1,0} reduce-scatter(f32[8,16]{1,0} %param_0),"
    " replica_groups=[1,8]<=[8],"
    " dimensions={0}, to_apply=%add",
    "}",
    "",
    "ENTRY %main (p: f32[8,16]) -> (f32[8,16], f32[64,16], f32[8,16], f32[1,16]) {",
    "  %p = f32[8,16]{1,0} parameter(0)",
    "  %ar-start = f32[8,16]{1,0} all-reduce-start(%p), replica_groups=[1,8]<=[8],"
    " to_apply=%add",
    "  %ar-done = f32[8,16]{1,0} all-reduce-done(%ar-start)",
    "  %ag-start = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%p),"
    " replica_groups=[1,8]<=[8], dimensions={0}",
    "  %ag-done = f32[64,16]{1,0} all-gather-done(%ag-start)",
    "  %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p),"
    " source_target_pairs={{0,1},{1,0}}",
    "  %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)",
    "  %rs-start = ((f32[8,16]{1,0}), f32[1,16]{1,0}) async-start(%p), calls=%async_rs",
    "  %rs-done = f32[1,16]{1,0} async-done(%rs-start)",
    "  ROOT %t = (f32[8,16]{1,0}, f32[64,16]{1,0}, f32[8,16]{1,0}, f32[1,16]{1,0})"
    " tuple(%ar-done, %ag-done, %cp-done, %rs-done)",
    "}",
])


def test_async_start_done_pairs_count_once_with_the_done_result_bytes():
    found = {op.kind: op for op in hlo.collectives(ASYNC_HLO)}
    assert len(hlo.collectives(ASYNC_HLO)) == len(found) == 4
    assert {kind: op.bytes for kind, op in found.items()} == {
        "all-reduce": BLOCK_BYTES, "all-gather": 8 * BLOCK_BYTES,
        "collective-permute": BLOCK_BYTES, "reduce-scatter": BLOCK_BYTES // 8}
    assert found["reduce-scatter"].operand_bytes == BLOCK_BYTES
    assert found["all-gather"].replica_groups == ALL_EIGHT
    assert [r.bytes for r in hlo.all_reduces(ASYNC_HLO)] == [BLOCK_BYTES]


def test_ring_all_reduce_moves_twice_n_minus_one_over_n_of_the_buffer():
    assert estimate.ring_all_reduce_s(1e9, 8, 1e9) == pytest.approx(1.75)
    assert estimate.ring_all_reduce_s(1e9, 2, 1e9) == pytest.approx(1.0)
    assert estimate.ring_all_reduce_s(4e8, 4, 2e8) == pytest.approx(3.0)
    assert estimate.ring_all_reduce_s(1e9, 1, 1e9) == 0.0


@pytest.mark.parametrize("device_count, bandwidth", [(0, 1e9), (8, 0.0)])
def test_ring_all_reduce_rejects_impossible_inputs(device_count, bandwidth):
    with pytest.raises(ValueError, match="must be"):
        estimate.ring_all_reduce_s(1e9, device_count, bandwidth)


def test_scaling_efficiency_is_compute_over_compute_plus_communication():
    rows = estimate.scaling(1e9, compute_s=0.0175, device_counts=(1, 8),
                            bandwidths_gb_per_s=(100, 25))
    assert [(r.device_count, r.bandwidth_gb_per_s) for r in rows] == [
        (1, 100), (1, 25), (8, 100), (8, 25)]
    # 8 devices: 1.75e9 bytes at 1e11 B/s = 0.0175 s, as long as the compute.
    assert [r.communication_s for r in rows] == pytest.approx([0, 0, 0.0175, 0.07])
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 1.0, 0.5, 0.2])


def test_scaling_without_compute_time_gives_times_only():
    rows = estimate.scaling(1e9, compute_s=None)
    assert len(rows) == 9 and all(r.efficiency is None for r in rows)
    assert rows[0].communication_s == pytest.approx(1.75e9 / 25e9)


def _op(kind, *shapes, in_loop=False):
    return hlo.Collective(kind=kind, computation="main", shapes=shapes,
                          replica_groups=ALL_EIGHT, in_loop=in_loop)


STEP_COLLECTIVES = (
    _op("all-reduce", ("f32", (100,)), ("f32", ()), ("f32", ())),  # gradients + 2 metrics
    _op("all-reduce", ("f32", (4,))),  # a BatchNorm layer's statistics
    _op("all-reduce", ("f32", (1000,)), in_loop=True),
    _op("all-gather", ("f32", (800,))),
)


def test_the_gradient_all_reduce_is_the_largest_one_outside_loops():
    assert estimate.gradient_all_reduce_bytes(STEP_COLLECTIVES) == 408
    assert estimate.gradient_all_reduce_bytes(()) == 0
    assert [c.bytes for c in estimate.other_all_reduces(STEP_COLLECTIVES)] == [16, 4000]


GiB = 2**30


def _inputs(**changes) -> estimate.PlanInputs:
    inputs = estimate.PlanInputs(
        platform="gpu", device_kind="NVIDIA H100", device_count=8, process_count=2,
        mesh_shape={"data": 8}, global_batch_size=256, per_process_batch_size=128,
        per_device_batch_size=32, micro_batch_size=8, grad_accum_steps=4, num_params=100,
        param_bytes=400, argument_bytes=2 * GiB, output_bytes=GiB, temp_bytes=3 * GiB,
        alias_bytes=GiB, collectives=STEP_COLLECTIVES, metric_bytes=8)
    return dataclasses.replace(inputs, **changes)


def test_plan_names_devices_batch_and_parameters():
    text = estimate.format_plan(_inputs())
    assert "8 x NVIDIA H100 (gpu), 2 processes; mesh data=8" in text
    assert "global 256 = 2 x 128 per process = 8 x 32 per device" in text
    assert "4 accumulation step(s) x micro-batch 8" in text
    assert "Parameters: 100 " in text


def test_plan_memory_is_against_capacity_or_says_it_is_unknown():
    assert "total 5.0 GiB: capacity unknown (CPU)" in estimate.format_plan(_inputs())
    text = estimate.format_plan(_inputs(device_memory_bytes=20 * GiB))
    assert "total 5.0 GiB: 25.0% of 20.0 GiB" in text


def test_plan_lists_each_collective_kind_with_count_bytes_and_place():
    lines = estimate.format_plan(_inputs()).splitlines()
    [in_loop] = [line for line in lines if "all-reduce" in line and "LOOP" in line]
    [gather] = [line for line in lines if line.strip().startswith("all-gather")]
    assert "x1" in in_loop and "3.9 KiB" in in_loop
    assert "3.1 KiB each" in gather and "groups of 8" in gather and "outside loops" in gather


@pytest.mark.parametrize("dtype, per_param", [("float32", 4), ("bfloat16", 2)])
def test_plan_compares_gradient_bytes_with_the_parameter_count(dtype, per_param):
    text = estimate.format_plan(_inputs(grad_reduce_dtype=dtype))
    assert "Gradient all-reduce: 408 B" in text and "8 B metric sums: gradients 400 B" in text
    assert f"expected {per_param} B x 100 parameters ({dtype}) = {per_param * 100} B" in text
    assert ("differs from expected" in text) == (dtype == "bfloat16")


def test_plan_efficiency_uses_the_measured_step_time_first():
    # 400 gradient bytes on 8 devices at 25 GB/s: 1.75 x 400 / 25e9 s = 28 ns.
    text = estimate.format_plan(_inputs(step_time_s=28e-9, flops_per_step=1e12,
                                    peak_flops_per_s=1e12))
    row_8 = next(line for line in text.splitlines() if line.strip().startswith("8 "))
    assert row_8.split()[:4] == ["8", "0.028", "us", "50.0%"]  # the 25 GB/s column


def test_plan_efficiency_falls_back_to_flops_over_peak():
    text = estimate.format_plan(_inputs(flops_per_step=2e12, peak_flops_per_s=1e15))
    assert "compute 2 ms per step" in text
    assert "%" in text.splitlines()[-1]


def test_plan_without_compute_time_prints_communication_times_only():
    text = estimate.format_plan(_inputs(flops_per_step=1e12))
    assert "compute time cannot be estimated" in text
    table = text.split("communication times only")[1]
    assert "us" in table and "%" not in table


def test_plan_without_an_all_reduce_scales_the_expected_gradient_bytes():
    text = estimate.format_plan(_inputs(collectives=(), device_count=1, mesh_shape={"data": 1}))
    assert "Collectives: none" in text
    assert "scaling below uses the expected bytes" in text
    # 400 bytes, 512 devices, 400 GB/s: 2 x 511/512 x 400 / 4e11 s = 2.0 ns.
    assert "0.002 us" in text.splitlines()[-1]


def test_check_fits_names_the_need_the_capacity_and_the_fixes():
    with pytest.raises(estimate.PlanError) as error:
        estimate.check_fits(_inputs(device_memory_bytes=4 * GiB))
    message = str(error.value)
    assert "\n" not in message
    assert "needs 5.0 GiB per device" in message and "has 4.0 GiB" in message
    for fix in ("--config.batch_size", "--config.grad_accum_steps", "--config.remat=full",
                "--config.compute_dtype=bfloat16",
                "--config.parallel.shard_optimizer_state=true (ZeRO-1)",
                "--config.parallel.shard_params"):
        assert fix in message


def test_check_fits_counts_donated_buffers_once():
    # 6 GiB before aliasing, 5 GiB after: fits in 5.5 GiB only because of donation.
    estimate.check_fits(_inputs(device_memory_bytes=int(5.5 * GiB)))
    with pytest.raises(estimate.PlanError):
        estimate.check_fits(_inputs(device_memory_bytes=int(5.5 * GiB), alias_bytes=0))


def test_check_fits_passes_when_capacity_is_unknown_or_large():
    estimate.check_fits(_inputs(device_memory_bytes=None))
    estimate.check_fits(_inputs(device_memory_bytes=80 * GiB))
