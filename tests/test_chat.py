"""The chat template (wiola.chat): our ids equal transformers' apply_chat_template on the saved
folder, the template survives save/load, role tokens and the embedding resize."""

from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import pytest
import torch

import wiola
from wiola.chat import (
    CHAT_TEMPLATE,
    ROLE_TOKENS,
    add_role_tokens,
    apply_chat_template,
    check_chat_template,
    check_messages,
    render_chat,
    resize_token_embeddings,
    stream_reply,
    turn_end_marker,
    with_chat_template,
)
from wiola.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer, train_tokenizer
from wiola.train.corpus import generate_stories

MESSAGES = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Write a story with the word 'dog'.\n"},
    {"role": "assistant", "content": " Once upon a time, a dog ran.\n\nThe end."},
    {"role": "user", "content": "Again! <s> is text here"},
]


@pytest.fixture(scope="module")
def small_bpe() -> HFTokenizer:
    return train_tokenizer(generate_stories(200), 400, show_progress=False)


def _tokenizers(small_bpe: HFTokenizer) -> dict:
    gpt2 = load_tokenizer("gpt2-32k")
    return {
        "gpt2-32k": with_chat_template(gpt2),
        "gpt2-32k+roles": add_role_tokens(with_chat_template(load_tokenizer("gpt2-32k"))),
        "bpe-400": with_chat_template(small_bpe),
        "bpe-400+roles": add_role_tokens(small_bpe),
    }


def _transformers_ids(folder, messages, add_generation_prompt: bool) -> list[int]:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)  # 5.x may return a BatchEncoding


@pytest.mark.slow
def test_ids_equal_transformers_apply_chat_template(small_bpe, tmp_path) -> None:
    for name, tok in _tokenizers(small_bpe).items():
        folder = tmp_path / name
        (tok.to_hf() if isinstance(tok, TiktokenTokenizer) else tok).save(folder)
        assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
        for gen, messages in ((True, MESSAGES), (False, MESSAGES[:3])):
            ours = apply_chat_template(tok, messages, add_generation_prompt=gen)
            theirs = _transformers_ids(folder, messages, gen)
            assert ours == theirs, (
                f"{name} add_generation_prompt={gen}: ours {ours[:20]} != transformers' {theirs[:20]}"
            )


# What transformers' template environment adds to Jinja's: its tojson (no escaping of non-ASCII or
# <>&'), {% break %}/{% continue %}, {% generation %}, every named special token, tools=None.
RICH_TEMPLATE = (
    "{{ bos_token }}[{{ unk_token }}|{{ pad_token }}|{{ sep_token }}|{{ cls_token }}|{{ mask_token }}]"
    "{% if tools is none %}(no tools){% endif %}{% if documents is none %}(no documents){% endif %}"
    "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
    "{% else %}{{ m | tojson(indent=1) }}{% endif %}{{ eos_token }}{% endfor %}"
)
RICH_MESSAGES = [
    {"role": "system", "content": "skipped"},
    {"role": "user", "content": "Hi café 😀 <b> & 'x'"},
    {"role": "assistant", "content": "Ça va ✓"},
    {"role": "user", "content": "after the break"},
]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["all roles", "no bos", "gpt2"])
def test_template_environment_equals_transformers(small_bpe, tmp_path, variant) -> None:
    folder = tmp_path / "tok"
    if variant == "gpt2":
        with_chat_template(load_tokenizer("gpt2-32k"), RICH_TEMPLATE).to_hf().save(folder)
    else:
        small_bpe.save(folder)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config = json.loads((folder / name).read_text())
            config.update(sep_token="</s>", cls_token="<s>", mask_token="<unk>", chat_template=RICH_TEMPLATE)
            if variant == "no bos":
                config.pop("bos_token")
            (folder / name).write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    text = render_chat(tok, RICH_MESSAGES, add_generation_prompt=False)
    assert "café 😀 <b> & 'x'" in text and "(no tools)(no documents)" in text and "after the break" not in text
    assert text.startswith("<s>[" if variant == "all roles" else "[" if variant == "no bos" else "<|endoftext|>[")
    ours = apply_chat_template(tok, RICH_MESSAGES, add_generation_prompt=False)
    theirs = _transformers_ids(folder, RICH_MESSAGES, False)
    assert ours == theirs, f"{variant}: ours {ours[:24]} != transformers' {theirs[:24]}"


