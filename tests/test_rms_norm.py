"""wiola_kernels.rms_norm against the reference wiola.ops.rms_norm: forward (y and h) and every
gradient (x, γ, residual — including the upstream gradient flowing into h) with the same random
upstream gradients, odd sizes and widths up to 8,192, dtype promotion, NaN-poisoned kernel
outputs, deterministic dγ, torch.compile, and bad inputs.

The oracle is the reference evaluated in float64 on the very same inputs; dtypes are checked
against the reference evaluated in the inputs' own dtypes.
"""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, KERNEL_DTYPES, TOL, assert_close, poisoned

from wiola.ops.rms_norm import rms_norm as reference
from wiola_kernels import _utils as kernel_utils
from wiola_kernels import rms_norm as kr

# (lead shape, d): N = 1, 17, 300 rows; a non-power-of-2 width; the 8,192 maximum.
SHAPES = [((1,), 64), ((17,), 256), ((3, 100), 256), ((17,), 1000), ((300,), 64), ((5,), 8192)]
SHAPE_IDS = ["N1-d64", "N17-d256", "B3-T100-d256", "N17-d1000", "N300-d64", "N5-d8192"]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# (x dtype, residual dtype or None). The interpreter runs the half types' loads and stores
# (all arithmetic is fp32), so mixes with a half input run on CPU too.
MIXES = [(dt, None) for dt in KERNEL_DTYPES] + [(dt, dt) for dt in KERNEL_DTYPES]
MIXES += [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
if DEVICE == "cuda":
    MIXES += [(torch.float16, torch.float32), (torch.float16, torch.bfloat16)]
MIX_IDS = [f"{DTYPE_IDS[x]}{'' if r is None else '+res' + DTYPE_IDS[r]}" for x, r in MIXES]


def _tol(*dtypes: torch.dtype) -> float:
    return max(TOL[dt] for dt in dtypes)


def _rand(shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(device=DEVICE, dtype=dtype).requires_grad_()


@pytest.mark.parametrize(("x_dtype", "res_dtype"), MIXES, ids=MIX_IDS)
@pytest.mark.parametrize(("lead", "d"), SHAPES, ids=SHAPE_IDS)
def test_matches_reference(lead, d, x_dtype, res_dtype):
    x = _rand((*lead, d), x_dtype, 0)
    weight = _rand((d,), torch.float32, 1, scale=0.2, shift=1.0)
    res = None if res_dtype is None else _rand((*lead, d), res_dtype, 2, scale=2.0)
    inputs = [x, weight] + ([res] if res is not None else [])
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]

    got = kr.rms_norm(x, weight, 1e-6, residual=res)
    want = reference(*inputs64[:2], 1e-6, residual=inputs64[2] if res is not None else None)
    native = reference(x, weight, 1e-6, residual=res)
    got, want, native = [(t,) if isinstance(t, torch.Tensor) else t for t in (got, want, native)]
    h_dtype = native[0].dtype
    grads_out = [torch.randn(t.shape, generator=torch.Generator().manual_seed(3 + i)) for i, t in enumerate(got)]

    # Outputs are fp32 math stored in h's dtype; gradients also depend on h's rounding.
    for name, w, g, n in zip(["y", "h"], want, got, native):
        assert g.dtype == n.dtype == h_dtype, f"{name}: dtype {g.dtype} != reference {n.dtype}"
        assert_close(name, w.detach(), g.detach(), TOL[h_dtype])

    got_grads = torch.autograd.grad(got, inputs, [go.to(DEVICE, h_dtype) for go in grads_out])
    want_grads = torch.autograd.grad(want, inputs64, [go.to(DEVICE, h_dtype).double() for go in grads_out])
    for name, t, w, g in zip(["dx", "dweight", "dresidual"], inputs, want_grads, got_grads):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype} != input's {t.dtype}"
        assert_close(name, w, g, _tol(h_dtype, t.dtype))


