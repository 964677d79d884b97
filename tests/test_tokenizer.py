"""gpt2 and gpt2-32k through tiktoken, offline from the rank file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wiola.tokenizer import encoding_for_vocab, get_encoding

RANKS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2.tiktoken"
if "WIOLA_BPE_FILE" not in os.environ and RANKS.exists():
    os.environ["WIOLA_BPE_FILE"] = str(RANKS)


def bpe_file() -> str:
    path = os.environ.get("WIOLA_BPE_FILE")
    if not path:
        pytest.skip("no GPT-2 rank file here: set WIOLA_BPE_FILE")
    return path


def test_gpt2_known_ids():
    enc = get_encoding("gpt2", bpe_file())
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


def test_gpt2_32k_is_lossless_and_fits_the_13m_vocab():
    enc = get_encoding("gpt2-32k", bpe_file())
    assert enc.n_vocab == 32000 and enc.eot_token == 31999
    texts = ["Once upon a time, Lily found a shiny red ball.", "naïve café — 東京 🚀 \x00\t\n", "x" * 300]
    full = get_encoding("gpt2", bpe_file())
    for text in texts:
        ids = enc.encode(text)
        assert max(ids) < 31999 and enc.decode(ids) == text
        assert len(ids) >= len(full.encode(text))
    assert enc.encode("<|endoftext|>", allowed_special="all") == [31999]
    assert encoding_for_vocab(32000, bpe_file()).name == "gpt2-32k"


def test_errors_name_the_problem(tmp_path):
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