def test_fit_history_drops_a_user_turn_with_its_answer() -> None:
    """Over budget, the oldest user turn goes with the answer after it (never leaving an answer
    without its question), the system message stays, and the last turn is always kept."""
    from wiola.chat import fit_history

    tok = load_tokenizer("gpt2-32k")
    system = {"role": "system", "content": "Be brief."}
    turns = [
        {"role": "user", "content": "Tell me about the red boat on the lake."},
        {"role": "assistant", "content": "It was small and it floated near the old pier all day."},
        {"role": "user", "content": "And then?"},
    ]
    whole = len(apply_chat_template(tok, [system, *turns]))
    last = len(apply_chat_template(tok, [system, turns[-1]]))
    ids, kept, dropped = fit_history(tok, [system, *turns], whole)
    assert (kept, dropped) == ([system, *turns], 0) and len(ids) == whole
    for budget in (whole - 1, last):
        ids, kept, dropped = fit_history(tok, [system, *turns], budget)
        assert [m["role"] for m in kept] == ["system", "user"] and kept[-1] == turns[-1], (budget, kept)
        assert dropped == 2 and ids == apply_chat_template(tok, kept)
    with pytest.raises(ValueError, match=f"the model has room for {last - 1}"):
        fit_history(tok, [system, *turns], last - 1)


def test_role_tokens_are_one_id_each(small_bpe) -> None:
    tok = add_role_tokens(small_bpe)
    assert tok.vocab_size == small_bpe.vocab_size + 3
    ids = apply_chat_template(tok, MESSAGES[:2])
    for token in ROLE_TOKENS[:2]:
        assert tok._tok.token_to_id(token) in ids, token
    plain = apply_chat_template(small_bpe, MESSAGES[:2])
    assert len(ids) < len(plain)  # each marker was several byte-level pieces before
    assert tok.decode(ids) == render_chat(small_bpe, MESSAGES[:2])
    assert tok.fingerprint != small_bpe.fingerprint
    # the special ids a checkpoint's config set on the tokenizer stay (GPT-2's converted one too)
    for base in (load_tokenizer("gpt2-32k"), small_bpe):
        ids = (5, 6, 7)
        roles = add_role_tokens(base.with_special_ids(*ids))
        assert (roles.bos_token_id, roles.eos_token_id, roles.pad_token_id) == ids, base


def test_template_text_and_generation_prompt() -> None:
    tok = load_tokenizer("gpt2-32k")
    text = render_chat(tok, MESSAGES[1:3], add_generation_prompt=False)
    assert text == (
        "<|endoftext|><|user|>\nWrite a story with the word 'dog'.<|endoftext|>"
        "<|assistant|>\nOnce upon a time, a dog ran.\n\nThe end.<|endoftext|>"
    )
    assert render_chat(tok, MESSAGES[1:2]).endswith("<|endoftext|><|assistant|>\n")
    ids = apply_chat_template(tok, MESSAGES[1:2])
    assert ids[0] == tok.eos_token_id and ids.count(tok.eos_token_id) == 2


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}],
            "message 1: the assistant turn is empty",
        ),
        ([{"role": "user"}], "message 0: expected an object"),
    ],
)
def test_bad_messages_are_named(messages, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_messages(messages)


def test_a_custom_template_is_used_and_raise_exception_works() -> None:
    tok = load_tokenizer("gpt2-32k")
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ raise_exception('no') }}"
    with pytest.raises(ValueError, match="chat template: no"):
        apply_chat_template(tok, MESSAGES[:1])


def test_template_survives_save_and_checkpoint_load(small_bpe, tmp_path) -> None:
    from wiola import WiolaModel
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.config import WiolaConfig

    custom = CHAT_TEMPLATE.replace("<|", "<<")
    model = WiolaModel(WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=32))
    for name, tok in (("tiktoken", load_tokenizer("gpt2-32k")), ("bpe", small_bpe)):
        assert load_checkpoint_tokenizer_or_none(tmp_path, name, model, tok) is None
        tok = with_chat_template(tok, custom)
        model.save_pretrained(tmp_path / f"{name}-chat", tok)
        assert load_checkpoint_tokenizer(tmp_path / f"{name}-chat").chat_template == custom, name


