"""The butterfly FFN (issue 5), CUDA only: forward and forward + backward at the paper's shapes.

N 16,384 (B 32 × T 512), d 256, d_ff 512, bf16: ours (kernels/butterfly.py: one up/bypass kernel,
the down projection with the residual add in its epilogue, a backward that recomputes a and b)
against the reference eager (wiola.ops.butterfly) and ``torch.compile`` of it. Liger-Kernel has no
butterfly op (its SwiGLU lacks the bypass), so it is not a baseline here.

The model calls the FFN without a residual (the next RMSNorm adds it); the residual variant
measures the fused epilogue.
"""

from __future__ import annotations

import pytest
import torch

from bench import roofline
from bench.frame import reference_baselines, wrapper_for
from wiola.ops import butterfly as reference

SHAPES = [dict(N=16384, d=256, d_ff=512)]
CASES = [("fwd", False), ("fwd_bwd", False), ("fwd_bwd", True)]


@pytest.mark.parametrize(("mode", "residual"), CASES, ids=[f"{m}{'-residual' if r else ''}" for m, r in CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s['N']}-d{s['d']}-ff{s['d_ff']}")
def test_butterfly(cuda_bench, shape, mode, residual):
    from wiola_kernels.butterfly import butterfly as ours  # import inside: the file must import on CPU

    N, d, d_ff, dtype = shape["N"], shape["d"], shape["d_ff"], torch.bfloat16

    def inputs():  # fresh random data at the model's init scale
        def rand(*size, scale=1.0):
            return (torch.randn(*size, device="cuda") * scale).to(dtype).requires_grad_()

        x = rand(N, d)
        weights = (rand(2 * d_ff, d, scale=0.02), rand(d_ff, d, scale=0.02), rand(d, d_ff, scale=0.02))
        return (x, *weights, rand(N, d)) if residual else (x, *weights)

    wrap = wrapper_for(mode)
    cuda_bench.run(
        wrap(ours),
        op="butterfly",
        mode=mode,
        cost=roofline.butterfly(N, d, d_ff, dtype, mode=mode, residual=residual),
        shape={**shape, "residual": residual},
        dtype=dtype,
        inputs=inputs,
        baselines=reference_baselines(reference, wrap),
    )
