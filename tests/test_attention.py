"""wiola_kernels.attention against the reference wiola.ops.attention and a float64 oracle: forward,
log-sum-exp and every gradient (q, k, v, g), NaN-poisoned outputs, fused-QKV strided views,
stride-0 tables, left/right/ragged padding, every autotune block shape, torch.compile."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from numerics import DEVICE, KERNEL_DTYPES, TOL, assert_close, poisoned

from wiola.ops.attention import attention as reference_attention
from wiola.ops.rope import helix_frequencies, positions_from_mask, rope_tables
from wiola_kernels import attention as K

# triton 3.6's interpreter converts a 1-element array to an int in range() bounds.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# (B, T, H, D, helix_alpha, padding): a covering set, not the full product (the interpreter is slow).
CASES = [
    (1, 1, 1, 16, 0.0, "none"),
    (3, 17, 4, 32, 0.05, "none"),
    (3, 17, 1, 64, 0.0, "left"),
    (1, 64, 8, 16, 0.05, "left"),
    (3, 64, 4, 32, 0.05, "right"),
    (1, 300, 1, 32, 0.05, "none"),
    (3, 300, 1, 64, 0.05, "mixed"),
    (1, 17, 2, 128, 0.05, "left"),
]


def _case_id(case) -> str:
    B, T, H, D, alpha, pad = case
    return f"B{B}-T{T}-H{H}-D{D}-a{alpha}-{pad}"


def _mask(B: int, T: int, padding: str) -> torch.Tensor | None:
    """(B, T) bool, False = padding key. 'mixed': left, right, a hole, and (B ≥ 3) a row of only padding."""
    if padding == "none":
        return None
    m = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        n = (T * (b + 1)) // (B + 2) if T > 1 else 0
        if padding == "left" or (padding == "mixed" and b == 0):
            m[b, :n] = False
        elif padding == "right" or (padding == "mixed" and b == 1):
            m[b, T - n :] = False
        elif padding == "mixed":
            m[b] = False
    if padding == "mixed" and T > 4:
        m[0, T - 3] = False  # a hole after real tokens
    return m.to(DEVICE)


def _inputs(B, T, H, D, alpha, padding, dtype, seed=0):
    """q, k, v as views of one fused (B, T, 3, H, D) projection; cos/sin stride-0 on batch when unpadded."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, 3, H, D, generator=gen) * 1.5).to(DEVICE, dtype)
    q, k, v = qkv.unbind(2)  # (B, T, H, D), strides (3HDT, 3HD, D, 1)
    g = (torch.rand(B, T, H, generator=gen) * 1.8 + 0.1).to(DEVICE)
    mask = _mask(B, T, padding)
    freqs = helix_frequencies(D, alpha=alpha)
    if mask is None:
        cos, sin = rope_tables(positions_from_mask(None, 1, T), freqs)
        cos, sin = cos.to(DEVICE).expand(B, T, D // 2), sin.to(DEVICE).expand(B, T, D // 2)
    else:
        cos, sin = rope_tables(positions_from_mask(mask.cpu(), B, T), freqs)
        cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    do = torch.randn(B, T, H, D, generator=gen).to(DEVICE, dtype)
    return q, k, v, g, cos, sin, mask, do


def _float64_oracle(q, k, v, g, cos, sin, mask):
    """Independent float64 math of SPEC eq. 4-13; returns (o, base-2 lse as (B, H, T))."""
    q, k, v, g, cos, sin = (x.double() for x in (q, k, v, g, cos, sin))
    half = q.shape[-1] // 2
    c, s = cos[:, :, None], sin[:, :, None]

    def rot(x):
        return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c), -1)

    B, T, H, D = q.shape
    a = torch.einsum("bthd,bshd->bhts", rot(q), rot(k)) * g.permute(0, 2, 1)[..., None] / math.sqrt(D)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril().expand(B, 1, T, T)
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    a = a.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(a, -1)  # -inf where a query has no allowed key
    p = torch.exp(a - torch.where(lse.isinf(), 0.0, lse)[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhts,bshd->bthd", p, v)
    return o, torch.where(lse.isinf(), float("inf"), lse / math.log(2.0))


def _grads(fn, q, k, v, g, cos, sin, mask, do):
    """Output and gradients of fn w.r.t. fresh leaf copies of q, k, v, g (same upstream do)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
    o = fn(*leaves, cos, sin, mask)
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
    return o.detach(), grads


def _kernel_forward_backward(q, k, v, g, cos, sin, mask, do, fwd_cfg=None, dq_cfg=None, dkdv_cfg=None):
    """Run the launchers directly into NaN-poisoned buffers: any element never written stays NaN."""
    B, T, H, D = q.shape
    o, lse = poisoned(B, T, H, D, dtype=q.dtype), poisoned(B, H, T)
    o_res = None if q.dtype == torch.float32 else poisoned(B, T, H, D, dtype=q.dtype)  # as the op does
    K.attention_fwd_launch(q, k, v, g, cos, sin, mask, o, lse, o_res, config=fwd_cfg)
    dq, dk, dv = (poisoned(B, T, H, D, dtype=q.dtype) for _ in range(3))
    dg = poisoned(B, T, H)
    K.attention_bwd_launch(do, q, k, v, g, cos, sin, mask, o, lse, dq, dk, dv, dg, o_res, dq_config=dq_cfg,
                           dkdv_config=dkdv_cfg)  # fmt: skip
    if o_res is not None:
        assert not torch.isnan(o_res).any(), "o_res: NaN in output (an element was never written?)"
    return o, lse, (dq, dk, dv, dg)


def _assert_grads(tag, refs, grads, tol):
    """dq, dk, dv, dg against the reference. A gradient that is exactly zero in the reference (T = 1:
    one key, so dA = 0) is measured against the scale of dv instead of its own zero maximum."""
    scale = refs[2].abs().max().double()
    for name, ref, got in zip(("dq", "dk", "dv", "dg"), refs, grads):
        if ref.abs().max() == 0:
            assert not torch.isnan(got).any(), f"{tag} {name}: NaN in output"
            err = float(got.double().abs().max() / scale.clamp_min(1e-30))
            assert err <= tol, f"{tag} {name}: error {err:.3e} relative to max|dv| > {tol:.1e} (reference is 0)"
        else:
            assert_close(f"{tag} {name}", ref.double(), got.double(), tol)


def _check_all(tag, dtype, q, k, v, g, cos, sin, mask, do, o, lse, grads):
    tol = TOL[dtype]
    o_ref, g_ref = _grads(reference_attention, q, k, v, g, cos, sin, mask, do)
    assert_close(f"{tag} o", o_ref.float(), o.float(), tol)
    _assert_grads(tag, g_ref, grads, tol)
    if dtype == torch.float32:  # the float64 oracle, forward, lse and gradients
        o64, g64 = _grads(lambda *a: _float64_oracle(*a)[0], q, k, v, g, cos, sin, mask, do)
        assert_close(f"{tag} o vs float64", o64, o.double(), tol)
        _assert_grads(f"{tag} vs float64", g64, grads, tol)
        lse64 = _float64_oracle(q, k, v, g, cos, sin, mask)[1]
        finite = lse64.isfinite()
        assert torch.equal(lse.isinf(), ~finite), f"{tag} lse: +inf must mark exactly the queries with no key"
        assert_close(f"{tag} lse", lse64[finite], lse.double()[finite], tol)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward_poisoned(case, dtype):
    """Launchers into NaN-filled buffers: forward, lse, dq, dk, dv, dg against both oracles."""
    q, k, v, g, cos, sin, mask, do = _inputs(*case, dtype)
    o, lse, grads = _kernel_forward_backward(q, k, v, g, cos, sin, mask, do)
    _check_all(_case_id(case), dtype, q, k, v, g, cos, sin, mask, do, o, lse, grads)


@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[7]], ids=_case_id)
def test_float16_rounding_path(case):
    """fp16 runs under the interpreter too (NumPy has float16, not bfloat16): the half-precision
    roundings and o's rounding residual (o_res, which keeps Δ and so dg and dk exact) at the fp16
    tolerance; and the residual is at most half an fp16 ulp of o."""
    q, k, v, g, cos, sin, mask, do = _inputs(*case, torch.float16, seed=8)
    o, lse, grads = _kernel_forward_backward(q, k, v, g, cos, sin, mask, do)
    _check_all(_case_id(case), torch.float16, q, k, v, g, cos, sin, mask, do, o, lse, grads)
    B, T, H, D = q.shape
    o2, lse2, o_res = poisoned(B, T, H, D, dtype=q.dtype), poisoned(B, H, T), poisoned(B, T, H, D, dtype=q.dtype)
    K.attention_fwd_launch(q, k, v, g, cos, sin, mask, o2, lse2, o_res)
    assert torch.equal(o2, o), "o: differs when o_res is stored"
    ulp = torch.finfo(torch.float16).eps * o.float().abs().clamp_min(torch.finfo(torch.float16).tiny)
    assert (o_res.float().abs() <= ulp).all(), "o_res: larger than the rounding of o"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=_case_id)
def test_autograd_op(case, dtype):
    """The public function through torch.library autograd, gradients into the fused QKV tensor."""
    q, k, v, g, cos, sin, mask, do = _inputs(*case, dtype, seed=1)
    B, T, H, D = q.shape
    qkv = torch.stack((q, k, v), 2).detach().requires_grad_(True)  # (B, T, 3, H, D)
    gl = g.detach().clone().requires_grad_(True)
    qs, ks, vs = qkv.unbind(2)
    o = K.attention(qs, ks, vs, gl, cos, sin, mask)
    assert o.dtype == dtype and o.shape == (B, T, H, D), f"o: {o.dtype} {tuple(o.shape)}"
    dqkv, dg = torch.autograd.grad(o, (qkv, gl), do)
    o_ref, (dq, dk, dv, dg_ref) = _grads(reference_attention, q, k, v, g, cos, sin, mask, do)
    tol = TOL[dtype]
    assert_close("o", o_ref.float(), o.detach().float(), tol)
    for name, ref, got in zip(("dq", "dk", "dv"), (dq, dk, dv), dqkv.unbind(2)):
        assert_close(name, ref.float(), got.float(), tol)
    assert_close("dg", dg_ref, dg, tol)


def _config_triples():
    """Every config of each kernel and dtype class at least once (the shorter lists wrap around)."""
    triples = []
    for cls in ("half", "fp32"):
        lists = (K.FWD_CONFIGS[cls], K.DQ_CONFIGS[cls], K.DKDV_CONFIGS[cls])
        triples += [tuple(c[i % len(c)] for c in lists) for i in range(max(map(len, lists)))]
    return list(dict.fromkeys(triples))


@pytest.mark.parametrize(
    "configs", _config_triples(), ids=lambda c: f"fwd-{c[0].tag()}|dq-{c[1].tag()}|dkdv-{c[2].tag()}"
)
def test_every_autotune_block_shape(configs):
    """Each GPU block configuration (forced, not autotuned) on a ragged, left-padded B2-T200-H2-D32."""
    fwd_cfg, dq_cfg, dkdv_cfg = configs
    case = (2, 200, 2, 32, 0.05, "left")
    q, k, v, g, cos, sin, mask, do = _inputs(*case, torch.float32, seed=2)
    o, lse, grads = _kernel_forward_backward(q, k, v, g, cos, sin, mask, do, fwd_cfg, dq_cfg, dkdv_cfg)
    _check_all(_case_id(case), torch.float32, q, k, v, g, cos, sin, mask, do, o, lse, grads)


_TUNED = {"fwd": "_attn_fwd_tuned", "dq": "_attn_bwd_dq_tuned", "dkdv": "_attn_bwd_dkdv_tuned"}
_LISTS = {"fwd": "FWD_CONFIGS", "dq": "DQ_CONFIGS", "dkdv": "DKDV_CONFIGS"}


@pytest.mark.parametrize("kernel", sorted(_TUNED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("D", K.SUPPORTED_HEAD_DIMS)
def test_autotune_tries_only_its_dtypes_configs(kernel, dtype, D):
    """The autotuner's pruning keeps exactly the configs listed for q's dtype class and D (the
    fp32 lists are the ones that build without spills for fp32's FMA dots), never none."""
    tuned, lists = getattr(K, _TUNED[kernel]), getattr(K, _LISTS[kernel])
    q = torch.empty(0, dtype=dtype)
    kept = tuned.early_config_prune(tuned.configs, {"Q": q}, D=D)
    got = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
    want = {c.key() for c in lists["fp32" if dtype == torch.float32 else "half"] if D in c.head_dims}
    assert want, f"{kernel}: no {dtype} config for D={D}"
    assert got == want, f"{kernel} {dtype} D={D}: autotune would try {sorted(got)}, listed {sorted(want)}"


@pytest.mark.parametrize("kernel", sorted(_TUNED))
def test_autotune_key_covers_every_flag(kernel):
    """Every constexpr that changes the kernel body is in the autotune key, so one variant's best
    tiles never serve another: all but the tiles, HALF_PAD (follows D) and DOT_PRECISION (follows
    the dtype, which Triton adds to every key). T_BUCKET keys the sequence length."""
    tuned = getattr(K, _TUNED[kernel])
    params = inspect.signature(tuned.fn.fn).parameters
    flags = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    expected = flags - {"BLOCK_M", "BLOCK_N", "HALF_PAD", "DOT_PRECISION"} | {"T_BUCKET"}
    assert set(tuned.keys) == expected, f"{kernel}: key {tuned.keys}, body flags {sorted(expected)}"


def test_layouts_and_table_broadcast():
    """Separate contiguous q, a k whose last stride is not 1, v from a transpose, (1, T, D/2) tables."""
    B, T, H, D = 2, 33, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, D, generator=gen).to(DEVICE)
    k = torch.randn(B, T, D, H, generator=gen).to(DEVICE).transpose(2, 3)  # strides (., ., 1, H)
    v = torch.randn(B, H, T, D, generator=gen).to(DEVICE).transpose(1, 2)  # (B, T, H, D) view
    g = torch.rand(B, H, T, generator=gen).to(DEVICE).transpose(1, 2)  # non-contiguous gate
    cos, sin = rope_tables(positions_from_mask(None, 1, T), helix_frequencies(D))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    do = torch.randn(B, T, H, D, generator=gen).to(DEVICE)
    o, grads = _grads(K.attention, q, k, v, g, cos, sin, None, do)
    o_ref, g_ref = _grads(reference_attention, q, k, v, g, cos, sin, None, do)
    assert_close("o", o_ref, o, TOL[torch.float32])
    for name, ref, got in zip(("dq", "dk", "dv", "dg"), g_ref, grads):
        assert_close(name, ref, got, TOL[torch.float32])


def test_gate_one_is_plain_causal_attention():
    """SPEC claim 3: g = 1 gives standard causal softmax attention of the rotated q, k (SDPA as oracle)."""
    B, T, H, D = 1, 40, 2, 32
    q, k, v, _, cos, sin, _, _ = _inputs(B, T, H, D, 0.0, "none", torch.float32, seed=4)
    g = torch.ones(B, T, H, device=DEVICE)
    o = K.attention(q, k, v, g, cos, sin)
    half = D // 2
    c, s = cos[:, :, None], sin[:, :, None]

    def rot(x):
        return torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c), -1)

    sdpa = torch.nn.functional.scaled_dot_product_attention(
        rot(q).transpose(1, 2), rot(k).transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    assert_close("o (g = 1)", sdpa, o, TOL[torch.float32])


def test_backward_is_deterministic():
    """No atomics: two backward passes give bit-identical gradients."""
    q, k, v, g, cos, sin, mask, do = _inputs(2, 50, 2, 16, 0.05, "left", torch.float32, seed=5)
    _, _, first = _kernel_forward_backward(q, k, v, g, cos, sin, mask, do)
    _, _, second = _kernel_forward_backward(q, k, v, g, cos, sin, mask, do)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), first, second):
        assert torch.equal(a, b), f"{name}: two backward passes differ"


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the custom op, forward and backward, with the same numbers."""
    q, k, v, g, cos, sin, mask, do = _inputs(1, 17, 2, 16, 0.05, "left", torch.float32, seed=6)

    def loss_fn(q, k, v, g, cos, sin, mask):
        return K.attention(q, k, v, g, cos, sin, mask) * 2.0

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    o, grads = _grads(compiled, q, k, v, g, cos, sin, mask, do)
    o_ref, g_ref = _grads(lambda *a: reference_attention(*a) * 2.0, q, k, v, g, cos, sin, mask, do)
    assert_close("o (compiled)", o_ref, o, TOL[torch.float32])
    for name, ref, got in zip(("dq", "dk", "dv", "dg"), g_ref, grads):
        assert_close(f"{name} (compiled)", ref, got, TOL[torch.float32])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture needs a GPU")
def test_cuda_graph_capture():
    """Forward and backward replay from a captured CUDA graph (no host syncs inside the op)."""
    q, k, v, g, cos, sin, mask, do = _inputs(2, 256, 4, 32, 0.05, "left", torch.bfloat16, seed=7)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
    for _ in range(2):  # warm up: autotune and compile outside the capture
        torch.autograd.grad(K.attention(*leaves, cos, sin, mask), leaves, do)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = K.attention(*leaves, cos, sin, mask)
        grads = torch.autograd.grad(o, leaves, do)
    graph.replay()
    torch.cuda.synchronize()
    o_ref, g_ref = _grads(reference_attention, q, k, v, g, cos, sin, mask, do)
    assert_close("o (graph)", o_ref.float(), o.float(), TOL[torch.bfloat16])
    for name, ref, got in zip(("dq", "dk", "dv", "dg"), g_ref, grads):
        assert_close(f"{name} (graph)", ref.float(), got.float(), TOL[torch.bfloat16])


def _good(B=1, T=8, H=2, D=16):
    q, k, v, g, cos, sin, _, _ = _inputs(B, T, H, D, 0.05, "none", torch.float32)
    return dict(q=q, k=k, v=v, g=g, cos=cos, sin=sin, attention_mask=None)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {"k": a["k"][:, :4]}, ValueError, "k shape"),
        (lambda a: {"q": a["q"][0]}, ValueError, "q must be"),
        (lambda a: {"v": a["v"].double()}, TypeError, "dtypes differ"),
        (lambda a: {"q": a["q"].to(torch.int32)}, TypeError, "float32, float16 or bfloat16"),
        (lambda a: {"g": a["g"].half()}, TypeError, "g must be float32"),
        (lambda a: {"g": a["g"][:, :, :1]}, ValueError, "g shape"),
        (lambda a: {"cos": a["cos"][:, :, :3]}, ValueError, "cos shape"),
        (lambda a: {"sin": a["sin"].double()}, TypeError, "sin must be float32"),
        (lambda a: {"attention_mask": torch.ones(1, 5, dtype=torch.bool, device=DEVICE)}, ValueError, "mask shape"),
        (lambda a: {"g": torch.empty(1, 8, 2, device="meta")}, ValueError, "g is on meta"),
        (lambda a: {"k": [1.0]}, TypeError, "k must be a torch.Tensor"),
    ],
    ids=[
        "k-shape",
        "q-rank",
        "dtype-mismatch",
        "int-dtype",
        "g-dtype",
        "g-shape",
        "cos-shape",
        "sin-dtype",
        "mask-shape",
        "device-mismatch",
        "not-tensor",
    ],
)
def test_bad_inputs(change, error, match):
    args = _good()
    args.update(change(args))
    with pytest.raises(error, match=match):
        K.attention(**args)


@pytest.mark.parametrize("D", [8, 24, 256])
def test_unsupported_head_dim(D):
    q = torch.randn(1, 4, 1, D, device=DEVICE)
    g = torch.rand(1, 4, 1, device=DEVICE)
    cs = torch.ones(1, 4, D // 2, device=DEVICE)
    with pytest.raises(ValueError, match=f"head dim D={D} not supported"):
        K.attention(q, q, q, g, cs, cs)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _good().items()}
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        K.attention(**args)