def test_a_template_in_chat_template_jinja_is_read_before_the_configs(small_bpe, tmp_path) -> None:
    """``chat_template.jinja`` (where transformers 5 saves a template) is read, and wins over a
    ``chat_template`` in ``tokenizer_config.json`` (4.x's place); transformers reads the same."""
    with_chat_template(small_bpe, CHAT_TEMPLATE).save(tmp_path)
    assert load_tokenizer(tmp_path).chat_template == CHAT_TEMPLATE
    custom = CHAT_TEMPLATE.replace("<|", "<<")
    (tmp_path / "chat_template.jinja").write_text(custom)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == custom
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) >= 5:  # 4.x does not read the file
        for gen in (False, True):
            assert apply_chat_template(tok, MESSAGES, add_generation_prompt=gen) == _transformers_ids(
                tmp_path, MESSAGES, gen
            )


def load_checkpoint_tokenizer_or_none(tmp_path, name, model, tok):
    from wiola.checkpoint import load_checkpoint_tokenizer

    tok.chat_template = None
    model.save_pretrained(tmp_path / name, tok)
    return load_checkpoint_tokenizer(tmp_path / name).chat_template


def test_resize_token_embeddings_appends_mean_rows() -> None:
    from wiola import WiolaModel
    from wiola.config import WiolaConfig

    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig(vocab_size=300, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=32))
    before = model.embed.weight.detach().clone()
    ids = torch.tensor([[5, 7, 299]])
    logits = model(ids).logits
    resize_token_embeddings(model, 303)
    assert model.config.vocab_size == 303 and model.embed.weight.shape == (303, 16)
    assert torch.equal(model.embed.weight[:300], before)
    for row in range(300, 303):
        torch.testing.assert_close(model.embed.weight[row], before.mean(0), rtol=0, atol=0)
    after = model(ids).logits
    assert torch.equal(after[..., :300], logits), "old tokens' logits changed"
    torch.testing.assert_close(after[..., 300], logits.mean(-1), rtol=1e-5, atol=1e-5)  # linear in the row
    model(torch.tensor([[302]]))  # the new ids embed
    with pytest.raises(ValueError, match="cannot shrink"):
        resize_token_embeddings(model, 10)


def test_exported_folder_gives_our_ids_in_transformers(tmp_path) -> None:
    """`wiola export` (the wiola13m / transformers layout) carries the template: transformers'
    AutoTokenizer on the exported folder gives the ids of a checkpoint fine-tuned with it."""
    pytest.importorskip("transformers")
    from wiola import WiolaModel
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.cli import main
    from wiola.config import WiolaConfig

    model = WiolaModel(WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=32))
    model.save_pretrained(tmp_path / "ckpt", with_chat_template(load_tokenizer("gpt2-32k")))
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    ours = apply_chat_template(load_checkpoint_tokenizer(tmp_path / "ckpt"), MESSAGES)
    assert ours == _transformers_ids(tmp_path / "hf", MESSAGES, True)


# --------------------------------------------------------------------------- end-of-turn markers
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BROKEN = "{% for m in messages %}{{ m['content'] }"


def _with_template(template: str | None):
    tok = load_tokenizer("gpt2-32k")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    "template, marker",
    [
        (None, None),  # wiola's own: turns end with eos
        (CHATML, "<|im_end|>"),
        (CHATML.replace("<|im_end|>\n", "<|im_end|>{{ eos_token }}"), "<|im_end|>"),  # the marker, then eos
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}", None),  # whitespace only
        ("{{ raise_exception('no') }}", None),  # cannot render the probe
    ],
)
def test_turn_end_marker_is_what_follows_the_reply_unless_eos(template, marker) -> None:
    assert turn_end_marker(_with_template(template)) == marker


def test_a_template_that_does_not_compile_is_named() -> None:
    check_chat_template(_with_template(CHATML))
    with pytest.raises(ValueError, match=r"the chat template does not compile: unexpected '}' \(line 1\)"):
        check_chat_template(_with_template(BROKEN))


