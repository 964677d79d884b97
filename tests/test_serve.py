"""``wiola serve`` as a user runs it: ``python -m wiola serve`` in a subprocess on 127.0.0.1 and a free
port, a small checkpoint made here (random weights, our format, a trained byte-level BPE with the chat
template), called with the official ``openai`` client and raw HTTP (httpx).

Served tokens are compared with ``wiola.fast.WiolaModel.generate`` of the same checkpoint (greedy,
and seeded sampling with ``generator=torch.Generator().manual_seed(seed)``), alone and under load
(32 concurrent streaming clients × 4 requests), and with a tokenizer whose decoding rewrites its end.
Faults: malformed JSON, an empty prompt, max_tokens past max_seq_len, a chat prompt that fills the
context, NaN and infinite numbers, non-UTF-8 bytes, a 10 MB body (by Content-Length and streamed),
clients that go away mid-stream or time out without streaming; the server stays up. SIGTERM
finishes the requests in flight, then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import wiola.fast  # noqa: E402
from wiola import WiolaConfig  # noqa: E402
from wiola.tokenizer import train_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Once upon a time there was a little cat. The cat liked to play in the sun with a red ball.",
    "One day a girl named Lily went to the park. She saw a big dog and they played all day.",
] * 20
PROMPTS = ["Once upon a time", "The cat", "Lily went to the", "A big dog", "One day"]
MAX_SEQ = 256
ENV = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(folder: Path) -> Path:
    """Random weights spread wide enough that greedy text varies (no repetition of one token)."""
    from wiola.chat import with_chat_template

    tok = with_chat_template(train_tokenizer(TEXTS, 320, show_progress=False))
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=MAX_SEQ, eos_token_id=2)
    model = wiola.WiolaModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        model.embed.weight[:4] = 0  # the special tokens' logits are 0: greedy text runs to max_tokens
    model.save_pretrained(folder, tok)
    return folder


class Served:
    """A ``wiola serve`` subprocess; ``url``, ``stop()`` (SIGTERM) and its captured log."""

    def __init__(self, checkpoint: Path, log: Path, *extra: str, port: int | None = None) -> None:
        """``port`` None: a free one; 0: the one the server reports it got, read from its log."""
        self.port = _free_port() if port is None else port
        self.log = log
        cmd = [sys.executable, "-m", "wiola", "serve", "--checkpoint", str(checkpoint), "--port", str(self.port),
               "--max-batch", "8", "--log-level", "warning", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"wiola serve exited: {log.read_text()}"
            if self.port == 0:
                said = re.search(r"on http://127\.0\.0\.1:(\d+), up to", log.read_text())
                if said is None:
                    time.sleep(0.2)
                    continue
                self.port = int(said[1])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"wiola serve did not come up: {log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-wiola")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    served = Served(checkpoint, tmp_path_factory.mktemp("log") / "serve.log")
    yield served
    assert served.stop() == 0, served.log.read_text()


@pytest.fixture(scope="module")
def solo(checkpoint):
    """``(prompt, max_tokens, temperature, top_p, seed) -> (ids, text, finish_reason)`` from the
    fast model's own ``generate`` (the C++ step), one request alone."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    model = wiola.fast.WiolaModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    tok = load_checkpoint_tokenizer(checkpoint)
    memo: dict[tuple, tuple[list[int], str, str]] = {}

    def run(prompt: str, max_tokens: int, temperature: float = 0.0, top_p: float | None = None, seed: int = 0):
        key = (prompt, max_tokens, temperature, top_p, seed)
        if key not in memo:
            ids = torch.tensor([tok.encode(prompt)])
            out = model.generate(ids, max_tokens, temperature=temperature, top_p=top_p, eos_token_id=tok.eos_token_id,
                                 generator=torch.Generator().manual_seed(seed))  # fmt: skip
            new = out[0, ids.shape[1] :].tolist()
            reason = "length"
            if tok.eos_token_id in new:
                new, reason = new[: new.index(tok.eos_token_id)], "stop"
            memo[key] = (new, tok.decode(new), reason)
        return memo[key]

    yield run
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


# ---------------------------------------------------------------------------- the API
def test_openai_client_greedy_equals_generate(server, solo):
    client = _client(server)
    for prompt in PROMPTS[:3]:
        ids, text, reason = solo(prompt, 24)
        done = client.completions.create(model="tiny-wiola", prompt=prompt, max_tokens=24, temperature=0)
        assert done.object == "text_completion" and done.model == "tiny-wiola" and done.id.startswith("cmpl-")
        assert done.choices[0].text == text and done.choices[0].finish_reason == reason
        assert done.usage.completion_tokens == len(ids) + (reason == "stop")
        streamed = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == reason
    ids, text, reason = solo(PROMPTS[0], 16)
    assert reason == "length", "the prompt ends before 16 tokens: it cannot show the default"
    done = client.completions.create(model="x", prompt=PROMPTS[0], temperature=0)  # OpenAI's default max_tokens
    assert (done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens) == (text, reason, 16)


def test_served_text_equals_wiola_generate(server, checkpoint, solo, capsys):
    """The same greedy and seeded requests through ``wiola generate --json`` and the server (``solo``: a plain CPU)."""
    from wiola.cli import main

    for extra, body in ((["--temperature", "0"], {"temperature": 0}),
                        (["--temperature", "0.9", "--top-p", "0.95", "--seed", "5"], {"temperature": 0.9, "top_p": 0.95, "seed": 5})):  # fmt: skip
        args = ["generate", "--checkpoint", str(checkpoint), "--prompt", PROMPTS[3], "--max-new-tokens", "20"]
        assert main([*args, *extra, "--json", "--device", "cpu"]) == 0
        cli = json.loads(capsys.readouterr().out)
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 20, **body}, timeout=60
        )
        assert r.json()["choices"][0]["text"] == cli["text"], extra


