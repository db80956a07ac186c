"""ViT classification. The default trains a small ViT on the built-in `digits`
dataset in about a minute on a CPU; `:cifar10` and `:imagenet2012` read those
TFDS datasets from `data.data_dir`.

    python -m jdp.main --config=experiments/vit.py --workdir=runs/vit
    python -m jdp.main --config=experiments/vit.py:cifar10 --workdir=runs/vit_c10 \
        --config.data.data_dir=/data/tfds
"""

import jax.numpy as jnp
import ml_collections

from jdp.config import defaults
from jdp.data.images import PRESETS
from jdp.models.vit import flops_per_example as vit_flops_per_example
from jdp.models.vit import vit


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults()
    config.model = ml_collections.ConfigDict()
    config.model.size = "nano"
    config.model.patch_size = 2
    config.model.pool = "gap"
    config.model.dropout_rate = 0.0

    dataset = arg or "digits"
    config.data.name = dataset
    if dataset == "digits":
        config.batch_size = 128
        config.total_steps = 600
        config.warmup_steps = 60
        config.learning_rate = 3e-3
        config.label_smoothing = 0.1  # 1,437 training images: a small ViT overfits without it
        config.eval_every_steps = 300
        config.log_every_steps = 50
    elif dataset == "cifar10":
        config.model.size = "tiny"
        config.model.patch_size = 4
        config.data.augment = True
        config.batch_size = 512
        config.total_steps = 20_000
        config.warmup_steps = 1_000
        config.learning_rate = 1e-3
        config.weight_decay = 0.05
        config.eval_every_steps = 1_000
    elif dataset == "imagenet2012":
        config.model.size = "small"
        config.model.patch_size = 16
        config.model.pool = "cls"
        config.data.augment = True
        config.batch_size = 1024
        config.total_steps = 300_000
        config.warmup_steps = 10_000
        config.learning_rate = 1e-3
        config.weight_decay = 0.05
        config.grad_clip_norm = 1.0
        config.compute_dtype = "bfloat16"
        config.eval_every_steps = 5_000
        config.checkpoint.every_steps = 2_000
    # Any other TFDS name prepared in data.data_dir trains with the defaults above.
    config.base_batch_size = config.batch_size
    return config


def build_model(config, *, num_classes):
    return vit(
        config.model.size,
        num_classes=num_classes,
        patch_size=config.model.patch_size,
        pool=config.model.pool,
        dropout_rate=config.model.dropout_rate,
        dtype=jnp.dtype(config.compute_dtype),
        remat=config.remat,
    )


def flops_per_example(config) -> float:
    """Model FLOPs per training example, for MFU (jdp.models.vit's formula), with the
    image geometry of the dataset's preset (other datasets: 224 x 224 x 3)."""
    preset = PRESETS.get(config.data.name)
    image_size = config.data.image_size or (preset.image.image_size if preset else 224)
    channels = preset.image.channels if preset else 3
    num_classes = config.data.num_classes or {"imagenet2012": 1000}.get(config.data.name, 10)
    return vit_flops_per_example(build_model(config, num_classes=num_classes),
                                 image_size=image_size, channels=channels)