class Scripted(torch.nn.Module):
    """A stand-in model whose greedy tokens are ``script`` in turn (the last one repeated)."""

    def __init__(self, script: list[int], vocab_size: int = 32000, max_seq_len: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1, 1)
        self.config = SimpleNamespace(vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.script, self.step = script, 0

    def new_cache(self, batch: int, length: int) -> None:
        self.step = 0

    def forward(self, ids: torch.Tensor, cache=None, logits_to_keep=None) -> SimpleNamespace:
        logits = torch.zeros(1, ids.shape[1], self.config.vocab_size)
        logits[0, -1, self.script[min(self.step, len(self.script) - 1)]] = 1.0
        self.step += 1
        return SimpleNamespace(logits=logits)


def _stream(tok, text: str, max_new_tokens: int = 40, stop_text: str | None = "<|im_end|>", tail: list[int] = ()):
    """The ``(ids, pieces)`` of ``stream_reply`` for a model that writes ``text`` (then ``tail``)."""
    model = Scripted([*tok.encode_batch([text])[0], *tail])
    pairs = list(stream_reply(model, tok, [1, 2], max_new_tokens, stop_text=stop_text))
    return [t for t, _ in pairs], [p for _, p in pairs]


def test_stream_reply_stops_at_a_marker_of_several_tokens_and_never_shows_it() -> None:
    tok = _with_template(CHATML)
    ids, pieces = _stream(tok, "Yes, a cat.<|im_end|>\nmore text")
    assert "".join(pieces) == "Yes, a cat."
    assert len(ids) == len(tok.encode_batch(["Yes, a cat.<|im_end|>"])[0])  # ends at the marker's last token
    # tokens "Yes" "," " a" " cat" ".<" "|" "im" "_" "end" "|" ">": the "<" of ".<" could start the
    # marker, so it is held back with what follows until the marker is whole; none of it is shown
    assert pieces == ["Yes", ",", " a", " cat", ".", "", "", "", "", "", ""]


def test_stream_reply_shows_held_back_text_that_turns_out_not_to_be_the_marker() -> None:
    tok = _with_template(CHATML)
    _, pieces = _stream(tok, "a <|im_start|> b<|im_end|>")
    assert "".join(pieces) == "a <|im_start|> b"
    # tokens "a" " <" "|" "im" "_" "start" ...: "<|im_" is held back, shown once "start" rules the marker out
    assert pieces[:9] == ["a", " ", "", "", "", "<|im_start", "|", ">", " b"] and set(pieces[9:]) == {""}
    # at max_new_tokens a partial marker is the reply's own text: shown, not lost
    _, pieces = _stream(tok, "ok <|im", max_new_tokens=4)
    assert "".join(pieces) == "ok <|im"


def test_stream_reply_without_a_marker_is_unchanged() -> None:
    tok = _with_template(None)
    eos = tok.eos_token_id
    ids, pieces = _stream(tok, "Yes<|im_end|>", stop_text=None, tail=[eos])
    assert "".join(pieces) == "Yes<|im_end|>" and eos not in ids  # shown as it comes, ends at eos
    assert pieces == [tok.decode([t]) for t in ids]


def test_stream_reply_shows_text_held_back_for_the_marker_when_the_reply_ends_at_eos() -> None:
    tok = _with_template(CHATML)
    eos = tok.eos_token_id
    for text in ("Use x <", "The tag is <|", "Say <|im"):
        ids, pieces = _stream(tok, text, tail=[eos])
        assert "".join(pieces) == text, pieces
        assert ids == [*tok.encode_batch([text])[0], eos]  # the held-back text comes with eos


def test_stream_reply_at_max_new_tokens_shows_the_text_before_an_incomplete_character() -> None:
    tok = _with_template(None)
    # tokens "Hi" " \xe2\x80" "\x9c" ...: the second holds a space and 2 of the 3 bytes of "“"
    ids, pieces = _stream(tok, "Hi “yes”", max_new_tokens=2, stop_text=None)
    assert "".join(pieces) == tok.decode(ids) == "Hi \ufffd", pieces


def _cleaning_up(template: str | None) -> HFTokenizer:
    """GPT-2's tokenizer with ``clean_up_tokenization_spaces`` (``decode_reach`` 3)."""
    tok = _with_template(template).to_hf()
    tok.chat_template, tok.clean_up_spaces = template, True
    return tok


def test_stream_reply_shows_what_the_clean_up_of_spaces_rewrites() -> None:
    """With ``clean_up_tokenization_spaces`` a later token rewrites the end of the decoding
    (" ." to ".", " do n't" to " don't"): the pieces still join to the decoding of the reply."""
    tok = _cleaning_up(None)
    eos = tok.eos_token_id
    for words, text in (
        (["Hello", " ", ".", " I", " do", " n't", " know", " ", "!"], "Hello. I don't know!"),
        (["It", " '", "s", " fine", " ", "?"], "It's fine?"),
    ):
        ids = [i for w in words for i in tok.encode(w)]
        pairs = list(stream_reply(Scripted([*ids, eos]), tok, [1, 2], 40))
        assert "".join(p for _, p in pairs) == tok.decode(ids) == text, pairs
        assert [t for t, _ in pairs] == [*ids, eos]  # the last characters, held back, come with eos


def test_stream_reply_pieces_join_to_the_reply_whatever_the_clean_up_and_the_marker_do() -> None:
    """Random replies of clean-up patterns, marker pieces and characters of several bytes, ended
    at eos, at ``max_new_tokens`` or by the marker: the pieces join to the decoding up to the
    marker, and the reply ends at the token that completes it."""
    import random

    rng = random.Random(0)
    tok, marker = _cleaning_up(CHATML), "<|im_end|>"
    alphabet = [*" .?!,'ntmsvera<|_>", "é", "“", " n't", marker]
    for _ in range(300):
        ids = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
        max_new_tokens = rng.randint(1, len(ids) + 1)  # len(ids) + 1: the reply ends at eos
        made = ids[:max_new_tokens]
        pairs = list(stream_reply(Scripted([*ids, tok.eos_token_id]), tok, [1, 2], max_new_tokens, stop_text=marker))
        full = tok.decode(made)
        want = full.split(marker)[0]
        ends = next((k for k in range(1, len(made) + 1) if marker in tok.decode(made[:k])), None)
        assert "".join(p for _, p in pairs) == want, (made, pairs)
        if ends is not None:
            assert [t for t, _ in pairs] == made[:ends], (made, pairs)


def test_finetune_data_warns_once_when_answers_hold_no_eos(tmp_path) -> None:
    from wiola.train.sft import IGNORE, load_sft_data

    lines = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w + "!"}]} for w in "abc"]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    said: list[str] = []
    data = load_sft_data(path, "chat", _with_template(CHATML), 64, warn=said.append)
    assert len(said) == 1, said
    assert "'<|im_end|>', not with the eos token '<|endoftext|>'" in said[0]
    assert "3 of 3 conversations" in said[0] and "cannot learn to stop" in said[0]
    assert all(31999 not in [t for t in labels if t != IGNORE] for _, labels in data.examples)
    no_marker = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    said.clear()
    load_sft_data(path, "chat", _with_template(no_marker), 64, warn=said.append)
    assert len(said) == 1 and "ends assistant turns without the eos token" in said[0]
    said.clear()
    load_sft_data(path, "chat", _with_template(None), 64, warn=said.append)  # wiola's template: eos ends turns
    assert said == []
    with pytest.raises(ValueError, match="^the chat template does not compile"):  # not blamed on a line of the data
        load_sft_data(path, "chat", _with_template(BROKEN), 64, warn=said.append)


