"""``generate`` as ``transformers`` callers write it, on ``wiola.WiolaModel`` and ``wiola.fast.WiolaModel``:
``do_sample``, ``transformers``' own streamers (``TextStreamer``, ``TextIteratorStreamer``; 4.45 and 5.x),
stop strings, and the published ``wiola13m`` README's quickstart run verbatim apart from the import.

``wiola13m`` 1.0.1's README also points at ``examples/generate.py``, which neither its wheel nor its
sdist ships (only ``src/`` and ``tests/``): its ``tests/test_generation.py`` calls stand in for it."""

from __future__ import annotations

import dataclasses
import io
import threading
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

import wiola
import wiola.fast
from wiola import WiolaConfig
from wiola.tokenizer import train_tokenizer

CLASSES = {"reference": wiola.WiolaModel, "fast": wiola.fast.WiolaModel}
TEXTS = ["Once upon a time there was a little cat. The cat liked to play in the sun."] * 20


pytestmark = pytest.mark.usefixtures("plain_cpu")  # a plain CPU: the C++ step, not the interpreter


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, 300, show_progress=False)


@pytest.fixture(scope="module", params=sorted(CLASSES))
def model(request, tokenizer):
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=96)
    m = CLASSES[request.param](cfg).eval()
    with torch.no_grad():
        m.embed.weight.normal_(0, 1.0)  # peaked distributions: greedy has no near-ties
    return m


def _prompt(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode("Once upon a time")])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_wiola13m_readme_quickstart(name):
    """The README's Quickstart block, verbatim but for the import line."""
    WiolaForCausalLM = CLASSES[name]  # instead of: from wiola13m import WiolaConfig, WiolaForCausalLM
    torch.manual_seed(0)
    # --- verbatim from wiola13m 1.0.1's README.md
    model = WiolaForCausalLM(WiolaConfig())  # Wiola Nano, random init
    ids = torch.randint(0, 32000, (1, 16))

    out = model(input_ids=ids, labels=ids)  # forward + LM loss
    out.loss.backward()  # gradients flow

    model.eval()
    gen = model.generate(ids[:, :4], max_new_tokens=20, do_sample=False)
    # ---
    assert gen.shape == (1, 24) and torch.equal(gen[:, :4], ids[:, :4])
    assert torch.equal(gen, model.generate(ids[:, :4], 20, temperature=0)), f"{name}: do_sample=False is not greedy"


def test_wiola13m_generation_test_calls(model):
    """The calls of ``wiola13m``'s tests/test_generation.py, verbatim (its tiny model replaced by ours)."""
    ids = torch.randint(3, 64, (1, 4))
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == 4 + 8
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=10, temperature=0.9)
    assert out.shape[1] == 4 + 8
    torch.manual_seed(0)
    again = model.generate(ids, max_new_tokens=8, temperature=0.9, top_k=10)
    assert torch.equal(out, again), "do_sample=True must sample as temperature/top_k do (global RNG)"
    ids = torch.randint(3, 64, (3, 5))
    attn = torch.ones_like(ids)
    out = model.generate(ids, attention_mask=attn, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, 5 + 6)


