"""An experiment file of synthetic batches of real shape, for `python -m jdp.bench gpu`:
random pixels or tokens held in memory, so the loop measures the model, not a dataset.

    --config=jdp/bench/synthetic.py:vit_b16     # ViT-B/16, 224 x 224 RGB, 1000 classes
    --config=jdp/bench/synthetic.py:gpt2_small  # GPT-2 small, 1024 tokens, vocab 50257
    --config=jdp/bench/synthetic.py:smoke_vit   # tiny shapes of each, for CPU smoke runs
    --config=jdp/bench/synthetic.py:smoke_lm
"""

import ml_collections
import numpy as np

from jdp import task
from jdp.config import defaults
from jdp.data import Data
from jdp.models.transformer import TRANSFORMER_SIZES, flops_per_token, transformer
from jdp.models.vit import flops_per_example as vit_flops_per_example
from jdp.models.vit import vit

# variant -> (kind, model size, image size or sequence length, classes or vocabulary,
# global batch, compute dtype, patch size)
VARIANTS = {
    "vit_b16": ("vit", "base", 224, 1000, 256, "bfloat16", 16),
    "gpt2_small": ("lm", "gpt2_small", 1024, 50257, 32, "bfloat16", 0),
    "smoke_vit": ("vit", "nano", 16, 10, 16, "float32", 4),
    "smoke_lm": ("lm", "nano", 32, 128, 16, "float32", 0),
}
_DISTINCT_BATCHES = 2  # examples held: this many global batches, cycled


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "smoke_vit"
    if variant not in VARIANTS:
        raise ValueError(f"jdp/bench/synthetic.py:{variant}: unknown variant; use one of "
                         f"{', '.join(VARIANTS)}")
    kind, size, length, classes, batch, dtype, patch = VARIANTS[variant]
    config = defaults()
    config.model = ml_collections.ConfigDict(dict(kind=kind, size=size, length=length,
                                                  classes=classes, patch_size=patch))
    config.batch_size = config.base_batch_size = config.eval_batch_size = batch
    config.compute_dtype = dtype
    config.total_steps, config.warmup_steps = 30, 5
    config.log_every_steps, config.eval_every_steps = 10, 0
    config.tensorboard = False
    return config


class _Arrays:
    """Examples as rows of in-memory arrays; `get_batch` lets jdp read them at once."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, index: int) -> dict:
        return {key: value[index] for key, value in self.arrays.items()}

    def get_batch(self, indices) -> dict:
        return {key: value[np.asarray(indices)] for key, value in self.arrays.items()}


def _examples(model, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if model.kind == "vit":
        shape = (count, model.length, model.length, 3)
        return {"image": rng.integers(0, 256, shape, dtype=np.uint8),
                "label": rng.integers(0, model.classes, count).astype(np.int32)}
    tokens = rng.integers(0, model.classes, (count, model.length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((count, model.length), np.float32)}


def _pixels_to_float(batch: dict) -> dict:
    import jax.numpy as jnp

    return {**batch, "image": batch["image"].astype(jnp.float32) / 255.0}


def build_data(config) -> Data:
    rng = np.random.default_rng(config.seed)
    train = _Arrays(_examples(config.model, _DISTINCT_BATCHES * config.batch_size, rng))
    evaluation = _Arrays(_examples(config.model, config.eval_batch_size, rng))
    is_vit = config.model.kind == "vit"
    return Data(train, evaluation, batch_preprocess=lambda batch, rngs: batch,
                num_classes=config.model.classes if is_vit else None,
                device_preprocess=_pixels_to_float if is_vit else None)


def build_task(config) -> task.Task:
    return task.classification() if config.model.kind == "vit" else task.next_token(
        exact_match=False)


def build_model(config, **unused):
    import jax.numpy as jnp

    model = config.model
    if model.kind == "vit":
        return vit(model.size, num_classes=model.classes, patch_size=model.patch_size,
                   dtype=jnp.dtype(config.compute_dtype))
    return transformer(model.size, vocab_size=model.classes, max_len=model.length,
                       dtype=jnp.dtype(config.compute_dtype))


def flops_per_example(config) -> float:
    """Model FLOPs of one training example, as jdp's experiments count them."""
    model = config.model
    if model.kind == "vit":
        return vit_flops_per_example(build_model(config), image_size=model.length, channels=3)
    size = TRANSFORMER_SIZES[model.size]
    return model.length * flops_per_token(
        hidden_size=size["hidden_size"], num_layers=size["num_layers"],
        mlp_dim=size["mlp_dim"], vocab_size=model.classes, length=model.length)