def _token_ids(checkpoint, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> list[int]:
    """The new tokens of the fast model's ``generate`` for ``prompt_ids`` (the C++ step)."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    model = wiola.fast.WiolaModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    out = model.generate(torch.tensor([prompt_ids]), max_tokens, temperature=temperature,
                         eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def make_clean_up_checkpoint(folder: Path) -> tuple[Path, list[int]]:
    """A checkpoint whose tokenizer cleans up spaces before punctuation (``tokenizer_config.json``:
    ``clean_up_tokenization_spaces: true``) and whose greedy text alternates the tokens " " and
    ".", so that each "." rewrites the decoded text before it (" ." -> "."). Its layers add
    nothing to the residual stream: the tied head scores ``norm(embed[token]) . embed``, which with
    the norm's signs below favours the other of the two tokens. Returns the folder and the two ids."""
    tok = train_tokenizer(TEXTS, 320, show_progress=False)
    tok.clean_up_spaces = True
    (space,), (dot,) = (tok.encode(x)[1:] for x in (" ", "."))  # after the tokenizer's leading <s>
    cfg = WiolaConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=MAX_SEQ, eos_token_id=2)
    model = wiola.WiolaModel(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.o_proj.weight.zero_()
            layer.ffn.down_proj.weight.zero_()
        model.embed.weight.zero_()
        model.embed.weight[space, :3] = torch.tensor([3.0, 4.0, 0.0])
        model.embed.weight[dot, :3] = torch.tensor([3.0, 0.0, 4.0])
        model.norm.weight.zero_()
        model.norm.weight[:3] = torch.tensor([1.0, -1.0, -1.0])
    model.save_pretrained(folder, tok)
    return folder, [space, dot]


def test_text_of_a_tokenizer_that_rewrites_its_end_is_its_decoding(tmp_path, capsys, monkeypatch):
    """Served text (streamed and not) equals ``wiola generate``'s and the decoding of the served
    tokens, with a tokenizer whose decoding rewrites text a later token completes."""
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    checkpoint, (space, dot) = make_clean_up_checkpoint(tmp_path / "clean-up")
    tok = load_checkpoint_tokenizer(checkpoint)
    assert tok.clean_up_spaces and tok.decode([space, dot, space]) == ". "
    served = Served(checkpoint, tmp_path / "serve.log")
    try:
        client = _client(served)
        for prompt in (" ", "The cat ."):
            assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "9",
                         "--temperature", "0", "--json", "--device", "cpu"]) == 0  # fmt: skip
            cli = json.loads(capsys.readouterr().out)["text"]
            ids = _token_ids(checkpoint, tok.encode(prompt), 9, 0.0, 0)
            assert set(ids) == {space, dot} and len(ids) == 9
            done = client.completions.create(model="m", prompt=prompt, max_tokens=9, temperature=0)
            assert done.choices[0].text == cli == tok.decode(ids), prompt
            streamed = client.completions.create(model="m", prompt=prompt, max_tokens=9, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in streamed) == cli, prompt
    finally:
        assert served.stop() == 0, served.log.read_text()


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_quantized_server_equals_generate_on_the_same_weights(checkpoint, tmp_path, monkeypatch, scheme):
    """``wiola serve --quantize``: the server says which form it serves, and its greedy text equals
    ``generate`` of the fast model quantized the same way (the C++ step on the packed weights)."""
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.fast.quantize import quantize

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = quantize(wiola.fast.WiolaModel.from_pretrained(checkpoint).eval().requires_grad_(False), scheme)
    tok = load_checkpoint_tokenizer(checkpoint)
    served = Served(checkpoint, tmp_path / "serve.log", "--quantize", scheme)
    try:
        for prompt in PROMPTS[:2]:
            ids = torch.tensor([tok.encode(prompt)])
            new = model.generate(ids, 16, temperature=0, eos_token_id=tok.eos_token_id)[0, ids.shape[1] :].tolist()
            if tok.eos_token_id in new:
                new = new[: new.index(tok.eos_token_id)]
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(new), (scheme, prompt)
    finally:
        assert served.stop() == 0, served.log.read_text()
    assert f"({scheme}) on http://127.0.0.1:{served.port}" in served.log.read_text()


def test_openai_client_retrieves_the_model(server):
    openai = pytest.importorskip("openai")
    client = _client(server)
    card = client.models.retrieve("tiny-wiola")
    assert (card.id, card.object, card.owned_by) == ("tiny-wiola", "model", "wiola")
    assert [m.id for m in client.models.list()] == ["tiny-wiola"]
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny-wiola'"):
        client.models.retrieve("gpt-4")


def test_seeded_sampling_equals_generate_with_that_seed(server, solo):
    client = _client(server)
    _, text, _ = solo(PROMPTS[0], 30, 0.9, 0.95, 11)
    done = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    assert done.choices[0].text == text
    two = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=30, temperature=0.9, top_p=0.95, seed=11,
                                    n=2)  # fmt: skip
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == text and two.choices[1].text == solo(PROMPTS[0], 30, 0.9, 0.95, 12)[1]


def test_prompt_list_echo_stop_and_logprobs(server, solo):
    client = _client(server)
    texts = [solo(p, 16)[1] for p in PROMPTS[:2]]
    done = client.completions.create(model="m", prompt=PROMPTS[:2], max_tokens=16, temperature=0, echo=True)
    assert [c.text for c in done.choices] == [p + t for p, t in zip(PROMPTS[:2], texts)]
    stop = texts[0][5:8]
    cut = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == texts[0][: texts[0].index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    lp = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3).choices[0]
    assert len(lp.logprobs.tokens) == 6  # top_logprobs are keyed by text: tokens of equal text share a key
    assert all(1 <= len(top) <= 3 for top in lp.logprobs.top_logprobs)
    for chosen, top in zip(lp.logprobs.token_logprobs, lp.logprobs.top_logprobs):
        assert chosen <= 0 and max(top.values()) == pytest.approx(chosen)  # greedy: the best is the chosen one


def test_echo_of_ids_seeds_per_prompt_and_a_stop_that_frees_its_row(server, checkpoint, solo):
    """``echo`` of a prompt given as ids echoes its text; each prompt of a list is seeded as it
    would be alone (choice i: ``seed + i``); a reply a stop string ends leaves its row at once
    (``/health``'s ``left_early``), not after decoding on to ``max_tokens``."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    client = _client(server)
    ids = tok.encode(PROMPTS[1])
    text = solo(PROMPTS[1], 8)[1]
    done = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert done.choices[0].text == tok.decode(ids) + text
    sampled = dict(max_tokens=10, temperature=1.0, seed=7)
    both = client.completions.create(model="m", prompt=PROMPTS[:2], **sampled)
    alone = [client.completions.create(model="m", prompt=p, **sampled).choices[0].text for p in PROMPTS[:2]]
    assert [c.text for c in both.choices] == alone
    full = solo(PROMPTS[0], 200)[1]
    stop = full[10:13]
    before = httpx.get(server.url + "/health").json()
    cut = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=200, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    after = httpx.get(server.url + "/health").json()
    assert after["left_early"] == before["left_early"] + 1, (before, after)
    assert after["steps"] - before["steps"] < 100, (before, after)


def test_text_offset_counts_the_echoed_prompt_and_goes_on_across_chunks(server, checkpoint, solo):
    """``logprobs.text_offset``: where each token's text begins in the choice's text (the echoed
    prompt first; a token that ends a split character where the character begins), the same
    streamed (across chunks) and not."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    client = _client(server)
    prompt = PROMPTS[0]
    ids, text, _ = solo(prompt, 12)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # bytes that are no whole character among them
    for echo in (True, False):
        start = len(prompt) if echo else 0
        done = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=1, echo=echo)
        lp, whole = done.choices[0].logprobs, done.choices[0].text
        assert whole == (prompt if echo else "") + text and len(lp.tokens) == 12
        assert lp.text_offset[0] == start and lp.text_offset == sorted(lp.text_offset)
        for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
            assert "\ufffd" in token or whole[offset : offset + len(token)] == token, (token, offset, whole)
        chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                                echo=echo, stream=True))  # fmt: skip
        streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        assert streamed == lp.text_offset
        assert "".join(c.choices[0].text for c in chunks) == whole, echo  # the echoed prompt streamed too


