"""Reusable Flax Linen models with a compute dtype and per-block remat.

`vit.py` owns the Vision Transformer, `resnet.py` the BatchNorm ResNet and
`remat.py` the names of the rematerialisation policies both accept. Build a
model by size name (`vit('small', ...)`, `resnet('50', ...)`) or directly.
"""

from jdp.models.remat import REMAT_POLICIES, remat_policy
from jdp.models.resnet import RESNET_SIZES, ResNet, resnet
from jdp.models.vit import VIT_SIZES, ViT, vit

__all__ = [
    "REMAT_POLICIES",
    "RESNET_SIZES",
    "VIT_SIZES",
    "ResNet",
    "ViT",
    "remat_policy",
    "resnet",
    "vit",
]
