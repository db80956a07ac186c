"""The export's self-check: `transformers` loads the written directory (PyTorch, CPU)
and its logits on real token sequences must equal jdp's.

The tolerance scales with the logits: max |jdp - transformers| <= TOLERANCE * max(1,
max |logits|). Both sides compute in float32 from the same (exported) weights, so what
remains is float32 rounding in a different order of operations.
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np

TOLERANCE = 1e-4
INSTALL_HINT = "pip install 'jdp[hf]' and a torch (its CPU build is enough)"


class ExportMismatch(Exception):
    """transformers computes other logits from the export than jdp from the run."""


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:  # the export is written all the same, and said to be unchecked
        return False
    return True


def _release_freed_memory() -> None:
    """Hands the heap that jdp's forward pass freed back to the system (glibc keeps it
    otherwise), so transformers' copy of the model does not come on top of it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak is higher, nothing else
        pass


def transformers_logits(directory: str, tokens: np.ndarray) -> np.ndarray:
    """Float32 logits of the model saved in `directory` on `tokens` [batch, length]."""
    _release_freed_memory()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    del model
    gc.collect()
    return logits


def check(directory: str, tokens: np.ndarray, jdp_logits: np.ndarray) -> float:
    """The max abs difference of transformers' logits from `jdp_logits`; ExportMismatch
    above the tolerance."""
    theirs = transformers_logits(directory, tokens)
    if theirs.shape != jdp_logits.shape:
        raise ExportMismatch(f"transformers' logits have shape {theirs.shape}, jdp's "
                             f"{jdp_logits.shape}")
    difference = float(np.abs(theirs - jdp_logits).max())
    bound = TOLERANCE * max(1.0, float(np.abs(jdp_logits).max()))
    if not difference <= bound:
        raise ExportMismatch(f"transformers' logits differ from jdp's by up to {difference:.3g} "
                             f"(allowed {bound:.3g}) on {tokens.shape[0]} sequences of "
                             f"{tokens.shape[1]} tokens")
    return difference
