"""The model axis's rows of `bench memory` and `bench communication`: a GPT's train step
at each `model_parallel` on this process's devices, compiled from shapes alone (nothing
is allocated or run, so a CPU with 8 simulated devices stands in for 8 accelerators).

Read from the compiled program (the model axis's collectives are XLA's, inserted when
it partitions each layer, so the program as lowered has none): per device, the
arguments, temporaries and the params + optimizer state it holds; per step, what a
device sends over the model axis (the activations' all-reduces) and over the data axes
(the gradient reduction), with ring algorithms. The vocabulary is padded to a multiple
of 128 (GPT-2's 50,257 ids to 50,304, as Megatron-LM pads it) so that every
`model_parallel` up to 128 splits it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.dryrun import estimate, hlo
from jdp.dryrun.lowering import compile_to_read, lower_from_shapes
from jdp.errors import ConfigError
from jdp.experiment import adapters
from jdp.experiment.task import next_token
from jdp.models import axes, transformer
from jdp.parallel import StepOptions, compiler_options, make_backend
from jdp.parallel import mesh as mesh_lib

VOCAB_MULTIPLE = 128
GPT2_VOCAB = 50257


def add_arguments(parser) -> None:
    parser.add_argument("--model_axis", action="store_true",
                        help="instead: a GPT's step at model_parallel = 1, 2, 4, ... up to "
                             "the devices")
    parser.add_argument("--gpt", default="gpt2_small",
                        help="with --model_axis: the Transformer size (jdp.models)")
    parser.add_argument("--seq_len", type=int, default=1024, help="with --model_axis")
    parser.add_argument("--global_batch_size", type=int, default=8,
                        help="with --model_axis: sequences per step, the same at every M")
    parser.add_argument("--per_replica_batch_size", type=int, default=0,
                        help="with --model_axis: instead, sequences per data replica (the "
                             "global batch shrinks as M grows)")


@dataclasses.dataclass(frozen=True)
class Setting:
    gpt: str
    seq_len: int
    global_batch_size: int
    dtype: str  # compute dtype
    remat: str
    per_replica_batch_size: int = 0  # > 0: instead of global_batch_size

    def batch(self, model_parallel: int) -> int:
        """The global batch at `model_parallel`."""
        if self.per_replica_batch_size:
            return self.per_replica_batch_size * jax.device_count() // model_parallel
        return self.global_batch_size

    def describe(self, model_parallel: int) -> str:
        batch = (f"{self.per_replica_batch_size} a data replica" if self.per_replica_batch_size
                 else "global")
        return (f"{self.gpt} (vocabulary padded to a multiple of {VOCAB_MULTIPLE}), "
                f"{self.seq_len} tokens, {self.dtype}, remat {self.remat}, batch "
                f"{self.batch(model_parallel)} ({batch}) on {jax.device_count()} devices")


def setting(args, dtype: str, remat: str) -> Setting:
    return Setting(args.gpt, args.seq_len, args.global_batch_size, dtype, remat,
                   args.per_replica_batch_size)


@dataclasses.dataclass(frozen=True)
class Row:
    argument_bytes: int  # per device
    temp_bytes: int
    state_bytes: int  # params and optimizer state one device holds
    model_axis_sent: float  # bytes a device sends per step over the model axis
    data_axis_sent: float  # ... over the data axes (the gradient reduction)
    model_axis_ops: int  # collectives over the model axis per step


def model_parallel_values(device_count: int) -> list[int]:
    """1, 2, 4, ... up to `device_count`: the powers of two that divide it."""
    return [2**i for i in range(int(math.log2(device_count)) + 1) if device_count % 2**i == 0]


def gpt_step(setting: Setting, model_parallel: int) -> Row:
    """The GPT's step at `model_parallel` over every device (one host), read as compiled."""
    mesh = mesh_lib.make_mesh(model_parallel=model_parallel)
    vocab = math.ceil(GPT2_VOCAB / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    model = adapters.from_linen(transformer(
        setting.gpt, vocab_size=vocab, max_len=setting.seq_len,
        dtype=jnp.dtype(setting.dtype), remat=setting.remat))
    options = StepOptions(
        compiler_options=compiler_options(jax.default_backend(), setting.remat),
        axis_rules=axes.RULES)
    backend = make_backend("pjit", mesh, model, next_token(exact_match=False),
                           optax.adamw(1e-3), options)
    tokens = np.zeros((setting.seq_len,), np.int32)
    example = {"inputs": tokens, "targets": tokens, "weights": np.ones_like(tokens, np.float32)}
    lowered, state = lower_from_shapes(backend, (tokens[None],), example,
                                       setting.batch(model_parallel))
    compiled = compile_to_read(lowered, options.compiler_options)
    memory = compiled.memory_analysis()
    replica_of = mesh_lib.data_replica_of(mesh)
    model_ops, data_ops = [], []
    for op in hlo.collectives(compiled.as_text()):
        (model_ops if estimate.over_model_axis(op, replica_of) else data_ops).append(op)
    return Row(memory.argument_size_in_bytes, memory.temp_size_in_bytes,
               mesh_lib.device_bytes((state.params, state.opt_state)),
               sum(op.ring_bytes_sent(mesh.size) for op in model_ops),
               sum(op.ring_bytes_sent(mesh.size) for op in data_ops), len(model_ops))


def rows(setting: Setting):
    """(model_parallel, its Row, or the one line that refuses it: a split dimension it
    does not divide, GPT-2 small's 12 heads at 8), yielded as they come (a compile each)."""
    devices = jax.device_count()
    for model_parallel in model_parallel_values(devices):
        if setting.batch(model_parallel) % (devices // model_parallel):
            raise SystemExit(f"--global_batch_size={setting.global_batch_size}: not divisible "
                             f"by the {devices // model_parallel} data-parallel devices at "
                             f"model_parallel={model_parallel}. Fix: a multiple of {devices}.")
        try:
            yield model_parallel, gpt_step(setting, model_parallel)
        except ConfigError as e:
            yield model_parallel, str(e)