def test_do_sample_false_is_greedy_whatever_the_temperature(model, tokenizer):
    p = _prompt(tokenizer)
    greedy = model.generate(p, 12)
    assert torch.equal(model.generate(p, 12, do_sample=False, temperature=5.0, top_k=3, top_p=0.5), greedy)
    g = lambda: torch.Generator().manual_seed(3)
    sampled = model.generate(p, 12, do_sample=True, generator=g())
    assert torch.equal(sampled, model.generate(p, 12, temperature=1.0, generator=g()))
    assert torch.equal(
        model.generate(p, 12, do_sample=True, temperature=0.7, top_p=0.9, generator=g()),
        model.generate(p, 12, temperature=0.7, top_p=0.9, generator=g()),
    )
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        model.generate(p, 2, do_sample=True, temperature=0)
    with pytest.raises(TypeError, match="do_sample"):
        model.generate(p, 2, do_sample="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_argument'"):
        model.generate(p, 2, no_such_argument=1)
    for name in ("repetition_penalty", "min_new_tokens", "num_return_sequences"):  # refused by name, never ignored
        streamer = _Recorder()
        with pytest.raises(TypeError, match=rf"generate\(\) got an unexpected keyword argument '{name}': Wiola's"):
            model.generate(p, 2, streamer=streamer, **{name: 2})
        assert streamer.calls == ["end"]
    for name, value in (("use_cache", True), ("past_key_values", None)):  # the cache is explicit (cache=)
        with pytest.raises(TypeError, match=rf"generate\(\) got an unexpected keyword argument '{name}': Wiola's"):
            model.generate(p, 2, **{name: value})
        with pytest.raises(TypeError, match=rf"forward\(\) got an unexpected keyword argument '{name}'"):
            model(p, **{name: value})
    # transformers' defaults that change nothing: one beam, top_k=0 (no top-k filter)
    assert torch.equal(model.generate(p, 12, num_beams=1, do_sample=False), greedy)
    assert torch.equal(
        model.generate(p, 12, num_beams=np.int64(1), top_k=0, temperature=0.7, generator=g()),
        model.generate(p, 12, temperature=0.7, generator=g()),
    )
    for beams, error in ((2, ValueError), (0, ValueError), ("1", TypeError), (True, TypeError)):
        streamer = _Recorder()
        with pytest.raises(error, match="num_beams"):
            model.generate(p, 2, streamer=streamer, num_beams=beams)
        assert streamer.calls == ["end"]
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got -1"):
        model.generate(p, 2, top_k=-1)


def test_transformers_text_streamer(model, tokenizer):
    transformers = pytest.importorskip("transformers")
    p = _prompt(tokenizer)
    new = model.generate(p, 20)[0, p.shape[1] :].tolist()
    printed = io.StringIO()
    with redirect_stdout(printed):
        out = model.generate(p, max_new_tokens=20, streamer=transformers.TextStreamer(tokenizer, skip_prompt=True))
    assert out[0, p.shape[1] :].tolist() == new
    assert printed.getvalue() == tokenizer.decode(new) + "\n"
    with_prompt = io.StringIO()
    with redirect_stdout(with_prompt):
        model.generate(p, max_new_tokens=20, streamer=transformers.TextStreamer(tokenizer))
    assert with_prompt.getvalue() == tokenizer.decode(p[0].tolist() + new) + "\n"


def test_transformers_text_iterator_streamer(model, tokenizer):
    transformers = pytest.importorskip("transformers")
    p = _prompt(tokenizer)
    new = model.generate(p, 20)[0, p.shape[1] :].tolist()
    streamer = transformers.TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    worker = threading.Thread(target=model.generate, args=(p,), kwargs=dict(max_new_tokens=20, streamer=streamer))
    worker.start()
    pieces = list(streamer)
    worker.join(timeout=60)
    assert "".join(pieces) == tokenizer.decode(new)


