"""ResNet classification with BatchNorm over the global batch (both backends).
The default trains a tiny ResNet on the built-in `digits` dataset on a CPU;
`:cifar10` (ResNet-18) and `:imagenet2012` (ResNet-50) read TFDS datasets from
`data.data_dir`. SGD with Nesterov momentum and the linear LR scaling rule
(Goyal et al., 2017): `learning_rate` is the rate at `base_batch_size` = 256.

    python -m jdp.main --config=experiments/resnet.py --workdir=runs/resnet
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from jdp import DATA_AXIS
from jdp.config import defaults
from jdp.models import resnet


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults()
    config.model = ml_collections.ConfigDict()
    config.model.size = "tiny"
    config.momentum = 0.9
    config.lr_scaling = "linear"
    config.base_batch_size = 256
    config.weight_decay = 1e-4

    dataset = arg or "digits"
    config.data.name = dataset
    if dataset == "digits":
        config.batch_size = 128
        config.total_steps = 300
        config.warmup_steps = 30
        config.learning_rate = 0.2
        config.eval_every_steps = 150
    elif dataset == "cifar10":
        config.model.size = "18"
        config.data.augment = True
        config.batch_size = 512
        config.total_steps = 20_000
        config.warmup_steps = 500
        config.learning_rate = 0.1
        config.weight_decay = 5e-4
        config.eval_every_steps = 1_000
    elif dataset == "imagenet2012":
        config.model.size = "50"
        config.data.augment = True
        config.batch_size = 1024
        config.total_steps = 112_600  # 90 epochs
        config.warmup_steps = 6_250  # 5 epochs
        config.learning_rate = 0.1
        config.compute_dtype = "bfloat16"
        config.eval_every_steps = 5_000
        config.checkpoint.every_steps = 2_000
    # Any other TFDS name prepared in data.data_dir trains with the defaults above.
    return config


def build_model(config, *, num_classes):
    return resnet(
        config.model.size,
        num_classes=num_classes,
        small_inputs=config.data.name != "imagenet2012",
        dtype=jnp.dtype(config.compute_dtype),
        remat=config.remat,
        bn_axis_name=DATA_AXIS,  # statistics over the global batch
    )


def build_optimizer(config, learning_rate_fn):
    decay_kernels = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=decay_kernels),
        optax.sgd(learning_rate_fn, momentum=config.momentum, nesterov=True),
    )
