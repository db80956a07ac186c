"""`validate()`: everything about a config that can be checked without data or
compilation, run before anything is compiled or written. Every rule raises
`ConfigError` with one line naming the field, the value and the fix.
"""

from __future__ import annotations

import ml_collections

from jdp.config.batch import BatchSplit, batch_split, data_devices_text
from jdp.config.checks import check_choice, check_positive, fail
from jdp.config.defaults import (
    BACKENDS,
    COMPUTE_DTYPES,
    CROSS_HOST_REDUCE_DTYPES,
    GRAD_REDUCE_DTYPES,
    IN_MEMORY,
    LR_SCALINGS,
    MESH_SHAPES,
    REDUCTIONS,
    SHARDING_MODES,
)
from jdp.runtime import gpu_flags


def validate(config: ml_collections.ConfigDict, device_count: int,
             process_count: int) -> BatchSplit:
    """Checks everything that can be checked without data or compilation."""
    from jdp.models.remat import REMAT_POLICIES

    for field in ("batch_size", "total_steps", "log_every_steps", "grad_accum_steps",
                  "base_batch_size", "learning_rate", "checkpoint.max_to_keep"):
        check_positive(config, field)
    for field in ("eval_every_steps", "warmup_steps", "eval_batch_size", "weight_decay",
                  "grad_clip_norm", "checkpoint.every_steps", "checkpoint.every_minutes",
                  "watchdog_timeout_s",
                  "skip_nonfinite_steps", "profile.start_step", "profile.num_steps"):
        check_positive(config, field, allow_zero=True)
    check_choice(config, "parallel.backend", BACKENDS)
    check_choice(config, "parallel.mesh", MESH_SHAPES)
    check_choice(config, "parallel.grad_reduce_dtype", GRAD_REDUCE_DTYPES)
    check_choice(config, "compute_dtype", COMPUTE_DTYPES)
    check_choice(config, "lr_scaling", LR_SCALINGS)
    check_choice(config, "remat", REMAT_POLICIES)
    check_choice(config, "checkpoint.keep_best_mode", ("max", "min"))
    check_choice(config, "data.in_memory", IN_MEMORY)
    for field in ("data.num_classes", "data.image_size", "data.num_threads",
                  "data.num_workers", "data.tokenize_processes"):
        check_positive(config, field, allow_zero=True)
    for field in ("shard_optimizer_state", "shard_params"):
        check_choice(config, f"parallel.{field}", SHARDING_MODES)
        if config.parallel.backend == "pmap" and config.parallel[field]:
            fail(f"parallel.{field}", config.parallel[field], "the pmap backend keeps a full "
                  "replica of the state on every device",
                  "use --config.parallel.backend=pjit to shard it")
    _check_reduction(config, device_count, process_count)
    _check_model_parallel(config, device_count, process_count)
    if "gpu" in config:
        gpu_flags.parse_flags(config.gpu.flags)
    if config.warmup_steps >= config.total_steps:
        fail("warmup_steps", config.warmup_steps,
              f"must be below total_steps ({config.total_steps})", "shorten the warmup")

    model_parallel = config.parallel.model_parallel
    plan = batch_split(config.batch_size, config.grad_accum_steps, device_count, process_count,
                       model_parallel)
    eval_batch = config.eval_batch_size or config.batch_size
    if eval_batch % plan.data_parallel_size:
        fail("eval_batch_size", eval_batch,
              f"must be divisible by {data_devices_text(device_count, model_parallel)}",
              f"use a multiple of {plan.data_parallel_size}")
    return plan


