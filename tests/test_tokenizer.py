"""gpt2 and gpt2-32k through tiktoken, offline from the bundled (or a given) rank file."""

from __future__ import annotations

from pathlib import Path

import pytest

import wiola.tokenizer as tok
from wiola.tokenizer import encoding_for_vocab, get_encoding

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
