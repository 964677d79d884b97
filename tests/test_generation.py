"""generate(): greedy equals the argmax of full passes, sampling filters, eos, streaming."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wiola import WiolaConfig, WiolaModel
from wiola.generation import filter_logits, sample_next


@pytest.fixture(scope="module")
def model() -> WiolaModel:
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64)
    m = WiolaModel(cfg).eval()
    with torch.no_grad():
        m.embed.weight.normal_(0, 1.0)  # peaked distributions: greedy has no near-ties
    return m


def test_greedy_equals_argmax_of_full_passes(model):
    prompt = torch.randint(0, 101, (2, 7))
    out = model.generate(prompt, 15, temperature=0)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(15):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    prompt = torch.randint(0, 101, (3, 5))
    greedy = model.generate(prompt, 10, temperature=0)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 10, temperature=1.0, top_k=1, generator=g), greedy)
    assert torch.equal(model.generate(prompt, 10, temperature=0.7, top_p=1e-6, generator=g), greedy)


def test_sampling_is_reproducible_with_a_generator():
    torch.manual_seed(1)
    model = WiolaModel(WiolaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64))
    prompt = torch.randint(0, 101, (2, 4))
    a = model.generate(prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    c = model.generate(prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_filter_logits_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = torch.isfinite(filter_logits(logits, top_k=2, top_p=None))
    assert keep.tolist() == [[True, True, False, False, False]]
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the 0.15 token is needed too; 0.85 >= 0.8 stops there
    keep = torch.isfinite(filter_logits(logits, top_k=None, top_p=0.8))
    assert keep.tolist() == [[True, True, True, False, False]]
    keep = torch.isfinite(filter_logits(logits, top_k=None, top_p=0.7))
    assert keep.tolist() == [[True, True, False, False, False]]


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    tokens = sample_next(logits, temperature=2.0, generator=g)
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64) / 2.0, 0)
    assert (freq - want).abs().max() < 0.015  # 4.5σ for 20,000 draws


def test_vanishing_temperature_is_the_argmax_of_negative_logits():
    """At a temperature where every logit / T of an all-negative row overflows to -inf (1e-40),
    the token is the row's argmax, the limit of the distribution, not id 0; with top-k and top-p
    too, and beside a row whose positive logits overflow to +inf."""
    logits = torch.tensor([[-3.0, -2.0, -1.0, -5.0], [0.5, 2.0, -1.0, 1.0]])
    for kwargs in ({}, {"top_k": 2}, {"top_p": 0.9}):
        for seed in range(4):
            got = sample_next(logits, 1e-40, generator=torch.Generator().manual_seed(seed), **kwargs)
            assert got.tolist() == [2, 1], (kwargs, seed)


def test_rows_that_hit_eos_stop_and_are_padded(model):
    prompt = torch.randint(0, 101, (2, 6))
    free = model.generate(prompt, 12, temperature=0)
    eos = int(free[0, 6 + 3])  # row 0 produces this at step 3
    out = model.generate(prompt, 12, temperature=0, eos_token_id=eos, pad_token_id=100)
    for row in range(2):
        new = free[row, 6:].tolist()
        stop = new.index(eos) if eos in new else None
        want = new if stop is None else new[: stop + 1] + [100] * (11 - stop)
        assert out[row, 6:].tolist() == want
    assert out.shape == (2, 18)


def test_streamer_sees_every_token(model):
    seen = []
    out = model.generate(torch.randint(0, 101, (1, 3)), 8, temperature=0, streamer=lambda t: seen.append(int(t[0])))
    assert seen == out[0, 3:].tolist()


def test_generate_rejects_bad_arguments(model):
    p = torch.randint(0, 101, (1, 5))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(p, 60)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(p, 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(p, 2, top_p=1.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):  # 0 keeps no token: not greedy, refused
        model.generate(p, 2, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(p, 2, top_k=-1)  # 0 is transformers' "no filter" (tests/test_generate_hf.py)
    with pytest.raises(ValueError, match="left padding"):
        model.generate(p, 2, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))
    assert torch.equal(model.generate(p, 0), p)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(p, -1)


def test_greedy_unless_sampling_is_asked_for():
    """No temperature, top_k or top_p: greedy. top_k or top_p alone, or ``do_sample=True``: sampling
    at temperature 1."""
    torch.manual_seed(2)  # the initialised model: flat distributions, so samples differ
    model = WiolaModel(WiolaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64))
    prompt = torch.randint(0, 101, (2, 5))
    greedy = model.generate(prompt, 12, temperature=0)
    assert torch.equal(model.generate(prompt, 12), greedy), "the default must be greedy"
    assert torch.equal(model.generate(prompt, 12, generator=torch.Generator().manual_seed(1)), greedy)
    draws = {tuple(model.generate(prompt, 12, top_k=50, generator=torch.Generator().manual_seed(s))[0].tolist())
             for s in range(4)}  # fmt: skip
    assert len(draws) > 1, "top_k alone did not sample"
    g = lambda: torch.Generator().manual_seed(3)
    sampled = model.generate(prompt, 12, do_sample=True, generator=g())  # transformers' do_sample: temperature 1
    assert not torch.equal(sampled, greedy), "do_sample=True without a temperature decoded greedily"
    assert torch.equal(sampled, model.generate(prompt, 12, temperature=1.0, generator=g()))
    assert torch.equal(model.generate(prompt, 12, temperature=0, top_k=50, top_p=0.5), greedy), (
        "temperature=0 must be greedy whatever the filters"
    )


def test_resolve_sampling():
    from wiola.generation import Sampling, resolve_sampling

    assert resolve_sampling(None, None, None, 100) == Sampling(0.0)
    assert resolve_sampling(None, 5, None, 100) == Sampling(1.0, 5, None)
    assert resolve_sampling(0.7, 100, 1.0, 100) == Sampling(0.7, None, None), "no-op filters are dropped"
    assert resolve_sampling(0, 5, 0.9, 100) == Sampling(0.0)
    with pytest.raises(ValueError, match="temperature"):
        resolve_sampling(float("nan"), None, None, 100)
    with pytest.raises(TypeError, match="temperature must be a number, got bool True"):
        resolve_sampling(True, None, None, 100)
    with pytest.raises(TypeError, match="top_p must be a number, got str '0.9'"):
        resolve_sampling(None, None, "0.9", 100)
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got True"):
        resolve_sampling(None, True, None, 100)
    # Past float32's largest value the fp32 logits divided by it are all 0 (a uniform draw), and
    # the C++ sampler's float32 setting overflows: refused.
    assert resolve_sampling(3.4e38, None, None, 100) == Sampling(3.4e38)
    with pytest.raises(ValueError, match="finite in float32"):
        resolve_sampling(3.5e38, None, None, 100)
    assert resolve_sampling(np.float32(0.5), np.int64(3), torch.tensor(0.5), 100) == Sampling(0.5, 3, 0.5)


@pytest.mark.parametrize("cls", ["reference", "fast"])
def test_sampling_arguments_of_the_wrong_type_are_named_by_both_classes(cls, model, plain_cpu):
    """The fast class checks the sampling arguments before it chooses a loop, so a wrongly typed
    one gets the reference's named error, never a failed comparison on the way."""
    import wiola.fast

    m = model if cls == "reference" else wiola.fast.WiolaModel(model.config).eval()
    p = torch.randint(0, 101, (1, 4), generator=torch.Generator().manual_seed(3))
    bad = [
        (dict(top_p="0.9"), r"top_p must be a number, got str '0\.9'"),
        (dict(top_p=[0.9]), r"top_p must be a number, got list"),
        (dict(top_p=torch.tensor([0.9, 0.8])), r"top_p must be a number"),
        (dict(top_p=0.5, temperature=torch.tensor([0.5, 0.5])), r"temperature must be a number"),
        (dict(temperature="0"), r"temperature must be a number, got str '0'"),
    ]
    for kwargs, match in bad:
        with pytest.raises(TypeError, match=match):
            m.generate(p, 2, **kwargs)