def test_stop_strings_end_a_row_after_the_token_that_completes_one(model, tokenizer):
    a, b = tokenizer.encode("Once upon a time"), tokenizer.encode("The cat")
    width = max(len(a), len(b))
    p = torch.tensor([[3] * (width - len(a)) + a, [3] * (width - len(b)) + b])  # left-padded with <pad>
    mask = (p != 3).long()
    full = model.generate(p, 24, attention_mask=mask, pad_token_id=3)
    T = p.shape[1]
    row0 = full[0, T:].tolist()
    text0 = tokenizer.decode(row0)
    stop = text0[len(text0) // 2 : len(text0) // 2 + 2]  # a string the greedy row 0 surely produces
    assert stop.strip("\ufffd"), f"pick another seed: {text0!r}"
    at = next(i for i in range(len(row0)) if stop in tokenizer.decode(row0[: i + 1]))
    steps: list[torch.Tensor] = []
    out = model.generate(
        p, 24, attention_mask=mask, pad_token_id=3, stop_strings=[stop], tokenizer=tokenizer, streamer=steps.append
    )
    streamed = torch.stack(steps, dim=1)
    assert torch.equal(streamed, out[:, T : T + streamed.shape[1]]), (
        f"the streamer saw other tokens than the result holds (a stopped row's pad):\n{streamed}\n{out[:, T:]}"
    )
    assert out[0, T : T + at + 1].tolist() == row0[: at + 1]
    assert (out[0, T + at + 1 :] == 3).all(), "slots after the stop must hold the pad id"
    row1 = full[1, T:].tolist()
    hit1 = [i for i in range(len(row1)) if stop in tokenizer.decode(row1[: i + 1])]
    end1 = hit1[0] + 1 if hit1 else len(row1)
    assert out[1, T : T + end1].tolist() == row1[:end1], "the other row decodes as without the stop string"
    # every row stopped: generation ends early, the width stays T + max_new_tokens
    one = model.generate(p[:1], 24, pad_token_id=3, stop_strings=stop, tokenizer=tokenizer)
    assert one.shape == (1, T + 24) and torch.equal(one[0], out[0])
    with pytest.raises(ValueError, match="tokenizer="):
        model.generate(p[:1], 4, stop_strings=["x"], pad_token_id=3)
    with pytest.raises(ValueError, match="empty"):
        model.generate(p[:1], 4, stop_strings=[""], tokenizer=tokenizer, pad_token_id=3)


class _Recorder:
    """A ``transformers``-style streamer that records what it is given."""

    def __init__(self) -> None:
        self.calls: list = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(tuple(value.shape))

    def end(self) -> None:
        self.calls.append("end")


def test_a_refused_call_streams_no_prompt(model, tokenizer):
    """Arguments are checked before the streamer gets the prompt: a refused call puts nothing
    (only ``end``, so that a reader waiting on it finishes); a bad generator or streamer is named."""
    p = _prompt(tokenizer)
    for kwargs, error, match in (
        ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
        ({"temperature": "0.7"}, TypeError, "temperature must be a number, got str"),
        ({"top_p": True}, TypeError, "top_p must be a number, got bool"),
        ({"temperature": 1e39}, ValueError, "finite in float32"),
        ({"generator": 123}, TypeError, "generator must be a torch.Generator or None, got int 123"),
    ):
        streamer = _Recorder()
        with pytest.raises(error, match=match):
            model.generate(p, 3, streamer=streamer, **kwargs)
        assert streamer.calls == ["end"], kwargs
    with pytest.raises(TypeError, match="streamer must be a callable or a transformers streamer"):
        model.generate(p, 3, streamer=123)
    streamer = _Recorder()
    model.generate(p, 2, streamer=streamer)
    assert streamer.calls == [tuple(p.shape), (1,), (1,), "end"]
    streamer = _Recorder()
    model.generate(p, 0, streamer=streamer)  # no new tokens: the prompt alone
    assert streamer.calls == [tuple(p.shape), "end"]


def test_eos_defaults_to_the_model_configs(model, tokenizer):
    """As ``transformers`` takes its generation config's: without ``eos_token_id`` a row stops at
    the config's eos (later slots: the pad id); an explicit None decodes on."""
    p = _prompt(tokenizer)
    free = model.generate(p, 12)[0, p.shape[1] :].tolist()
    eos = free[3]
    config = model.config
    try:
        model.config = dataclasses.replace(config, eos_token_id=eos, pad_token_id=7)
        stopped = model.generate(p, 12)[0, p.shape[1] :].tolist()
        on = model.generate(p, 12, eos_token_id=None)[0, p.shape[1] :].tolist()
    finally:
        model.config = config
    cut = free.index(eos) + 1
    assert stopped == free[:cut] + [7] * (12 - cut)
    assert on == free


def test_transformers_length_and_prompt_names(model, tokenizer):
    """``max_length`` (prompt + new tokens) and ``inputs`` as transformers takes them; a missing
    or doubled argument, or a max_length shorter than the prompt, is named, and a streamer is
    ended whatever the error (a reader thread waiting on it does not hang)."""
    p = _prompt(tokenizer)
    want = model.generate(p, 6)
    assert torch.equal(model.generate(p, max_length=p.shape[1] + 6), want)
    assert torch.equal(model.generate(inputs=p, max_new_tokens=6), want)
    assert torch.equal(model.generate(p, np.int64(6)), want)  # numpy integers are the ints they hold
    for kwargs, error, match in (
        ({"input_ids": p}, TypeError, "generate needs max_new_tokens .* or max_length"),
        ({"max_new_tokens": 3}, TypeError, r"generate needs the prompt: input_ids \(or inputs\)"),
        ({"input_ids": p, "inputs": p, "max_new_tokens": 3}, TypeError, "input_ids or as inputs, not both"),
        ({"input_ids": p, "max_new_tokens": 3, "max_length": 9}, ValueError, "max_new_tokens .* or max_length .*, not both"),
        ({"input_ids": p, "max_length": p.shape[1] - 1}, ValueError, "is shorter than the prompt"),
    ):  # fmt: skip
        streamer = _Recorder()
        with pytest.raises(error, match=match):
            model.generate(**kwargs, streamer=streamer)
        assert streamer.calls == ["end"], kwargs


def test_a_tokenizers_token_type_ids_are_taken(model, tokenizer):
    """``model(**enc)`` and ``model.generate(**enc)`` with a ``transformers`` tokenizer's output,
    which holds ``token_type_ids`` (zeros for one sequence): taken and ignored; other values are
    refused by name."""
    p = _prompt(tokenizer)
    zeros = torch.zeros_like(p)
    enc = {"input_ids": p, "token_type_ids": zeros, "attention_mask": torch.ones_like(p)}
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, model(p).logits)
    assert torch.equal(model.generate(**enc, max_new_tokens=4), model.generate(p, 4))
    for bad, match in ((zeros + 1, "must be all 0"), (zeros[:, :-1], "must be a tensor of input_ids' shape")):
        with pytest.raises(ValueError, match=match), torch.no_grad():
            model(p, token_type_ids=bad)
        with pytest.raises(ValueError, match=match):
            model.generate(p, 2, token_type_ids=bad)


