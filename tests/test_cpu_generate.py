"""The decoding loop in C++ (``wiola.fast.generation.cpu_generate``) and its sampler.

The oracle is today's loop, ``wiola.generation.generate`` on the same fast model (its one-token
steps the C++ step, its sampler ``wiola.generation.sample_next`` in torch): the C++ loop's tokens
equal it bitwise, greedy and sampled (temperature, top-k, top-p), with left padding, eos and pad,
an early stop inside a chunk of noise, and a streamer; the caller's generator is left in the same
state. The C++ sampler alone equals ``sample_next`` on logits with ties (nuclei that end inside a
run of equal logits included), for every instruction-set variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within, left_padded_prompt, log_softmax_bound, platform_line

import wiola
import wiola.fast
from wiola import generation as reference_loop
from wiola.fast import generation as fast_generation
from wiola.fast.quantize import quantize

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
SMALL = wiola.WiolaConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=96)


@pytest.fixture
def isa(isa, monkeypatch) -> str:
    """conftest's variants, also named in ``$WIOLA_CPU_ISA`` (read by the bindings ``generate`` makes)."""
    monkeypatch.setenv("WIOLA_CPU_ISA", isa)
    return isa


pytestmark = pytest.mark.usefixtures("plain_cpu")  # a plain CPU: the C++ step, not the interpreter


def _model(scheme: str = "fp32", seed: int = 0) -> wiola.fast.WiolaModel:
    torch.manual_seed(seed)
    model = wiola.fast.WiolaModel(SMALL).eval().requires_grad_(False)
    with torch.no_grad():  # peaked distributions: sampled rows hit their eos now and then
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model if scheme == "fp32" else quantize(model, scheme)


SETTINGS = {
    "greedy": {"temperature": 0},
    "temperature": {"temperature": 0.8},
    "top-k": {"temperature": 1.2, "top_k": 7},
    "top-p": {"temperature": 0.9, "top_p": 0.8},
    "top-k top-p": {"temperature": 1.1, "top_k": 12, "top_p": 0.6},
    "top-k greedy": {"temperature": 0, "top_k": 3},
}