# --------------------------------------------------------------------------- wiola chat, piped
def _chat_cli(monkeypatch, capsys, checkpoint, lines: str | bytes, *flags: str, loaded=None) -> tuple[int, str, str]:
    """``wiola chat`` with ``lines`` on stdin (no terminal; bytes are decoded as strict UTF-8, as
    a UTF-8 locale's stdin is); ``loaded`` stands in for the checkpoint."""
    from wiola.cli import main

    if loaded is not None:
        monkeypatch.setattr("wiola.train.finetune.load_finetuned", lambda *a, **k: loaded)
    stdin = io.TextIOWrapper(io.BytesIO(lines), encoding="utf-8") if isinstance(lines, bytes) else io.StringIO(lines)
    monkeypatch.setattr(sys, "stdin", stdin)
    code = main(["chat", "--checkpoint", str(checkpoint), "--temperature", "0", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chat_cli_ends_a_reply_at_the_template_marker(monkeypatch, capsys) -> None:
    tok = _with_template(CHATML)
    model = Scripted(tok.encode_batch(["Yes, a cat.<|im_end|>\n<|im_start|>user\nmore"])[0])
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "cat\n", loaded=(model, tok))
    assert code == 0
    assert "whose turns end at '<|im_end|>'" in out
    assert "model> Yes, a cat.\n" in out and "im_end" not in out.split("model> ")[-1], out


def test_chat_cli_shows_and_keeps_text_held_back_for_the_marker_at_eos(monkeypatch, capsys) -> None:
    tok = _with_template(CHATML)
    model = Scripted([*tok.encode_batch(["Use x <"])[0], tok.eos_token_id])
    saved = []
    monkeypatch.setattr("wiola.chat.fit_history", _recording(saved))
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "first\nsecond\n", loaded=(model, tok))
    assert code == 0 and "model> Use x <\n" in out, out
    assert saved[-1][-2] == {"role": "assistant", "content": "Use x <"}, saved[-1]