@pytest.mark.parametrize("cls", ["reference", "fast"])
def test_eos_and_pad_ids_are_checked_before_any_work(cls, model, plain_cpu):
    """eos and pad ids reach the embedding (the fast model's C++ loop feeds pad back unchecked):
    each must be one int in [0, vocab_size), refused before a step runs (nothing streamed);
    numpy and torch integer scalars are those ints."""
    import numpy as np

    import wiola.fast

    m = model if cls == "reference" else wiola.fast.WiolaModel(model.config).eval()
    m.load_state_dict(model.state_dict())
    p = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(3))
    free = m.generate(p, 12)
    eos = int(free[0, 6 + 3])  # row 0 stops at step 3: pad fills its later slots
    bad = [
        (dict(eos_token_id=eos, pad_token_id=101), ValueError, r"pad_token_id 101 is outside \[0, vocab_size=101\)"),
        (dict(eos_token_id=eos, pad_token_id=-1), ValueError, r"pad_token_id -1 is outside \[0, vocab_size=101\)"),
        (dict(eos_token_id=101), ValueError, r"eos_token_id 101 is outside \[0, vocab_size=101\)"),
        (dict(eos_token_id=-2), ValueError, r"eos_token_id -2 is outside"),
        (
            dict(eos_token_id=[eos, 6]),
            TypeError,
            r"eos_token_id must be a single int \(a list of ids is not supported\)",
        ),
        (dict(eos_token_id=torch.tensor([eos, 6])), TypeError, r"eos_token_id must be a single int"),
        (dict(eos_token_id=float(eos)), TypeError, rf"eos_token_id must be an int, got float {eos}\.0"),
        (dict(eos_token_id=True), TypeError, r"eos_token_id must be an int, got the bool True"),
        (dict(eos_token_id=eos, pad_token_id="0"), TypeError, r"pad_token_id must be an int, got str '0'"),
    ]
    for kwargs, error, match in bad:
        seen = []
        with pytest.raises(error, match=match):
            m.generate(p, 12, streamer=seen.append, **kwargs)
        assert seen == [], f"{kwargs}: a step ran before the refusal"
    want = m.generate(p, 12, eos_token_id=eos, pad_token_id=100)
    assert want[0, 6 + 4 :].eq(100).all() and not want[1, 6:].eq(100).all()
    for e, pad in ((np.int64(eos), np.int32(100)), (torch.tensor(eos), torch.tensor(100)), (eos, [100][0])):
        assert torch.equal(m.generate(p, 12, eos_token_id=e, pad_token_id=pad), want), (type(e), type(pad))


def test_finished_rows_hold_eos_when_no_pad_id_is_given() -> None:
    """Without ``pad_token_id`` and with none in the config, a finished row holds its eos id."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32)).eval()
    prompt = torch.randint(0, 64, (2, 4))
    eos = int(model.generate(prompt, 8)[0, 5])  # row 0's second new token
    assert getattr(model.config, "pad_token_id", None) is None
    out = model.generate(prompt, 8, eos_token_id=eos)
    first = int((out[0, 4:] == eos).nonzero()[0])
    assert (out[0, 4 + first :] == eos).all(), out[0].tolist()
