"""The fused gate (kernels/gate.py) against the reference (wiola/ops/gate.py) and a float64 loop.

Forward (g, sum, count) and every gradient (q, w1, w2, b2, the carried sum) with the same random
upstream gradients; every buffer the kernels write starts as NaN. Under TRITON_INTERPRET=1 on
CPU in fp32; on CUDA also in bf16 and fp16.
"""

from __future__ import annotations

import pytest
import torch
from gate_oracle import gate_float64, make_inputs
from numerics import DEVICE, KERNEL_DTYPES, TOL, assert_close

import wiola_kernels.gate as kgate
from wiola.ops.gate import gate as ref_gate
from wiola.ops.rope import helix_frequencies, rope_tables
from wiola_kernels._utils import poisoned_outputs


@pytest.fixture(autouse=True)
def nan_buffers():
    """Every kernel output and scratch buffer starts as NaN (integers as -1)."""
    with poisoned_outputs():
        yield


def run(fn, qkv, weights, mask, rope, state, dg, dsum):
    """Forward with ``fn``, then gradients of <g, dg> + <sum, dsum> for every differentiable input,
    ``dg`` and ``dsum`` handed to the backward as the upstream gradients themselves."""
    q = qkv.unbind(2)[0]  # (B, T, H, D) strided view
    g, total, count = fn(q, *weights, attention_mask=mask, carry=state, **rope)
    inputs = [qkv, *weights] + ([state[0]] if state is not None else [])
    grads = torch.autograd.grad((g, total), inputs, (dg, dsum))  # dg as it is, strides included
    names = ["dq", "dw1", "dw2", "db2", "dcarry_sum"]
    return {"g": g, "sum": total, "count": count, **dict(zip(names, grads))}


CASES = [
    # B, T, H, D, rotate, alpha, pad, carry
    (1, 1, 1, 16, False, 0.05, "none", False),
    (3, 1, 4, 32, True, 0.05, "none", True),
    (3, 17, 4, 32, True, 0.05, "left", False),
    (1, 17, 8, 64, False, 0.05, "right", True),
    (3, 64, 1, 16, True, 0.0, "both", False),
    (1, 64, 8, 32, True, 0.05, "none", False),
    (3, 300, 4, 32, False, 0.05, "left", True),
    (1, 300, 8, 16, True, 0.05, "right", False),
    (3, 300, 1, 64, True, 0.0, "none", False),
    (1, 1000, 2, 16, True, 0.05, "left", True),  # 32 blocks in 4 spans: the two-level scan
]


def case_id(case) -> str:
    B, T, H, D, rotate, alpha, pad, carry = case
    rot = f"post-a{alpha}" if rotate else "pre"
    return f"B{B}-T{T}-H{H}-D{D}-{rot}-pad_{pad}" + ("-carry" if carry else "")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_gate_matches_reference(case, dtype):
    B, T, H, D, rotate, alpha, pad, carry = case
    qkv, weights, mask, rope, state = make_inputs(
        B, T, H, D, dtype=dtype, pad=pad, rotate=rotate, alpha=alpha, carry=carry
    )
    gen = torch.Generator().manual_seed(1)
    dg = torch.randn(B, T, H, generator=gen).to(DEVICE)
    if T > 1:  # g's upstream gradient as a loss that reads g transposed hands it: strides (T*H, 1, T)
        dg = torch.randn(B, H, T, generator=gen).to(DEVICE).transpose(1, 2)
    dsum = torch.randn(B, D, generator=gen).to(DEVICE)
    ref = run(ref_gate, qkv, weights, mask, rope, state, dg, dsum)
    got = run(kgate.gate, qkv, weights, mask, rope, state, dg, dsum)
    assert got["count"].dtype == torch.int64, f"count: dtype {got['count'].dtype}"
    assert torch.equal(ref["count"], got["count"]), f"count: {got['count'].tolist()} != {ref['count'].tolist()}"
    assert got["g"].dtype == torch.float32 and got["sum"].dtype == torch.float32
    for name in ref:
        if name != "count":
            assert_close(name, ref[name], got[name], TOL[dtype])