def test_chat_cli_reset_clears_the_history_and_the_system_message_opens_each_prompt_once(monkeypatch, capsys) -> None:
    """After ``/reset`` the next prompt holds the new question alone; with ``--system`` each
    prompt opens with the system message, once, then the turns."""
    tok = _with_template(CHATML)
    saved = []
    monkeypatch.setattr("wiola.chat.fit_history", _recording(saved))
    model = Scripted([*tok.encode_batch(["Yes."])[0], tok.eos_token_id])
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "hello\n/reset\nagain\n", loaded=(model, tok))
    assert code == 0 and "(conversation cleared)" in out, out
    assert saved[-1] == [{"role": "user", "content": "again"}], saved[-1]
    saved.clear()
    code, _, _ = _chat_cli(monkeypatch, capsys, "ckpt", "hello\nagain\n", "--system", "Be brief.", loaded=(model, tok))
    assert code == 0
    assert [m["role"] for m in saved[-1]] == ["system", "user", "assistant", "user"], saved[-1]
    assert saved[-1][0] == {"role": "system", "content": "Be brief."}


def _recording(saved: list):
    """``fit_history`` that also appends each conversation it is given to ``saved``."""
    from wiola.chat import fit_history

    def record(tokenizer, messages, budget):
        saved.append(list(messages))
        return fit_history(tokenizer, messages, budget)

    return record


def test_chat_cli_says_a_line_that_is_not_utf8_and_goes_on(monkeypatch, capsys) -> None:
    """A strict UTF-8 stdin would raise at the bad byte (and lose the rest of a piped chunk):
    that line is said and skipped, the lines before and after it are answered."""
    tok = _with_template(None)
    model = Scripted([*tok.encode_batch(["Fine."])[0], tok.eos_token_id])
    lines = b"hello\n\xff\xfe bad\nagain\n"
    code, out, err = _chat_cli(monkeypatch, capsys, "ckpt", lines, loaded=(model, tok))
    assert code == 0, err
    assert out.count("model> Fine.") == 2, out
    assert "(that line is not valid utf-8 text, so it was not sent)" in out, out
    assert sys.stdin.errors == "strict"  # as it was


def test_chat_cli_says_when_a_reply_is_only_ids_past_the_tokenizer(monkeypatch, capsys) -> None:
    tok = _with_template(None)
    model = Scripted([32005], vocab_size=32064)  # a padded embedding row: no text
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "hello\n", "--max-new-tokens", "5", loaded=(model, tok))
    assert code == 0
    assert "5 generated token(s) (first id 32005) lie past the 32,000 ids of tokenizer 'gpt2-32k'" in out, out
    assert "the empty reply is left out of the conversation" in out


