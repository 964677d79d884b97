"""The paper's math as small readable functions: the oracle for every kernel in ``kernels/``
and the CPU path of the model. Each function here has a fused twin of the same name and
signature in ``kernels/<op>.py``, except the ablations' feed-forward blocks (``mlp``), which
both model classes run as written here."""

from wiola.ops.attention import attention, gated_attention
from wiola.ops.butterfly import butterfly
from wiola.ops.cross_entropy import linear_cross_entropy
from wiola.ops.decode import decode_attention
from wiola.ops.gate import gate
from wiola.ops.mlp import gelu_mlp, swiglu
from wiola.ops.rms_norm import rms_norm
from wiola.ops.rope import apply_rope, helix_frequencies, positions_from_mask, rope_tables

__all__ = [
    "apply_rope",
    "attention",
    "butterfly",
    "decode_attention",
    "gate",
    "gated_attention",
    "gelu_mlp",
    "helix_frequencies",
    "linear_cross_entropy",
    "positions_from_mask",
    "rms_norm",
    "rope_tables",
    "swiglu",
]