def test_gate_matches_float64_loop():
    B, T, H, D = 2, 23, 4, 16
    qkv, (w1, w2, b2), mask, rope, _ = make_inputs(B, T, H, D, pad="left", rotate=True, seed=3)
    q = qkv.detach().unbind(2)[0]
    g, total, count = kgate.gate(q, w1.detach(), w2.detach(), b2.detach(), attention_mask=mask, **rope)
    g64, sum64, _ = gate_float64(
        q.cpu(), w1.cpu(), w2.cpu(), b2.cpu(), rope["cos"].cpu(), rope["sin"].cpu(), mask.cpu()
    )
    assert_close("g", g64, g.cpu(), 1e-5)
    assert_close("sum", sum64, total.cpu(), 1e-5)
    assert count.tolist() == mask.sum(1).tolist(), f"count: {count.tolist()}"
    # Gradients through the float64 loop by autograd.
    q64 = q.cpu().double().requires_grad_()
    w64 = [w.detach().cpu().double().requires_grad_() for w in (w1, w2, b2)]
    dg = torch.randn(B, T, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g_loop, _, _ = gate_float64(q64, *w64, rope["cos"].cpu(), rope["sin"].cpu(), mask.cpu())
    ref_grads = torch.autograd.grad((g_loop * dg).sum(), [q64, *w64])
    qf = q.clone().requires_grad_()
    wf = [w.detach().clone().requires_grad_() for w in (w1, w2, b2)]
    g, _, _ = kgate.gate(qf, *wf, attention_mask=mask, **rope)
    got_grads = torch.autograd.grad((g * dg.float().to(DEVICE)).sum(), [qf, *wf])
    for name, r, k in zip(("dq", "dw1", "dw2", "db2"), ref_grads, got_grads):
        assert_close(name, r, k.cpu(), 1e-5)


@pytest.mark.parametrize("rotate", [False, True], ids=["pre", "post"])
def test_prefill_in_chunks_equals_one(rotate):
    """Two chunks (and then token-by-token decoding) carry (sum, count) exactly like one pass."""
    B, T, H, D, split = 3, 40, 4, 32, 23
    qkv, weights, mask, rope, _ = make_inputs(B, T, H, D, pad="left", rotate=rotate, seed=7)
    q = qkv.detach().unbind(2)[0]
    weights = [w.detach() for w in weights]
    g_one, sum_one, count_one = kgate.gate(q, *weights, attention_mask=mask, **rope)

    def chunk(lo, hi, carry):
        part = {k: v[:, lo:hi] for k, v in rope.items()}
        return kgate.gate(q[:, lo:hi], *weights, attention_mask=mask[:, lo:hi], carry=carry, **part)

    g_a, sum_a, count_a = chunk(0, split, None)
    g_b, sum_b, count_b = chunk(split, T - 3, (sum_a, count_a))
    pieces, carry = [g_a, g_b], (sum_b, count_b)
    for t in range(T - 3, T):  # decoding steps, T = 1 each
        g_t, *carry = chunk(t, t + 1, tuple(carry))
        pieces.append(g_t)
    assert_close("g", g_one, torch.cat(pieces, dim=1), 1e-5)
    assert_close("sum", sum_one, carry[0], 1e-5)
    assert torch.equal(count_one, carry[1]), f"count: {carry[1].tolist()} != {count_one.tolist()}"


@pytest.mark.parametrize("fn", [kgate.gate, ref_gate], ids=["kernel", "reference"])
@pytest.mark.parametrize("T,grad", [(1, False), (1, True), (40, False)], ids=["step", "step-grad", "chunk"])
def test_update_carry_writes_the_cache_state(fn, T, grad):
    """``update_carry=True`` gives the out-of-place result bitwise, in the carry's own tensors: the
    kernel writes them itself for a step without gradients (no copy launched), else copies."""
    from bench.launches import LaunchCounter

    qkv, weights, mask, rope, state = make_inputs(3, T, 4, 16, pad="left" if T > 1 else "none", rotate=True, carry=True)
    q = qkv.unbind(2)[0]
    with torch.set_grad_enabled(grad):
        g_want, sum_want, count_want = fn(q, *weights, attention_mask=mask, carry=state, **rope)
        carry = (state[0].detach().clone(), state[1].clone())
        with LaunchCounter() as counter:
            g, total, count = fn(q, *weights, attention_mask=mask, carry=carry, update_carry=True, **rope)
    assert total is carry[0] and count is carry[1], "the returned state is not the carry's own tensors"
    assert torch.equal(g, g_want), "g differs from the call without update_carry"
    assert torch.equal(total, sum_want.detach()) and torch.equal(count, count_want), "carry written wrongly"
    # One program's span a row (always for a step; for the chunk, on the interpreter's 4 programs
    # never, on a GPU by its SM count), no gradient: written in place.
    span = kgate._span_tokens(3, T, kgate._configs(4, 16, q.dtype)["fwd"]["BLOCK_T"], q.device)
    in_place = fn is kgate.gate and T <= span and not grad
    assert (counter.aten["copy_"] == 0) == in_place, f"in place {in_place}: {counter.report()}"
    with pytest.raises(ValueError, match="update_carry needs a carry"):
        fn(q, *weights, attention_mask=mask, update_carry=True, **rope)


def test_any_nonzero_mask_value_is_one_real_token():
    """A mask holding other nonzero values (0.5, 2) is a bool mask to the reference and the
    kernel alike: every nonzero is one real token, counted once, never weighted."""
    B, T, H, D = 2, 9, 2, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=gen).to(DEVICE)
    weights = [
        w.to(DEVICE)
        for w in (torch.randn(H, D, generator=gen), torch.randn(H, H, generator=gen), torch.randn(H, generator=gen))
    ]
    odd = torch.tensor([[1.0] * 9, [0, 0, 0.5, 0.5, 1, 2, 1, 1, 1]], device=DEVICE)
    for fn in (ref_gate, kgate.gate):
        got, want = fn(q, *weights, attention_mask=odd), fn(q, *weights, attention_mask=odd.bool())
        for name, a, b in zip(("g", "sum", "count"), want, got):
            assert torch.equal(a, b), f"{fn.__module__}: {name} with a 0.5/2 mask differs from the bool mask"


