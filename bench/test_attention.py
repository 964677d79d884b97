"""Gated helical attention (issue 4), CUDA only: forward and forward + backward, bf16.

Ours (kernels/attention.py: RoPE in registers, gate inside the softmax, one fused kernel each
way) against what a user would write instead, all computing the same function:

- ``reference``: wiola.ops.attention (eager, materialises the (B, H, T, T) scores);
- ``torch.compile``: the same reference under ``torch.compile``;
- ``sdpa+rope``: a separate RoPE pass (wiola.ops.apply_rope), the gate folded into a scaled copy
  of the rotated queries (``⟨g·q̃, k̃⟩ = g·⟨q̃, k̃⟩``), then causal
  ``F.scaled_dot_product_attention`` on (B, H, T, D) views (the flash backend on an H200);
- ``flex``: FlexAttention with the gate as a ``score_mod`` (``score · g[b, h, q]``) and a causal
  block mask, RoPE before it, the whole function under ``torch.compile`` (gradients flow to g
  through the captured tensor; if this torch cannot do that, it is recorded as unavailable), and
  ``flex (gate in q)``: the same without the score_mod, the gate folded into q as for SDPA.

q, k, v are the three slices of one fused (B, T, 3, H, D) projection, as in the model; the
gradients measured are those of q, k, v and g. Shapes: the paper's (B 32, T 512, H 8, D 32), a
long context (B 8, T 2048, H 8, D 32), and a wider head (B 4, T 4096, H 8, D 64). The paper's
shape forward + backward is the device check's headline (``-m headline``), measured there against
SDPA and the reference only (``WIOLA_BENCH_COMPILED=0``); the compiled baselines come last.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from bench import roofline
from bench.frame import compile_heavy, rel_err, shape_id, wrapper_for
from wiola.ops import apply_rope, helix_frequencies, rope_tables
from wiola.ops import attention as reference

SHAPES = [
    dict(B=32, T=512, H=8, D=32),
    dict(B=8, T=2048, H=8, D=32),
    dict(B=4, T=4096, H=8, D=64),
]
MODES = ["fwd", "fwd_bwd"]
# The device check's headline (``-m headline``): the paper's shape, forward + backward.
CASES = [
    pytest.param(shape, mode, marks=[pytest.mark.headline] if (shape is SHAPES[0] and mode == "fwd_bwd") else [])
    for shape in SHAPES
    for mode in MODES
]
DTYPE = torch.bfloat16
CLOSE = 2e-2  # bf16 relative max error (tests/conftest.py TOL)


def sdpa_rope(q, k, v, g, cos, sin):
    """RoPE pass, gate folded into the rotated queries, causal SDPA; ``(B, T, H, D)`` out."""
    qr = apply_rope(q, cos, sin)
    kr = apply_rope(k, cos, sin)
    qg = (qr.float() * g[..., None]).to(q.dtype)
    o = F.scaled_dot_product_attention(qg.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


def _flex(gate_in_q: bool = False) -> Callable | str:
    """FlexAttention after a RoPE pass, compiled as one function; a string when it is missing.

    ``gate_in_q=False``: the gate is a ``score_mod`` (``score · g[b, h, q]``, gradient to g through
    the captured tensor). ``True``: no score_mod, the gate folded into the queries as for SDPA — a
    fallback measurement where this torch cannot differentiate through a captured tensor.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:
        return f"FlexAttention not importable: {type(exc).__name__}: {exc}"
    masks: dict = {}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def flex(q, k, v, g, cos, sin, block_mask):
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if gate_in_q:
            qr, score_mod = (qr.float() * g[..., None]).to(q.dtype), None
        else:
            gate = g.transpose(1, 2)  # (B, H, T)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score * gate[b, h, q_idx]

        o = flex_attention(
            qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=block_mask
        )
        return o.transpose(1, 2)

    compiled = torch.compile(flex, fullgraph=True)

    def run(q, k, v, g, cos, sin):
        T = q.shape[1]
        if T not in masks:
            masks[T] = create_block_mask(causal, B=None, H=None, Q_LEN=T, KV_LEN=T, device=q.device)
        return compiled(q, k, v, g, cos, sin, masks[T])

    return run


@pytest.mark.parametrize("shape, mode", CASES, ids=[f"{shape_id(c.values[0])}-{c.values[1]}" for c in CASES])
def test_attention(cuda_bench, shape, mode):
    attention_kernels = pytest.importorskip("wiola_kernels.attention")
    ours = attention_kernels.attention
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    freqs = helix_frequencies(D)  # the model's helix_alpha = 0.05

    def inputs():  # fresh random data: q, k, v slices of one fused projection, a gate in (0, 1)
        qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=DTYPE, requires_grad=mode == "fwd_bwd")
        q, k, v = qkv.unbind(2)
        g = torch.sigmoid(torch.randn(B, T, H, device="cuda")).requires_grad_(mode == "fwd_bwd")
        cos, sin = rope_tables(torch.arange(T, device="cuda").expand(B, T), freqs)  # (B, T, D/2) fp32
        return q, k, v, g, cos, sin

    heavy, notes = compile_heavy(
        {"torch.compile": lambda: torch.compile(reference), "flex": _flex, "flex (gate in q)": lambda: _flex(True)}
    )
    flex = {name: f for name, f in heavy.items() if name != "torch.compile" and callable(f)}
    impls = {"ours": ours, "reference": reference, "sdpa+rope": sdpa_rope, **flex}  # torch.compile: the reference
    # Same function, checked once on one input set before timing. Ours must agree: asserted after
    # its time is recorded (a wrong kernel fails the test but its measurement is kept, marked). A
    # baseline that fails or disagrees is recorded as unavailable with the reason, not timed.
    failed: dict[str, str] = {}
    errors: dict[str, float] = {}
    with torch.no_grad():
        args = [a.detach() for a in inputs()]
        want = reference(*args).float()
        for name, f in impls.items():
            try:
                got = f(*args)
            except Exception as exc:
                if name in ("ours", "reference", "sdpa+rope"):
                    raise
                failed[name] = f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            errors[name] = err = rel_err(want, got.float())
            if err > CLOSE:
                failed[name] = f"{name}: relative error {err:.3e} against the reference > {CLOSE}"
        del args, want
    if "ours" in failed:
        notes.append(f"FAILED the correctness check: {failed.pop('ours')}")

    wrap = wrapper_for(mode)
    baselines = {"sdpa+rope": sdpa_rope, "reference": reference}  # SDPA first: the headline's comparison
    baselines.update({name: heavy[name] for name in ("torch.compile", "flex", "flex (gate in q)") if name in heavy})
    baselines = {name: failed.get(name) or (wrap(f) if callable(f) else f) for name, f in baselines.items()}
    cuda_bench.run(
        wrap(ours),
        op="attention",
        mode=mode,
        cost=roofline.attention(B, T, H, D, DTYPE, mode=mode),
        shape=shape,
        dtype=DTYPE,
        inputs=inputs,
        baselines=baselines,
        notes=notes,
        info={"rel_err_vs_reference": errors},
    )
    assert errors["ours"] <= CLOSE, f"ours: relative error {errors['ours']:.3e} against the reference > {CLOSE}"
