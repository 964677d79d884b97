"""wiola_kernels.butterfly against the reference wiola.ops.butterfly: forward and every gradient
(x, w_up, w_bp, w_down, residual) with one random upstream gradient, odd sizes, NaN-poisoned
kernel outputs, torch.compile, and bad inputs.

The oracle is the reference function evaluated in float64 on the very same (already rounded)
inputs, so the tolerance measures the kernel's own error; dtypes are checked against the
reference evaluated in the inputs' own dtypes.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from numerics import DEVICE, KERNEL_DTYPES, TOL, assert_close, poisoned

from wiola.ops.butterfly import butterfly as reference
from wiola_kernels import _utils as kernel_utils
from wiola_kernels import butterfly as kb

# (lead shape of x, d, d_ff): N = 1, 17, 300 rows; d 64/256; d_ff 128/512; and widths that are
# not a multiple of any tile (d 48/100, d_ff 96/72): the last K and N blocks run part-masked.
# (bench/plan.py reads this literal for the device check's launches: keep it one list.)
SHAPES = [
    ((1,), 64, 128), ((17,), 64, 128), ((3, 100), 64, 128), ((17,), 256, 512), ((300,), 256, 512),
    ((17,), 48, 96), ((5,), 100, 72),
]  # fmt: skip
SHAPE_IDS = ["N1-d64-ff128", "N17-d64-ff128", "B3-T100-d64-ff128", "N17-d256-ff512", "N300-d256-ff512"]
SHAPE_IDS += ["N17-d48-ff96", "N5-d100-ff72"]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# residual: none, same dtype as the branch, and (for half branches) fp32, the model's residual
# stream under autocast.
CASES = [(dt, res) for dt in KERNEL_DTYPES for res in ("none", "same", "fp32") if dt != torch.float32 or res != "fp32"]
CASE_IDS = [f"{DTYPE_IDS[dt]}-res_{res}" for dt, res in CASES]


def _inputs(lead, d, d_ff, dtype, residual, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dt).requires_grad_()

    x = rand(*lead, d)
    # Weights at a scale that keeps a, b, c and the output O(1) (std ~ 1/sqrt(fan_in)).
    w = [rand(2 * d_ff, d, scale=d**-0.5), rand(d_ff, d, scale=d**-0.5), rand(d, d_ff, scale=d_ff**-0.5)]
    res = None
    if residual != "none":
        res = rand(*lead, d, dt=dtype if residual == "same" else torch.float32)
    return x, w, res


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize(("dtype", "residual"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("lead", "d", "d_ff"), SHAPES, ids=SHAPE_IDS)
def test_matches_reference(lead, d, d_ff, dtype, residual):
    x, w, res = _inputs(lead, d, d_ff, dtype, residual)
    inputs = [x, *w] + ([res] if res is not None else [])
    out = kb.butterfly(x, *w, residual=res)
    expected_dtype = reference(x, *w, residual=res).dtype
    assert out.dtype == expected_dtype, f"y: dtype {out.dtype} != reference {expected_dtype}"

    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*inputs64[:4], residual=inputs64[4] if res is not None else None)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, out.dtype)
    got_grads = _grads(out, inputs, grad_out)
    ref_grads = _grads(ref, inputs64, grad_out.double())

    # y is as precise as the branch's matmul dtype (an fp32 residual adds a bf16 branch); each
    # gradient is held to its input's dtype.
    assert_close("y", ref.detach(), out.detach(), TOL[dtype])
    names = ["dx", "dw_up", "dw_bp", "dw_down", "dresidual"]
    for name, t, r, gt in zip(names, inputs, ref_grads, got_grads):
        assert gt.dtype == t.dtype, f"{name}: dtype {gt.dtype} != input's {t.dtype}"
        assert_close(name, r, gt, TOL[t.dtype])


@pytest.mark.parametrize(
    ("N", "d", "d_ff"),
    [(17, 64, 128), (33, 256, 512), (9, 100, 72)],
    ids=["N17-d64-ff128", "N33-d256-ff512", "N9-d100-ff72"],
)
def test_kernels_write_every_element(N, d, d_ff):
    """Each launch writes its whole output: the buffers start as NaN."""
    x, w, res = _inputs((N,), d, d_ff, torch.float32, "same")
    x, res = x.detach(), res.detach()
    w_up, w_bp, w_down = (t.detach() for t in w)
    dy = torch.randn(N, d, device=DEVICE)

    a, b = (x @ w_up.t()).chunk(2, dim=-1)
    c = x @ w_bp.t()
    r_ref = torch.nn.functional.silu(a) * b + c
    r = poisoned(N, d_ff)
    kb._up(x, w_up, w_bp, r)
    assert_close("r", r_ref, r, TOL[torch.float32])

    for name, residual in (("y", None), ("y+residual", res)):
        y = poisoned(N, d)
        kb._down(r, w_down, residual, y)
        y_ref = r_ref @ w_down.t() + (0 if residual is None else residual)
        assert_close(name, y_ref, y, TOL[torch.float32])

    dabc = poisoned(N, 3 * d_ff)
    kb._up_bwd(dy, x, w_up, w_down, dabc)
    dr = dy @ w_down
    sig = torch.sigmoid(a)
    assert_close("da", dr * b * sig * (1 + a * (1 - sig)), dabc[:, :d_ff], TOL[torch.float32])
    assert_close("db", dr * a * sig, dabc[:, d_ff : 2 * d_ff], TOL[torch.float32])
    assert_close("dc", dr, dabc[:, 2 * d_ff :], TOL[torch.float32])


def _tile_cases() -> list[tuple[str, object]]:
    """Every autotune tile of the forward's two kernels, both row classes, once each."""
    return [(name, c) for name, lists in (("up", kb.UP_CONFIGS), ("down", kb.DOWN_CONFIGS))
            for c in dict.fromkeys(c for listed in lists.values() for c in listed)]  # fmt: skip


