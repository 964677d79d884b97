"""``wiola.fast.WiolaModel`` against the reference ``wiola.WiolaModel`` on the same weights:
logits, loss, every gradient, cached and padded decoding, greedy generation, state dicts,
``torch.compile``; on the kernels (interpreter on CPU, CUDA when present) and on the PyTorch
CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from numerics import DEVICE, TOL, AbsSums, assert_close, assert_within, bound, rel_err

from wiola import WiolaConfig
from wiola import WiolaModel as Reference
from wiola.fast import WiolaModel as Fast
from wiola.fast import ops as fast_ops
from wiola.fast import use_kernels

CONFIG = dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=256)
FP32 = TOL[torch.float32]
cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


def _models(seed: int = 0, **overrides) -> tuple[Reference, Fast]:
    """A reference and a fast model with the same random weights (gate biases and norms perturbed
    too, so no gate sits at exactly 0.5)."""
    torch.manual_seed(seed)
    ref = Reference(WiolaConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fast = Fast(ref.config)
    fast.load_state_dict(ref.state_dict())
    return ref.to(DEVICE), fast.to(DEVICE)


def _batch(B: int, T: int, pad: str | None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen)
    if pad is None or B == 1:
        return ids.to(DEVICE), None
    mask = torch.ones(B, T, dtype=torch.long)
    lengths = [T, max(1, T - 5), max(1, T // 3)][:B]
    for row, n in enumerate(lengths):
        if pad == "left":
            mask[row, : T - n] = 0
        else:
            mask[row, n:] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _assert_grads_equal(ref: Reference, fast: Fast, tol: float) -> None:
    fast_params = dict(fast.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None and fast_params[name].grad is not None, f"grad[{name}] missing"
        assert_close(f"grad[{name}]", p.grad, fast_params[name].grad, tol)


# Gradients where the interpreter affords them; logits and loss everywhere.
FORWARD_CASES = [
    (1, 1, None, True),
    (1, 17, None, True),
    (1, 130, None, True),
    (3, 1, None, False),
    (3, 17, "left", True),
    (3, 130, "right", False),
]


@pytest.mark.parametrize(
    "B,T,pad,grads", FORWARD_CASES, ids=[f"B{b}-T{t}-{p or 'nopad'}{'-grads' * g}" for b, t, p, g in FORWARD_CASES]
)
def test_forward_and_gradients_match_reference(B, T, pad, grads):
    ref, fast = _models()
    ids, mask = _batch(B, T, pad)
    r = ref(ids, attention_mask=mask, labels=ids)
    if grads:
        f = fast(ids, attention_mask=mask, labels=ids)  # fused loss: no logits
        assert f.logits is None, "logits: the fast model must not materialise them when labels are given"
        assert_close("loss[fused]", r.loss.detach(), f.loss.detach(), FP32)
        r.loss.backward()
        f.loss.backward()
        _assert_grads_equal(ref, fast, FP32)
    with torch.no_grad():
        f = fast(ids, attention_mask=mask, labels=ids, return_logits=True)
    assert_close("logits", r.logits.detach(), f.logits, FP32)
    assert_close("loss", r.loss.detach(), f.loss, FP32)


@pytest.mark.parametrize(
    "overrides", [dict(gate_pre_rope=False), dict(helix_alpha=0.0), dict(gate=False)], ids=lambda o: str(o)
)
def test_gate_variants_match_reference(overrides):
    ref, fast = _models(**overrides)
    ids, mask = _batch(2, 9, "left")
    with torch.no_grad():
        assert_close("logits", ref(ids, attention_mask=mask).logits, fast(ids, attention_mask=mask).logits, FP32)


@pytest.mark.parametrize("n_heads", [8, 2], ids=["head-width-8", "head-width-32"])
def test_head_widths_the_attention_kernels_lack_run_the_torch_attention(n_heads):
    """d_model 64 with 8 heads is a head width of 8, which the attention kernels are not built for:
    attention (and decoding's) runs the PyTorch path, the other kernels stay, and the model still
    matches the reference forward, backward and in cached decoding (32 runs every kernel)."""
    if n_heads == 8:
        with pytest.warns(UserWarning, match=r"head width 8 has no attention kernel \(built for \(16, 32, 64, 128\)\)"):
            ref, fast = _models(n_heads=n_heads)
    else:
        ref, fast = _models(n_heads=n_heads)
        assert fast.describe() == "wiola.fast: every op on its fused kernel where usable (the butterfly included)"
    assert (ref.config.head_dim in fast_ops.ATTENTION_HEAD_DIMS) == (n_heads == 2)
    ids, mask = _batch(3, 17, "left")
    r, f = ref(ids, attention_mask=mask, labels=ids), fast(ids, attention_mask=mask, labels=ids)
    assert_close("loss[fused]", r.loss.detach(), f.loss.detach(), FP32)
    r.loss.backward()
    f.loss.backward()
    _assert_grads_equal(ref, fast, FP32)
    with torch.no_grad():
        full = ref(ids, attention_mask=mask).logits
        cache = fast.new_cache(3, 32)
        got = torch.cat([fast(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits,
                         fast(ids[:, 9:], attention_mask=mask, cache=cache).logits], dim=1)  # fmt: skip
    assert_close("cached logits", full[mask.bool()], got[mask.bool()], FP32)


def test_a_training_forward_moves_the_graph_stamp():
    """A captured CUDA graph reads the derived weights built at capture; writes through ``p.data``
    move no version counter, so a training forward (which forgets the derived weights) and
    ``derived_weights.clear()`` move the stamp the graphs are kept by, and an inference forward does not."""
    from wiola.fast.generation import _stamp

    _, fast = _models()
    ids, _ = _batch(1, 5, None)
    stamp = _stamp(fast)
    with torch.no_grad():
        fast(ids)
    assert _stamp(fast) == stamp
    fast(ids, labels=ids).loss.backward()
    assert _stamp(fast) != stamp
    stamp = _stamp(fast)
    fast.derived_weights.clear()
    assert _stamp(fast) != stamp


@torch.no_grad()
@pytest.mark.parametrize("B,chunks", [(1, (10, 1, 6)), (3, (5, 11, 1))])
def test_cached_decoding_equals_full_pass(B, chunks):
    ref, fast = _models()
    T = sum(chunks)
    ids, mask = _batch(B, T, "left")
    full = ref(ids, attention_mask=mask).logits
    cache = fast.new_cache(B, 64)
    pieces, at = [], 0
    for n in chunks:
        part_mask = None if mask is None else mask[:, : at + n]
        pieces.append(fast(ids[:, at : at + n], attention_mask=part_mask, cache=cache).logits)
        at += n
    got = torch.cat(pieces, dim=1)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert_close("cached logits", full[real], got[real], FP32)
    assert cache.length == T, f"cache.length {cache.length} != {T}"


@torch.no_grad()
def test_float64_cached_decoding_stays_float64():
    """A float64 model's one-token steps (the fast model's carried gate step) compute in float64,
    as the reference does: within the float64 bound (unit 2⁻⁵³) of the full pass, left-padded."""
    ref, fast = (m.double() for m in _models())
    ids, mask = _batch(3, 12, "left")
    with AbsSums(ref) as sums:
        full = ref(ids, attention_mask=mask).logits
    cache = fast.new_cache(3, 32)
    pieces = [fast(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
    for t in range(6, 12):
        pieces.append(fast(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
    got = torch.cat(pieces, dim=1)
    real = mask.bool()
    allowed = bound(ref.config, 12, sums.head, unit=2.0**-53)
    assert_within("float64 cached logits", full[real], got[real], allowed[real])


@torch.no_grad()
def test_bf16_model_cached_decoding_within_the_references_error():
    """A bf16 model (its cache bf16, unlike under autocast): the fast model's prefill and
    one-token steps against the float64 full pass, within the ``BF16_ERROR_RATIO`` of the bf16
    reference's own cached error, and its greedy tokens. Under Triton's interpreter the decoding
    kernel's bf16 products were wrong (logits off by a relative 1.5)."""
    ref, fast = _models()
    exact = Reference(ref.config).to(DEVICE, torch.float64)
    exact.load_state_dict(ref.state_dict())
    ref, fast = ref.to(torch.bfloat16), fast.to(torch.bfloat16)
    ids, mask = _batch(3, 12, "left")
    real = mask.bool()
    full = exact(ids, attention_mask=mask).logits

    def cached(model):
        cache = model.new_cache(3, 32)
        pieces = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
        for t in range(6, 12):
            pieces.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
        return torch.cat(pieces, dim=1)[real]

    _within_reference_error("bf16 model cached logits", full[real], cached(ref), cached(fast))