def test_transformers_names_of_the_model_its_output_and_config(model, tokenizer, tmp_path):
    """What code written against ``transformers`` (and ``wiola13m``) reads: ``model.device`` and
    ``.dtype``, ``get_input_embeddings()``/``get_output_embeddings()`` (the tied embedding),
    ``out[0]``/``out["loss"]``/``to_tuple()`` in ``transformers``' order, the config's
    ``hidden_size``-style names, and ``from_pretrained(torch_dtype=...)``."""
    p = _prompt(tokenizer)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.get_input_embeddings() is model.embed and model.get_output_embeddings().weight is model.embed.weight
    with torch.no_grad():
        out = model(p, labels=p, return_logits=True)
        plain = model(p)
    assert out.keys() == ["loss", "logits"] and out[0] is out.loss and out[1] is out.logits
    assert out["loss"] is out.loss and out.to_tuple() == (out.loss, out.logits) and out[-1] is out.logits
    assert plain.keys() == ["logits"] and plain[0] is plain.logits
    with pytest.raises(KeyError, match="'loss': this output holds \\['logits'\\]"):
        plain["loss"]
    c = model.config
    names = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.max_position_embeddings)
    assert names == (c.d_model, c.n_layers, c.n_heads, c.d_ff, c.max_seq_len)
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path, torch_dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype or torch_dtype"):
        type(model).from_pretrained(tmp_path, dtype=torch.float32, torch_dtype=torch.float32)


def test_max_length_equal_to_the_prompt_returns_the_prompt() -> None:
    torch.manual_seed(0)
    model = wiola.WiolaModel(WiolaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16))
    prompt = torch.randint(0, 64, (2, 5))
    assert torch.equal(model.generate(prompt, max_length=5), prompt)
    with pytest.raises(ValueError, match="max_length=4 is shorter than the prompt"):
        model.generate(prompt, max_length=4)
