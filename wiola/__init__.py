"""Wiola: gated helical attention, a causal cumulative-mean gate and a butterfly feed-forward
block (docs/SPEC.md). ``wiola.WiolaModel`` is the readable PyTorch reference; ``wiola.fast.WiolaModel``
is the same model on fused Triton kernels."""

from wiola.budget import Budget, budget
from wiola.cache import Cache
from wiola.config import PRESETS, WiolaConfig
from wiola.model import ModelOutput, WiolaModel

__all__ = ["PRESETS", "Budget", "Cache", "ModelOutput", "WiolaConfig", "WiolaModel", "budget"]
__version__ = "0.1.0"