@torch.no_grad()
def test_padded_batch_generation_matches_reference_and_rows_alone():
    """One left-padded greedy generation with eos: identical to the reference's tokens, and row
    by row to each row alone (the reference's, which equals the fast model's); the padded
    batch's logits equal each row's alone."""
    ref, fast = _models()
    ids, mask = _batch(3, 9, "left")
    N = 6
    plain = ref.generate(ids, N, attention_mask=mask, temperature=0)
    eos = int(plain[0, 9 + 2])  # row 0 produces it at its third step and stops there
    want = ref.generate(ids, N, attention_mask=mask, temperature=0, eos_token_id=eos, pad_token_id=0)
    got = fast.generate(ids, N, attention_mask=mask, temperature=0, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(want, got), f"greedy tokens differ from the reference:\n{want}\n{got}"
    assert (got[0, 9 + 3 :] == 0).all(), "row 0 did not stop at eos"
    batch_logits = fast(ids, attention_mask=mask).logits
    for row in range(3):
        real = mask[row].bool()
        alone = ids[row, real].unsqueeze(0)
        tokens = ref.generate(alone, N, temperature=0, eos_token_id=eos, pad_token_id=0)[0, -N:]
        assert torch.equal(tokens, got[row, -N:]), f"greedy tokens of row {row} differ from the row alone"
        assert_close(f"logits[row {row}]", fast(alone).logits[0], batch_logits[row, real], FP32)


@use_kernels(False)  # about weights and files, not kernels
def test_state_dicts_and_checkpoints_interchange(tmp_path):
    ref, fast = _models()
    assert list(ref.state_dict()) == list(fast.state_dict()), "state-dict keys differ"
    fresh_fast, fresh_ref = Fast(ref.config).to(DEVICE), Reference(ref.config).to(DEVICE)
    fresh_fast.load_state_dict(ref.state_dict(), strict=True)
    fresh_ref.load_state_dict(fast.state_dict(), strict=True)
    ids, _ = _batch(2, 11, None)
    with torch.no_grad():
        want = ref(ids).logits
        assert_close("logits[fast <- reference state dict]", want, fresh_fast(ids).logits, FP32)
        assert_close("logits[reference <- fast state dict]", want, fresh_ref(ids).logits, FP32)
        ref.save_pretrained(tmp_path / "ref")
        fast.save_pretrained(tmp_path / "fast")
        loaded_fast = Fast.from_pretrained(tmp_path / "ref", device=DEVICE)
        loaded_ref = Reference.from_pretrained(tmp_path / "fast", device=DEVICE)
        assert type(loaded_fast) is Fast and type(loaded_ref) is Reference, "from_pretrained returned the wrong class"
        assert_close("logits[Fast.from_pretrained]", want, loaded_fast(ids).logits, FP32)
        assert_close("logits[Reference.from_pretrained]", want, loaded_ref(ids).logits, FP32)


def test_return_logits_and_bad_input():
    _, fast = _models()
    ids, _ = _batch(1, 5, None)
    with torch.no_grad():
        assert fast(ids).logits.shape == (1, 5, 1000), "logits without labels"
        out = fast(ids, labels=ids, return_logits=True)
        assert out.logits is not None and out.loss is not None, "return_logits=True must give logits and loss"
    if DEVICE == "cpu":  # on CUDA the fast model skips host-syncing value checks
        with pytest.raises(ValueError, match="token id 1000"):
            fast(torch.tensor([[1, 1000]]))
    with pytest.raises(ValueError, match="labels shape"):
        fast(ids, labels=ids[:, :3])


def test_torch_compile_fullgraph_forward_backward():
    """No graph break from our ops: the compiled model (forward + backward) equals eager."""
    ref, fast = _models(n_layers=1)
    ids, mask = _batch(2, 17, "right")
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    out = compiled(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    r = ref(ids, attention_mask=mask, labels=ids)
    r.loss.backward()
    assert_close("loss[compiled]", r.loss.detach(), out.loss.detach(), FP32)
    _assert_grads_equal(ref, fast, FP32)


# ------------------------------------------------------------------ the PyTorch (CPU) path
@pytest.mark.parametrize(
    "B,T,pad", [(1, 1, None), (3, 17, "left"), (3, 130, "right")], ids=["B1-T1", "B3-T17", "B3-T130"]
)
def test_torch_path_matches_reference(B, T, pad):
    ref, fast = _models()
    ids, mask = _batch(B, T, pad)
    with use_kernels(False):
        f = fast(ids, attention_mask=mask, labels=ids)
        f.loss.backward()
        with torch.no_grad():
            f_logits = fast(ids, attention_mask=mask).logits
    r = ref(ids, attention_mask=mask, labels=ids)
    r.loss.backward()
    assert_close("loss", r.loss.detach(), f.loss.detach(), FP32)
    assert_close("logits", r.logits.detach(), f_logits, FP32)
    _assert_grads_equal(ref, fast, FP32)


@torch.no_grad()
def test_torch_path_decoding_and_generation():
    ref, fast = _models()
    ids, mask = _batch(3, 17, "left")
    full = ref(ids, attention_mask=mask).logits
    with use_kernels(False):
        cache = fast.new_cache(3, 40)
        first = fast(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits
        rest = [fast(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits for t in range(9, 17)]
        got = fast.generate(ids, 8, attention_mask=mask, temperature=0)
    real = mask.bool()
    assert_close("cached logits", full[real], torch.cat([first, *rest], dim=1)[real], FP32)
    want = ref.generate(ids, 8, attention_mask=mask, temperature=0)
    assert torch.equal(want, got), f"greedy tokens differ:\n{want}\n{got}"


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU autocast check of the PyTorch path")
def test_torch_path_under_cpu_autocast():
    ref, fast = _models()
    ids, mask = _batch(3, 17, "left")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(ids, attention_mask=mask).logits
        with use_kernels(False):
            got = fast(ids, attention_mask=mask).logits
    assert_close("logits[bf16 autocast]", want, got, TOL[torch.bfloat16])


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the plain-CPU dispatch")
def test_plain_cpu_without_interpreter_uses_torch_path():
    """In a fresh process without TRITON_INTERPRET, the fast model runs (no kernel) and matches."""
    script = textwrap.dedent(
        f"""
        import torch
        from wiola import WiolaConfig, WiolaModel
        from wiola.fast import WiolaModel as Fast, ops
        torch.manual_seed(0)
        ref = WiolaModel(WiolaConfig(**{CONFIG!r}))
        fast = Fast(ref.config)
        fast.load_state_dict(ref.state_dict())
        ids = torch.randint(0, 1000, (3, 17))
        mask = torch.ones(3, 17, dtype=torch.long)
        mask[1, :6] = 0
        assert ops._kernel("attention", ids.float()) is None, "a kernel was picked on a plain CPU"
        with torch.no_grad():
            a, b = ref(ids, attention_mask=mask).logits, fast(ids, attention_mask=mask).logits
        print(float((a - b).abs().max() / a.abs().max()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"subprocess failed:\n{run.stderr[-3000:]}"
    err = float(run.stdout.strip().splitlines()[-1])
    assert err <= FP32, f"logits[plain CPU]: relative error {err:.3e} > {FP32:.1e}"


# ------------------------------------------------------------------ the CUDA-graph step, eagerly
@torch.no_grad()
def test_graph_mode_step_matches_reference_greedy():
    """The step ``generate`` captures on CUDA (slot read from the device, key mask written by
    index, token fed back by the step itself), run eagerly here: identical greedy tokens."""
    from wiola.fast.generation import step_generate

    ref, fast = _models()
    ids, mask = _batch(3, 7, "left")
    want = ref.generate(ids, 5, attention_mask=mask, temperature=0, eos_token_id=int(ids[0, -1]))
    got = step_generate(fast, ids, 5, attention_mask=mask, temperature=0, eos_token_id=int(ids[0, -1]), capture=False)
    assert torch.equal(want, got), f"graph-mode greedy tokens differ:\n{want}\n{got}"


def test_exponential_race_sampling_distribution():
    """``sample_next`` with a noise buffer and device-tensor settings (what the CUDA graph runs)
    draws from the filtered softmax: frequencies over 40,000 rows match the probabilities
    (3σ ≈ 0.007; the tolerance is 0.0105 at p = 0.7), and top-k / top-p never pick a filtered token."""
    from wiola.generation import sample_next

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device=DEVICE).expand(40_000, 5)
    noise = torch.empty(40_000, 5, device=DEVICE).exponential_(generator=gen)
    one = torch.ones((), device=DEVICE)

    def draw(top_k, top_p, temperature=1.0):
        tokens = sample_next(logits, one * temperature, top_k, None if top_p is None else one * top_p, noise=noise)
        return torch.bincount(tokens, minlength=5).double() / tokens.numel()

    want = torch.softmax(logits[0].double() / 0.7, dim=0)
    assert_close("frequencies", want, draw(None, None, temperature=0.7), 0.015)
    top2 = draw(2, None)
    assert top2[2:].sum() == 0, f"top_k=2 sampled a filtered token: {top2}"
    p = torch.softmax(logits[0].double(), dim=0)
    assert_close("frequencies[top_k=2]", p[:2] / p[:2].sum(), top2[:2], 0.015)
    nucleus = draw(None, 0.6)  # p = 0.53, 0.20, ...: the first two cover 0.6
    assert nucleus[2:].sum() == 0, f"top_p=0.6 sampled outside the nucleus: {nucleus}"


@torch.no_grad()
def test_graph_mode_sampling_equals_reference_sampling():
    """One sampler for both loops: with the same generator seed, the graph-mode step (run
    eagerly here) samples the very tokens the reference loop samples."""
    from wiola.fast.generation import step_generate
    from wiola.generation import generate

    ref, fast = _models()
    ids, mask = _batch(3, 7, "left")
    kwargs = dict(attention_mask=mask, temperature=0.9, top_k=40, top_p=0.95)
    want = ref.generate(ids, 6, generator=torch.Generator(DEVICE).manual_seed(3), **kwargs)
    got = step_generate(fast, ids, 6, generator=torch.Generator(DEVICE).manual_seed(3), capture=False, **kwargs)
    assert torch.equal(want, got), f"sampled tokens differ:\n{want}\n{got}"
    again = generate(fast, ids, 6, generator=torch.Generator(DEVICE).manual_seed(3), **kwargs)
    assert torch.equal(want, again), "the fast model's eager loop samples differently"
    other = ref.generate(ids, 6, generator=torch.Generator(DEVICE).manual_seed(4), **kwargs)
    assert not torch.equal(want, other), "another seed gave the same tokens: the test could not fail"


# ------------------------------------------------------------------ CUDA only
# Under bf16 autocast both models round to bf16 at different places (the kernels keep fp32 where
# the reference rounds), so each differs from the exact function by its own rounding error, and
# the two can differ by the sum of both: the reference's own error on a gradient that is a
# reduction with cancellation (a gate bias's, say) reaches 5-7 unit roundoffs. The fast model is
# therefore held against the float64 oracle, to within twice the reference's own bf16 error there
# (and never less than the bf16 tolerance, for values the reference happens to get almost exact).
BF16_ERROR_RATIO = 2.0


def _within_reference_error(name: str, exact: torch.Tensor, ref: torch.Tensor, fast: torch.Tensor) -> None:
    exact = exact.double()
    ref_err, fast_err = rel_err(exact, ref.double()), rel_err(exact, fast.double())
    allowed = max(BF16_ERROR_RATIO * ref_err, TOL[torch.bfloat16])
    assert not torch.isnan(fast).any(), f"{name}: NaN in the fast model's output"
    assert fast_err <= allowed, (
        f"{name}: the fast model's error against the float64 oracle {fast_err:.3e} > {allowed:.3e} "
        f"({BF16_ERROR_RATIO:g}x the reference's own bf16 error {ref_err:.3e}, at least {TOL[torch.bfloat16]:.0e}) "
        f"on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )


def _bf16_autocast_runs(B: int, T: int):
    """The float64 oracle, the reference and the fast model (loss and gradients under bf16
    autocast, the fast model's logits without labels) on one left-padded batch."""
    ref, fast = _models()
    exact = Reference(ref.config).to(DEVICE, torch.float64)
    exact.load_state_dict(ref.state_dict())
    ids, mask = _batch(B, T, "left")
    e = exact(ids, attention_mask=mask, labels=ids)
    e.loss.backward()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        r = ref(ids, attention_mask=mask, labels=ids)
        f = fast(ids, attention_mask=mask, labels=ids)
        with torch.no_grad():
            f_logits = fast(ids, attention_mask=mask).logits
    r.loss.backward()
    f.loss.backward()
    _within_reference_error("loss[bf16]", e.loss.detach(), r.loss.detach(), f.loss.detach())
    _within_reference_error("logits[bf16]", e.logits.detach(), r.logits.detach(), f_logits)
    fast_params, ref_params = dict(fast.named_parameters()), dict(ref.named_parameters())
    grads = []
    for name, p in exact.named_parameters():
        assert ref_params[name].grad is not None and fast_params[name].grad is not None, f"grad[{name}] missing"
        grads.append((name, p.grad, ref_params[name].grad, fast_params[name].grad))
    return grads


@cuda
@pytest.mark.parametrize("B,T", [(3, 17), (2, 130)], ids=["B3-T17", "B2-T130"])
def test_cuda_bf16_autocast_matches_reference(B, T):
    for name, exact, ref, fast in _bf16_autocast_runs(B, T):
        _within_reference_error(f"grad[{name}]", exact, ref, fast)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's bf16 path")
@pytest.mark.parametrize("B,T", [(3, 17), (2, 130)], ids=["B3-T17", "B2-T130"])
def test_cpu_bf16_autocast_matches_reference(B, T):
    """Under Triton's interpreter (NumPy has no bfloat16) the training attention and butterfly
    kernels step aside for bf16 (``INTERPRETER_BF16_WRONG``; with them the gradients were ~1e12x
    off). The fast model then mixes the other kernels (fp32 inside) with ATen's bf16 ops, so a
    small reduction's gradient (a gate bias, |g| ~ 1e-5) lands on either side of twice the
    reference's own error by torch version; the loss, the logits and the whole gradient are held
    to that bound."""
    grads = _bf16_autocast_runs(B, T)
    whole = [torch.cat([g.flatten().double() for g in parts]) for parts in zip(*[(e, r, f) for _, e, r, f in grads])]
    _within_reference_error("every gradient[bf16]", *whole)


@cuda
@torch.no_grad()
def test_no_graphs_without_the_caching_allocator(monkeypatch):
    """With PyTorch's caching allocator off (as under compute-sanitizer) a capture would fail on
    its first allocation, so generation takes the eager loop, with the same tokens."""
    from wiola.fast.generation import graphs_usable

    ref, fast = _models()
    ids, mask = _batch(3, 9, "left")
    assert graphs_usable(fast, ids), "graphs unusable to begin with: the test could not fail"
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert not graphs_usable(fast, ids), "CUDA graphs chosen with the caching allocator off"
    want = ref.generate(ids, 12, attention_mask=mask, temperature=0)
    got = fast.generate(ids, 12, attention_mask=mask, temperature=0)
    assert torch.equal(want, got), f"greedy tokens differ:\n{want}\n{got}"


@cuda
@torch.no_grad()
def test_cuda_graph_generation():
    ref, fast = _models()
    ids, mask = _batch(3, 9, "left")
    want = ref.generate(ids, 20, attention_mask=mask, temperature=0)
    for _ in range(2):  # the second call replays the captured graph
        got = fast.generate(ids, 20, attention_mask=mask, temperature=0)
        assert torch.equal(want, got), f"greedy tokens differ:\n{want}\n{got}"
    eos = int(want[1, 9 + 3])
    want = ref.generate(ids, 20, attention_mask=mask, temperature=0, eos_token_id=eos)
    got = fast.generate(ids, 20, attention_mask=mask, temperature=0, eos_token_id=eos)
    assert torch.equal(want, got), f"greedy tokens with eos differ:\n{want}\n{got}"
    draws = [
        fast.generate(ids, 20, attention_mask=mask, temperature=0.8, top_k=50, top_p=0.9,
                      generator=torch.Generator("cuda").manual_seed(7))
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(draws[0], draws[1]), "sampling with the same generator seed is not reproducible"
    assert ((draws[0] >= 0) & (draws[0] < 1000)).all(), "sampled ids out of range"


@torch.no_grad()
def test_torch_path_chunk_after_a_left_padded_prompt():
    """A left-padded prompt in a cache, then a chunk of several tokens with no mask (all real):
    on the PyTorch path the chunk must still skip the padding slots, as the reference does."""
    ref, fast = _models()
    ids, mask = _batch(3, 9, "left")
    chunk = ids[:, -3:].flip(1)
    outs = []
    with use_kernels(False):
        for model in (ref, fast):
            cache = model.new_cache(3, 12)
            model(ids, attention_mask=mask, cache=cache)
            outs.append(model(chunk, cache=cache).logits)
    assert_close("chunk logits after a left-padded prompt", outs[0], outs[1], FP32)