def test_an_empty_reply_leaves_its_question_out_of_the_history(capsys) -> None:
    """``_reply``: a reply with no text leaves the history as it was (no user turn without its
    answer, which would put two user turns in a row); a reply with text adds both turns."""
    import argparse

    from wiola.cli.chat import _reply

    tok = _with_template(None)
    args = argparse.Namespace(max_new_tokens=3, temperature=0.0, top_k=None, top_p=None)
    before = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Fine."}]
    history, dropped = _reply(Scripted([32005], vocab_size=32064), tok, [], before, "hello", args, None, None)
    assert (history, dropped) == (before, 0), history
    fine = tok.encode_batch(["Fine."])[0]
    history, _ = _reply(Scripted([*fine, tok.eos_token_id]), tok, [], before, "again", args, None, None)
    assert history == [*before, {"role": "user", "content": "again"}, {"role": "assistant", "content": "Fine."}]
    capsys.readouterr()


def test_stream_reply_may_fill_the_context_exactly() -> None:
    """A prompt and ``max_new_tokens`` that together make ``max_seq_len`` run; one more is refused."""
    tok = _with_template(None)
    model = Scripted([7], max_seq_len=32)
    assert [t for t, _ in stream_reply(model, tok, [1] * 24, 8)] == [7] * 8
    with pytest.raises(ValueError, match="max_seq_len"):
        list(stream_reply(model, tok, [1] * 24, 9))


def test_chat_cli_says_a_reply_was_cut_at_max_new_tokens(monkeypatch, capsys) -> None:
    """A reply cut at ``--max-new-tokens`` says so; one that ends at eos, or at the template's
    marker on its last allowed token, does not."""
    tok = _with_template(CHATML)
    text = tok.encode_batch(["one two three four five six"])[0]
    cases = (([*text, tok.eos_token_id], "3", True), ([*text[:2], tok.eos_token_id], "3", False))
    for script, limit, cut in cases:
        model = Scripted(script)
        code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", limit, loaded=(model, tok))
        assert code == 0 and ("[cut at --max-new-tokens 3]" in out) is cut, out
    marker = tok.encode_batch(["ok<|im_end|>"])[0]
    model = Scripted(marker)
    code, out, _ = _chat_cli(
        monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", str(len(marker)), loaded=(model, tok)
    )
    assert code == 0 and "model> ok\n" in out and "[cut" not in out, out
    for script, limit, why in (
        (text, 2, "length"),
        ([*text[:1], tok.eos_token_id], 5, "stop"),
        (marker, len(marker), "stop"),
        ([], 0, "length"),
    ):
        reply = stream_reply(Scripted(script or [0]), tok, [1, 2], limit, stop_text="<|im_end|>")
        with pytest.raises(StopIteration) as end:
            while True:
                next(reply)
        assert end.value.value == why, (script, limit)


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_top_k_0_is_no_filter_on_the_command_line(command) -> None:
    """``--top-k 0`` means no top-k filter, as ``generate(top_k=0)`` and the server read it (chat
    samples with top-k 50 by default: 0 is how to turn that off); a negative one is named."""
    from wiola.cli import build_parser
    from wiola.cli.arguments import check_sampling_flags

    args = build_parser().parse_args([command, "--checkpoint", "x", "--top-k", "0"])
    assert args.top_k is None
    check_sampling_flags(1.0, args.top_k, None)
    with pytest.raises(ValueError, match="--top-k -2: top_k must be a positive int"):
        check_sampling_flags(
            1.0, build_parser().parse_args([command, "--checkpoint", "x", "--top-k", "-2"]).top_k, None
        )


def test_chat_cli_exit_with_words_after_it_leaves(monkeypatch, capsys) -> None:
    tok = _with_template(None)
    model = Scripted([tok.eos_token_id])
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "/help\n/exit now\nnot read\n", loaded=(model, tok))
    assert code == 0
    assert "unknown command" not in out and "/reset clears the conversation" in out.split("you> ")[1], out


def _saved(path, max_seq_len: int, template: str | None = None):
    from wiola import WiolaModel
    from wiola.config import WiolaConfig

    torch.manual_seed(0)
    config = WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=max_seq_len)
    WiolaModel(config).save_pretrained(path, _with_template(template))
    return path


