"""Rows that join and leave between steps (``wiola.fast.rows``): each row's tokens equal
``model.generate`` for the same request, bitwise, greedy and seeded sampling (temperature, top-k,
top-p, eos), whatever rows join and leave beside it and at whichever row index it lands; for
every instruction-set variant this CPU runs and every weight type of the C++ step (fp32, int8,
bf16), and on the PyTorch backend (the reference model class, ``use_kernels(False)``). The C++
step's per-row entry is batch-invariant bitwise (a row alone == the same row as row 3 of 8).
Also: ``leave`` frees at once, bad input is named, nothing is allocated for a refused join."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from numerics import AbsSums, assert_within, bound, log_softmax_bound, platform_line

import wiola
import wiola.fast
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")

SMALL = wiola.WiolaConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=96)
ODD = wiola.WiolaConfig(vocab_size=301, d_model=40, n_layers=2, n_heads=4, d_ff=72, max_seq_len=96)
SCHEMES = ("fp32", "int8", "bf16")


def _model(config: wiola.WiolaConfig, scheme: str = "fp32", cls: type = wiola.fast.WiolaModel, seed: int = 0):
    torch.manual_seed(seed)
    model = cls(config).eval().requires_grad_(False)
    with torch.no_grad():  # larger than the init: peaked distributions, attention far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model if scheme == "fp32" else quantize(model, scheme)


def _requests(config: wiola.WiolaConfig, n: int, seed: int) -> list[RowRequest]:
    """Prompts of 1 to 20 tokens and every sampler: greedy, temperature, top-k, top-p, top-k with
    top-p, some with an eos id that the row is likely to emit (a frequent greedy token)."""
    rng = random.Random(seed)
    samplers = [
        {},
        {"temperature": 0.8},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.9, "top_p": 0.7},
        {"temperature": 1.0, "top_k": 40, "top_p": 0.9},
        {"temperature": 0.0, "top_k": 3},  # greedy: the filter is ignored, as in generate
        {"top_k": 7},  # no temperature: sampling at 1.0, as in generate
    ]
    out = []
    for i in range(n):
        T = rng.randint(1, 20)
        out.append(
            RowRequest(
                prompt=[rng.randrange(config.vocab_size) for _ in range(T)],
                max_new_tokens=rng.randint(1, 14),
                seed=rng.randrange(1 << 30),
                eos_token_id=rng.choice([None, None, rng.randrange(config.vocab_size)]),
                logprobs=rng.choice([0, 3]),
                **samplers[i % len(samplers)],
            )
        )
    return out


def _generate(model, r: RowRequest) -> list[int]:
    gen = None if r.seed is None else torch.Generator().manual_seed(r.seed)
    out = model.generate(
        torch.tensor([r.prompt]), r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
        eos_token_id=r.eos_token_id, generator=gen,
    )  # fmt: skip
    new = out[0, len(r.prompt) :].tolist()
    if r.eos_token_id is not None and r.eos_token_id in new:
        new = new[: new.index(r.eos_token_id) + 1]
    return new


def _drive(rows: Rows, requests: list[RowRequest], seed: int) -> tuple[dict[int, list[int]], dict[int, set]]:
    """Join the requests at random steps into random free rows (by occupying and freeing fillers
    first), make some leave early at random; returns each request's tokens and the rows it used."""
    rng = random.Random(seed)
    waiting = list(range(len(requests)))
    got: dict[int, list[int]] = {i: [] for i in waiting}
    owner: dict[int, int] = {}  # row -> request
    landed: dict[int, set] = {}
    quitting = set(rng.sample(waiting, k=max(1, len(waiting) // 4)))
    for _ in range(400):  # bounded: every request finishes well within this
        if not waiting and not rows.live:
            break
        while waiting and rows.free and rng.random() < 0.6:
            fillers = [rows.join(RowRequest([1], 3)) for _ in range(rng.randrange(rows.free))]
            i = waiting.pop(0)
            r = rows.join(requests[i])
            owner[r] = i
            landed.setdefault(i, set()).add(r)
            for f in fillers:
                rows.leave(f)
        for t in rows.step():
            i = owner[t.row]
            got[i].append(t.token)
            assert len(t.top) == requests[i].logprobs
            if t.finish_reason is not None:
                want = "stop" if t.token == requests[i].eos_token_id else "length"
                assert t.finish_reason == want, (t, requests[i])
                assert t.row not in rows.live, "a finished row is still live"
        for r in list(rows.live):
            if owner[r] in quitting and got[owner[r]] and rng.random() < 0.3:
                rows.leave(r)
                assert r not in rows.live
    assert not rows.live and not waiting, "the schedule did not finish"
    return got, landed


def _check_against_generate(model, rows: Rows, requests: list[RowRequest], seed: int, what: str) -> None:
    got, landed = _drive(rows, requests, seed)
    for i, r in enumerate(requests):
        want = _generate(model, r)
        n = len(got[i])
        assert n >= 1, f"{what}: request {i} produced nothing"
        assert got[i] == want[:n], f"{what}: request {i} ({r}) in rows {landed[i]}: {got[i]} != generate {want}"
        if n < len(want):  # it left early: only the requests chosen to quit may
            assert got[i][-1] != r.eos_token_id


@torch.inference_mode()
@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_equal_generate_cpp(scheme, isa, plain_cpu, monkeypatch):
    monkeypatch.setenv("WIOLA_CPU_ISA", isa)  # generate's own binding takes the same variant
    model = _model(SMALL, scheme)
    rows = Rows(model, max_rows=4, max_len=40)
    assert rows.backend == "C++" and rows._step.isa == isa
    _check_against_generate(model, rows, _requests(SMALL, 10, seed=1), seed=2, what=f"{isa} {scheme}")


@torch.inference_mode()
def test_rows_equal_generate_odd_shapes(isa, plain_cpu, monkeypatch):
    monkeypatch.setenv("WIOLA_CPU_ISA", isa)
    for config in (ODD, dataclasses.replace(ODD, gate=False), dataclasses.replace(ODD, gate_pre_rope=False)):
        model = _model(config, seed=4)
        rows = Rows(model, max_rows=3)
        _check_against_generate(model, rows, _requests(config, 6, seed=5), seed=6, what=f"{isa} {config}")


@torch.inference_mode()
@pytest.mark.parametrize("which", ["reference", "kernels-off"])
def test_rows_equal_generate_pytorch_backend(which, plain_cpu):
    if which == "reference":
        model = _model(SMALL, cls=wiola.WiolaModel)
    else:
        model = _model(SMALL).use_kernels(False)
    rows = Rows(model, max_rows=3, max_len=40)
    assert rows.backend == "PyTorch"
    _check_against_generate(model, rows, _requests(SMALL, 7, seed=8), seed=9, what=which)


def _copy_row(dst: wiola.Cache, r: int, src: wiola.Cache, s: int) -> None:
    for name in ("k", "v", "gate_sum", "gate_count"):
        getattr(dst, name)[:, r] = getattr(src, name)[:, s]
    dst.key_mask[r], dst.n_real[r] = src.key_mask[s], src.n_real[s]


@torch.inference_mode()
@pytest.mark.parametrize("config", [SMALL, ODD], ids=["small", "odd"])
@pytest.mark.parametrize("scheme", (*SCHEMES, "int4"))
def test_row_alone_equals_row_3_of_8_bitwise(scheme, config, isa, plain_cpu):
    """The per-row C++ entry: a row's logits and cache writes are bitwise the same stepped alone
    (a 1-row cache), as row 3 of 8 rows at other slots and prompts, as the middle of a permuted
    subset of rows (6, 3, 0), and as the second of a pair (5, 3), over 6 steps. The batch sizes
    reach each block shape of the products: 1 (8-row blocks for int8 and int4), 8 (4 x 4 for fp32,
    int8 and, on AVX-512, bf16; 4 x 2 for int4 and bf16 elsewhere), 3 (4 x 3 for fp32 and int8; a
    pair and a single row for int4 and bf16 on AVX2; single rows for bf16 on AVX-512) and 2 (4 x 2
    for every type but AVX-512's bf16, single rows there). ``odd``: K not a multiple of the vector
    width (tails) and a head of 301 rows, whose last row is a block of one (each block shape at
    each batch size is its own instantiation of the product)."""
    if scheme == "int4" and config is ODD:  # its groups of 32 weights need K a multiple of 32: the odd head only
        config = dataclasses.replace(ODD, d_model=64, d_ff=96)
    model = _model(config, scheme)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (1, T), generator=gen) for T in (5, 9, 1, 13, 2, 7, 11, 4)]
    caches = {"all 8": model.new_cache(8, 40), "alone": model.new_cache(1, 40), "subset": model.new_cache(8, 40)}
    caches["pair"] = model.new_cache(8, 40)
    for r, ids in enumerate(prompts):
        tmp = model.new_cache(1, 40)
        model(ids, cache=tmp, logits_to_keep=1)
        for name in ("all 8", "subset", "pair"):
            _copy_row(caches[name], r, tmp, 0)
        if r == 3:
            _copy_row(caches["alone"], 0, tmp, 0)
    steps = {name: decode_step_cpu.DecodeStepCPU(model, c, isa=isa) for name, c in caches.items()}
    picks = {
        "all 8": (torch.arange(8), 3),
        "alone": (torch.tensor([3]), 0),
        "subset": (torch.tensor([6, 3, 0]), 1),
        "pair": (torch.tensor([5, 3]), 1),
    }
    slots0 = torch.tensor([p.shape[1] for p in prompts])
    tokens = torch.randint(0, config.vocab_size, (6, 8), generator=gen)
    for i in range(6):
        got = {}
        for name, (index, at) in picks.items():
            cache_rows = torch.tensor([0]) if name == "alone" else index
            logits = steps[name].rows(cache_rows, tokens[i, index].contiguous(), (slots0[index] + i).contiguous())
            got[name] = logits[at]
        assert torch.equal(got["all 8"], got["alone"]), f"{isa} {scheme}: row 3 of 8 != the row alone at step {i}"
        assert torch.equal(got["subset"], got["alone"]), f"{isa} {scheme}: row 3 in (6, 3, 0) != alone at step {i}"
        assert torch.equal(got["pair"], got["alone"]), f"{isa} {scheme}: row 3 in (5, 3) != alone at step {i}"
    n = int(slots0[3]) + 6
    for name in ("k", "v", "gate_sum", "gate_count"):
        one = getattr(caches["alone"], name)[:, 0]
        for other in ("all 8", "subset", "pair"):
            row = getattr(caches[other], name)[:, 3]
            if name in ("k", "v"):
                row, one_ = row[:, :, :n], one[:, :, :n]
            else:
                one_ = one
            assert torch.equal(row, one_), f"{isa} {scheme}: cache.{name} of row 3 ({other}) != the row alone"
    assert torch.equal(caches["all 8"].n_real, slots0 + 6) and torch.equal(caches["alone"].n_real, slots0[3:4] + 6)
    untouched = torch.tensor([1, 2, 4, 5, 7])  # the subset run never stepped these rows
    assert torch.equal(caches["subset"].n_real[untouched], slots0[untouched])


@torch.inference_mode()
def test_leave_frees_at_once(plain_cpu):
    """``leave`` frees the row at once; handles are never reused, so a late ``leave`` of a row
    that finished is refused rather than freeing the request that took its place."""
    model = _model(SMALL)
    rows = Rows(model, max_rows=3, max_len=40)
    a = rows.join(RowRequest([1, 2, 3], 10))
    b = rows.join(RowRequest([4], 10, temperature=1.0, seed=3))
    assert rows.live == [a, b] and rows.free == 1
    rows.step()
    rows.leave(a)
    assert rows.live == [b] and rows.free == 2
    assert [t.row for t in rows.step()] == [b], "a row that left still got a token"
    c = rows.join(RowRequest([5, 6], 10))
    assert c not in (a, b), "a handle was given twice"
    assert rows._index[c] == 0, "the freed row was not reused first"
    with pytest.raises(ValueError, match=rf"row {a} is not live \(live rows: \[{b}, {c}\]\)"):
        rows.leave(a)  # its row now holds c
    with pytest.raises(ValueError, match=r"row 7 is not live"):
        rows.leave(7)
    with pytest.raises(ValueError, match=r"row \(a handle from join\) must be an int, got the bool True"):
        rows.leave(True)  # not row 1
    with pytest.raises(ValueError, match=r"row \(a handle from join\) must be an int, got str '1'"):
        rows.leave("1")
    assert rows.live == [b, c]
    rows.leave(b)
    with pytest.raises(ValueError, match=f"row {b} is not live"):
        rows.leave(b)
    assert rows.step()[0].row == c
    d = rows.join(RowRequest([1], 1))
    assert [(t.row, t.finish_reason) for t in rows.step()] == [(c, None), (d, "length")]
    with pytest.raises(ValueError, match=f"row {d} is not live"):
        rows.leave(d)
    assert rows.live == [c]


@torch.inference_mode()
def test_bad_input_is_named(plain_cpu):
    model = _model(SMALL)
    rows = Rows(model, max_rows=2, max_len=30)
    bad = {
        "prompt must be a non-empty list": RowRequest([], 4),
        r"prompt token id 1000 is outside \[0, vocab_size=1000\)": RowRequest([1, 1000], 4),
        "prompt token id -1 is outside": RowRequest([-1], 4),
        "prompt token id must be an int, got float 2.0": RowRequest([2.0], 4),
        "prompt token id must be an int, got the bool True": RowRequest([1, True], 4),
        "eos_token_id must be an int, got float 5.0": RowRequest([1], 4, eos_token_id=5.0),
        r"eos_token_id must be a single int \(a list of ids is not supported\)": RowRequest([1], 4, eos_token_id=[5]),
        "max_new_tokens must be a positive int, got 0": RowRequest([1], 0),
        "prompt of 20 tokens \\+ 11 new tokens = 31 is past max_len=30": RowRequest([1] * 20, 11),
        "eos_token_id 5000 is outside": RowRequest([1], 4, eos_token_id=5000),
        "temperature must be >= 0": RowRequest([1], 4, temperature=-1.0),
        "top_p must be in": RowRequest([1], 4, temperature=1.0, top_p=1.5),
        "top_k must be a positive int": RowRequest([1], 4, top_k=0),
        "seed must be an int": RowRequest([1], 4, seed="x"),
        r"seed must be in \[-2\*\*63, 2\*\*64\)": RowRequest([1], 4, seed=2**64),
        "logprobs must be an int in": RowRequest([1], 4, logprobs=-2),
        r"logprobs must be an int in \[0, vocab_size=1000\], got 1001": RowRequest([1], 4, logprobs=1001),
        "temperature must be a number, got str '0.5'": RowRequest([1], 4, temperature="0.5"),
        "top_p must be a number, got str": RowRequest([1], 4, temperature=1.0, top_p="0.9"),
        "top_p must be a number, got bool": RowRequest([1], 4, top_p=True),
        # A temperature past float32 would overflow the C++ sampler's setting in every step.
        "temperature must be >= 0 and finite in float32": RowRequest([1], 4, temperature=1e39),
        "max_new_tokens must be an int, got float": RowRequest([1], 4.0),
    }
    for match, request in bad.items():
        with pytest.raises(ValueError, match=match):
            rows.join(request)
    assert rows.free == 2, "a refused join took a row"
    rows.join(RowRequest([1], 4))
    rows.join(RowRequest([1], 4))
    with pytest.raises(ValueError, match="full: all 2 rows are live"):
        rows.join(RowRequest([1], 4))
    with pytest.raises(TypeError, match="join takes a RowRequest"):
        rows.join({"prompt": [1]})
    for args, match in (
        ((0,), "max_rows must be a positive int"),
        ((2, 97), r"max_len must be an int in \[1, max_seq"),
        ((2, 1.5), "max_len must be an int, got float"),
    ):
        with pytest.raises(ValueError, match=match):
            Rows(model, *args)
    for m in (model, wiola.WiolaModel(SMALL)):  # the reference model too, which never binds the step
        with pytest.raises(ValueError, match="isa='bogus' is not one of auto"):
            Rows(m, 2, isa="bogus")
    big = Rows(model, np.int64(2), np.int32(30))  # numpy integers are the ints they hold
    assert (big.max_rows, big.max_len) == (2, 30)
    whole = big.join(RowRequest([1, 2], 1, logprobs=SMALL.vocab_size))  # every id's logprob: the top end is taken
    (token,) = big.step()
    assert token.row == whole and len(token.top) == SMALL.vocab_size and token.finish_reason == "length"


@pytest.mark.parametrize("backend", ["C++", "PyTorch"])
def test_an_eos_that_is_the_last_allowed_token_ends_the_row_with_stop(backend, plain_cpu):
    """A row whose ``max_new_tokens``-th token is its eos ends with ``"stop"`` (the token is the
    eos), not ``"length"``; one token earlier it ends with ``"length"``."""
    model = _model(SMALL)
    if backend == "PyTorch":
        model.use_kernels(False)
    prompt = [5, 6, 7]
    greedy = model.generate(torch.tensor([prompt]), 3, temperature=0)[0, 3:].tolist()
    assert greedy[1] not in greedy[:1], greedy  # the second token is not also the first
    rows = Rows(model, 2)
    assert rows.backend == backend
    ends = {rows.join(RowRequest(prompt, 2, eos_token_id=greedy[1])): None}
    ends[rows.join(RowRequest(prompt, 1, eos_token_id=greedy[1]))] = None
    tokens: dict[int, list[int]] = {h: [] for h in ends}
    while rows.live:
        for t in rows.step():
            tokens[t.row].append(t.token)
            ends[t.row] = t.finish_reason
    assert list(tokens.values()) == [greedy[:2], greedy[:1]]
    assert list(ends.values()) == ["stop", "length"]


@torch.inference_mode()
def test_isa_asked_for_is_the_steps_whatever_the_environment_names(plain_cpu, monkeypatch):
    """``Rows(isa=...)`` binds that variant even where ``$WIOLA_CPU_ISA`` names one this CPU
    lacks (faked here: a CPU without AVX-512 asked for avx512), which the step's binding used to
    refuse."""
    model = _model(SMALL)
    compiler = decode_step_cpu._compiler()
    monkeypatch.setitem(decode_step_cpu._FEATURES, compiler, (frozenset({"avx2", "fma"}), "test"))
    monkeypatch.setenv("WIOLA_CPU_ISA", "avx512")
    rows = Rows(model, 2, isa="portable")
    assert rows.backend == "C++" and rows._step.isa == "portable"


@torch.inference_mode()
def test_numpy_and_torch_integer_ids_are_ints(plain_cpu):
    """Integer scalars of numpy and torch, as token ids, eos or a row handle, are the ints they
    hold: the same tokens as a request of Python ints."""
    model = _model(SMALL)
    rows = Rows(model, max_rows=2, max_len=30)
    plain = rows.join(RowRequest([3, 14, 15], 6))
    want = [t.token for t in _drain(rows)]
    assert want == model.generate(torch.tensor([[3, 14, 15]]), 6)[0, 3:].tolist()
    eos = want[2]
    row = rows.join(RowRequest([np.int64(3), torch.tensor(14), np.int32(15)], np.int64(6), eos_token_id=np.int64(eos)))
    assert row != plain
    got = _drain(rows)
    assert [t.token for t in got] == want[: want.index(eos) + 1] and got[-1].finish_reason == "stop"
    row = rows.join(RowRequest([3], 6))
    rows.leave(np.int64(row))
    assert rows.live == []


def _drain(rows: Rows) -> list:
    out = []
    while rows.live:
        out += rows.step()
    return out


@torch.inference_mode()
def test_logprobs_are_the_unfiltered_log_softmax(plain_cpu):
    """Beside each other, a sampled row (temperature 1, top-k 2) and a greedy row: each token's
    ``logprob`` and its ``top`` values are the log-softmax of the unfiltered logits of the reference
    model for the prefix (a full pass), within the bound through the log-softmax of the two-sided
    fp32 logit bound (``log_softmax_bound``); ``top`` is the best ids, best first; a greedy row's
    token is ``top[0]`` and its logprob ``top[0]``'s value, bitwise."""
    model = _model(SMALL)
    ref = wiola.WiolaModel(SMALL).eval().requires_grad_(False)
    ref.load_state_dict(model.state_dict())
    rows = Rows(model, max_rows=2)
    assert rows.backend == "C++"
    isa = decode_step_cpu.select_isa(rows.isa)
    prompts = {"sampled": [3, 14, 15, 92], "greedy": [65, 35, 89]}
    handles = {
        rows.join(RowRequest(prompts["sampled"], 5, logprobs=4, temperature=1.0, top_k=2, seed=0)): "sampled",
        rows.join(RowRequest(prompts["greedy"], 5, logprobs=4)): "greedy",
    }
    seqs = {name: list(prompt) for name, prompt in prompts.items()}
    sampled_not_best = False
    for step in range(5):
        for t in rows.step():
            name = handles[t.row]
            seq = seqs[name]
            with AbsSums(ref) as sums:
                logits = ref(torch.tensor([seq])).logits[0, -1]
            want = torch.log_softmax(logits.double(), -1)
            allowed = log_softmax_bound(bound(SMALL, len(seq), sums.head[0, -1]), logits)
            what = f"{name} row, token {step}"
            best = torch.topk(want, 4).indices.tolist()
            assert [i for i, _ in t.top] == best, (
                f"{what}: top ids {[i for i, _ in t.top]} != {best}; {platform_line(isa)}"
            )
            ids = torch.tensor([t.token, *best])
            got = torch.tensor([t.logprob, *(v for _, v in t.top)], dtype=torch.float64)
            assert_within(f"{what}: logprob and top values", want[ids], got, allowed[ids], isa)
            if name == "greedy":
                assert (t.token, t.logprob) == t.top[0], f"{what}: ({t.token}, {t.logprob}) != top[0] {t.top[0]}"
            else:
                sampled_not_best |= t.token != best[0]
            seq.append(t.token)
    assert sampled_not_best, "the sampled row took the best token every time: the test shows nothing of sampling"


def _finish(rows: Rows, got: dict[int, list[int]], reasons: dict[int, str]) -> None:
    while rows.live:
        for t in rows.step():
            got[t.row].append(t.token)
            if t.finish_reason is not None:
                reasons[t.row] = t.finish_reason


@pytest.mark.parametrize("backend", ["C++", "PyTorch"])
def test_a_step_that_raises_after_drawing_restores_torchs_generator(backend, plain_cpu, monkeypatch):
    """A row without a seed draws from torch's default generator: a step that raises after that
    draw (C++: in the step's call, after the rows' noise was drawn; PyTorch: in the second row's
    forward, after the unseeded first row sampled) leaves the generator's state as it was."""
    model = _model(SMALL, cls=wiola.WiolaModel if backend == "PyTorch" else wiola.fast.WiolaModel)
    rows = Rows(model, max_rows=2, max_len=40)
    assert rows.backend == backend
    rows.join(RowRequest([5, 6, 7], 6, temperature=1.0))  # no seed: torch's default generator
    rows.join(RowRequest([8, 9], 6))  # greedy
    rows.step()
    state = torch.random.get_rng_state()

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure")

    if backend == "C++":
        monkeypatch.setattr(rows._step, "step_rows", fail)
    else:
        calls = []
        model.register_forward_pre_hook(lambda module, args: fail() if calls.append(1) or len(calls) == 2 else None)
    with pytest.raises(RuntimeError, match="injected failure"):
        rows.step()
    assert torch.equal(torch.random.get_rng_state(), state), f"{backend}: a failed step moved torch's generator"


@torch.no_grad()  # not inference mode, in which the in-place change below would move no version counter
@pytest.mark.parametrize("backend", ["C++", "PyTorch"])
def test_a_step_that_raises_changes_nothing(backend, plain_cpu):
    """A ``step`` that raises loses no token and moves no generator: once the cause is gone the
    rows go on exactly as ``generate`` decodes them. C++: a quantized model whose matrix changed
    (its binding is refused); PyTorch: a forward that fails for the second of three rows, after
    the first row's cache has taken its token."""
    requests = [
        RowRequest([5, 6, 7], 6, temperature=1.0, seed=1),
        RowRequest([8], 2, temperature=0.9, top_p=0.8, seed=2),  # its last token comes in the failed step
        RowRequest([9, 10], 5),  # greedy
    ]
    if backend == "C++":
        model = _model(SMALL, "int8")
    else:
        model = _model(SMALL, cls=wiola.WiolaModel)
    rows = Rows(model, max_rows=3, max_len=40)
    assert rows.backend == backend
    handles = [rows.join(r) for r in requests]
    got: dict[int, list[int]] = {h: [] for h in handles}
    reasons: dict[int, str] = {}
    for t in rows.step():
        got[t.row].append(t.token)
    if backend == "C++":
        weight = model.layers[0].attn.q_proj.weight
        saved = weight.clone()
        weight.add_(1.0)
        with pytest.raises(ValueError, match="int8"):
            rows.step()
        weight.copy_(saved)
    else:
        calls = []

        def fail_second(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")

        hook = model.register_forward_pre_hook(fail_second)
        with pytest.raises(RuntimeError, match="injected failure"):
            rows.step()
        hook.remove()
    assert rows.live == handles, "a failed step freed a row"
    _finish(rows, got, reasons)
    for h, r in zip(handles, requests, strict=True):
        assert got[h] == _generate(model, r), f"{backend}: request {r} lost or repeated a token"
        assert reasons[h] == "length"


@torch.inference_mode()
def test_rows_move_to_pytorch_where_the_step_stops_applying(plain_cpu):
    """A C++ ``Rows`` whose model the step can no longer compute goes on on the PyTorch backend,
    each live row's cache carried over: a weight replaced by a non-contiguous one (the same
    values: the tokens of ``generate``), the model moved to float64 (the rows finish, and a row
    that joins after decodes as ``generate`` on the float64 model)."""
    model = _model(SMALL)
    request = RowRequest([3, 14, 15], 8)
    want = _generate(model, request)
    rows = Rows(model, max_rows=2, max_len=40)
    h = rows.join(request)
    got: dict[int, list[int]] = {h: [t.token for t in rows.step()]}
    proj = model.layers[0].attn.q_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().t().contiguous().t(), requires_grad=False)
    _finish(rows, got, {})
    assert rows.backend == "PyTorch" and got[h] == want

    model = _model(SMALL)
    rows = Rows(model, max_rows=2, max_len=40)
    first = rows.join(RowRequest([3, 14, 15], 8, temperature=0.9, seed=3))
    rows.step()
    model.double()
    late = RowRequest([4, 5], 6)
    h = rows.join(late)
    got = {first: [], h: []}
    reasons: dict[int, str] = {}
    _finish(rows, got, reasons)
    assert rows.backend == "PyTorch" and reasons == {first: "length", h: "length"}
    assert got[h] == _generate(model, late)


@torch.inference_mode()
def test_rows_made_before_adapters_decode_with_them(plain_cpu):
    """LoRA adapters attached after the ``Rows`` was made: the C++ step reads the base weights
    only, so the rows move to the PyTorch backend, and a row decodes as ``generate`` with the
    adapters."""
    peft = pytest.importorskip("peft")
    model = _model(SMALL)
    rows = Rows(model, max_rows=2, max_len=40)
    assert rows.backend == "C++"
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    model = peft.inject_adapter_in_model(lora, model)
    request = RowRequest([5, 6, 7], 10)
    h = rows.join(request)
    got: dict[int, list[int]] = {h: []}
    _finish(rows, got, {})
    assert rows.backend == "PyTorch"
    assert got[h] == _generate(model, request)


@torch.inference_mode()
@pytest.mark.parametrize("which", ["C++", "PyTorch"])
def test_tied_logprobs_list_the_lower_id_first(which, plain_cpu):
    """Equal logits (every embedding row the same: the tied head gives every id one logit): the
    ``logprobs`` best are the lowest ids, in order, for the prefill's token as for the steps'. Each
    row is one nonzero weight, so every logit is that weight times one element of the hidden state
    exactly, whatever order a GEMM sums in (a dense row gave ids 992-995 the largest logits by one
    ulp under MKL's sgemm in torch 2.11 on an Intel Xeon: its last rows take another kernel)."""
    model = _model(SMALL, cls=wiola.fast.WiolaModel if which == "C++" else wiola.WiolaModel)
    model.embed.weight.zero_()
    model.embed.weight[:, 0] = 0.75
    rows = Rows(model, max_rows=2, max_len=40)
    assert rows.backend == which
    rows.join(RowRequest([1, 2], 3, logprobs=4))
    for t in _drain(rows):
        assert [i for i, _ in t.top] == [0, 1, 2, 3], t


@torch.inference_mode()
@pytest.mark.parametrize("which", ["C++", "PyTorch"])
def test_vanishing_temperature_and_top_p_are_greedy(which, plain_cpu):
    """A temperature so small that logits / T overflow float32 (1e-40), and a top_p that float32
    rounds to 0 (1e-50), give the greedy tokens (the limits of those distributions), in
    ``generate`` (the reference loop and the C++ one) and in ``Rows``; they used to give id 0."""
    model = _model(SMALL, cls=wiola.fast.WiolaModel if which == "C++" else wiola.WiolaModel)
    prompt = torch.tensor([[3, 14, 15]])
    greedy = model.generate(prompt, 6)[0, 3:].tolist()
    assert greedy != [0] * 6
    for sampling in ({"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-50}, {"temperature": 1e-40, "top_k": 5}):
        got = model.generate(prompt, 6, generator=torch.Generator().manual_seed(0), **sampling)[0, 3:].tolist()
        assert got == greedy, (which, sampling)
        rows = Rows(model, max_rows=2, max_len=40)
        assert rows.backend == which
        rows.join(RowRequest([3, 14, 15], 6, seed=0, **sampling))
        assert [t.token for t in _drain(rows)] == greedy, (which, sampling)