def test_strided_and_transposed_q():
    """q in a (B, H, T, D) layout seen as (B, T, H, D), and fp32 tables broadcast over the batch."""
    B, T, H, D = 2, 33, 4, 32
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, T, D, generator=gen).to(DEVICE).transpose(1, 2)  # strides (H*T*D, D, T*D, 1)
    w1, w2, b2 = torch.randn(H, D, generator=gen), torch.randn(H, H, generator=gen), torch.randn(H, generator=gen)
    w1, w2, b2 = (w.to(DEVICE) for w in (w1, w2, b2))
    cos, sin = rope_tables(torch.arange(T).view(1, T), helix_frequencies(D))
    rope = {"cos": cos.to(DEVICE), "sin": sin.to(DEVICE)}  # (1, T, D/2): broadcast over rows
    got = kgate.gate(q, w1, w2, b2, **rope)
    ref = ref_gate(q, w1, w2, b2, **rope)
    for name, r, k in zip(("g", "sum"), ref[:2], got[:2]):
        assert_close(name, r, k, 1e-5)


def test_heads_at_once_keeps_the_order_of_additions(monkeypatch):
    """The head mean's loads issued several heads at a time (``HEADS_AT_ONCE``) add the heads in
    the same order as one at a time: g and the running sum are bitwise the same. Decoding (T 1,
    carry, rotation) and a prompt split into spans (the pre-pass), H 8 (8 at once) and 6 (2)."""
    assert kgate._configs(8, 32, torch.bfloat16)["fwd"]["HEADS_AT_ONCE"] == 8  # the 13m preset's shape
    assert kgate._configs(6, 32, torch.float32)["fwd"]["HEADS_AT_ONCE"] == 2
    assert kgate._configs(8, 64, torch.bfloat16)["fwd"]["HEADS_AT_ONCE"] == 1  # wider tiles: one at a time
    for B, T, H, pad, carry in ((3, 1, 8, "none", True), (2, 300, 8, "left", True), (2, 40, 6, "right", False)):
        qkv, weights, mask, rope, state = make_inputs(B, T, H, 32, pad=pad, rotate=True, carry=carry, seed=5)
        q = qkv.detach().unbind(2)[0]
        weights = [w.detach() for w in weights]
        state = None if state is None else (state[0].detach(), state[1])
        together = kgate.gate(q, *weights, attention_mask=mask, carry=state, **rope)
        with monkeypatch.context() as m:
            m.setattr(kgate, "_heads_at_once", lambda H, block_half: 1)
            one_by_one = kgate.gate(q, *weights, attention_mask=mask, carry=state, **rope)
        for name, a, b in zip(("g", "sum", "count"), together, one_by_one):
            assert torch.equal(a, b), f"{name} differs with heads loaded together (B{B} T{T} H{H})"


def test_weights_in_half_precision_get_gradients_in_their_dtype():
    B, T, H, D = 2, 17, 4, 16
    qkv, weights, mask, _, _ = make_inputs(B, T, H, D, pad="left", seed=2)
    weights = [w.detach().to(torch.bfloat16).requires_grad_() for w in weights]
    dg = torch.randn(B, T, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = run(ref_gate, qkv, weights, mask, {}, None, dg, torch.zeros(B, D, device=DEVICE))
    got = run(kgate.gate, qkv, weights, mask, {}, None, dg, torch.zeros(B, D, device=DEVICE))
    for name in ("g", "dq"):
        assert_close(name, ref[name], got[name], 1e-5)
    for name in ("dw1", "dw2", "db2"):
        assert got[name].dtype == torch.bfloat16, f"{name}: dtype {got[name].dtype}"
        assert_close(name, ref[name].float(), got[name].float(), 1e-2)  # one bf16 rounding


def test_torch_compile_fullgraph_forward_backward():
    B, T, H, D = 2, 17, 4, 16
    qkv, weights, mask, rope, state = make_inputs(B, T, H, D, pad="left", rotate=True, carry=True, seed=9)

    def loss(fn, qkv, w1, w2, b2, carry_sum, carry_count):
        g, total, _ = fn(qkv.unbind(2)[0], w1, w2, b2, attention_mask=mask, carry=(carry_sum, carry_count), **rope)
        return (g * g).sum() + total.sum()  # dg not contiguous-friendly: 2g, computed in the graph

    compiled = torch.compile(lambda *a: loss(kgate.gate, *a), fullgraph=True)
    inputs = [qkv, *weights, *state]
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs[:5])
    ref = loss(ref_gate, *inputs)
    ref_grads = torch.autograd.grad(ref, inputs[:5])
    assert_close("loss", ref.detach(), got.detach(), 1e-5)
    for name, r, k in zip(("dq", "dw1", "dw2", "db2", "dcarry_sum"), ref_grads, got_grads):
        assert_close(name, r, k, 1e-5)