def test_usage_counts_each_prompt_once_whatever_n(server, checkpoint):
    from wiola.chat import apply_chat_template
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    client = _client(server)
    prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS[:2])
    for stream in (False, True):
        args = {"model": "m", "prompt": PROMPTS[:2], "max_tokens": 5, "temperature": 0.8, "seed": 1, "n": 3}
        if stream:
            chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**args).usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 2 * 3 * 5), stream
        assert usage.total_tokens == prompt_tokens + 30
    messages = [{"role": "user", "content": "The cat"}]
    chat_tokens = len(apply_chat_template(tok, messages))
    for stream in (False, True):
        args = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0.8, "seed": 1, "n": 2}
        if stream:
            chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(**args).usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (chat_tokens, 8, chat_tokens + 8)


def test_chat_completion_uses_the_template(server, checkpoint, solo):
    from wiola.chat import apply_chat_template
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    messages = [{"role": "user", "content": "Tell me about the cat."}]
    prompt_ids = apply_chat_template(tok, messages)
    client = _client(server)
    done = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.usage.prompt_tokens == len(prompt_ids)
    streamed = list(
        client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == done.choices[0].message.content
    roles = [c.choices[0].delta.role for c in streamed if c.choices]
    assert roles[0] == "assistant" and not any(roles[1:]), roles  # the first delta names the role, as OpenAI's
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and "unknown role" in bad.json()["error"]["message"]


def test_chat_logprobs_are_the_models_log_softmax(server, checkpoint, monkeypatch):
    """Chat ``logprobs`` (seeded sampling, so the chosen token is often not the best): each token's
    log-probability equals the legacy endpoint's for the same prompt ids (bitwise: the same
    engine) and the reference model's log-softmax at that position, within twice the two-sided
    fp32 bound of the logits (``log_softmax_bound``); its ``top_logprobs`` are the best, best
    first, with those values; streamed chunks carry the same entries."""
    from numerics import AbsSums, assert_within, bound, log_softmax_bound

    from wiola.chat import apply_chat_template
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.fast.decode_step_cpu import select_isa

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tok = load_checkpoint_tokenizer(checkpoint)
    messages = [{"role": "user", "content": "Tell me about the cat."}]
    prompt_ids = apply_chat_template(tok, messages)
    new = _token_ids(checkpoint, prompt_ids, 12, 1.0, 3)
    reference = wiola.WiolaModel.from_pretrained(checkpoint).eval()
    seq = prompt_ids + new[:-1]
    with torch.no_grad(), AbsSums(reference) as sums:
        logits = reference(torch.tensor([seq])).logits[0, len(prompt_ids) - 1 :]
    logp = torch.log_softmax(logits.double(), dim=-1)
    best = torch.topk(logp, 3)
    # The server's C++ step against the reference: the two-sided fp32 bound on each logit (at the
    # longest prefix's chain length), twice the row's largest through the log-softmax.
    allowed = log_softmax_bound(bound(reference.config, len(seq), sums.head[0, len(prompt_ids) - 1 :]), logits)
    isa = select_isa()  # the server's variant: it runs in this environment (ENV)

    client = _client(server)
    args = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": True}
    done = client.chat.completions.create(**args, top_logprobs=3).choices[0]
    content = done.logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in new]
    got = torch.tensor([e.logprob for e in content], dtype=torch.float64)
    rows, chosen = torch.arange(len(new)), torch.tensor(new)
    assert_within("logprobs of the chosen tokens", logp[rows, chosen], got, allowed[rows, chosen], isa)
    assert new != best.indices[:, 0].tolist()  # sampled: not always the best token
    for n, (e, t, ids, values) in enumerate(zip(content, new, best.indices.tolist(), best.values, strict=True)):
        assert [t.token for t in e.top_logprobs] == [tok.decode([i]) for i in ids]
        top = torch.tensor([t.logprob for t in e.top_logprobs], dtype=torch.float64)
        assert_within(f"top_logprobs of token {n}", values, top, allowed[n, ids], isa)
        for x, i in zip((e, *e.top_logprobs), (t, *ids), strict=True):
            assert x.bytes == list(tok.token_bytes(i))  # a byte-level vocabulary: every token's own bytes
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace") == done.message.content
    legacy = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": prompt_ids, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 0}).json()  # fmt: skip
    legacy = legacy["choices"][0]["logprobs"]
    assert legacy["token_logprobs"] == got.tolist() and legacy["top_logprobs"] == [{}] * 12
    assert legacy["tokens"] == [e.token for e in content]

    plain = client.chat.completions.create(**args).choices[0].logprobs.content  # logprobs without top_logprobs
    assert [(e.token, e.logprob, e.top_logprobs) for e in plain] == [(e.token, e.logprob, []) for e in content]
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, top_logprobs=3, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert all(len(c.logprobs.content) == 1 for c in chunks if c.logprobs)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert "".join(c.delta.content or "" for c in chunks) == done.message.content
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_chat_without_a_template_is_a_400(checkpoint):
    from starlette.testclient import TestClient

    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.serve.app import Server, create_app
    from wiola.serve.engine import Engine

    tok = load_checkpoint_tokenizer(checkpoint)
    tok.chat_template = None
    model = wiola.WiolaModel.from_pretrained(checkpoint).eval()
    with TestClient(create_app(Server(Engine(model, 2), tok, "plain", MAX_SEQ))) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_a_step_that_fails_fails_its_jobs_and_frees_their_rows(checkpoint, caplog):
    """A step that raises (here a forward hook, on the PyTorch backend) ends every job in flight
    with the error, and the rows are free for the next requests, which then decode normally."""
    from starlette.testclient import TestClient

    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.serve.app import Server, create_app
    from wiola.serve.engine import Engine

    tok = load_checkpoint_tokenizer(checkpoint)
    model = wiola.WiolaModel.from_pretrained(checkpoint).eval()
    calls = []

    def fail_the_fourth_forward(module, args):
        calls.append(1)
        if len(calls) == 4:  # two prefills, then the first step's second row
            raise RuntimeError("injected failure")

    body = {"prompt": "The cat", "max_tokens": 6, "temperature": 0}
    with TestClient(create_app(Server(Engine(model, 2), tok, "plain", MAX_SEQ))) as client:
        want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        hook = model.register_forward_pre_hook(fail_the_fourth_forward)
        r = client.post("/v1/completions", json={**body, "n": 2})
        assert r.status_code == 500 and "injected failure" in r.text
        assert "decoding failed" in caplog.text and "injected failure" in caplog.text  # the operator sees it too
        calls.clear()  # streamed: the failure is an error event before [DONE]
        r = client.post("/v1/completions", json={**body, "n": 2, "stream": True})
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert events[-1] == "[DONE]" and len(errors) == 1, r.text
        assert errors[0]["type"] == "server_error" and "decoding failed: injected failure" in errors[0]["message"]
        hook.remove()
        for _ in range(2):  # the engine's two rows were freed: n=2 joins at once
            r = client.post("/v1/completions", json={**body, "n": 2})
            assert r.status_code == 200, r.text
            assert [c["text"] for c in r.json()["choices"]] == [want, want]