def _check_model_parallel(config: ml_collections.ConfigDict, device_count: int,
                          process_count: int) -> None:
    """The model axis: inside a host, pjit only."""
    parallel = config.parallel
    model_parallel = parallel.model_parallel
    if not isinstance(model_parallel, int) or model_parallel < 1:
        fail("parallel.model_parallel", model_parallel, "must be a whole number >= 1",
              "pass --config.parallel.model_parallel=1 (data parallelism only) or more")
    if model_parallel == 1:
        return
    if parallel.backend == "pmap":
        fail("parallel.model_parallel", model_parallel, "the pmap backend keeps a whole "
              "replica of the model on every device", "use --config.parallel.backend=pjit")
    per_host = device_count // (parallel.hosts or process_count)
    if per_host % model_parallel:
        divisors = [d for d in range(1, per_host + 1) if per_host % d == 0]
        fail("parallel.model_parallel", model_parallel,
              f"must divide the {per_host} devices of a host (the model axis never crosses "
              "hosts)", f"use one of {divisors}")
    if parallel.cross_host_reduce != "float32":
        fail("parallel.cross_host_reduce", parallel.cross_host_reduce,
              "the compressed cross-host reduction is not implemented with a model axis",
              "use --config.parallel.cross_host_reduce=float32 with model_parallel > 1")


def _check_reduction(config: ml_collections.ConfigDict, device_count: int,
                     process_count: int) -> None:
    """The hosts x local mesh and the gradient reduction over it."""
    parallel = config.parallel
    check_positive(config, "parallel.hosts", allow_zero=True)
    check_choice(config, "parallel.reduction", REDUCTIONS)
    check_choice(config, "parallel.cross_host_reduce", CROSS_HOST_REDUCE_DTYPES)
    hosts = parallel.hosts or process_count
    if device_count % hosts:
        divisors = [d for d in range(1, device_count + 1) if device_count % d == 0]
        fail("parallel.hosts", parallel.hosts, f"must divide the {device_count} devices",
              f"use one of {divisors}, or 0 for one host per process")
    if hosts % process_count and process_count % hosts:
        fail("parallel.hosts", parallel.hosts,
              f"a host must hold whole processes or split one ({process_count} processes)",
              f"use a multiple or a divisor of {process_count}, or 0 for one host per process")
    host_mode = "host" in (parallel.shard_params, parallel.shard_optimizer_state)
    if parallel.shard_params and parallel.shard_optimizer_state not in (
            False, parallel.shard_params):
        fail("parallel.shard_optimizer_state", parallel.shard_optimizer_state,
              f"shard_params={parallel.shard_params!r} shards the optimizer state with the "
              "params", "leave shard_optimizer_state unset with shard_params")
    if host_mode and hosts == 1:
        field = "shard_params" if parallel.shard_params == "host" else "shard_optimizer_state"
        fail(f"parallel.{field}", "host", "with one host it is the same as True (every "
              "device is in the host)", f"use --config.parallel.{field}=true, or split the "
              "devices into virtual hosts with --config.parallel.hosts=2")
    if parallel.reduction == "two_level":
        if parallel.backend == "pmap":
            fail("parallel.reduction", "two_level", "the pmap backend reduces gradients flat",
                  "use --config.parallel.backend=pjit")
        if parallel.shard_params is True:
            fail("parallel.reduction", "two_level", "with shard_params (FSDP) the gradients "
                  "are reduce-scattered over every device as the params are gathered",
                  "use --config.parallel.reduction=flat with FSDP, or "
                  "--config.parallel.shard_params=host (sharded inside hosts, reduced in two "
                  "levels)")
    if parallel.cross_host_reduce != "float32":
        if parallel.reduction != "two_level" and not host_mode:
            fail("parallel.cross_host_reduce", parallel.cross_host_reduce,
                  "compression applies to the cross-host part of the two-level reduction",
                  "add --config.parallel.reduction=two_level (pjit backend), or shard inside "
                  "hosts with --config.parallel.shard_params=host")
        if hosts == 1:
            fail("parallel.cross_host_reduce", parallel.cross_host_reduce,
                  "with one host nothing crosses hosts",
                  "use --config.parallel.cross_host_reduce=float32, or split the devices into "
                  "virtual hosts with --config.parallel.hosts=2")