@pytest.mark.parametrize(("N", "d"), [(17, 256), (300, 1000)], ids=["N17-d256", "N300-d1000"])
def test_kernels_write_every_element(N, d):
    """Each launch writes its whole output (buffers start as NaN), and the dγ partials, one row
    a program, sum to the full dγ."""
    x, res = torch.randn(N, d, device=DEVICE), torch.randn(N, d, device=DEVICE)
    weight = torch.randn(d, device=DEVICE)
    dy, dh_up = torch.randn(N, d, device=DEVICE), torch.randn(N, d, device=DEVICE)
    h_ref = x + res
    rstd_ref = torch.rsqrt(h_ref.double().pow(2).mean(-1) + 1e-6)
    y, h, rstd = poisoned(N, d), poisoned(N, d), poisoned(N)
    kr._forward(x, weight, 1e-6, res, y, h, rstd)
    assert_close("h", h_ref, h, TOL[torch.float32])
    assert_close("rstd", rstd_ref, rstd, TOL[torch.float32])
    assert_close("y", h_ref.double() * rstd_ref[:, None] * weight.double(), y, TOL[torch.float32])

    programs = kr._bwd_programs(torch.device(DEVICE), N)
    dx, dres, partial = poisoned(N, d), poisoned(N, d, dtype=torch.bfloat16), poisoned(programs, d)
    kr._backward_partial(dy, dh_up, h, weight, rstd, dx, dres, partial)
    hat = h_ref.double() * rstd_ref[:, None]
    wdy = dy.double() * weight.double()
    dh_ref = (wdy - hat * (wdy * hat).mean(-1, keepdim=True)) * rstd_ref[:, None] + dh_up.double()
    assert_close("dx", dh_ref, dx, TOL[torch.float32])
    assert_close("dresidual (bf16)", dh_ref, dres, TOL[torch.bfloat16])
    assert_close("dweight", (dy.double() * hat).sum(0), partial.sum(0), TOL[torch.float32])


def test_dweight_is_deterministic():
    """No atomics: the same inputs give bit-identical gradients."""
    x = _rand((300, 256), torch.float32, 0)
    weight = _rand((256,), torch.float32, 1)
    grad = torch.randn(300, 256, device=DEVICE)
    first = torch.autograd.grad(kr.rms_norm(x, weight), [x, weight], grad)
    second = torch.autograd.grad(kr.rms_norm(x, weight), [x, weight], grad)
    for name, a, b in zip(["dx", "dweight"], first, second):
        assert torch.equal(a, b), f"{name}: differs between two identical backward passes"


def test_unused_h_gets_no_upstream_gradient():
    """Only y feeds the loss: dresidual is then the normalisation's gradient alone."""
    x, res = _rand((17, 64), torch.float32, 0), _rand((17, 64), torch.float32, 1)
    weight = _rand((64,), torch.float32, 2)
    grad = torch.randn(17, 64, device=DEVICE)
    got = torch.autograd.grad(kr.rms_norm(x, weight, residual=res)[0], [x, weight, res], grad)
    want = torch.autograd.grad(reference(x, weight, residual=res)[0], [x, weight, res], grad)
    for name, w, g in zip(["dx", "dweight", "dresidual"], want, got):
        assert_close(name, w, g, TOL[torch.float32])


def test_torch_compile_fullgraph_forward_backward():
    """The two custom ops trace under torch.compile(fullgraph=True), chained as in the model
    (the second norm consumes the first's residual stream); ``.sum()`` sends stride-0 gradients."""
    torch._dynamo.reset()
    x, a = _rand((2, 9, 64), torch.float32, 0), _rand((2, 9, 64), torch.float32, 1)
    w1, w2 = _rand((64,), torch.float32, 2), _rand((64,), torch.float32, 3)

    def block(norm, x, a, w1, w2):
        y1 = norm(x, w1)
        y2, h = norm(a, w2, 1e-6, residual=x)
        return (y1 * y2).sum() + h.sum()

    compiled = torch.compile(lambda *t: block(kr.rms_norm, *t), fullgraph=True)
    inputs = [x, a, w1, w2]
    loss = compiled(*inputs)
    ref_loss = block(reference, *inputs)
    assert_close("loss", ref_loss.detach(), loss.detach(), TOL[torch.float32])
    got = torch.autograd.grad(loss, inputs)
    want = torch.autograd.grad(ref_loss, inputs)
    for name, w, g in zip(["dx", "da", "dw1", "dw2"], want, got):
        assert_close(name, w, g, TOL[torch.float32])