def test_the_eos_token_is_at_the_texts_end_and_not_a_chat_content_token(checkpoint):
    """A reply that ends at eos: the legacy ``text_offset`` of the eos token is where the text
    ends (it has no text), and chat ``logprobs.content`` leaves it out (its tokens' bytes join to
    the content), streamed or not; usage still counts it. The eos here is a token the model
    emits third (a template without eos text keeps the chat prompt independent of it)."""
    from starlette.testclient import TestClient

    from wiola.chat import apply_chat_template
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.serve.app import Server, create_app
    from wiola.serve.engine import Engine

    model = wiola.WiolaModel.from_pretrained(checkpoint).eval()
    tok = load_checkpoint_tokenizer(checkpoint)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "The cat"}]
    prompt_ids = apply_chat_template(tok, messages)  # the chat's prompt, given to completions as ids too
    new = model.generate(torch.tensor([prompt_ids]), 3, eos_token_id=None)[0, len(prompt_ids) :].tolist()
    assert new[2] not in new[:2], new
    tok = tok.with_special_ids(eos_token_id=new[2])
    text = tok.decode(new[:2])
    with TestClient(create_app(Server(Engine(model, 2), tok, "plain", MAX_SEQ))) as client:
        body = {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "logprobs": 1}
        for streamed in (False, True):
            r = client.post("/v1/completions", json={**body, "stream": streamed})
            if streamed:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                offsets = [
                    o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]
                ]
            else:
                choice = r.json()["choices"][0]
                assert choice["text"] == text and choice["finish_reason"] == "stop"
                offsets = choice["logprobs"]["text_offset"]
            assert offsets[-1] == len(text) and offsets == sorted(offsets), (streamed, offsets)
        chat = {
            "messages": [{"role": "user", "content": "The cat"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
        }
        done = client.post("/v1/chat/completions", json=chat).json()
        content = done["choices"][0]["logprobs"]["content"]
        assert done["choices"][0]["message"]["content"] == text and done["usage"]["completion_tokens"] == 3
        r = client.post(
            "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}}
        )
        (usage,) = [c["usage"] for c in map(json.loads, re.findall(r"^data: (\{.*)$", r.text, re.M)) if c.get("usage")]
        assert usage["completion_tokens"] == 3, f"streamed usage counts the eos token too: {usage}"
        assert [bytes(e["bytes"]) for e in content] == [tok.token_bytes(t) for t in new[:2]]  # no eos entry
        r = client.post("/v1/chat/completions", json={**chat, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
        assert streamed == content


def test_legacy_top_logprobs_keep_the_best_of_tokens_that_decode_alike():
    """OpenAI's legacy ``top_logprobs`` is keyed by text: two byte tokens of a split character both
    read U+FFFD, and that key keeps the better log-probability; the keys come best first."""
    from types import SimpleNamespace

    from wiola.fast.rows import RowToken
    from wiola.serve.app import Server
    from wiola.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2-32k")
    lead, cont = (tok.encoding.encode_single_token(bytes([b])) for b in (0xE2, 0x80))
    a = tok.encoding.encode_single_token(b"a")
    assert tok.decode([lead]) == tok.decode([cont]) == "\ufffd"
    server = SimpleNamespace(token_text=lambda t: tok.decode([t]))
    token = RowToken(0, a, -0.5, [(lead, -3.0), (a, -0.5), (cont, -1.0)])
    entry = Server.logprobs_entry(server, token, 7)
    assert list(entry["top"].items()) == [("a", -0.5), ("\ufffd", -1.0)], entry
    assert (entry["token"], entry["logprob"], entry["offset"]) == ("a", -0.5, 7)


def test_models_health_tokenize_detokenize(server):
    for method, path, status, message in (
        ("GET", "/v1/nothing", 404, "no endpoint /v1/nothing"),
        ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions"),
    ):  # OpenAI's error JSON, as every other refusal
        r = httpx.request(method, server.url + path)
        assert r.status_code == status and r.json()["error"]["message"] == message, r.text
        assert r.headers.get("allow") == ("POST" if status == 405 else None), r.headers
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-wiola"
    assert httpx.get(server.url + "/v1/models/tiny-wiola").json() == models["data"][0]
    r = httpx.get(server.url + "/v1/models/other/model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert r.json()["error"]["message"] == "no model 'other/model': this server serves 'tiny-wiola'"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The cat"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"].endswith("The cat")
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


# ---------------------------------------------------------------------------- faults
def test_port_0_serves_on_the_port_it_says(checkpoint, tmp_path):
    """``--port 0``: the system picks a free port, and the startup line names that port (it named
    0); the server answers there and ends on SIGTERM with exit 0."""
    served = Served(checkpoint, tmp_path / "serve.log", port=0)
    try:
        assert served.port != 0 and httpx.get(served.url + "/health").json()["status"] == "ok"
    finally:
        assert served.stop() == 0, served.log.read_text()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_connections_turn_nagle_off(host):
    """``wiola serve`` listens on ``listening_socket``'s socket, on whose connections asyncio (which
    uvicorn serves on) turns Nagle's algorithm off. On ``socket.create_server``'s, whose protocol
    number is 0, asyncio left it on, and on a kept-alive connection every streamed token event of
    the next response waited for the client's delayed acknowledgement: they arrived together about
    40 ms late (seen with httpx and a raw socket; ``bench.serve``'s sequential TTFT was 44 ms)."""
    from wiola.serve import listening_socket

    if host == "::1" and not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")

    async def nodelay_of_a_connection() -> tuple[int, int]:
        sock = listening_socket(host, 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)  # as uvicorn: loop.create_server(sock=)
        async with server:
            _, writer = await asyncio.open_connection(host, sock.getsockname()[1])
            value = await asyncio.wait_for(got, 30)
            writer.close()
        return sock.proto, value

    proto, nodelay = asyncio.run(nodelay_of_a_connection())
    assert proto == socket.IPPROTO_TCP and nodelay != 0, f"listening socket protocol {proto}, TCP_NODELAY {nodelay}"


def test_serve_cli_bad_input_exits_2_with_one_line(server, checkpoint, tmp_path, capsys):
    from wiola.cli import main

    cases = [(["--checkpoint", str(checkpoint), "--port", str(server.port)], "cannot listen on 127.0.0.1:"),
             (["--checkpoint", str(tmp_path / "none")], "does not exist"),
             (["--checkpoint", str(checkpoint), "--max-batch", "0", "--port", "0"], "--max-batch must be >= 1"),
             (["--checkpoint", str(checkpoint), "--body-timeout", "inf", "--port", "0"], "--body-timeout must be a positive number of seconds, got inf"),
             (["--checkpoint", str(checkpoint), "--body-timeout", "0", "--port", "0"], "--body-timeout must be a positive")]  # fmt: skip
    cases.append((["--checkpoint", str(checkpoint), "--port", "65536"], "--port must be in [0, 65535], got 65536"))
    for args, message in cases:
        assert main(["serve", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("wiola serve: error: ") and message in lines[-1], lines
    from wiola.cli import build_parser

    defaults = build_parser().parse_args(["serve", "--checkpoint", str(checkpoint)])
    assert (defaults.port, defaults.max_batch, defaults.body_timeout, defaults.host) == (8000, 8, 30.0, "127.0.0.1")


@pytest.mark.parametrize(
    ("content", "status", "message"),
    [
        (b'{"prompt": "a", ', 400, "not valid JSON"),
        (b'{"prompt": ""}', 400, "prompt is empty"),
        (b"", 400, "body is empty"),
        (b'{"prompt": "a", "max_tokens": 1000}', 400, "past the model's context of 256"),
        (b'{"prompt": "\xff\xfe caf\xe9"}', 400, "not UTF-8"),
        (b'{"prompt": "a", "temperature": -1}', 400, "temperature must be in"),
        (b'{"prompt": "a", "n": "two"}', 400, "n must be an integer"),
        (b'["prompt"]', 400, "must be a JSON object"),
        (b'{"max_tokens": 3}', 400, "prompt is required"),
        (b'{"prompt": "a", "top_k": -2}', 400, "top_k must be 0 or -1 (no top-k filter) or a positive integer"),
        (b'{"prompt": ["a", "the cat and the dog and the cat"], "max_tokens": 250}', 400, "prompt[1] has "),
        (b'{"prompt": "the cat and the dog and the cat", "max_tokens": 250}', 400, "the prompt has "),
        (b'{"prompt": "a", "presence_penalty": 0.5}', 400, "presence_penalty is not supported by this server"),
        (b'{"prompt": "a", "logit_bias": {"5": 100}}', 400, "logit_bias is not supported"),
        (b'{"prompt": "a", "best_of": 3}', 400, "best_of is not supported by this server (got 3); use n"),
        (b'{"prompt": "a", "top_k": false}', 400, "top_k must be an integer, got False"),
        (b'{"prompt": "a", "top_k": 0.0}', 400, "top_k must be an integer, got 0.0"),
        pytest.param(
            b'{"prompt": "a", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, "nested too deeply", id="nested-2000"
        ),
        pytest.param(
            b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}",
            400,
            "nested too deeply (at most 32",
            id="nested-40",
        ),
        pytest.param(
            b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
            400,
            "a number that cannot be read",
            id="5000-digits",
        ),
        pytest.param(
            b'{"prompt": ' + json.dumps([[1]] * 300).encode() + b"}",
            400,
            "300 prompts × n=1 = 300 choices",
            id="300-prompts",
        ),
        pytest.param(
            b'{"n": 16, "prompt": ' + json.dumps(["a"] * 17).encode() + b"}",
            400,
            "17 prompts × n=16 = 272",
            id="17-prompts-n16",
        ),
    ],
)
def test_bad_requests_are_clear_4xx(server, content, status, message):
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_values_at_each_bound_are_taken_and_one_past_is_a_400(server):
    """OpenAI's ranges include their ends: temperature 2, top_p 1, 4 stop strings, a body nested
    ``MAX_DEPTH`` levels; one past each is a 400 naming the parameter, as are token ids equal to
    the vocabulary's size (in a prompt and to /detokenize)."""
    from wiola.serve.app import MAX_DEPTH
    from wiola.serve.protocol import MAX_STOP

    def post(body: bytes | dict, path: str = "/v1/completions") -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)

    base = {"prompt": "The cat", "max_tokens": 2}
    for extra in ({"temperature": 2}, {"temperature": 2.0}, {"top_p": 1.0}, {"stop": ["x"] * MAX_STOP}):
        r = post({**base, **extra})
        assert r.status_code == 200, (extra, r.text)
    nested = b'{"prompt": "a", "max_tokens": 1, "x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert post(nested).status_code == 200, "a body of MAX_DEPTH levels (the object and 31 lists) is taken"
    refused = [
        ({**base, "temperature": 2.0001}, "temperature", "temperature must be in [0.0, 2.0]"),
        ({**base, "top_p": 1.0001}, "top_p", "top_p must be in (0.0, 1.0]"),
        ({**base, "stop": ["x"] * (MAX_STOP + 1)}, "stop", f"stop takes at most {MAX_STOP} strings, got 5"),
        ({**base, "prompt": [5, 320]}, "prompt", "prompt has token id 320 outside [0, 320)"),
    ]
    for body, param, message in refused:
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert message in r.json()["error"]["message"], (body, r.text)
    deeper = b'{"prompt": "a", "x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    assert "nested too deeply" in post(deeper).json()["error"]["message"]
    r = post({"tokens": [5, 320]}, "/detokenize")
    assert r.status_code == 400 and r.json()["error"]["message"] == "token id 320 is outside [0, 320)", r.text


def test_more_ends_of_the_ranges_and_defaults(server):
    """The other ranges' ends: n 16, logprobs 20, ``best_of`` equal to n, ``top_k`` -1 (no filter,
    as 0), a negative seed, a token id 0 are taken; n 17, logprobs 21, ``best_of`` below n, an
    empty stop string, a bool among prompt ids (streamed too: refused before the stream starts), a
    negative id to /detokenize are a 400 naming the parameter. ``max_completion_tokens`` is
    ``max_tokens``; without ``temperature`` a request samples at 1 (a seeded one equals 1.0's)."""

    def post(body: dict, path: str = "/v1/completions") -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=60)

    base = {"prompt": "The cat", "max_tokens": 2}
    for extra in ({"n": 16}, {"logprobs": 20}, {"n": 2, "best_of": 2}, {"top_k": -1}, {"seed": -5}, {"prompt": [0, 5]}):
        r = post({**base, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert len(post({**base, "n": 16}).json()["choices"]) == 16
    refused = [
        ({**base, "n": 17}, "n", "n must be in [1, 16]"),
        ({**base, "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        ({**base, "n": 2, "best_of": 1}, "best_of", "best_of"),
        ({**base, "stop": [""]}, "stop", "stop"),
        ({**base, "prompt": [True, 5, 6]}, "prompt", "prompt"),
        ({**base, "prompt": [True, 5, 6], "stream": True}, "prompt", "prompt"),
    ]
    for body, param, message in refused:
        r = post(body)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), (body, r.text)
        assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], (body, r.text)
    r = post({"tokens": [5, -1]}, "/detokenize")
    assert r.status_code == 400 and r.json()["error"]["message"] == "token id -1 is outside [0, 320)", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    r = post({**chat, "max_completion_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    seeded = {**base, "max_tokens": 12, "seed": 3}
    assert (
        post(seeded).json()["choices"][0]["text"] == post({**seeded, "temperature": 1.0}).json()["choices"][0]["text"]
    )
    assert post(seeded).json()["choices"][0]["text"] != post({**seeded, "temperature": 0}).json()["choices"][0]["text"]


def test_a_body_of_exactly_the_limit_is_taken(server):
    """1 MiB (1,048,576 bytes) is the largest body taken, by ``Content-Length`` and chunked alike;
    one byte more is a 413."""
    from wiola.serve.app import MAX_BODY

    def body(size: int) -> bytes:
        head = b'{"prompt": "a", "max_tokens": 1, "pad": "'
        return head + b"x" * (size - len(head) - 2) + b'"}'

    for size, status in ((MAX_BODY, 200), (MAX_BODY + 1, 413)):
        r = httpx.post(server.url + "/v1/completions", content=body(size), timeout=60,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == status, (size, r.text[:200])
        chunks = (body(size)[i : i + 65536] for i in range(0, size, 65536))
        r = httpx.post(server.url + "/v1/completions", content=chunks, timeout=60,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == status, ("chunked", size, r.text[:200])


def test_a_chat_prompt_of_exactly_the_context_has_no_room():
    """``room_after``: a chat prompt of ``max_len - 1`` tokens leaves room for one, one of
    ``max_len`` tokens is ``context_length_exceeded`` (not a request for 0 tokens)."""
    from wiola.serve.protocol import ApiError, room_after

    assert room_after([0] * (MAX_SEQ - 1), MAX_SEQ) == 1
    with pytest.raises(ApiError, match=f"take {MAX_SEQ} tokens with the chat template") as info:
        room_after([0] * MAX_SEQ, MAX_SEQ)
    assert info.value.code == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_is_a_400_naming_where(server, stream):
    """JSON may escape half of a UTF-16 pair (``"\\ud83d"``, an emoji cut in half): Python reads it
    into a str that no tokenizer and no UTF-8 can take. Each endpoint refuses it with a 400 naming
    the field, before any work; the server stays up."""
    cases = [
        ("/v1/completions", '{"prompt": "Smile \\ud83d please", "max_tokens": 3', "prompt", "prompt"),
        ("/v1/completions", '{"prompt": ["a", "b \\udc00"], "max_tokens": 3', "prompt[1]", "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a \\ud800"}], "max_tokens": 3',
         "messages[0].content", "messages"),
        ("/tokenize", '{"prompt": "x \\ud800"', "prompt", "prompt"),
    ]  # fmt: skip
    for path, head, where, param in cases:
        r = httpx.post(server.url + path, content=f'{head}, "stream": {str(stream).lower()}}}',
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, r.text)
        error = r.json()["error"]
        assert error["message"].startswith(f"{where} holds a lone UTF-16 surrogate (\\u"), (path, error)
        assert error["param"] == param and error["type"] == "invalid_request_error", (path, error)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a 🦊"}).status_code == 200  # a whole pair is fine
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_non_finite_numbers_are_a_400_naming_the_parameter(server, name, value, stream):
    """JSON's NaN (which compares False with any bound) and infinities are refused before a stream starts."""
    for path, head in (("/v1/completions", '"prompt": "a"'), ("/v1/chat/completions",
                                                              '"messages": [{"role": "user", "content": "a"}]')):  # fmt: skip
        content = f'{{{head}, "max_tokens": 3, "{name}": {value}, "stream": {str(stream).lower()}}}'
        r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, r.text)
        error = r.json()["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error", (path, error)
        assert f"{name} must be a finite number, got {float(value)!r}" == error["message"], (path, error)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_prompt_that_fills_the_context_without_max_tokens_is_a_400(server, checkpoint, stream):
    from wiola.chat import apply_chat_template
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(checkpoint)
    for content in ("The cat " * 200, "The cat " * 40):
        messages = [{"role": "user", "content": content}]
        n = len(apply_chat_template(tok, messages))
        body = {"messages": messages, "stream": stream, "temperature": 0}  # greedy: the API's default samples
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        if n < MAX_SEQ:  # room for MAX_SEQ - n tokens: the default max_tokens takes it all
            assert r.status_code == 200, r.text
            if not stream:  # the special tokens' logits are 0: greedy text runs to the context's end
                usage = r.json()["usage"]
                assert (usage["prompt_tokens"], usage["total_tokens"]) == (n, MAX_SEQ), usage
            continue
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded"), error
        assert f"{n} tokens" in error["message"] and f"context of {MAX_SEQ} tokens" in error["message"], error


def test_a_10mb_body_is_refused_before_it_is_read(server):
    big = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=60)
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: refused by the streamed size
        for _ in range(10):
            yield b"a" * (1 << 20)

    with contextlib.suppress(httpx.HTTPError):  # the server may close the connection mid-upload
        r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
        assert r.status_code == 413
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_non_streaming_client_that_times_out_frees_its_rows(server):
    """The client gives up while tokens keep flowing: its rows leave within a poll or two,
    long before the request's 256 choices (the most a request may ask) x 200 tokens (6400 steps
    of 8 rows) would have finished."""
    before = httpx.get(server.url + "/health").json()
    body = {"prompt": (PROMPTS * 4)[:16], "n": 16, "max_tokens": 200, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    # done when rows have left early and none runs or waits: "none runs" alone is also the state
    # before a server slower than the client's timeout (a loaded machine) has queued the request
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["left_early"] > before["left_early"] and health["live_rows"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the request's rows did not leave early: before {before}, now {health}")
    assert health["steps"] - before["steps"] < 6400 // 2, (before, health)


def test_a_client_that_leaves_mid_stream_frees_its_row(server, solo):
    before = httpx.get(server.url + "/health").json()["left_early"]
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["left_early"] > before and health["live_rows"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the row was not freed: {health}")
    ids, text, _ = solo(PROMPTS[2], 10)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0},
                      timeout=60).json()["choices"][0]["text"] == text  # fmt: skip


# ---------------------------------------------------------------------------- load
@pytest.mark.slow
def test_32_streaming_clients_each_get_their_solo_result(server, checkpoint, solo):
    """32 clients × 4 streamed requests each, joining and leaving the batch at different steps
    (prompts, lengths and sampling vary): every request equals the same request alone."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    plans = []
    for c in range(32):
        for k in range(4):
            prompt = PROMPTS[(c + k) % len(PROMPTS)]
            sampled = (c + k) % 3 == 0
            plans.append(
                (c, prompt, 6 + (c * 7 + k * 5) % 20, 0.8 if sampled else 0.0, 0.9 if sampled else None, c % 4)
            )
    decode = load_checkpoint_tokenizer(checkpoint).decode
    # n tokens of a request are the first n of the same request with more (the same draws, in order)
    want = {p: decode(solo(p[1], 25, p[3], p[4], p[5])[0][: p[2]]) for p in plans}

    async def request(client, plan) -> str:
        _, prompt, n, temperature, top_p, seed = plan
        body = {"prompt": prompt, "max_tokens": n, "temperature": temperature, "seed": seed, "stream": True}
        if top_p is not None:
            body["top_p"] = top_p
        text = ""
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def one_client(client, c) -> list[tuple[tuple, str]]:
        return [(p, await request(client, p)) for p in plans if p[0] == c]

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one_client(client, c) for c in range(32)))

    results = [r for per_client in asyncio.run(asyncio.wait_for(main(), 600)) for r in per_client]
    assert len(results) == 128
    wrong = [(p, got, want[p]) for p, got in results if got != want[p]]
    assert not wrong, f"{len(wrong)} of 128 differ from their solo run, first: {wrong[0]}"
    assert httpx.get(server.url + "/health").json()["live_rows"] == 0


# ---------------------------------------------------------------------------- shutdown
@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_then_exits_0(checkpoint, tmp_path, solo):
    served = Served(checkpoint, tmp_path / "serve.log")
    _, text, _ = solo(PROMPTS[0], 120)
    body = {"prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0, "stream": True}
    try:
        got = ""
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    got += json.loads(line[6:])["choices"][0]["text"]
                    break
            served.proc.send_signal(signal.SIGTERM)
            tail = list(lines)
        got += "".join(json.loads(x[6:])["choices"][0]["text"] for x in tail if x.startswith("data: {"))
        assert tail[-1] == "data: [DONE]" or tail[-2] == "data: [DONE]"
        assert got == text
        assert served.proc.wait(60) == 0, served.log.read_text()
    finally:
        served.stop()


def _stall_a_body(port: int) -> socket.socket:
    """A connection that sends its headers and the first bytes of a 100-byte body, then nothing."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    conn.sendall(head.encode() + b'{"prompt":')
    return conn


def _read_reply(conn: socket.socket) -> str:
    """One HTTP response read whole: the head, then its Content-Length of body (or until closed)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(1 << 16)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    while length is not None and len(body) < int(length[1]) and (chunk := conn.recv(1 << 16)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_stalled_or_abandoned_body_is_closed_and_does_not_hold_a_shutdown(checkpoint, tmp_path):
    served = Served(checkpoint, tmp_path / "serve.log", "--body-timeout", "1")
    try:
        with _stall_a_body(served.port) as conn:  # a 408 once the timeout has passed
            start = time.monotonic()
            reply = _read_reply(conn)
            assert reply.startswith("HTTP/1.1 408") and "did not arrive within 1 s" in reply, reply
            assert time.monotonic() - start < 30
        _stall_a_body(served.port).close()  # a client that leaves mid-body: its request ends, quietly
        time.sleep(0.5)
        assert httpx.get(served.url + "/health", timeout=10).status_code == 200
        with _stall_a_body(served.port):  # SIGTERM does not wait on a stalled body past its timeout
            time.sleep(0.2)
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(30) == 0, served.log.read_text()
        log = served.log.read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    finally:
        served.stop()


def test_a_second_sigterm_stops_waiting_for_requests_in_flight(checkpoint, tmp_path):
    served = Served(checkpoint, tmp_path / "serve.log")  # the default body timeout: 30 s
    try:
        with _stall_a_body(served.port):
            time.sleep(0.2)
            served.proc.send_signal(signal.SIGTERM)
            time.sleep(1)
            assert served.proc.poll() is None, "the first SIGTERM waits for the request in flight"
            start = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(20) == 0, served.log.read_text()
            assert time.monotonic() - start < 20
    finally:
        served.stop()


# ---------------------------------------------------------------------------- the playground
def _chromium():
    """playwright's sync API and apt's chromium, or a skip naming what is missing."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
    if chromium is None:
        pytest.skip("no chromium at /usr/bin/chromium (apt-get install chromium)")
    return sync_api, chromium


def test_playground_streams_in_a_real_browser(server, tmp_path, solo):
    """Headless chromium (apt's) types a prompt into the page at /, waits for the streamed text and
    compares it with the server's greedy completion; the screenshot is saved under tmp_path."""
    sync_api, chromium = _chromium()
    _, text, _ = solo("The cat", 40)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#prompt", "The cat")
            page.fill("#max_tokens", "40")
            page.fill("#temperature", "0")
            page.click("#go")
            page.wait_for_selector("#stats[data-done]", timeout=60_000)
            shot = tmp_path / "playground.png"
            page.screenshot(path=str(shot), full_page=True)
            got = page.inner_text("#completion")
            stats = page.inner_text("#stats")
        finally:
            browser.close()
    assert shot.stat().st_size > 1000
    assert got == text, f"page: {got!r} != server greedy {text!r}"
    assert "tokens/s" in stats and "finish:" in stats, stats


ESCAPE_AT_3 = """new MutationObserver((_, seen) => {
    if (parseInt(document.getElementById("stats").textContent) >= 3) {
        seen.disconnect(); document.dispatchEvent(new KeyboardEvent("keydown", {key: "Escape"}));
    }
}).observe(document.getElementById("stats"), {childList: true, characterData: true, subtree: true})"""


def test_playground_checks_its_fields_and_shows_what_it_is_given_as_text(checkpoint, tmp_path):
    """The page as a user meets it, in headless chromium: a model name holding HTML and a quote
    shows as text (no script from it runs, the page's own still does); a field the browser finds
    invalid (2.7 tokens, a seed past 2**53) is named and nothing is sent, while ``1e2`` is sent as
    100; the defaults are valid; Ctrl+Enter generates; a stop string ends the text; the server's
    400 for a lone surrogate is shown as its message; long words wrap at a phone's width; a prompt
    past the context is refused with the message in view (the output box scrolls within 60% of
    the window, not down the page); Stop keeps the count; with the server gone the page says it
    cannot be reached, not the browser's "Failed to fetch"."""
    sync_api, chromium = _chromium()
    name = 'my "model" </script><script>document.title="PWNED"</script>'
    served = Served(checkpoint, tmp_path / "serve.log", "--model-name", name)
    sent: list[dict] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 375, "height": 800})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/completions") else None)
                page.goto(served.url + "/")
                assert page.title() == "Wiola playground" and page.inner_text("#model") == name

                def run(**fields: str) -> str:
                    for field, value in fields.items():
                        page.fill(f"#{field}", value)
                    page.evaluate("delete document.getElementById('stats').dataset.done")
                    page.click("#go")
                    page.wait_for_selector("#stats[data-done]", timeout=60_000)
                    return page.inner_text("#stats")

                assert page.evaluate("[...document.querySelectorAll('input')].every((i) => i.checkValidity())")
                for field, value, label in (("max_tokens", "2.7", "max tokens"), ("seed", "9007199254740993", "seed")):
                    stats = run(**{field: value})
                    assert stats.startswith(f"error: {label}: ") and not sent, (stats, sent)
                    page.fill(f"#{field}", "" if field == "seed" else "64")
                stats = run(max_tokens="1e2", temperature="0", top_k="0")
                assert sent[-1]["max_tokens"] == 100 and sent[-1]["top_k"] == 0 and "seed" not in sent[-1], sent
                assert "finish: length" in stats and stats.startswith("100 tokens in"), stats
                plain = page.inner_text("#completion")
                # A stop string of whole characters (a token holding part of one reads U+FFFD until the
                # rest comes) whose first place in the text is where it was taken from.
                at = next(i for i in range(2, len(plain) - 3)
                          if "\ufffd" not in plain[i : i + 3] and plain.find(plain[i : i + 3]) == i)  # fmt: skip
                stop = plain[at : at + 3]
                page.fill("#stop", stop.replace("\n", "\\n"))
                page.fill("#max_tokens", "100")  # the same tokens as plain's, to the stop
                page.focus("#prompt")
                page.evaluate("delete document.getElementById('stats').dataset.done")
                page.keyboard.press("Control+Enter")
                page.wait_for_selector("#stats[data-done]", timeout=60_000)
                assert sent[-1]["stop"] == stop and page.inner_text("#completion") == plain[:at], (sent[-1], plain)
                assert "finish: stop" in page.inner_text("#stats")
                run(stop="cat\\nThe", max_tokens="4")  # the field's \n is a new line
                assert sent[-1]["stop"] == "cat\nThe", sent[-1]
                page.fill("#stop", "")
                page.fill("#prompt", "https://example.com/" + "abcdefghij" * 8)
                page.evaluate("document.getElementById('prompt').value += ' \\ud83d'")  # half an emoji
                stats = run()
                assert "error: prompt holds a lone UTF-16 surrogate (\\ud83d)" in stats, stats
                assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
                page.fill("#prompt", "Once upon a time " * 300)  # past the context: refused, below a long echo
                stats = run(max_tokens="8")
                in_view = "(() => { const r = document.getElementById('stats').getBoundingClientRect(); " \
                          "return r.top >= 0 && r.bottom <= window.innerHeight; })()"  # fmt: skip
                assert stats.startswith("error: ") and page.evaluate(in_view), stats
                assert page.evaluate("document.getElementById('output').offsetHeight <= 0.6 * window.innerHeight + 40")
                page.fill("#prompt", "Once upon a time")
                page.fill("#max_tokens", "240")
                for _ in range(3):  # a loaded machine may hand the page the whole stream in one read: again
                    page.evaluate("delete document.getElementById('stats').dataset.done")
                    page.evaluate(ESCAPE_AT_3)
                    page.click("#go")
                    page.wait_for_selector("#stats[data-done]", timeout=60_000)
                    stopped = page.inner_text("#stats")
                    if stopped.startswith("stopped after "):
                        break
                page.screenshot(path=str(tmp_path / "playground-phone.png"), full_page=True)
                assert served.stop() == 0, served.log.read_text()  # the server gone: the page says so
                gone = run()
                assert gone == f"error: the server at {served.url} could not be reached (is wiola serve still running?)"
            finally:
                browser.close()
        assert stopped.startswith("stopped after ") and int(stopped.split()[2]) >= 3, stopped
        refused = "Failed to load resource: the server responded with a status of 400 (Bad Request)"
        assert errors[:2] == [refused, refused] and all("net::ERR_" in e for e in errors[2:]), errors
    finally:
        assert served.stop() == 0, served.log.read_text()


def test_no_op_values_of_unsupported_parameters_and_text_parts_are_taken(server, solo):
    """OpenAI parameters this server does not implement are refused when set (above) but taken
    at their no-op values; chat content as OpenAI's list of text parts is the text they join to,
    and a part of another kind is a 400 naming it."""
    want = solo(PROMPTS[1], 6)[1]
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "best_of": 1, "user": "me"}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    chat = {"max_tokens": 6, "temperature": 0}
    plain = httpx.post(server.url + "/v1/chat/completions",
                       json={**chat, "messages": [{"role": "user", "content": "Tell me about the cat."}]})  # fmt: skip
    parts = [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "the cat."}]
    split = httpx.post(
        server.url + "/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": parts}]}
    )
    assert split.status_code == plain.status_code == 200, split.text
    assert split.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": image}]})
    assert r.status_code == 400 and "messages[0].content[0] is a 'image_url' part" in r.json()["error"]["message"]
