"""Framework defaults, config validation and the batch arithmetic.

Experiment files start from `defaults()` and add their own `model` section.
`validate()` runs before anything is compiled or written: every rule here
raises `ConfigError` with one line naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math

import ml_collections

from jdp.errors import ConfigError

BACKENDS = ("pjit", "pmap")
COMPUTE_DTYPES = ("float32", "bfloat16")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
IN_MEMORY = ("auto", "true", "false")  # data.in_memory
LR_SCALINGS = ("none", "linear", "sqrt")
MESH_SHAPES = ("flat", "hybrid")
REDUCTIONS = ("flat", "two_level")
CROSS_HOST_REDUCE_DTYPES = ("float32", "bfloat16", "int8")


def defaults() -> ml_collections.ConfigDict:
    """The framework's config keys with their defaults; experiments override them."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.batch_size = 128  # global: all hosts and devices together
    c.eval_batch_size = 0  # 0 = batch_size
    c.total_steps = 1000
    c.log_every_steps = 50
    c.eval_every_steps = 0  # 0 = only at the end
    c.learning_rate = 1e-3  # at base_batch_size; see lr_scaling
    c.lr_scaling = "none"
    c.base_batch_size = 128
    c.warmup_steps = 50
    c.weight_decay = 1e-4
    c.grad_clip_norm = 0.0  # 0 = no clipping
    c.label_smoothing = 0.0
    c.grad_accum_steps = 1
    c.compute_dtype = "float32"
    c.remat = "none"
    c.crash_on_nan = True  # stop when more steps than skip_nonfinite_steps are non-finite
    c.skip_nonfinite_steps = 0  # non-finite updates to skip (and count) before stopping
    c.tensorboard = True  # TensorBoard event files in <workdir>/tensorboard

    c.profile = ml_collections.ConfigDict()
    c.profile.start_step = 0  # a jax.profiler trace of steps start_step+1 .. +num_steps
    c.profile.num_steps = 0  # 0 = no trace

    # The data, when the experiment file defines no build_data(config): a TFDS
    # dataset by name (the built-in `digits`, or any prepared in data_dir), or the
    # user's own .npz / ArrayRecord files. Empty / 0 values come from the
    # dataset's preset or its TFDS metadata.
    c.data = ml_collections.ConfigDict()
    c.data.name = "digits"  # a TFDS name; ignored when train_files is set
    c.data.data_dir = ""  # "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    c.data.train_split = ""  # TFDS split with slicing, e.g. "train[:90%]"
    c.data.eval_split = ""
    c.data.train_files = ""  # globs of .npz or .array_record files (instead of TFDS)
    c.data.eval_files = ""
    c.data.image_key = "image"
    c.data.label_key = "label"
    c.data.num_classes = 0
    c.data.image_size = 0  # model input height = width
    c.data.mean = ()  # per channel, on the 0..1 scale
    c.data.std = ()
    c.data.augment = False
    # "auto": a split is read into memory once and batched by vectorised numpy when its
    # preprocessing has a batch form and its arrays take at most 1 GiB (else it streams
    # through grain, example by example); "true": always (an error where it cannot);
    # "false": never. The batches are the same either way.
    c.data.in_memory = "auto"
    c.data.num_threads = 4  # threads preparing batches in the trainer (num_workers=0)
    # > 0: worker processes prepare the batches instead (CPU-heavy decoding, e.g. JPEG:
    # threads share one GIL); the example stream is the same for any value. Neither
    # applies to a split batched from memory.
    c.data.num_workers = 0

    c.parallel = ml_collections.ConfigDict()
    c.parallel.backend = "pjit"
    # The mesh is hosts x local devices. "flat" orders each host's devices by id,
    # "hybrid" in their fast-interconnect order (create_hybrid_device_mesh).
    c.parallel.mesh = "flat"
    # Groups of devices that share a fast interconnect; 0 = one per process. More
    # than the processes splits each process's devices into virtual hosts.
    c.parallel.hosts = 0
    c.parallel.shard_optimizer_state = False  # ZeRO-1 (pjit only)
    c.parallel.shard_params = False  # FSDP-style params sharding (pjit only)
    c.parallel.grad_reduce_dtype = "float32"
    # "flat": one all-reduce over all devices; "two_level": reduce-scatter inside each
    # host, all-reduce across hosts, all-gather inside (pjit only).
    c.parallel.reduction = "flat"
    # What crosses hosts in the two-level reduction: "float32", "bfloat16" or "int8"
    # (per-block scales), the last two with error feedback (jdp/parallel/reduction.py).
    c.parallel.cross_host_reduce = "float32"
    c.parallel.error_feedback = True

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # 0 = only at the end
    c.checkpoint.max_to_keep = 3
    c.checkpoint["async"] = True
    c.checkpoint.init_from = ""
    c.checkpoint.keep_best = ""  # e.g. "eval/accuracy"
    c.checkpoint.keep_best_mode = "max"

    c.watchdog_timeout_s = 600.0
    # Compiled programs are kept here across runs (jdp/compile_cache.py). "" =
    # $JDP_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/jdp/compile_cache, else
    # ~/.cache/jdp/compile_cache; "none" = no cache.
    c.compile_cache_dir = ""
    return c


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split over processes, devices and micro-batches."""

    global_batch_size: int
    process_count: int
    device_count: int
    grad_accum_steps: int

    @property
    def per_process_batch_size(self) -> int:
        return self.global_batch_size // self.process_count

    @property
    def per_device_batch_size(self) -> int:
        return self.global_batch_size // self.device_count

    @property
    def micro_batch_size(self) -> int:
        """Examples per device in one accumulation micro-step."""
        return self.per_device_batch_size // self.grad_accum_steps


def _fail(field: str, value, why: str, fix: str) -> None:
    raise ConfigError(f"config.{field}={value!r}: {why}. Fix: {fix}.")


def _get(config: ml_collections.ConfigDict, field: str):
    """The value at a dotted path such as 'parallel.backend'."""
    value = config
    for part in field.split("."):
        value = value[part]
    return value


def _check_choice(config: ml_collections.ConfigDict, field: str, choices) -> None:
    value = _get(config, field)
    if value not in choices:
        _fail(field, value, "unknown value", f"use one of {', '.join(map(repr, choices))}")


def _check_positive(config: ml_collections.ConfigDict, field: str, allow_zero=False) -> None:
    value = _get(config, field)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        _fail(field, value, f"must be {bound}", f"pass --config.{field}=<a value {bound}>")


def batch_plan(
    global_batch_size: int, grad_accum_steps: int, device_count: int, process_count: int
) -> BatchPlan:
    """Checks the batch arithmetic; every later size is derived from the global batch."""
    if global_batch_size % device_count:
        lower = global_batch_size - global_batch_size % device_count
        _fail(
            "batch_size",
            global_batch_size,
            f"the global batch must be divisible by the device count ({device_count})",
            f"use a multiple of {device_count}, e.g. --config.batch_size={lower or device_count}",
        )
    per_device = global_batch_size // device_count
    if per_device % grad_accum_steps:
        _fail(
            "grad_accum_steps",
            grad_accum_steps,
            f"must divide the per-device batch ({global_batch_size} / {device_count} devices "
            f"= {per_device})",
            f"use a divisor of {per_device}, or a batch_size that is a multiple of "
            f"{device_count * grad_accum_steps}",
        )
    return BatchPlan(global_batch_size, process_count, device_count, grad_accum_steps)


def validate(config: ml_collections.ConfigDict, device_count: int, process_count: int) -> BatchPlan:
    """Checks everything that can be checked without data or compilation."""
    from jdp.models.remat import REMAT_POLICIES

    for field in ("batch_size", "total_steps", "log_every_steps", "grad_accum_steps",
                  "base_batch_size", "learning_rate", "checkpoint.max_to_keep"):
        _check_positive(config, field)
    for field in ("eval_every_steps", "warmup_steps", "eval_batch_size", "weight_decay",
                  "grad_clip_norm", "checkpoint.every_steps", "watchdog_timeout_s",
                  "skip_nonfinite_steps", "profile.start_step", "profile.num_steps"):
        _check_positive(config, field, allow_zero=True)
    _check_choice(config, "parallel.backend", BACKENDS)
    _check_choice(config, "parallel.mesh", MESH_SHAPES)
    _check_choice(config, "parallel.grad_reduce_dtype", GRAD_REDUCE_DTYPES)
    _check_choice(config, "compute_dtype", COMPUTE_DTYPES)
    _check_choice(config, "lr_scaling", LR_SCALINGS)
    _check_choice(config, "remat", REMAT_POLICIES)
    _check_choice(config, "checkpoint.keep_best_mode", ("max", "min"))
    _check_choice(config, "data.in_memory", IN_MEMORY)
    for field in ("data.num_classes", "data.image_size", "data.num_threads",
                  "data.num_workers"):
        _check_positive(config, field, allow_zero=True)
    if config.parallel.backend == "pmap":
        for field in ("shard_optimizer_state", "shard_params"):
            if config.parallel[field]:
                _fail(f"parallel.{field}", True, "the pmap backend keeps a full replica of the "
                      "state on every device", "use --config.parallel.backend=pjit to shard it")
    _check_reduction(config, device_count, process_count)
    if config.warmup_steps >= config.total_steps:
        _fail("warmup_steps", config.warmup_steps,
              f"must be below total_steps ({config.total_steps})", "shorten the warmup")

    plan = batch_plan(config.batch_size, config.grad_accum_steps, device_count, process_count)
    eval_batch = config.eval_batch_size or config.batch_size
    if eval_batch % device_count:
        _fail("eval_batch_size", eval_batch,
              f"must be divisible by the device count ({device_count})",
              f"use a multiple of {device_count}")
    return plan


def _check_reduction(config: ml_collections.ConfigDict, device_count: int,
                     process_count: int) -> None:
    """The hosts x local mesh and the gradient reduction over it."""
    parallel = config.parallel
    _check_positive(config, "parallel.hosts", allow_zero=True)
    _check_choice(config, "parallel.reduction", REDUCTIONS)
    _check_choice(config, "parallel.cross_host_reduce", CROSS_HOST_REDUCE_DTYPES)
    hosts = parallel.hosts or process_count
    if device_count % hosts:
        divisors = [d for d in range(1, device_count + 1) if device_count % d == 0]
        _fail("parallel.hosts", parallel.hosts, f"must divide the {device_count} devices",
              f"use one of {divisors}, or 0 for one host per process")
    if hosts % process_count and process_count % hosts:
        _fail("parallel.hosts", parallel.hosts,
              f"a host must hold whole processes or split one ({process_count} processes)",
              f"use a multiple or a divisor of {process_count}, or 0 for one host per process")
    if parallel.reduction == "two_level":
        if parallel.backend == "pmap":
            _fail("parallel.reduction", "two_level", "the pmap backend reduces gradients flat",
                  "use --config.parallel.backend=pjit")
        if parallel.shard_params:
            _fail("parallel.reduction", "two_level", "with shard_params (FSDP) the gradients "
                  "are reduce-scattered over every device as the params are gathered",
                  "use --config.parallel.reduction=flat with FSDP")
    if parallel.cross_host_reduce != "float32":
        if parallel.reduction != "two_level":
            _fail("parallel.cross_host_reduce", parallel.cross_host_reduce,
                  "compression applies to the cross-host part of the two-level reduction",
                  "add --config.parallel.reduction=two_level (pjit backend)")
        if hosts == 1:
            _fail("parallel.cross_host_reduce", parallel.cross_host_reduce,
                  "with one host nothing crosses hosts",
                  "use --config.parallel.cross_host_reduce=float32, or split the devices into "
                  "virtual hosts with --config.parallel.hosts=2")


def scaled_learning_rate(
    learning_rate: float, lr_scaling: str, global_batch_size: int, base_batch_size: int
) -> float:
    """The peak learning rate for this batch size.

    `learning_rate` is the rate tuned at `base_batch_size`. 'linear' scales it by
    batch/base (Goyal et al., 2017, for SGD), 'sqrt' by sqrt(batch/base) (the rule
    usually used for Adam-type optimizers), 'none' keeps it as given.
    """
    ratio = global_batch_size / base_batch_size
    if lr_scaling == "linear":
        return learning_rate * ratio
    if lr_scaling == "sqrt":
        return learning_rate * math.sqrt(ratio)
    return learning_rate


# Fields that may change when a run resumes: how it is logged, evaluated, saved and
# spread over devices; where the data and compiled programs live; how long it runs. Everything else
# shapes the trajectory and must match the run being resumed.
RESUMABLE_CHANGES = ("total_steps", "log_every_steps", "eval_every_steps", "eval_batch_size",
                     "crash_on_nan", "skip_nonfinite_steps", "tensorboard", "profile",
                     "watchdog_timeout_s", "checkpoint", "parallel", "data.data_dir",
                     "data.num_threads", "data.num_workers", "data.in_memory",
                     "compile_cache_dir")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def resume_differences(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for each field that may not change on resume."""

    def resumable(path: str) -> bool:
        return any(path == f or path.startswith(f + ".") for f in RESUMABLE_CHANGES)

    saved_flat, current_flat = _flatten(saved), _flatten(current)
    # A field added to jdp after the run was saved, at its default, changes nothing.
    added = {path: value for path, value in _flatten(json.loads(defaults().to_json())).items()
             if path not in saved_flat and current_flat.get(path) == value}
    saved_flat.update(added)
    return [f"{path}: {saved_flat.get(path, '<absent>')!r} -> "
            f"{current_flat.get(path, '<absent>')!r}"
            for path in sorted(set(saved_flat) | set(current_flat))
            if not resumable(path) and saved_flat.get(path) != current_flat.get(path)]