@pytest.mark.parametrize(("kernel", "config"), _tile_cases(), ids=lambda v: v if isinstance(v, str) else v.tag())
def test_every_autotune_tile(kernel, config):
    """Each tile the autotuner may pick (forced, not autotuned), at a decoding step's 5 rows and at
    40 (ragged in every BLOCK_M), d 256, d_ff 512 (several K steps), against the float64 oracle;
    outputs start as NaN. bf16 on CUDA (the tiles' dtype there), fp32 under the interpreter."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    for N in (5, 40):
        x, w, res = _inputs((N,), 256, 512, dtype, "fp32", seed=N)
        x, res = x.detach(), res.detach()
        w_up, w_bp, w_down = (t.detach() for t in w)
        a, b = (x.double() @ w_up.double().t()).chunk(2, dim=-1)
        r_ref = torch.nn.functional.silu(a) * b + x.double() @ w_bp.double().t()
        r = poisoned(N, 512, dtype=dtype)
        if kernel == "up":
            kb._up(x, w_up, w_bp, r, config=config)
            assert_close(f"r, N {N}, {config.tag()}", r_ref, r.double(), TOL[dtype])
        else:
            r_in = r_ref.to(dtype)  # the down kernel's own error, on rounded inputs
            y = poisoned(N, 256)
            kb._down(r_in, w_down, res, y, config=config)
            y_ref = r_in.double() @ w_down.double().t() + res.double()
            assert_close(f"y, N {N}, {config.tag()}", y_ref, y.double(), TOL[dtype])


def test_few_rows_try_their_own_tiles():
    """A launch of at most FEW_ROWS rows tries the few-row tiles and the others; more rows never
    the few-row tiles (their 16-row blocks would waste a large N's tensor cores)."""
    for tuned, lists in ((kb._up_tuned, kb.UP_CONFIGS), (kb._down_tuned, kb.DOWN_CONFIGS)):
        for n, cls in ((1, "few"), (kb.FEW_ROWS, "few"), (kb.FEW_ROWS + 1, "many"), (4096, "many")):
            kept = tuned.early_config_prune(tuned.configs, {"N_BUCKET": kb._n_bucket(n)})
            got = {(*c.kwargs.values(), c.num_warps, c.num_stages) for c in kept}
            want = {c.key() for c in lists[cls]}
            assert got == want, f"{tuned.fn.__name__} N={n}: tries {sorted(got)}, listed {sorted(want)}"
    assert not set(kb._UP_FEW_ROW_CONFIGS) & set(kb.UP_CONFIGS["many"])


def test_mixed_residual_dtype_promotes_like_torch():
    """An fp32 branch plus a bf16 residual gives fp32 (torch's promotion); the residual's
    gradient comes back in bf16. Only loads/stores touch bf16, so this also runs on CPU."""
    x, w, _ = _inputs((17,), 64, 128, torch.float32, "none")
    res = torch.randn(17, 64, device=DEVICE).to(torch.bfloat16).requires_grad_()
    out = kb.butterfly(x, *w, residual=res)
    ref = reference(x, *w, residual=res)
    assert out.dtype == ref.dtype == torch.float32, f"y: dtype {out.dtype}, reference {ref.dtype}"
    assert_close("y", ref.detach(), out.detach(), TOL[torch.float32])
    grad_out = torch.randn_like(out)
    (dres,) = torch.autograd.grad(out, [res], grad_out)
    (dres_ref,) = torch.autograd.grad(ref, [res], grad_out)
    assert dres.dtype == torch.bfloat16, f"dresidual: dtype {dres.dtype}"
    assert_close("dresidual", dres_ref, dres, 0.0)


def test_torch_compile_fullgraph_forward_backward():
    """The custom ops trace under torch.compile(fullgraph=True); the gradient of ``.sum()``
    reaches the backward as a stride-0 expanded tensor, which the op must make contiguous."""
    torch._dynamo.reset()
    x, w, res = _inputs((2, 9), 64, 128, torch.float32, "same")
    inputs = [x, *w, res]
    compiled = torch.compile(lambda *t: kb.butterfly(*t[:4], residual=t[4]).sum(), fullgraph=True)
    loss = compiled(*inputs)
    got = torch.autograd.grad(loss, inputs)
    ref_loss = reference(*inputs[:4], residual=res).sum()
    want = torch.autograd.grad(ref_loss, inputs)
    assert_close("loss", ref_loss.detach(), loss.detach(), TOL[torch.float32])
    for name, r, g in zip(["dx", "dw_up", "dw_bp", "dw_down", "dresidual"], want, got):
        assert_close(name, r, g, TOL[torch.float32])


def test_frozen_weights_get_no_gradient():
    """Only x requires a gradient: it is still exact, and no weight gradient is produced."""
    x, w, _ = _inputs((17,), 64, 128, torch.float32, "none")
    w = [t.detach() for t in w]
    grad_out = torch.randn(17, 64, device=DEVICE)
    out = kb.butterfly(x, *w)
    (dx,) = torch.autograd.grad(out, [x], grad_out)
    (dx_ref,) = torch.autograd.grad(reference(x, *w), [x], grad_out)
    assert_close("dx", dx_ref, dx, TOL[torch.float32])
    out = kb.butterfly(x.detach(), w[0], w[1], w[2].requires_grad_())
    (dw_down,) = torch.autograd.grad(out, [w[2]], grad_out)
    (dw_down_ref,) = torch.autograd.grad(reference(x.detach(), *w), [w[2]], grad_out)
    assert_close("dw_down", dw_down_ref, dw_down, TOL[torch.float32])


@pytest.mark.skipif(DEVICE != "cuda", reason="autocast to bf16 needs real bf16 matmuls (CUDA)")
def test_autocast_casts_like_f_linear():
    x, w, _ = _inputs((4, 33), 256, 512, torch.float32, "none")
    res = torch.randn(4, 33, 256, device=DEVICE, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = kb.butterfly(x, *w, residual=res)
        ref = reference(x, *w, residual=res)
    assert out.dtype == ref.dtype == torch.float32, f"y: dtype {out.dtype}, reference {ref.dtype}"
    assert_close("y", ref.detach(), out.detach(), TOL[torch.bfloat16])
    grad_out = torch.randn_like(out)
    for name, r, g in zip(
        ["dx", "dw_up", "dw_bp", "dw_down", "dresidual"],
        torch.autograd.grad(ref, [x, *w, res], grad_out),
        torch.autograd.grad(out, [x, *w, res], grad_out),
    ):
        assert g.dtype == torch.float32, f"{name}: dtype {g.dtype}"
        assert_close(name, r, g, TOL[torch.bfloat16])


@pytest.mark.parametrize("tuned", ["_up_tuned", "_up_bwd_tuned", "_down_tuned"])
def test_autotune_key_covers_every_flag_and_n(tuned):
    """Every constexpr that changes the body (not the tiles; PRECISION is always "ieee") and the N
    bucket key the autotuner: the first N a process sees must not fix the tiles of every other."""
    tuned = getattr(kb, tuned)
    params = inspect.signature(tuned.fn.fn).parameters
    flags = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    expected = flags - {"BLOCK_M", "BLOCK_N", "BLOCK_K", "PRECISION"} | {"N_BUCKET", "D", "F"}
    assert set(tuned.keys) == expected, f"key {tuned.keys}, expected {sorted(expected)}"


def test_n_bucket():
    """N rounds up to a power of two (decode's batch, prefill, training each get their own), at
    least 16 and at most the cap; every bucket is a multiple of 16 (one JIT specialisation)."""
    cases = {1: 16, 16: 16, 17: 32, 300: 512, 4096: 4096, 4097: 8192, kb.N_BUCKET_CAP + 1: kb.N_BUCKET_CAP}
    for n, bucket in cases.items():
        assert kb._n_bucket(n) == bucket, f"N={n}: bucket {kb._n_bucket(n)} != {bucket}"
    assert kb._n_bucket(10**7) == kb.N_BUCKET_CAP


def test_bad_inputs_raise(monkeypatch):
    x, (w_up, w_bp, w_down), _ = _inputs((5,), 64, 128, torch.float32, "none")
    with pytest.raises(ValueError, match="w_up must have shape"):
        kb.butterfly(x, w_up[:-1], w_bp, w_down)
    with pytest.raises(ValueError, match="w_down must have shape"):
        kb.butterfly(x, w_up, w_bp, w_down.t())
    with pytest.raises(ValueError, match="w_up must have shape"):
        kb.butterfly(x[:, :32], w_up, w_bp, w_down)
    with pytest.raises(ValueError, match="residual must have shape"):
        kb.butterfly(x, w_up, w_bp, w_down, residual=torch.zeros(5, 32, device=DEVICE))
    with pytest.raises(TypeError, match=r"w_bp must be .*, got torch\.float64"):
        kb.butterfly(x, w_up, w_bp.double(), w_down)
    with pytest.raises(TypeError, match=r"w_down must have x's dtype torch\.float32 .*got torch\.float16"):
        kb.butterfly(x, w_up, w_bp, w_down.half())
    with pytest.raises(TypeError, match=r"x must be .*, got torch\.int64"):
        kb.butterfly(torch.ones(5, 64, dtype=torch.long, device=DEVICE), w_up, w_bp, w_down)
    with pytest.raises(ValueError, match="w_bp is on meta"):
        kb.butterfly(x, w_up, w_bp.to("meta"), w_down)
    monkeypatch.setattr(kernel_utils, "kernels_usable", lambda t: False)
    with pytest.raises(ValueError, match=r"use wiola\.ops\.butterfly"):
        kb.butterfly(x, w_up, w_bp, w_down)
