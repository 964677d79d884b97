"""The argument layout of the C++ CPU decoding step (``decode_step_cpu.cpp``), written once.

The step reads raw pointers in a fixed order: ``GLOBALS`` (the tied embedding/head, the final
norm's γ, the helical frequencies), then ``PER_LAYER`` for every layer, then the cache's
``STATE`` buffers, with the sizes in ``DIMS``. Everything that gathers or checks those arguments
derives from these tables: the pointer arrays and shape checks of
``wiola.fast.decode_step_cpu.DecodeStepCPU``, the matrices ``wiola.fast.quantize`` packs
(``LAYER_MATRICES``, the rows whose ``matrix`` flag is set), and the check at load that the
compiled library's enums have the same lengths (``check_counts`` against
``wiola_layout_counts()``), so a drift between the C++ and this table is refused instead of
silently misread.

A shape is a tuple of symbols of ``WiolaConfig`` sizes: ``V`` vocabulary, ``d`` model width,
``H`` heads, ``D`` head width, ``half`` ``D/2``, ``F`` feed-forward width, ``2F`` its doubled up
projection.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from wiola.config import WiolaConfig


@dataclass(frozen=True)
class Slot:
    """One weight pointer: its C++ enum name, the model attribute path (``None``-able gate
    tensors are absent without a gate), its shape in symbols, and whether it is a matrix the
    step streams (packed by ``wiola.fast.quantize``; the others stay fp32)."""

    enum: str
    path: str
    shape: tuple[str, ...]
    matrix: bool = False
    gate: bool = False


GLOBALS: tuple[Slot, ...] = (
    Slot("kEmbed", "embed.weight", ("V", "d"), matrix=True),
    Slot("kFinalNorm", "norm.weight", ("d",)),
    Slot("kFreqs", "rope_freqs", ("half",)),
)
PER_LAYER: tuple[Slot, ...] = (
    Slot("kAttnNorm", "attn_norm.weight", ("d",)),
    Slot("kWq", "attn.q_proj.weight", ("d", "d"), matrix=True),
    Slot("kWk", "attn.k_proj.weight", ("d", "d"), matrix=True),
    Slot("kWv", "attn.v_proj.weight", ("d", "d"), matrix=True),
    Slot("kWo", "attn.o_proj.weight", ("d", "d"), matrix=True),
    Slot("kGateW1", "attn.gate_w1.weight", ("H", "D"), gate=True),
    Slot("kGateW2", "attn.gate_w2.weight", ("H", "H"), gate=True),
    Slot("kGateB2", "attn.gate_w2.bias", ("H",), gate=True),
    Slot("kFfnNorm", "ffn_norm.weight", ("d",)),
    Slot("kWUp", "ffn.up_proj.weight", ("2F", "d"), matrix=True),
    Slot("kWBp", "ffn.bypass_proj.weight", ("F", "d"), matrix=True),
    Slot("kWDown", "ffn.down_proj.weight", ("d", "F"), matrix=True),
)
# The cache buffers: (name, dtype, shape in symbols; R the cache's rows, S its slots, L layers).
STATE: tuple[tuple[str, torch.dtype, tuple[str, ...]], ...] = (
    ("k", torch.float32, ("L", "R", "H", "S", "D")),
    ("v", torch.float32, ("L", "R", "H", "S", "D")),
    ("key_mask", torch.bool, ("R", "S")),
    ("gate_sum", torch.float32, ("L", "R", "D")),
    ("gate_count", torch.int64, ("L", "R")),
    ("n_real", torch.int64, ("R",)),
)
# The int64 dims array, in the C++'s Dim order: the sizes, gate on, gate before RoPE, the weight type,
# then the tuning chosen for the CPU with the matrices' bytes it was chosen for
# (wiola.fast.decode_step_cpu.choose_tuning), then the int4 group
# the binding packs (checked against the one the library was compiled for).
DIMS = (
    "R", "V", "d", "L", "H", "D", "F", "S", "gate", "gate_pre_rope", "weight_type",
    "stream_head", "prefetch_rows", "bytes_per_thread", "matrix_bytes", "group",
)  # fmt: skip
WEIGHT_TYPES = {
    None: (0, torch.float32), "bf16": (1, torch.bfloat16), "int8": (2, torch.int8), "int4": (3, torch.uint8),
}  # the C++'s enum; int4 packs two weights a byte  # fmt: skip
LAYER_MATRICES = tuple(s.path.removesuffix(".weight") for s in PER_LAYER if s.matrix)  # quantize's per-layer list


def counts() -> tuple[int, int, int, int]:
    """``(dims, global slots, slots per layer, cache buffers)``: what ``wiola_layout_counts`` must report."""
    return len(DIMS), len(GLOBALS), len(PER_LAYER), len(STATE)


def check_counts(reported: tuple[int, ...], where: str) -> None:
    """Raise ``RuntimeError`` naming both when the compiled library's layout lengths differ from
    this table's (a library from another source, or an enum edited on one side only)."""
    if tuple(reported) != counts():
        names = ("dims", "global slots", "slots per layer", "cache buffers")
        diff = ", ".join(f"{n} {r} != {c}" for n, r, c in zip(names, reported, counts(), strict=True) if r != c)
        raise RuntimeError(f"{where}: the compiled step's layout differs from wiola.fast.step_layout ({diff})")


def sizes(config: WiolaConfig, rows: int = 1, slots: int = 1) -> dict[str, int]:
    """The value of every shape symbol for ``config`` and a cache of ``rows`` x ``slots``."""
    c = config
    return {
        "V": c.vocab_size, "d": c.d_model, "H": c.n_heads, "D": c.head_dim, "half": c.head_dim // 2,
        "F": c.d_ff, "2F": 2 * c.d_ff, "L": c.n_layers, "R": rows, "S": slots,
    }  # fmt: skip


def shape(symbols: tuple[str, ...], size: dict[str, int]) -> tuple[int, ...]:
    return tuple(size[s] for s in symbols)


def slots(n_layers: int) -> list[tuple[str, Slot]]:
    """Every weight slot in the step's order, as ``(model attribute path, Slot)``."""
    out = [(s.path, s) for s in GLOBALS]
    for i in range(n_layers):
        out += [(f"layers.{i}.{s.path}", s) for s in PER_LAYER]
    return out


def matrix_slots(n_layers: int) -> list[int]:
    """The positions (in ``slots`` order) of the matrices a quantized model packs, in the order of
    ``matrix_names``."""
    return [i for i, (_, s) in enumerate(slots(n_layers)) if s.matrix]


@functools.cache
def matrix_names(n_layers: int) -> tuple[str, ...]:
    """The parameter names of the packed matrices, in the step's order (made once per depth: the
    binding's check before every step reads them)."""
    return tuple(path for path, s in slots(n_layers) if s.matrix)


def tensor_at(model: torch.nn.Module, path: str) -> torch.Tensor | None:
    """The tensor at attribute path ``path`` of ``model`` (None where a module is absent: the
    gate of a model without one)."""
    obj: object = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)  # type: ignore[index]
        if obj is None:
            return None
    return obj  # type: ignore[return-value]