def test_chat_cli_refuses_a_template_that_does_not_compile_at_startup(tmp_path, monkeypatch, capsys) -> None:
    checkpoint = _saved(tmp_path / "broken", 512, BROKEN)  # the context fits the default reply length
    code, out, err = _chat_cli(monkeypatch, capsys, checkpoint, "hello\n")
    assert code == 2 and "you>" not in out
    assert (
        err.strip() == f"wiola chat: error: {checkpoint}: the chat template does not compile: unexpected '}}' (line 1)"
    )


def test_chat_cli_default_reply_length_fits_a_short_context(tmp_path, monkeypatch, capsys) -> None:
    """The default ``--max-new-tokens`` is ``min(200, max_seq_len // 2)``: 32 at 64 positions, 200
    at 512 (a model that never ends its reply is cut there)."""
    checkpoint = _saved(tmp_path / "short", 64)
    code, out, err = _chat_cli(monkeypatch, capsys, checkpoint, "hello\n")
    assert code == 0 and "model> " in out, err
    code, _, err = _chat_cli(monkeypatch, capsys, checkpoint, "hello\n", "--max-new-tokens", "200")
    assert code == 2 and "--max-new-tokens must be in [1, 63]" in err  # an explicit value is not clamped
    tok = _with_template(CHATML)
    word = tok.encode_batch([" cat"])[0]
    assert len(word) == 1
    for positions, default in ((64, 32), (512, 200)):
        model = Scripted(word, max_seq_len=positions)  # " cat" forever
        code, out, err = _chat_cli(monkeypatch, capsys, "ckpt", "hi\n", loaded=(model, tok))
        assert code == 0 and f"model> {' cat' * default} [cut at --max-new-tokens {default}]\n" in out, out


def test_chat_cli_refuses_a_system_message_that_leaves_no_room(monkeypatch, capsys) -> None:
    """The system message opens every prompt (old turns are dropped, never it): one that leaves no
    room for a turn is refused at the start, naming --system and both counts, exit 2; one that fits
    starts the session."""
    tok = _with_template(None)
    model = Scripted([tok.eos_token_id], max_seq_len=64)
    long = " ".join(["cat dog sun"] * 40)  # 120 words: past 64 - 8 tokens
    code, out, err = _chat_cli(monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", "8", "--system", long,
                               loaded=(model, tok))  # fmt: skip
    assert code == 2 and out == "", out
    assert err.startswith("wiola chat: error: --system takes ") and "the model has room for 56 (64 tokens" in err, err
    code, out, _ = _chat_cli(monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", "8", "--system", "Be brief.",
                             loaded=(model, tok))  # fmt: skip
    assert code == 0 and "you> " in out, out


def test_chat_cli_refuses_max_new_tokens_that_leave_no_room_for_a_message(monkeypatch, capsys) -> None:
    """The template's framing of an empty message must fit beside --max-new-tokens, or every
    message would be refused: said at the start in one line, exit 2."""
    tok = _with_template(None)
    model = Scripted([tok.eos_token_id], max_seq_len=256)
    need = len(apply_chat_template(tok, [{"role": "user", "content": ""}]))
    code, out, err = _chat_cli(monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", "250", loaded=(model, tok))
    assert code == 2 and out == "", out
    assert err == (
        f"wiola chat: error: --max-new-tokens 250 leaves no room for a message: the template takes {need} tokens "
        "around an empty one; the model has room for 6 (256 tokens of context less --max-new-tokens 250): lower "
        "--max-new-tokens\n"
    ), err
    code, out, _ = _chat_cli(  # room for an empty message only: the session starts
        monkeypatch, capsys, "ckpt", "hi\n", "--max-new-tokens", str(256 - need), loaded=(model, tok)
    )
    assert code == 0 and "you> " in out, out


def test_chat_refuses_base_for_a_full_model(tmp_path, capsys) -> None:
    """--base names the model a LoRA folder's adapters sit on: given with a full checkpoint it
    would be ignored, so it is refused (exit 2) before the model loads."""
    from wiola.cli import main

    torch.manual_seed(0)
    config = wiola.WiolaConfig(d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=32)
    wiola.WiolaModel(config).save_pretrained(tmp_path / "full")
    code = main(["chat", "--checkpoint", str(tmp_path / "full"), "--base", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and "--base is for a LoRA adapter folder" in err and err.count("\n") == 1, err