def test_bad_inputs_raise(monkeypatch):
    x, weight = torch.randn(5, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(64,\)"):
        kr.rms_norm(x, torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(64,\)"):
        kr.rms_norm(x, torch.ones(1, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"residual must have shape \(5, 64\), got \(5, 1\)"):
        kr.rms_norm(x, weight, residual=torch.zeros(5, 1, device=DEVICE))
    with pytest.raises(ValueError, match="row width must be in 1..8192, got 8200"):
        kr.rms_norm(torch.randn(2, 8200, device=DEVICE), torch.ones(8200, device=DEVICE))
    with pytest.raises(TypeError, match=r"x must be float32, float16, bfloat16, got torch\.float64"):
        kr.rms_norm(x.double(), weight)
    with pytest.raises(TypeError, match=r"residual must be .*, got torch\.int32"):
        kr.rms_norm(x, weight, residual=torch.zeros(5, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="weight is on meta"):
        kr.rms_norm(x, weight.to("meta"))
    monkeypatch.setattr(kernel_utils, "kernels_usable", lambda t: False)
    with pytest.raises(ValueError, match=r"use wiola\.ops\.rms_norm"):
        kr.rms_norm(x, weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reference_takes_half_inputs_statistics_in_fp32(dtype) -> None:
    """SPEC: statistics in float32 whatever the input's dtype. A bf16/fp16 input's output is the
    fp32 formula's, rounded once at the end (bitwise: the same fp32 operations), with the
    residual's sum kept in the input's dtype; the same statistics in bf16 differ (it can fail)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 3 + 1).to(dtype)
    r = torch.randn(64, 256, generator=g).to(dtype)
    w = (torch.rand(256, generator=g) + 0.5).to(dtype)
    y, h = reference(x, w, 1e-6, r)
    assert h.dtype == dtype and torch.equal(h, x + r)
    hf = h.float()
    want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    assert torch.equal(y, want)
    in_dtype = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert not torch.equal(in_dtype, want), "the check cannot tell statistics in the input's dtype"


def test_eps_keeps_a_near_zero_row_finite_and_small() -> None:
    """``eps`` is inside the root: a row of zeros normalises to zeros (not NaN), and a row far
    below ``sqrt(eps)`` is scaled by about ``1/sqrt(eps)``, not to unit RMS."""
    w = torch.ones(8, device=DEVICE)
    assert torch.equal(reference(torch.zeros(2, 8, device=DEVICE), w), torch.zeros(2, 8, device=DEVICE))
    x = torch.full((1, 8), 1e-6, device=DEVICE)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close("rms_norm of a tiny row", want, reference(x, w, eps=1e-6), TOL[torch.float32])
    assert float(reference(x, w, eps=1e-6).abs().max()) < 2e-3  # without eps it would be 1


@pytest.mark.parametrize("scale", [0.0, 1e-6, 1e-3, 1.0], ids=["zeros", "1e-6", "1e-3", "1"])
def test_kernel_eps_inside_the_root_at_small_magnitudes(scale: float) -> None:
    """The kernel's ``eps`` sits where the reference's does, inside the root: rows whose mean
    square is near or below ``eps`` (where ``1/(sqrt(ms) + eps)`` would give another function)
    match the float64 reference, forward and both gradients, each scale a row of its own."""
    eps = 1e-6
    x = _rand((3, 64), torch.float32, 0, scale=scale)
    weight = _rand((64,), torch.float32, 1, scale=0.2, shift=1.0)
    grad = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = kr.rms_norm(x, weight, eps)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    want = reference(x64, w64, eps)
    assert_close(f"y at scale {scale}", want.detach(), got.detach(), TOL[torch.float32])
    got_grads = torch.autograd.grad(got, [x, weight], grad)
    want_grads = torch.autograd.grad(want, [x64, w64], grad.double())
    for name, w, g in zip(["dx", "dweight"], want_grads, got_grads):
        if scale == 0.0 and name == "dweight":  # y = 0 for any weight: dweight is exactly zero
            assert torch.equal(g, torch.zeros_like(g)), f"dweight at scale 0: {g.abs().max():.3e}, not zero"
            continue
        assert_close(f"{name} at scale {scale}", w, g, TOL[torch.float32])
