"""The chat template (wiola.chat): our ids equal transformers' apply_chat_template on the saved
folder, the template survives save/load, role tokens and the embedding resize."""

from __future__ import annotations

import json

import pytest
import torch

from wiola.chat import (
    CHAT_TEMPLATE,
    ROLE_TOKENS,
    add_role_tokens,
    apply_chat_template,
    check_messages,
    render_chat,
    resize_token_embeddings,
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
