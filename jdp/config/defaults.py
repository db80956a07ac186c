"""The framework's config keys, their defaults and the values each choice may take.

Experiment files start from `defaults()` and add their own `model` section;
every leaf can be overridden on the command line (`--config.KEY=VALUE`).
"""

from __future__ import annotations

import ml_collections

BACKENDS = ("pjit", "pmap")
COMPUTE_DTYPES = ("float32", "bfloat16")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
IN_MEMORY = ("auto", "true", "false")  # data.in_memory
LR_SCALINGS = ("none", "linear", "sqrt")
MESH_SHAPES = ("flat", "hybrid")
REDUCTIONS = ("flat", "two_level")
SHARDING_MODES = (False, True, "host")  # parallel.shard_params / shard_optimizer_state
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

    # Trackers that get what metrics.jsonl gets, plus the config, texts and the report's
    # plots (jdp/track/): "wandb", "mlflow", both ("wandb,mlflow" or a list); "" = none.
    # Process 0 sends; a failing tracker warns once and training goes on.
    c.tracker = ml_collections.ConfigDict()
    c.tracker.kind = ml_collections.FieldReference("", field_type=object)
    c.tracker.project = "jdp"  # the W&B project, the MLflow experiment
    c.tracker.run_name = ""  # "" = the workdir's name
    # "" = $MLFLOW_TRACKING_URI, else SQLite in <workdir>/mlflow (mlflow.db, artifacts/)
    c.tracker.mlflow_uri = ""

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
    # Text for language models (jdp.data.text.lm), instead of images when text_files is
    # set: a glob or comma-separated globs of .txt/.md/.py/.jsonl files (also .gz or .zst
    # compressed), .parquet or .arrow files (local or gs://), "hf_disk:DIR[:split]" (a
    # Hugging Face dataset saved with save_to_disk), or "stdlib" (the Python standard
    # library's own sources, on every machine). One corpus, in the order of the paths.
    c.data.text_files = ""
    c.data.text_field = "text"  # the field of .jsonl, Parquet and Arrow files with the text
    c.data.eval_text_files = ""  # held-out text; "" = eval_fraction of the documents
    # Held out from text_files when eval_text_files is empty; also `python -m jdp.text
    # prepare`'s default. 1% of the standard library's sources made 44 windows of 128
    # tokens, fewer than one of experiments/gpt.py's evaluation batches (64).
    c.data.eval_fraction = 0.03
    c.data.tokenizer = "bytes"  # or "sentencepiece:PATH", "hf:PATH" (a tokenizer.json)
    c.data.token_dir = ""  # where the token store is kept; "" = <workdir>/tokens
    c.data.rebuild_tokens = False  # replace a store made from other inputs
    c.data.tokenize_processes = 0  # processes tokenizing the store, per host; 0 = its cores
    c.data.seq_len = 128  # tokens per training example (windows of seq_len + 1)
    c.data.document_mask = True  # segment ids and positions: attention within a document
    # "auto": a split is read into memory once and batched by vectorised numpy when its
    # preprocessing has a batch form and its arrays take at most 1 GiB (else it streams
    # through grain, example by example); a memory-mapped source (a token store's
    # windows) is gathered from its map batch by batch, whatever its size; "true":
    # always (an error where it cannot); "false": never. The batches are the same.
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
    # Tensor parallelism (pjit only): each host's devices split into data x model, M
    # devices holding one data replica's share of every layer (heads, MLP units and
    # vocabulary split, as the model's logical axis names say). M divides a host's
    # devices; the batch splits over the data-parallel devices only (devices / M).
    c.parallel.model_parallel = 1
    # ZeRO-1 and FSDP (pjit only): False, True (sharded over every device) or "host"
    # (sharded over the devices of each host, replicated across hosts: the gathers and
    # scatters stay inside hosts and 1/L of the gradient crosses them, once a step).
    c.parallel.shard_optimizer_state = ml_collections.FieldReference(False, field_type=object)
    c.parallel.shard_params = ml_collections.FieldReference(False, field_type=object)
    c.parallel.grad_reduce_dtype = "float32"
    # "flat": one all-reduce over all devices; "two_level": reduce-scatter inside each
    # host, all-reduce across hosts, all-gather inside (pjit only).
    c.parallel.reduction = "flat"
    # What crosses hosts in the two-level reduction: "float32", "bfloat16" or "int8"
    # (per-block scales), the last two with error feedback (jdp/parallel/reduction.py).
    c.parallel.cross_host_reduce = "float32"
    c.parallel.error_feedback = True

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # 0 = none by steps
    # Also a save once this much wall time has passed since the last one (checked at log
    # steps), so a run stopped by anything loses at most about that much; 0 = off.
    c.checkpoint.every_minutes = 5.0
    c.checkpoint.max_to_keep = 3
    c.checkpoint["async"] = True
    c.checkpoint.init_from = ""
    c.checkpoint.keep_best = ""  # e.g. "eval/accuracy"
    c.checkpoint.keep_best_mode = "max"

    # GPU performance settings (jdp/runtime/gpu_flags.py), applied before jax starts and
    # only on a GPU host; a flag already in XLA_FLAGS, or a variable already set, wins.
    c.gpu = ml_collections.ConfigDict()
    c.gpu.enable_defaults = True  # False: none of jdp's XLA flags and variables
    c.gpu.flags = ""  # more flags or other values: "--xla_gpu_enable_pipelined_all_reduce=false"

    c.watchdog_timeout_s = 600.0
    # Compiled programs are kept here across runs (jdp/compile_cache.py). "" =
    # $JDP_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/jdp/compile_cache, else
    # ~/.cache/jdp/compile_cache; "none" = no cache.
    c.compile_cache_dir = ""
    # A result of `python -m jdp.tune` (its tune.json), applied before validation: its
    # winner's values replace the searched keys; refused if the rest of the config is not
    # the one it was tuned for. "" = none.
    c.tune = ""
    return c

