"""gpt2 and gpt2-32k through tiktoken, offline from the bundled (or a given) rank file; the
``Tokenizer`` interface over tiktoken and ``tokenizers`` (a byte-level BPE trained here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import wiola.tokenizer as tok
from wiola.tokenizer import (
    HFTokenizer,
    TiktokenTokenizer,
    encoding_for_vocab,
    get_encoding,
    load_tokenizer,
    train_tokenizer,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2.tiktoken"


def test_gpt2_known_ids():
    enc = get_encoding("gpt2")
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


def test_gpt2_32k_is_lossless_and_fits_the_13m_vocab():
    enc = get_encoding("gpt2-32k")
    assert enc.n_vocab == 32000 and enc.eot_token == 31999
    texts = ["Once upon a time, Lily found a shiny red ball.", "naïve café — 東京 🚀 \x00\t\n", "x" * 300]
    full = get_encoding("gpt2")
    for text in texts:
        ids = enc.encode(text)
        assert max(ids) < 31999 and enc.decode(ids) == text
        assert len(ids) >= len(full.encode(text))
    assert enc.encode("<|endoftext|>", allowed_special="all") == [31999]
    assert encoding_for_vocab(32000).name == "gpt2-32k"
    assert encoding_for_vocab(50257).name == "gpt2"


@pytest.mark.skipif(not SHARED.exists(), reason="no shared/ rank file beside the checkout")
def test_an_explicit_rank_file_gives_the_same_encoding():
    a = get_encoding("gpt2", str(SHARED))
    text = "The quick brown fox, 1234 times!"
    assert a.encode(text) == get_encoding("gpt2").encode(text)


def test_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown encoding"):
        get_encoding("llama")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_encoding("gpt2", str(tmp_path / "missing.tiktoken"))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="could not read BPE ranks|holds"):
        get_encoding("gpt2", str(bad))
    with pytest.raises(ValueError, match="no tokenizer has a vocabulary of 1000"):
        encoding_for_vocab(1000)


def test_no_rank_file_and_no_network_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("WIOLA_BPE_FILE", raising=False)
    monkeypatch.setattr(tok, "BUNDLED", tmp_path / "gone.tiktoken")

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tok.tiktoken, "get_encoding", offline)
    get_encoding.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="WIOLA_BPE_FILE"):
            get_encoding("gpt2-32k")
    finally:
        get_encoding.cache_clear()


TEXT = "Once upon a time, Zoë met 小明 🦊 — “naïve” café!\n\n  <s>tabs\tand</s> <pad> spaces   "
STORIES = [
    "Once upon a time there was a little fox. The fox liked to play in the snow.",
    "Lily found a shiny stone. She gave it to her mom, who smiled.",
    "Tom and Zoë built a big boat. It was red and blue, and it could float!",
] * 20


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_tokenizer(STORIES, 330, show_progress=False).save(out)
    return out


def test_trained_bpe_round_trips_unicode_and_special_tokens(bpe):
    t = load_tokenizer(bpe)
    assert isinstance(t, HFTokenizer) and t.vocab_size == 330
    assert (t.unk_token_id, t.bos_token_id, t.eos_token_id, t.pad_token_id) == (0, 1, 2, 3)
    ids = t.encode(TEXT)
    assert ids[0] == 1, "a prompt starts with <s>"
    assert {1, 2, 3} <= set(ids[1:]), "special-token text in a prompt is the special token"
    assert t.decode(ids) == "<s>" + TEXT
    plain = t.encode_batch([TEXT])[0]
    assert not {0, 1, 2, 3} & set(plain), "in a document, special-token text is text"
    assert t.decode(plain) == TEXT
    lengths = t.token_byte_lengths()
    assert sum(lengths[i] for i in plain) == len(TEXT.encode()) and lengths[1] == 0


def test_tiktoken_backend_is_the_encoding():
    enc = get_encoding("gpt2-32k")
    t = load_tokenizer("gpt2-32k")
    assert isinstance(t, TiktokenTokenizer) and (t.vocab_size, t.eos_token_id, t.bos_token_id) == (32000, 31999, None)
    text = TEXT + "<|endoftext|>"
    assert t.encode(text) == enc.encode(text, allowed_special="all") and t.decode(t.encode(text)) == text
    assert t.encode_batch([text])[0] == enc.encode_ordinary(text)
    assert t.document_prefix == [31999] and t.document_suffix == []


def test_tiktoken_converts_to_the_same_tokenizers_bpe():
    t = load_tokenizer("gpt2-32k")
    hf = t.to_hf()
    text = " ".join(STORIES[:3]) + TEXT + "  \n\n x's don't 1234567 ü   \t\n"
    assert hf.encode_batch([text]) == t.encode_batch([text]) and hf.vocab_size == 32000
    assert hf.decode(t.encode(text)) == text
    assert hf.token_byte_lengths() == t.token_byte_lengths()


def test_fingerprint_follows_the_tokenizer(bpe, tmp_path):
    a = load_tokenizer(bpe)
    assert load_tokenizer(bpe / "tokenizer.json").fingerprint == a.fingerprint, "same files, same fingerprint"
    b = train_tokenizer(STORIES, 320, show_progress=False)
    c = train_tokenizer([*STORIES, "A new story about a whale."], 330, show_progress=False)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint, a.with_special_ids(eos_token_id=3).fingerprint}) == 4
    assert load_tokenizer("gpt2").fingerprint != load_tokenizer("gpt2-32k").fingerprint


def test_bad_tokenizers_raise_clear_errors(bpe, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", ')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a valid tokenizers file"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"unknown tokenizer 'llama'"):
        load_tokenizer("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text((bpe / "tokenizer.json").read_text())
    (bad / "tokenizer_config.json").write_text('{"eos_token": "<end>"}')
    with pytest.raises(ValueError, match=r"eos_token '<end>' is not in the vocabulary"):
        load_tokenizer(bad)
    t = load_tokenizer(bpe)
    t.check_ids(t.encode(TEXT), 330)
    with pytest.raises(ValueError, match=r"token id 3\d\d .* outside the model's vocabulary of 300"):
        t.check_ids(t.encode(TEXT + " zzqqxx " * 30), 300)
    with pytest.raises(ValueError, match=r"vocab_size 100 is too small"):
        train_tokenizer(STORIES, 100)


def _with_config(bpe: Path, out: Path, **settings) -> Path:
    """A copy of the ``bpe`` folder whose ``tokenizer_config.json`` also holds ``settings``."""
    shutil.copytree(bpe, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    return out


# (tokenizer_class, flags, <s> first, </s> last): the Llama, CodeLlama and Gemma classes rebuild the
# ends from add_bos_token (default True) / add_eos_token (default False); other classes keep
# tokenizer.json's (this one's: <s> first).
END_FLAGS = [
    ("LlamaTokenizerFast", {"add_bos_token": False}, False, False),
    ("LlamaTokenizer", {"add_eos_token": True}, True, True),
    ("CodeLlamaTokenizerFast", {"add_bos_token": False, "add_eos_token": True}, False, True),
    ("GemmaTokenizerFast", {}, True, False),
    ("PreTrainedTokenizerFast", {"add_bos_token": False, "add_eos_token": True}, True, False),
]


@pytest.mark.parametrize("cls, flags, bos, eos", END_FLAGS, ids=[f"{c}-{f}" for c, f, _, _ in END_FLAGS])
def test_bos_and_eos_flags_of_llama_classes_set_the_ends(bpe, tmp_path, cls, flags, bos, eos):
    folder = _with_config(bpe, tmp_path / "tok", tokenizer_class=cls, **flags)
    t = load_tokenizer(folder)
    body = load_tokenizer(bpe).encode(TEXT)[1:]  # the text's own ids, after this file's <s>
    assert t.encode(TEXT) == [1] * bos + body + [2] * eos
    t.save(tmp_path / "saved")  # the ends live in the saved tokenizer.json: any reader adds them
    assert load_tokenizer(tmp_path / "saved").encode(TEXT) == t.encode(TEXT)
    assert t.fingerprint != load_tokenizer(bpe).fingerprint or (bos, eos) == (True, False)


def test_add_eos_token_without_an_eos_token_is_refused(bpe, tmp_path):
    folder = _with_config(bpe, tmp_path / "tok", tokenizer_class="LlamaTokenizerFast", add_eos_token=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            config.pop("eos_token", None)
            (folder / name).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="add_eos_token is set but its eos_token None is not in the vocabulary"):
        load_tokenizer(folder)


def test_save_carries_the_padding_and_truncation_settings(bpe, tmp_path):
    settings = {"model_max_length": 512, "padding_side": "left", "truncation_side": "left"}
    t = load_tokenizer(_with_config(bpe, tmp_path / "tok", **settings))
    t.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert {key: saved[key] for key in settings} == settings
    t.with_added_tokens(["<|user|>"]).save(tmp_path / "more")
    more = json.loads((tmp_path / "more" / "tokenizer_config.json").read_text())
    assert {key: more[key] for key in settings} == settings


@pytest.mark.parametrize(
    "cls", ["LlamaTokenizerFast", "LlamaTokenizer", "GemmaTokenizerFast", "PreTrainedTokenizerFast"]
)
def test_save_keeps_what_transformers_reads_of_the_folder(bpe, tmp_path, cls):
    """A saved copy is a ``PreTrainedTokenizerFast``: it keeps the left padding a Llama-class folder
    had by default in ``transformers`` 4 (``wiola13m``'s), and the sep/cls/mask tokens the folder
    named. (``transformers`` 5 loads a ByteLevel file under a Llama class as its generic backend.)"""
    transformers = pytest.importorskip("transformers")
    roles = {"sep_token": "</s>", "cls_token": "<s>", "mask_token": "<unk>"}
    folder = _with_config(bpe, tmp_path / "tok", tokenizer_class=cls, **roles)
    t = load_tokenizer(folder)
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    assert t.special_tokens_map == {**specials, **roles}
    t.save(tmp_path / "saved")
    after = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert after.padding_side == ("right" if cls == "PreTrainedTokenizerFast" else "left"), cls
    assert {role: getattr(after, role) for role in roles} == roles, cls
    if int(transformers.__version__.split(".")[0]) < 5:
        before = transformers.AutoTokenizer.from_pretrained(folder)
        assert after.padding_side == before.padding_side, cls
    bad = _with_config(bpe, tmp_path / "bad", mask_token="<nope>")
    with pytest.raises(ValueError, match="its mask_token '<nope>' is not in the vocabulary"):
        load_tokenizer(bad)


def test_the_ends_match_transformers_4(bpe, tmp_path):
    """As ``transformers`` 4 (the ``wiola13m`` package's) encodes each case of ``END_FLAGS``;
    ``transformers`` 5 reads tokenizer.json's post-processor alone."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip(f"transformers {transformers.__version__}: the flags are the 4.x classes' (wiola13m pins 4.45)")
    for i, (cls, flags, _, _) in enumerate(END_FLAGS):
        folder = _with_config(bpe, tmp_path / str(i), tokenizer_class=cls, **flags)
        theirs = transformers.AutoTokenizer.from_pretrained(folder)(TEXT).input_ids
        assert load_tokenizer(folder).encode(TEXT) == theirs, (cls, flags)


def test_token_bytes_are_each_tokens_own_bytes(bpe):
    """A token's bytes, part of a character or not, join to the text's bytes: for tiktoken, for the
    same vocabulary as a ``tokenizer.json``, for a trained byte-level BPE, and for a byte-fallback
    vocabulary; special tokens give their text, and a vocabulary whose decoding does not tell a
    token's bytes gives ``None`` for a token that reads U+FFFD."""
    text = "Zoë 🦊 naïve — 東京 x's" + TEXT
    t = load_tokenizer("gpt2-32k")
    for tokenizer in (t, t.to_hf(), load_tokenizer(bpe)):
        ids = tokenizer.encode_batch([text])[0]
        pieces = [tokenizer.token_bytes(i) for i in ids]
        assert b"".join(pieces) == text.encode(), tokenizer
        assert any(p.decode("utf-8", errors="replace") == "\ufffd" for p in pieces), "part of a character"
    assert t.token_bytes(t.eos_token_id) == t.to_hf().token_bytes(t.eos_token_id) == b"<|endoftext|>"
    assert load_tokenizer(bpe).token_bytes(1) == b"<s>"

    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁a": 257}
    fallback = HFTok(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    fb = HFTokenizer(fallback, "fallback", {"unk_token": "<unk>"})
    assert [fb.token_bytes(1 + b) for b in b"\xe6\x9d\xb1"] == [b"\xe6", b"\x9d", b"\xb1"]
    assert fb.token_bytes(257) == b" a"
    plain = HFTok(models.WordLevel({"<unk>": 0, "x": 1, "\ufffd": 2}, unk_token="<unk>"))
    assert HFTokenizer(plain, "plain", {}).token_bytes(1) == b"x"
    assert HFTokenizer(plain, "plain", {}).token_bytes(2) is None


def test_ids_past_the_vocabulary_have_no_text_in_every_backend(bpe):
    """A model with padded embedding rows may sample an id past its tokenizer's: ``decode`` leaves
    it out (tiktoken itself raises a KeyError, ``tokenizers`` drops it) and it has no bytes, so a
    server's text, logprobs and /detokenize do not fail on it."""
    t = load_tokenizer("gpt2-32k")
    for tokenizer in (t, t.to_hf(), load_tokenizer(bpe)):
        n = tokenizer.vocab_size
        ids = tokenizer.encode_batch(["Once upon a time"])[0]
        assert tokenizer.decode([*ids[:2], n, n + 63, *ids[2:]]) == tokenizer.decode(ids), tokenizer
        assert tokenizer.decode([n]) == "" and tokenizer.token_bytes(n) is None, tokenizer
        assert tokenizer.decode([*ids, 2**40]) == tokenizer.decode(ids), tokenizer  # past uint32


def test_a_negative_id_is_refused_by_name_in_every_backend(bpe):
    """A negative id is no token (not a padded row): ``decode`` names it, as ``ValueError``,
    where tiktoken and ``tokenizers`` would raise ``OverflowError`` or ``KeyError``."""
    t = load_tokenizer("gpt2-32k")
    for tokenizer in (t, t.to_hf(), load_tokenizer(bpe)):
        with pytest.raises(ValueError, match=r"token id -1 is negative"):
            tokenizer.decode([5, -1])
        assert tokenizer.token_bytes(-1) is None, tokenizer


# ------------------------------------------------------- Metaspace and byte-fallback vocabularies
METASPACE_WORDS = ["▁t", "▁th", "▁the", "▁c", "▁ca", "▁caf", "▁café", "▁a", "▁an", "▁and"]
METASPACE_TEXTS = [
    "the café 🐉 the",
    " leading space and the café",
    "  two leading spaces, naïve Zoë — 東京",
    "tabs\tand\nnewlines 👩‍👩‍👧 ",
    "x",
]


def metaspace_tokenizer(style: str) -> HFTokenizer:
    """A small BPE in the ways Llama-style tokenizers spell text (``▁`` a space, ``<0xNN>`` a
    byte of a character the vocabulary lacks). ``style``: ``"llama2"`` (normalizer ``Prepend("▁")``
    and ``Replace(" ", "▁")``, decoder ``Replace``/``ByteFallback``/``Fuse``/``Strip``, lossless),
    ``"mistral"`` (a ``Metaspace`` pre-tokenizer, the same decoder) or ``"metaspace"`` (a
    ``Metaspace`` pre-tokenizer and decoder, no byte fallback)."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if style != "metaspace":
        vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", *"abcdefhilnorstwxé", *METASPACE_WORDS]:
        vocab.setdefault(piece, len(vocab))
    merges = [(w[:-1], w[-1]) for w in METASPACE_WORDS]
    bpe = HFTok(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=style != "metaspace"))
    fallback = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    if style == "llama2":
        bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        bpe.decoder = decoders.Sequence(fallback)
    else:
        bpe.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first")
        bpe.decoder = decoders.Sequence(fallback) if style == "mistral" else decoders.Metaspace("▁", "first")
    bpe.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return HFTokenizer(bpe, style, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("style", ["llama2", "mistral", "metaspace"])
def test_metaspace_byte_counts_sum_to_the_text(style):
    """A document's first token at its ``at_start`` length and the rest at their own sum to the
    UTF-8 bytes of its decoding, which for Llama-2's lossless tokenizer is the text: a byte token
    counts 1 byte (decoded alone it reads U+FFFD, 3), a ``▁`` within the text its space, the
    ``▁`` the tokenizer put before the first word none. Each token's own bytes join to the text
    with that first ``▁``'s space; special tokens count 0."""
    t = metaspace_tokenizer(style)
    within, first = t.token_byte_lengths(), t.token_byte_lengths(at_start=True)
    assert within[t.bos_token_id] == within[t.eos_token_id] == first[t.bos_token_id] == 0
    texts = METASPACE_TEXTS if style != "metaspace" else ["the café and the", " café", "an   x"]
    for text in texts:
        ids = t.encode_batch([text])[0]
        decoded = t.decode(ids)
        assert style != "llama2" or decoded == text, f"{text!r}: the test tokenizer is lossless"
        assert first[ids[0]] + sum(within[i] for i in ids[1:]) == len(decoded.encode()), (style, text)
        dropped = " " * (within[ids[0]] - first[ids[0]])  # the space of the tokenizer's first ▁
        assert b"".join(t.token_bytes(i) for i in ids) == (dropped + decoded).encode(), (style, text)
    if style != "metaspace":
        f0 = t._tok.token_to_id("<0xF0>")
        assert (within[f0], first[f0], t.token_bytes(f0)) == (1, 1, b"\xf0")
    the = t._tok.token_to_id("▁the")
    assert (within[the], first[the], t.token_bytes(the)) == (4, 3, b" the")


def test_special_ids_one_past_the_vocabulary_are_refused():
    tok = load_tokenizer("gpt2")
    assert tok.with_special_ids(eos_token_id=tok.vocab_size - 1).eos_token_id == tok.vocab_size - 1
    for role in ("bos", "eos", "pad"):
        with pytest.raises(ValueError, match=rf"{role}_token_id 50257 is outside 'gpt2''s 50257 ids"):
            tok.with_special_ids(**{f"{role}_token_id": tok.vocab_size})


# ------------------------------------------------------------ decoding a growing list of ids
def _byte_ids(t) -> list[int]:
    """The id of each of the 256 one-byte tokens of a byte-level tokenizer, by byte."""
    if isinstance(t, TiktokenTokenizer):
        return [t.encoding.encode_single_token(bytes([b])) for b in range(256)]
    return [t._tok.token_to_id(tok._bytes_to_unicode()[b]) for b in range(256)]


def _growing_lists(t, seed: int) -> list[list[int]]:
    """Id lists that take a decoding through what can happen to its text: a real text of
    characters of 1 to 4 bytes, random ids of the whole vocabulary (special and added ones
    included), one-byte tokens drawn mostly from 0x80-0xFF (every kind of malformed UTF-8:
    stray continuation bytes, characters cut short, overlong forms, surrogates, code points past
    U+10FFFF), ids past the vocabulary."""
    import random

    from tokenizers import decoders

    rng = random.Random(seed)
    text = "Zoë 🦊 naïve — 東京 x's don't . ?" + TEXT
    real = t.encode_batch([text])[0]
    n = t.vocab_size
    mixed = [rng.randrange(n + 8) for _ in range(300)]
    if isinstance(t, TiktokenTokenizer) or isinstance(t._tok.decoder, decoders.ByteLevel):
        by_byte = _byte_ids(t)
        mixed = [by_byte[rng.choice([rng.randrange(0x80, 0x100)] * 3 + [rng.randrange(0x80)])] for _ in range(400)]
        mixed += [
            rng.randrange(n + 8) if rng.random() < 0.3 else by_byte[rng.randrange(0x80, 0x100)] for _ in range(200)
        ]
    if isinstance(t, TiktokenTokenizer):
        added = [t.eos_token_id]
    else:
        added = sorted(t._tok.get_added_tokens_decoder())
    between = [rng.choice(added + real[:40]) for _ in range(200)]  # each added token beside text and bytes
    return [real, mixed, [rng.randrange(n) for _ in range(200)], between]


def _added_tokens_bpe(bpe: Path) -> HFTokenizer:
    """The trained byte-level BPE with added tokens that ``tokenizers``' ``ByteLevel`` decoder reads
    differently: ``Ã日`` (a character outside the 256: its spelling's UTF-8), ``ÿé`` (two of the
    256: bytes 0xFF 0xE9, not UTF-8), and a special one."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTok

    inner = HFTok.from_file(str(bpe / "tokenizer.json"))
    inner.add_tokens([AddedToken("Ã日", special=False), "日本", "ÿé"])
    inner.add_special_tokens(["<|x|>"])
    return HFTokenizer(inner, "added", {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("kind", ["gpt2-32k", "gpt2", "gpt2-32k to_hf", "bpe added", "bpe clean-up", "llama2"])
def test_decoding_equals_decode_after_every_id(bpe, kind):
    """``decoding().add`` returns exactly ``decode`` of the ids added so far, after every id: the
    kept text of a byte-level tokenizer (tiktoken; ``tokenizers``' ``ByteLevel``, whose
    ``from_utf8_lossy`` replaces the same maximal parts as Python's UTF-8 decoder; with and without
    the clean-up of spaces) and the whole decoding of any other (Llama-2's byte fallback)."""
    from wiola.tokenizer import ByteDecoding

    if kind == "bpe added":
        t = _added_tokens_bpe(bpe)
    elif kind == "bpe clean-up":
        t = load_tokenizer(bpe)
        t.clean_up_spaces = True
    elif kind == "llama2":
        t = metaspace_tokenizer("llama2")
    else:
        t = load_tokenizer(kind.split()[0])
        t = t.to_hf() if kind.endswith("to_hf") else t
    assert isinstance(t.decoding(), ByteDecoding) == (kind != "llama2"), kind
    for seed, ids in enumerate(_growing_lists(t, 0)):
        d = t.decoding()
        for i, token in enumerate(ids):
            got = d.add(token)
            assert got == t.decode(ids[: i + 1]), (kind, seed, i, ids[max(0, i - 6) : i + 1])
        assert d.ids == ids


def test_a_decoding_refuses_a_negative_id_and_keeps_its_text(bpe):
    """A negative id raises ``decode``'s ``ValueError`` and is not added: the next id goes on from
    the text before it (a character cut short stays pending across the refusal)."""
    g = load_tokenizer("gpt2-32k")
    for t in (g, g.to_hf(), load_tokenizer(bpe), metaspace_tokenizer("llama2")):
        ids = t.encode_batch(["é x"])[0]
        first = _byte_ids(t)[0xC3] if t.name != "llama2" else ids[0]
        d = t.decoding()
        d.add(first)
        with pytest.raises(ValueError, match=r"token id -1 is negative"):
            d.add(-1)
        assert d.ids == [first], t
        rest = [_byte_ids(t)[0xA9]] if t.name != "llama2" else ids[1:2]
        assert d.add(rest[0]) == t.decode([first, *rest]), t