@torch.inference_mode()
@pytest.mark.parametrize("scheme", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_loop_equals_the_torch_loop(setting, scheme, monkeypatch):
    """Every sampler and weight type in the variant this CPU takes by default."""
    _loop_equals_the_torch_loop(setting, scheme, decode_step_cpu.select_isa(), monkeypatch)


@torch.inference_mode()
def test_loop_equals_the_torch_loop_every_variant(isa, monkeypatch):
    _loop_equals_the_torch_loop("top-k", "int8", isa, monkeypatch)


def _loop_equals_the_torch_loop(setting: str, scheme: str, isa: str, monkeypatch) -> None:
    model = _model(scheme)
    ids, mask = left_padded_prompt(SMALL.vocab_size, 3, 9, 4)
    kwargs = SETTINGS[setting]
    eos = int(model.generate(ids[:1], 3, temperature=0)[0, -1])  # a token the model likes
    monkeypatch.setattr(fast_generation, "NOISE_FLOATS", 5 * 3 * SMALL.vocab_size)  # chunks of 5 steps
    for extra in ({}, {"eos_token_id": eos, "pad_token_id": 0}):
        g_want, g_got = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        want = reference_loop.generate(model, ids, 23, attention_mask=mask, generator=g_want, **kwargs, **extra)
        streamed = []
        got = model.generate(
            ids, 23, attention_mask=mask, generator=g_got, streamer=streamed.append if extra else None,
            **kwargs, **extra,
        )  # fmt: skip
        what = f"{isa} {scheme} {setting} {extra}"
        assert torch.equal(want, got), f"{what}: tokens differ\n{want}\n{got}"
        assert torch.equal(torch.rand(4, generator=g_want), torch.rand(4, generator=g_got)), (
            f"{what}: the generator was left elsewhere"
        )
        if extra:
            assert torch.equal(torch.stack(streamed, 1), got[:, 9 : 9 + len(streamed)]), f"{what}: streamer"


@torch.inference_mode()
@pytest.mark.parametrize("streamed", [False, True], ids=["one-call", "streamed"])
def test_every_row_stopping_early_leaves_the_generator_and_streamer_as_the_torch_loop(streamed):
    """Sampling where the rows hit eos long before ``max_new_tokens``: the same tokens, the
    generator left after as many draws as the torch loop makes, and the streamer called for the
    same steps (none after the last row finished)."""
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    kwargs = {"temperature": 1.0, "top_k": 50}
    probe = reference_loop.generate(model, ids, 12, generator=torch.Generator().manual_seed(3), **kwargs)
    eos = int(probe[0, 3 + 2])  # the row stops by its third token
    runs = {}
    for name, run in (("torch", reference_loop.generate), ("C++", model.generate)):
        g, calls = torch.Generator().manual_seed(3), []
        out = run(model, ids, 30, generator=g, eos_token_id=eos, pad_token_id=0,
                  streamer=calls.append if streamed else None, **kwargs) if name == "torch" else \
            run(ids, 30, generator=g, eos_token_id=eos, pad_token_id=0,
                streamer=calls.append if streamed else None, **kwargs)  # fmt: skip
        runs[name] = (out, torch.rand(4, generator=g), calls)
    (want, g_want, s_want), (got, g_got, s_got) = runs["torch"], runs["C++"]
    assert torch.equal(want, got), f"tokens differ\n{want}\n{got}"
    assert want[0, 3:].tolist().index(eos) <= 2 and want[0, -1] == 0, f"no early stop: the test shows nothing {want}"
    assert torch.equal(g_want, g_got), "the generator was left after another number of draws"
    assert len(s_got) == len(s_want) and all(map(torch.equal, s_want, s_got)), (len(s_want), len(s_got))


@torch.inference_mode()
def test_loop_is_one_call_per_chunk(monkeypatch):
    """Greedy: one C++ call per request; sampling: one per chunk of ``NOISE_FLOATS`` draws; an
    early stop (every row at its eos) ends the loop inside a chunk."""
    calls = []
    original = decode_step_cpu.DecodeStepCPU.generate_loop

    def counted(self, start, steps, *args, **kwargs):
        calls.append(steps)
        return original(self, start, steps, *args, **kwargs)

    monkeypatch.setattr(decode_step_cpu.DecodeStepCPU, "generate_loop", counted)
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    model.generate(ids, 30, temperature=0)
    assert calls == [(0, 30)]
    calls.clear()
    monkeypatch.setattr(fast_generation, "NOISE_FLOATS", 8 * SMALL.vocab_size)
    model.generate(ids, 30, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert calls == [(0, 8), (8, 16), (16, 24), (24, 30)]
    calls.clear()
    asked = []  # the C++ nucleus' fallback into Python: only for near ties, which these logits lack
    nucleus_drop = reference_loop.nucleus_drop
    monkeypatch.setattr(reference_loop, "nucleus_drop", lambda *a: asked.append(a) or nucleus_drop(*a))
    model.generate(ids, 30, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert calls == [(0, 8), (8, 16), (16, 24), (24, 30)], "a nucleus took the loop out of C++"
    assert asked == [], "the nucleus called back into Python"
    first = int(model.generate(ids, 1, temperature=0)[0, -1])
    calls.clear()
    out = model.generate(ids, 30, temperature=0, eos_token_id=first, pad_token_id=1)
    assert out[0, 3:].tolist() == [first] + [1] * 29 and calls == [(0, 30)]


@pytest.mark.parametrize("V", [5, 16, 70, 203, 32000])
def test_greedy_choice_equals_torch_argmax(V, isa):
    """Greedy rows take torch.argmax's token: the first NaN where there is one (in the vector part
    or the last V % (4 · lanes) elements), else the first maximum (also where a later set of lanes
    holds it at a lower index than the first set), -0.0 and 0.0 counted equal, a row of -inf giving
    0; rows narrower than a vector and a vocabulary's width included."""
    lib = decode_step_cpu.load(isa)
    gen = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=gen) for _ in range(4)]
    rows.append(torch.full((V,), float("-inf")))
    rows.append(torch.zeros(V))
    signed = torch.zeros(V)
    signed[: V // 2] = -0.0
    rows.append(signed)
    for at in sorted({0, V // 3, V - 1}):
        r = torch.randn(V, generator=gen)
        r[at] = float("nan")
        # another lane; the same lane of every ISA variant; the same lane of its next set
        for later in (at + 2, at + 16, at + 64):
            if later < V:
                r[later] = float("nan")
        rows.append(r)
    tie = torch.randint(-3, 3, (V,), generator=gen).float()
    rows.append(tie)
    late = torch.randn(V, generator=gen)
    late[-1] = 100.0
    rows.append(late)
    two = torch.zeros(V)  # the maximum at 50 (the fourth set of 16 lanes) and at 64 (the next pass's first)
    two[[min(V - 1, 64), min(V - 1, 50)]] = 1.0
    rows.append(two)
    logits = torch.stack(rows).contiguous()
    samplers = decode_step_cpu.Samplers(len(rows), V, 1)
    samplers.mode.fill_(decode_step_cpu.MODE["greedy"])
    decode_step_cpu.sample_rows(lib, logits, samplers)
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(samplers.token, want), (
        f"{isa} on {decode_step_cpu.cpu_info()['name']}: greedy tokens {samplers.token.tolist()} "
        f"!= torch.argmax {want.tolist()}"
    )


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_sampler_equals_sample_next_with_ties(scale, isa):
    """The C++ sampler's tokens equal ``wiola.generation.sample_next``'s on the same logits and
    the same Exp(1) draws: greedy with repeated maxima, top-k whose k-th value repeats,
    temperatures that are not powers of two, nuclei (some ending inside a run of equal logits,
    where the reference decides; the others decided by the bound); its log-probabilities, the
    chosen token's and the best ``n_logprobs`` values, are the log-softmax of the unfiltered
    logits: the float64 log-softmax within the rounding of an fp32 one (``log_softmax_bound`` with
    no logit error)."""
    lib = decode_step_cpu.load(isa)
    gen = torch.Generator().manual_seed(3)
    V, n = 203, 64
    logits = (torch.randint(-6, 7, (n, V), generator=gen).float() / 4 * scale).contiguous()  # many ties
    logits[1:9] = torch.randn(8, V, generator=gen) * scale  # rows 6-8: nuclei over distinct logits
    settings = [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, 1, None), (2.1, 40, None),
                (0.9, V - 1, None), (1.0, None, 0.5), (0.8, 30, 0.9), (1.7, None, 0.97)]  # fmt: skip
    samplers = decode_step_cpu.Samplers(n, V, 6)
    want = []
    for i in range(n):
        t, k, p = settings[i % len(settings)]
        samplers.mode[i] = decode_step_cpu.MODE["greedy" if t == 0 else "sample"]
        samplers.temperature[i], samplers.top_k[i], samplers.n_logprobs[i] = t or 1.0, k or 0, i % 7
        samplers.top_p[i] = p or 1.0
        g = torch.Generator().manual_seed(i)
        want.append(int(reference_loop.sample_next(logits[i : i + 1], t, k, p, g)[0]))
        noise = torch.empty(1, V).exponential_(generator=torch.Generator().manual_seed(i))
        samplers.log_noise[i] = torch.log(noise.clamp_min(1e-30))[0]
    decode_step_cpu.sample_rows(lib, logits, samplers)
    assert samplers.token.tolist() == want, (
        f"{isa}: the C++ sampler's tokens differ from sample_next's; {platform_line(isa)}"
    )
    paths = {decode_step_cpu.NUCLEUS_PATHS[int(p)] for p in samplers.path}
    assert {"bound", "caller"} <= paths, f"a nucleus path untested: {paths}"
    logp = torch.log_softmax(logits.double(), -1)
    allowed = log_softmax_bound(0.0, logits)  # the same logits: only the log-softmax's own rounding
    chosen = samplers.token[:, None]
    assert_within(
        "logprob of the chosen token",
        logp.gather(1, chosen)[:, 0],
        samplers.logprob,
        allowed.gather(1, chosen)[:, 0],
        isa,
    )
    for i in range(n):
        k = i % 7
        ids = samplers.top_ids[i, :k].tolist()
        order = sorted(range(V), key=lambda j: (-float(logits[i, j]), j))[:k]
        assert ids == order, f"{isa}, row {i}: top ids {ids} != {order}; {platform_line(isa)}"
        if k:
            assert_within(f"row {i}: top values", logp[i, order], samplers.top_values[i, :k], allowed[i, order], isa)


@pytest.mark.parametrize("V", [7, 11, 203, 4099])
def test_logprobs_hold_across_the_range_of_the_exponentials(V, isa):
    """The sampler's log-probabilities take their exponentials a vector at a time (the attention's
    fp32 ``exp_nonpositive`` of ``z - max z``, the last vector padded) and sum them in double:
    within the rounding of an fp32 log-softmax of the float64 one, where every term counts (logits
    spread over [-30, 0]), where the terms span past fp32's and double's range (down to -745, and
    -inf), and for vocabularies shorter than a vector or with a tail."""
    lib = decode_step_cpu.load(isa)
    gen = torch.Generator().manual_seed(V)
    rows = [
        -30 * torch.rand(V, generator=gen),  # many terms of the same size
        -745 * torch.rand(V, generator=gen),  # across exp's range, some past its smallest double
        torch.where(torch.rand(V, generator=gen) < 0.3, float("-inf"), -3 * torch.rand(V, generator=gen)),
        -1e-3 * torch.rand(V, generator=gen),  # nearly equal: x near 0, n = 0
        30 * torch.randn(V, generator=gen),
    ]
    logits = torch.stack(rows).contiguous()
    logits[:, V // 2] = logits.amax(-1) + 0.5  # one finite maximum in every row
    k = min(V, 6)
    samplers = decode_step_cpu.Samplers(len(rows), V, k)
    samplers.mode.fill_(decode_step_cpu.MODE["greedy"])
    samplers.n_logprobs.fill_(k)
    decode_step_cpu.sample_rows(lib, logits, samplers)
    logp = torch.log_softmax(logits.double(), -1)
    allowed = log_softmax_bound(0.0, logits.masked_fill(logits.isinf(), 0.0))  # the finite logits' spread
    chosen = samplers.token[:, None]
    assert (samplers.token == V // 2).all(), f"{isa}: greedy tokens {samplers.token.tolist()}"
    assert_within("logprob of the chosen token", logp.gather(1, chosen)[:, 0], samplers.logprob, allowed[:, 0], isa)
    order = logits.double().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert_within("top values", logp.gather(1, order), samplers.top_values, allowed[:, :k], isa)


@pytest.mark.parametrize("V", [4099, 32000])
def test_top_k_keeps_what_torch_topk_keeps(V, isa):
    """The C++ top-k filter's k-th value (block maxima, then the few logits that reach theirs) keeps
    exactly ``torch.topk``'s: noise made to favour the best of the tokens the reference drops, and
    then the worst of those it keeps, makes any token wrongly kept, or wrongly dropped, win. Ties at
    the k-th value, ±0, -inf and NaN (ranked above everything, as torch.topk ranks it); k from 1 to
    V - 1, so both the block path and the whole-row path run."""
    lib = decode_step_cpu.load(isa)
    gen = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=gen) * 3, (torch.randn(V, generator=gen) * 4).round() / 2]
    signed = (torch.randn(V, generator=gen) * 2).round()
    signed[signed == 0] = torch.where(torch.rand(int((signed == 0).sum()), generator=gen) < 0.5, 0.0, -0.0)
    rows.append(signed)
    special = torch.randn(V, generator=gen)
    special[[3, 50]], special[[7, 9]] = float("-inf"), float("nan")
    rows.append(special)
    logits = torch.stack(rows)
    for k in (1, 7, 40, 301, V // 3, V - 1):
        for favour in ("dropped", "kept"):
            n = len(rows)
            samplers = decode_step_cpu.Samplers(n, V, 1, ([1] * n, [0.75] * n, [k] * n, [1.0] * n, [0] * n))
            want = []
            for i in range(n):
                scaled = logits[i : i + 1] / 0.75
                kth = torch.topk(scaled, k).values[0, -1]
                noise = torch.ones(1, V)
                target = (scaled < kth) if favour == "dropped" else (scaled == kth)
                noise[target] = 1e-20  # -log E = 46: such a token wins wherever it is not -inf
                want.append(int(reference_loop.sample_next(logits[i : i + 1], 0.75, k, None, noise=noise)[0]))
                samplers.log_noise[i] = torch.log(noise.clamp_min(1e-30))[0]
            decode_step_cpu.sample_rows(lib, logits, samplers)
            assert samplers.token.tolist() == want, f"{isa} V={V} k={k} favour {favour}: {platform_line(isa)}"


@pytest.mark.parametrize("temperature", [1e-40, 1e-38])
def test_vanishing_temperature_is_the_argmax_for_any_signs(temperature, isa):
    """A temperature at which logits / T overflow float32 gives each row's argmax (the limit of
    the distribution), as ``sample_next`` does on the same draws, whether the overflow takes a
    positive logit to +inf or, in a row of negative logits, every one to -inf; with top-k too. At
    1e-38 the negative rows stay finite (-1 / 1e-38 ≈ -1e38): the draw then runs, and equals the
    argmax because the logits are far apart on that scale."""
    lib = decode_step_cpu.load(isa)
    gen = torch.Generator().manual_seed(7)
    V = 203
    negative = -(torch.rand(3, V, generator=gen) + 0.5)  # every logit in [-1.5, -0.5)
    mixed = torch.randn(3, V, generator=gen)
    positive = torch.rand(2, V, generator=gen) + 0.5
    logits = torch.cat([negative, mixed, positive]).contiguous()
    n = logits.shape[0]
    for top_k in (0, 5):
        samplers = decode_step_cpu.Samplers(n, V, 1)
        samplers.mode.fill_(decode_step_cpu.MODE["sample"])
        samplers.temperature.fill_(temperature)
        samplers.top_k.fill_(top_k)
        want = []
        for i in range(n):
            noise = torch.empty(1, V).exponential_(generator=torch.Generator().manual_seed(i))
            samplers.log_noise[i] = torch.log(noise.clamp_min(1e-30))[0]
            g = torch.Generator().manual_seed(i)
            want.append(int(reference_loop.sample_next(logits[i : i + 1], temperature, top_k or None, None, g)[0]))
        decode_step_cpu.sample_rows(lib, logits, samplers)
        argmax = logits.argmax(dim=-1).tolist()
        assert want == argmax, f"sample_next at T={temperature}, top_k={top_k}: {want} != argmax {argmax}"
        assert samplers.token.tolist() == argmax, (
            f"{isa} on {decode_step_cpu.cpu_info()['name']}, T={temperature}, top_k={top_k}: "
            f"the C++ sampler's {samplers.token.tolist()} != argmax {argmax}"
        )
