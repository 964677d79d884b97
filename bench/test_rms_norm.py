"""RMSNorm with the fused residual add (issue 5), CUDA only: forward and forward + backward.

N 16,384 (B 32 × T 512), d 256: ours (kernels/rms_norm.py, one pass each way) against the
reference eager (wiola.ops.rms_norm), ``torch.compile`` of it, and Liger-Kernel's RMSNorm where
it is installed (Liger has no fused residual: it gets ``h = x + residual`` in eager PyTorch first,
which is what a user of it would write).

Cases: plain bf16; bf16 with a bf16 residual stream; and the model's mix under autocast, a bf16
branch added to an fp32 residual stream (h and y in fp32). With a residual, forward + backward
sends a random upstream gradient into both outputs (y and h), as in the model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench import roofline
from bench.frame import forward_only, reference_baselines, wrapper_for
from wiola.ops import rms_norm as reference

SHAPES = [dict(N=16384, d=256)]
EPS = 1e-6
# (mode, residual dtype or None)
CASES = [("fwd", None), ("fwd_bwd", None), ("fwd", torch.bfloat16), ("fwd_bwd", torch.bfloat16)]
CASES += [("fwd_bwd", torch.float32)]
RES_IDS = {None: "", torch.bfloat16: "-residual_bf16", torch.float32: "-residual_fp32"}


def _liger() -> Callable | str:
    try:
        from liger_kernel.transformers.functional import liger_rms_norm
    except Exception as exc:  # not installed, or an incompatible version
        return f"liger_kernel not available: {type(exc).__name__}: {exc}"
    return lambda x, w, eps: liger_rms_norm(x, w, eps, in_place=False)  # in place would overwrite dy


def _fwd_bwd_both(f):
    """Forward + backward with fixed random upstream gradients into y and h (the frame's
    ``fwd_bwd`` follows only the first output)."""
    grads: dict = {}

    def run(*args):
        outs = f(*args)
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        key = tuple((o.shape, o.dtype) for o in outs)
        if key not in grads:
            gen = torch.Generator(device=outs[0].device).manual_seed(0)
            grads[key] = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
        return torch.autograd.grad(outs, wrt, grads[key])

    return run


@pytest.mark.parametrize(("mode", "res_dtype"), CASES, ids=[f"{m}{RES_IDS[r]}" for m, r in CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s['N']}-d{s['d']}")
def test_rms_norm(cuda_bench, shape, mode, res_dtype):
    from wiola_kernels.rms_norm import rms_norm as ours  # import inside: the file must import on CPU

    N, d, dtype = shape["N"], shape["d"], torch.bfloat16
    residual = res_dtype is not None

    def inputs():  # fresh random data; γ near its init value 1, in fp32 like the model's parameter
        x = torch.randn(N, d, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
        if not residual:
            return x, w
        return x, w, (2 * torch.randn(N, d, device="cuda")).to(res_dtype).requires_grad_()

    liger = _liger()
    if residual:
        if callable(liger):
            liger_fn = liger
            liger = lambda x, w, r: (liger_fn(x + r, w, EPS), x + r)
        wrap = _fwd_bwd_both if mode == "fwd_bwd" else forward_only
        f = lambda x, w, r: ours(x, w, EPS, residual=r)
        ref = lambda x, w, r: reference(x, w, EPS, residual=r)
    else:
        wrap = wrapper_for(mode)
        f = lambda x, w: ours(x, w, EPS)
        ref = lambda x, w: reference(x, w, EPS)
        if callable(liger):
            liger_fn = liger
            liger = lambda x, w: liger_fn(x, w, EPS)

    cuda_bench.run(
        wrap(f),
        op="rms_norm",
        mode=mode,
        # For the bf16 + fp32-stream mix, counting every tensor at 4 bytes is exact in total: the
        # forward reads x in bf16 (2 bytes less), the backward writes dx in bf16 and dres in fp32
        # (2 bytes more).
        cost=roofline.rms_norm(N, d, res_dtype or dtype, mode=mode, residual=residual),
        shape={**shape, "residual": str(res_dtype).removeprefix("torch.") if residual else "none"},
        dtype=dtype,
        inputs=inputs,
        baselines={**reference_baselines(ref, wrap), "liger": wrap(liger) if callable(liger) else liger},
    )
