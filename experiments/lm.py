"""A decoder-only Transformer language model trained with next-token loss.

The default task is built in and needs no network: character-level addition
(`jdp.data.addition`), e.g. "347+85=" followed by the sum written least-
significant digit first ("234") and an end token. Only the answer tokens carry
loss weight, so every device holds a different number of real tokens; the loss
is still the weighted mean over the whole global batch. Reported: `eval/loss`,
`eval/token_accuracy` and `eval/exact_match` (every answer token right under
teacher forcing, which equals greedy decoding).

    python -m jdp.main --config=experiments/lm.py --workdir=runs/lm
"""

import jax.numpy as jnp
import ml_collections

from jdp import task
from jdp.config import defaults
from jdp.data import Data, addition
from jdp.models.transformer import flops_per_token, transformer


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg  # one variant for now
    config = defaults()
    config.model = ml_collections.ConfigDict()
    config.model.size = "tiny"
    config.model.positions = "rotary"
    config.model.dropout_rate = 0.0

    config.data.name = "addition"
    config.data.max_digits = 3
    config.data.num_train = 200_000
    config.data.num_eval = 1_000

    config.batch_size = 256
    config.total_steps = 600
    config.warmup_steps = 60
    config.learning_rate = 3e-3
    config.weight_decay = 0.01
    config.grad_clip_norm = 1.0
    config.base_batch_size = config.batch_size
    config.log_every_steps = 50
    config.eval_every_steps = 200
    config.eval_batch_size = 1_000
    return config


def build_data(config) -> Data:
    train, eval_source = addition.sources(
        seed=config.seed, max_digits=config.data.max_digits,
        num_train=config.data.num_train, num_eval=config.data.num_eval)
    return Data(train=train, eval=eval_source)  # examples are already token arrays


def build_task(config) -> task.Task:
    del config
    return task.next_token(inputs="inputs", targets="targets", weights="weights")


def build_model(config):
    return transformer(
        config.model.size,
        vocab_size=addition.VOCAB_SIZE,
        max_len=addition.sequence_length(config.data.max_digits),
        positions=config.model.positions,
        dropout_rate=config.model.dropout_rate,
        dtype=jnp.dtype(config.compute_dtype),
        remat=config.remat,
    )


def flops_per_example(config) -> float:
    """Model FLOPs per training sequence, for MFU (jdp.models.transformer's formula)."""
    model = build_model(config)
    length = addition.sequence_length(config.data.max_digits)
    return length * flops_per_token(hidden_size=model.hidden_size, num_layers=model.num_layers,
                                    mlp_dim=model.mlp_dim, vocab_size=model.vocab_size,
                                    length=length)
