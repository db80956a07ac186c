"""A ViT of 2,794 parameters on the built-in `digits`, trained for 12 steps with a
checkpoint every 4: the run whose step-4 checkpoint jax 0.10.2 wrote for
tests/test_jax_versions.py (make_fixture.py beside this file writes it)."""

import ml_collections

from jdp.config import defaults
from jdp.models.vit import ViT


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults()
    config.data.name = "digits"
    config.batch_size = 32
    config.base_batch_size = 32
    config.total_steps = 12
    config.warmup_steps = 2
    config.learning_rate = 3e-3
    config.log_every_steps = 1
    config.eval_every_steps = 0
    config.checkpoint.every_steps = 4
    config.tensorboard = False
    # jdp's default when the checkpoint was written (now 0.03): a run resumes only with
    # its saved config, so the experiment keeps the value it was saved with.
    config.data.eval_fraction = 0.01
    return config


def build_model(config, *, num_classes):
    return ViT(num_classes=num_classes, patch_size=4, hidden_size=16, num_layers=1,
               num_heads=2, mlp_dim=32)
