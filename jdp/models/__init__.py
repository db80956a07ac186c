"""Reusable Flax Linen models with a compute dtype and per-block remat.

`vit.py` owns the Vision Transformer, `resnet.py` the BatchNorm ResNet,
`transformer.py` the decoder-only language model and `remat.py` the names of
the rematerialisation policies they accept. Build a model by size name
(`vit('small', ...)`, `resnet('50', ...)`, `transformer('tiny', ...)`) or directly.
"""

from jdp.models.remat import REMAT_POLICIES, remat_policy
from jdp.models.resnet import RESNET_SIZES, ResNet, resnet
from jdp.models.transformer import TRANSFORMER_SIZES, Transformer, transformer
from jdp.models.vit import VIT_SIZES, ViT, vit

__all__ = [
    "REMAT_POLICIES",
    "RESNET_SIZES",
    "TRANSFORMER_SIZES",
    "VIT_SIZES",
    "ResNet",
    "Transformer",
    "ViT",
    "remat_policy",
    "resnet",
    "transformer",
    "vit",
]
