"""One decoding step as a pure tensor function, for runtimes that run a traced graph.

``DecodeStep(model)`` computes what ``model(ids, cache=cache)`` computes for one new token per
row, with the static cache passed in and the new state passed out (no Python state, no in-place
writes, no data-dependent control flow), so that ``torch.export`` / ``torch.onnx.export`` can
trace it. The caller (``wiola.export.runner.StepDriver``) keeps the cache buffers and writes
each step's new key and value into them. The norms, the rotation and the gate are the reference
ops themselves (``wiola.ops``); attention is written for one query over the cache plus itself.

Inputs (``L`` layers, ``B`` rows, ``S`` cache slots, ``H`` heads, ``D`` head width):

- ``input_ids`` ``(B, 1)`` int64: the new token of each row;
- ``position`` ``(B,)`` int64: its position (the number of real tokens before it in its row);
- ``real`` ``(B,)`` float32: 1 for a real token, 0 for left padding (left out of the gate's mean);
- ``key_mask`` ``(B, S)`` bool: the cached slots holding real tokens (the new token is not
  among them: it attends to itself separately);
- ``k_cache``, ``v_cache`` ``(L, B, H, S, D)`` float32: rotated keys and values;
- ``gate_sum`` ``(L, B, D)``, ``gate_count`` ``(L, B)`` float32: the gate's running state.

Outputs: ``logits`` ``(B, V)`` float32, the token's rotated keys and values ``(L, B, H, D)``, and
the new ``gate_sum`` and ``gate_count``.

Weights: the model's fp32 parameters; for a quantized model (``wiola.fast.quantize``), the
int8 matrices stay int8 in the graph with their per-row scales and are dequantized there
(``q · scale``, the oracle's weights exactly), int4 ones stay packed two a byte with their
per-group scales (unpacked in fp32 arithmetic: ``hi = floor(u / 16)``, ``lo = u − 16·hi``, each
exact, then ``(u − 8) · scale``: again the oracle's weights exactly), and bf16 ones stay bf16 and
are widened.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wiola.export.runner import INPUT_NAMES, StepFn
from wiola.fast.quantize import LAYER_MATRICES
from wiola.ops.gate import gate
from wiola.ops.rms_norm import rms_norm
from wiola.ops.rope import apply_rope, helix_frequencies

if TYPE_CHECKING:
    from wiola.model import WiolaModel

OUTPUT_NAMES = ("logits", "k_new", "v_new", "gate_sum_out", "gate_count_out")


def unpack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """``(..., K/2)`` uint8, two int4 weights a byte (low nibble first) -> ``(..., K)`` fp32 nibble
    values 0-15, in float arithmetic only (exact; exports to plain ONNX ops)."""
    f = u.to(torch.float32)
    hi = torch.floor(f / 16.0)
    return torch.stack((f - 16.0 * hi, hi), dim=-1).flatten(-2)


class PackedMatrix(nn.Module):
    """An ``(out, in)`` weight as the graph stores it: fp32, bf16, int8 with fp32 row scales, or
    int4 (uint8 ``(out, in/2)``) with fp32 ``(out, in/group)`` group scales."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone().contiguous())
        self.register_buffer("scale", None if scale is None else scale.detach().clone().contiguous())

    def _widen(self, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if w.dtype == torch.uint8:  # int4: (u - 8) · its group's scale
            q = unpack_nibbles(w) - 8.0
            groups = scale.shape[-1]
            return (q.unflatten(-1, (groups, -1)) * scale.unsqueeze(-1)).flatten(-2)
        w = w.to(torch.float32)
        return w if scale is None else w * scale.unsqueeze(-1)

    def dense(self) -> torch.Tensor:
        """The fp32 matrix (the dequantized one for int8 and int4, the widened one for bf16)."""
        return self._widen(self.weight, self.scale)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` in fp32 (the embedding lookup)."""
        return self._widen(self.weight[index], None if self.scale is None else self.scale[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense())


class DecodeStep(nn.Module):
    """The traceable one-token step of ``model`` (see the module). ``model`` is left untouched."""

    def __init__(self, model: WiolaModel) -> None:
        super().__init__()
        c = model.config
        if model.embed.weight.dtype != torch.float32:
            raise ValueError(f"export: the model is {model.embed.weight.dtype}; export an fp32 (or quantized) model")
        self.config = c
        self.n_layers, self.n_heads, self.head_dim = c.n_layers, c.n_heads, c.head_dim
        self.eps, self.gate, self.gate_pre_rope = c.norm_eps, c.gate, c.gate_pre_rope
        self.scheme = getattr(model, "quantization", None)
        packed = getattr(model, "quantized", None) or {}
        params = dict(model.named_parameters())

        def matrix(name: str) -> PackedMatrix:
            if name in packed:
                q, scale = packed[name]
                return PackedMatrix(q, scale)
            return PackedMatrix(params[name])

        self.embed = matrix("embed.weight")
        self.matrices = nn.ModuleList(  # per layer: "q_proj", ..., "down_proj"
            nn.ModuleDict({m.split(".")[1]: matrix(f"layers.{i}.{m}.weight") for m in LAYER_MATRICES})
            for i in range(c.n_layers)
        )
        small = {}
        for i, block in enumerate(model.layers):
            small[f"attn_norm_{i}"] = block.attn_norm.weight
            small[f"ffn_norm_{i}"] = block.ffn_norm.weight
            if c.gate:
                small[f"gate_w1_{i}"] = block.attn.gate_w1.weight
                small[f"gate_w2_{i}"] = block.attn.gate_w2.weight
                small[f"gate_b2_{i}"] = block.attn.gate_w2.bias
        small["norm"] = model.norm.weight
        for name, t in small.items():
            self.register_buffer(name, t.detach().to(torch.float32).clone())
        self.register_buffer("freqs", helix_frequencies(c.head_dim, c.rope_base, c.helix_alpha))

    def forward(
        self,
        input_ids: torch.Tensor,
        position: torch.Tensor,
        real: torch.Tensor,
        key_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        gate_sum: torch.Tensor,
        gate_count: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B = input_ids.shape[0]
        H, D = self.n_heads, self.head_dim
        angles = position.to(torch.float32).unsqueeze(-1) * self.freqs  # (B, D/2)
        cos, sin = torch.cos(angles).unsqueeze(1), torch.sin(angles).unsqueeze(1)  # (B, T=1, D/2)
        scale = 1.0 / math.sqrt(D)
        masked = torch.zeros_like(key_mask, dtype=torch.float32).masked_fill(~key_mask, float("-inf"))
        masked = masked.unsqueeze(1)  # (B, 1, S)
        real_mask = real.unsqueeze(1)  # (B, T=1)

        h = self.embed.rows(input_ids[:, 0])  # (B, d)
        residual = torch.zeros_like(h)
        keys, values, sums, counts = [], [], [], []
        for i in range(self.n_layers):
            mats = self.matrices[i]
            residual = residual + h
            x = rms_norm(residual, getattr(self, f"attn_norm_{i}"), self.eps)
            q = mats["q_proj"](x).view(B, 1, H, D)
            k = mats["k_proj"](x).view(B, 1, H, D)
            v = mats["v_proj"](x).view(B, H, D)
            if self.gate:
                w = (getattr(self, f"gate_{n}_{i}") for n in ("w1", "w2", "b2"))
                rope = {} if self.gate_pre_rope else {"cos": cos, "sin": sin}
                carry = (gate_sum[i], gate_count[i])
                g, running, count = gate(q, *w, attention_mask=real_mask, carry=carry, **rope)
                g = g[:, 0]  # (B, H)
                sums.append(running)
                counts.append(count.to(torch.float32))
            else:
                g = torch.ones(B, H, dtype=torch.float32)
                sums.append(gate_sum[i])
                counts.append(gate_count[i])
            qr, kr = apply_rope(q, cos, sin)[:, 0], apply_rope(k, cos, sin)[:, 0]  # (B, H, D)
            gs = g * scale  # (B, H)
            cached = torch.einsum("bhd,bhsd->bhs", qr, k_cache[i]) * gs.unsqueeze(-1) + masked
            own = (qr * kr).sum(dim=-1) * gs  # the token's score for its own key
            p = torch.softmax(torch.cat((cached, own.unsqueeze(-1)), dim=-1), dim=-1)
            o = torch.einsum("bhs,bhsd->bhd", p[..., :-1], v_cache[i]) + p[..., -1:] * v
            h = mats["o_proj"](o.reshape(B, H * D))
            residual = residual + h
            x = rms_norm(residual, getattr(self, f"ffn_norm_{i}"), self.eps)
            a, b = mats["up_proj"](x).chunk(2, dim=-1)
            h = mats["down_proj"](F.silu(a) * b + mats["bypass_proj"](x))
            keys.append(kr)
            values.append(v)
        x = rms_norm(residual + h, self.norm, self.eps)
        logits = self.embed(x)
        return logits, torch.stack(keys), torch.stack(values), torch.stack(sums), torch.stack(counts)

    def example_inputs(self, batch_size: int, slots: int) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes and dtypes (an empty cache of ``slots`` slots) for tracing."""
        L, H, D = self.n_layers, self.n_heads, self.head_dim
        B, S = batch_size, slots
        return (
            torch.zeros(B, 1, dtype=torch.int64),
            torch.zeros(B, dtype=torch.int64),
            torch.ones(B, dtype=torch.float32),
            torch.zeros(B, S, dtype=torch.bool),
            torch.zeros(L, B, H, S, D),
            torch.zeros(L, B, H, S, D),
            torch.zeros(L, B, D),
            torch.zeros(L, B),
        )


def torch_runner(step: DecodeStep) -> StepFn:
    """``StepDriver``'s ``run`` for a PyTorch ``DecodeStep``: the eager oracle of an export."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            outs = step(*(torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in INPUT_NAMES))
        return [o.numpy() for o in outs]

    return run
