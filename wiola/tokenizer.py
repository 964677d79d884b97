"""GPT-2 byte-level BPE through tiktoken: ``gpt2`` (50,257 tokens) and ``gpt2-32k`` (32,000).

``gpt2-32k`` keeps GPT-2's first 31,999 ranks (the 256 byte tokens and the first merges) and
puts ``<|endoftext|>`` at 31,999: lossless on any text, and the vocabulary of the 13m preset.

GPT-2's ranks come from, in order: ``bpe_file=``; the ``WIOLA_BPE_FILE`` environment variable;
the copy bundled in ``wiola/assets/gpt2.tiktoken`` (checked by its sha256); tiktoken's own
download. So the tokenizer works without network out of the box.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import tiktoken

ENCODINGS = {"gpt2": 50257, "gpt2-32k": 32000}
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = "<|endoftext|>"
BUNDLED = Path(__file__).parent / "assets" / "gpt2.tiktoken"
BUNDLED_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def _load_rank_file(path: str | Path) -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as e:  # a foreign or corrupt file
        raise ValueError(f"could not read BPE ranks from {str(path)!r}: {e}") from e
    if len(ranks) != 50256:
        raise ValueError(f"{str(path)!r} holds {len(ranks)} ranks; GPT-2's rank file holds 50,256")
    return ranks


def _gpt2_ranks(bpe_file: str | None) -> dict[bytes, int]:
    path = bpe_file or os.environ.get("WIOLA_BPE_FILE")
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"BPE rank file {path!r} (from bpe_file or WIOLA_BPE_FILE) does not exist")
        return _load_rank_file(path)
    if BUNDLED.is_file() and hashlib.sha256(BUNDLED.read_bytes()).hexdigest() == BUNDLED_SHA256:
        return _load_rank_file(BUNDLED)
    try:
        return tiktoken.get_encoding("gpt2")._mergeable_ranks
    except Exception as e:
        raise RuntimeError(
            f"cannot load GPT-2's BPE ranks: the bundled {BUNDLED} is missing or altered and tiktoken could not download them "
            f"({type(e).__name__}: {e}). Without network, set WIOLA_BPE_FILE (or pass bpe_file=) "
            "to a gpt2.tiktoken rank file."
        ) from e


@functools.lru_cache(maxsize=8)
def get_encoding(name: str = "gpt2-32k", bpe_file: str | None = None) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` called ``name`` (``"gpt2"`` or ``"gpt2-32k"``).

    Raises ``ValueError`` for an unknown name, ``RuntimeError`` when neither tiktoken's
    download nor a local rank file (``bpe_file`` or ``WIOLA_BPE_FILE``) works.
    """
    if name not in ENCODINGS:
        raise ValueError(f"unknown encoding {name!r}; choose one of {sorted(ENCODINGS)}")
    ranks = _gpt2_ranks(bpe_file)
    eot = ENCODINGS[name] - 1
    if name == "gpt2-32k":
        ranks = {token: rank for token, rank in ranks.items() if rank < eot}
    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: eot})


def encoding_for_vocab(vocab_size: int, bpe_file: str | None = None) -> tiktoken.Encoding:
    """The encoding whose vocabulary is exactly ``vocab_size`` (32,000 or 50,257)."""
    for name, size in ENCODINGS.items():
        if size == vocab_size:
            return get_encoding(name, bpe_file)
    raise ValueError(
        f"no tokenizer has a vocabulary of {vocab_size} tokens; the model's vocab_size must be one of "
        f"{sorted(ENCODINGS.values())} ({', '.join(ENCODINGS)})"
    )