@torch.no_grad()
def test_torch_compile_fullgraph_step_updates_the_carry_in_place():
    """A compiled decoding step's gate (``update_carry``, no gradient): the custom op declares the
    carry as mutated, so the compiled call leaves in the carry exactly what the eager one does."""
    B, H, D = 3, 4, 16
    qkv, weights, _, rope, state = make_inputs(B, 1, H, D, rotate=True, carry=True, seed=11)
    q = qkv.detach().unbind(2)[0]
    weights = [w.detach() for w in weights]

    def step(q, w1, w2, b2, carry_sum, carry_count):
        return kgate.gate(q, w1, w2, b2, carry=(carry_sum, carry_count), update_carry=True, **rope)[0]

    eager = (state[0].detach().clone(), state[1].clone())
    compiled = (state[0].detach().clone(), state[1].clone())
    g_eager = step(q, *weights, *eager)
    g_compiled = torch.compile(step, fullgraph=True)(q, *weights, *compiled)
    assert not torch.equal(eager[0], state[0].detach()), "the carry did not move: the test could not fail"
    assert torch.equal(g_compiled, g_eager), "g differs under torch.compile"
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1]), "carry not written when compiled"


def _bad(**change):
    B, T, H, D = 2, 5, 2, 8
    args = {
        "q": torch.randn(B, T, H, D, device=DEVICE),
        "w1": torch.randn(H, D, device=DEVICE),
        "w2": torch.randn(H, H, device=DEVICE),
        "b2": torch.randn(H, device=DEVICE),
    }
    kwargs = {}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value(args) if callable(value) else value
    return args, kwargs


BAD = {
    "q-3d": (ValueError, "q must be a", {"q": torch.randn(2, 5, 8)}),
    "q-int": (TypeError, "floating-point", {"q": torch.ones(2, 5, 2, 8, dtype=torch.int64)}),
    "q-float64": (TypeError, "not supported", {"q": torch.randn(2, 5, 2, 8, dtype=torch.float64)}),
    "q-empty-T": (ValueError, "T = 0", {"q": torch.randn(2, 0, 2, 8)}),
    "odd-D": (ValueError, "even", {"q": torch.randn(2, 5, 2, 7)}),
    "w1-shape": (ValueError, "w1 must have shape", {"w1": torch.randn(2, 4)}),
    "w2-shape": (ValueError, "w2 must have shape", {"w2": torch.randn(3, 2)}),
    "b2-shape": (ValueError, "b2 must have shape", {"b2": torch.randn(3)}),
    "cos-without-sin": (ValueError, "together", {"cos": torch.ones(2, 5, 4)}),
    "cos-shape": (ValueError, "cos must have shape", {"cos": torch.ones(2, 5, 8), "sin": torch.ones(2, 5, 8)}),
    "mask-shape": (ValueError, "attention_mask must have shape", {"attention_mask": torch.ones(2, 4)}),
    "carry-not-pair": (ValueError, "pair", {"carry": (torch.zeros(2, 8),)}),
    "carry-sum-dtype": (ValueError, "carry sum", {"carry": (torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2))}),
    "carry-count-float": (ValueError, "carry count", {"carry": (torch.zeros(2, 8), torch.zeros(2))}),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    error, message, change = BAD[name]
    change = {k: (tuple(x.to(DEVICE) for x in v) if isinstance(v, tuple) else v.to(DEVICE)) for k, v in change.items()}
    args, kwargs = _bad(**change)
    with pytest.raises(error, match=message):
        kgate.gate(args["q"], args["w1"], args["w2"], args["b2"], **kwargs)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU-without-interpreter error")
def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args, _ = _bad()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kgate.gate(args["q"], args["w1"], args["w2"], args["b2"])
