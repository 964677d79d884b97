"""Tokenizers: one interface (``Tokenizer``) over two backends.

- ``TiktokenTokenizer``: GPT-2's byte-level BPE through tiktoken, ``gpt2`` (50,257 tokens) and
  ``gpt2-32k`` (32,000), named in a checkpoint's ``config.json``.
- ``HFTokenizer``: any Hugging Face ``tokenizer.json`` (Wiola13M's TinyStories BPE, Llama-2's, one
  trained with ``train_tokenizer``), its special tokens read from ``tokenizer_config.json`` /
  ``special_tokens_map.json`` as ``transformers`` reads them.

``load_tokenizer`` takes a name, a folder or a ``tokenizer.json``. Every tokenizer has a ``name``
and a ``fingerprint`` (sha256 of what decides its ids), encodes and decodes, and saves itself.

``gpt2-32k`` keeps GPT-2's first 31,999 ranks (the 256 byte tokens and the first merges) and
puts ``<|endoftext|>`` at 31,999: lossless on any text, and the vocabulary of the 13m preset.

GPT-2's ranks come from, in order: ``bpe_file=``; the ``WIOLA_BPE_FILE`` environment variable;
the copy bundled in ``wiola/assets/gpt2.tiktoken`` (checked by its sha256); tiktoken's own
download. So the tokenizer works without network out of the box.
"""

from __future__ import annotations

import codecs
import copy
import functools
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------------------ the interface
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # Wiola13M's, ids 0..3 in a trained tokenizer
SPECIAL_ROLES = ("unk_token", "bos_token", "eos_token", "pad_token")
# transformers' other named special tokens: read from the files, written back by save and shown
# to a chat template (wiola only uses the ids of SPECIAL_ROLES).
OTHER_ROLES = ("sep_token", "cls_token", "mask_token")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a template; 4.x keeps it in the config
# transformers' tokenizer classes that rebuild tokenizer.json's post-processor from the config's
# add_bos_token / add_eos_token when they load (their defaults: True, False), whatever the file says.
BOS_EOS_FLAG_CLASSES = frozenset(
    f"{name}{fast}" for name in ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer") for fast in ("", "Fast")
)
# transformers' clean_up_tokenization, in order: what decode does to a tokenizer.json tokenizer's
# text where tokenizer_config.json sets clean_up_tokenization_spaces (the ONNX export's standalone
# runner, wiola/export/runner.py, holds the same table: tests/test_export_onnx.py compares them).
CLEAN_UP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip
# tokenizer_config.json settings a saved tokenizer carries on as they were read (transformers reads
# them for padding and truncation; the ids themselves do not depend on them).
CARRIED_SETTINGS = ("model_max_length", "padding_side", "truncation_side")
# The padding side of transformers' tokenizer classes whose default is left: a folder naming one
# of them without a padding_side pads on the left, which its saved copy (PreTrainedTokenizerFast,
# right by default) keeps by writing padding_side.
LEFT_PADDING_CLASSES = frozenset(
    f"{name}{fast}"
    for name in ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer", "CohereTokenizer", "XLNetTokenizer")
    for fast in ("", "Fast")
)


def read_chat_template(directory: str | os.PathLike) -> str | None:
    """The Jinja chat template saved in ``directory`` (``chat_template.jinja``, else the
    ``chat_template`` string of ``tokenizer_config.json``), or None. Raises ``ValueError`` for a
    corrupt config or a template that is not one string (a list of named templates included)."""
    directory = Path(directory)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text()
    path = directory / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path} is not a JSON object: {e}") from e
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be one Jinja string, got {type(template).__name__}")
    return template


class Tokenizer:
    """Text <-> token ids, as the rest of wiola needs it.

    Attributes: ``name``; ``vocab_size`` (ids are ``0 .. vocab_size - 1``; a model may have more
    rows); ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (``None`` when the tokenizer has none);
    ``chat_template``: the Jinja chat template saved with it (``wiola.chat``), None when it has none.
    """

    name: str
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        """A prompt's ids: special-token text (``<s>``, ``<|endoftext|>``) becomes its id, and the
        tokenizer's own framing (a leading ``<s>``, if its ``tokenizer.json`` adds one) is added,
        as ``transformers``' ``tokenizer(text)`` does."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        """Documents' ids: special-token text stays plain text, no framing (training data)."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included. An id past ``vocab_size`` (a model with
        padded embedding rows may sample one) has no text and is left out, in every backend; a
        negative id is no token at all: ``ValueError`` naming it."""
        raise NotImplementedError

    def _decodable(self, ids: list[int]) -> list[int]:
        """``ids`` without those past ``vocab_size`` (``decode``'s rule); ``ValueError`` on a
        negative one, which no backend has a text for (tiktoken and ``tokenizers`` would raise
        ``KeyError``/``OverflowError``)."""
        # map, min and max loop in C: a stream decoding its whole text at every token
        # (wiola.text_stream) calls this on thousands of ids a token
        ids = list(map(int, ids))
        if not ids:
            return ids
        if min(ids) < 0:
            i = next(i for i in ids if i < 0)
            raise ValueError(f"token id {i} is negative: tokenizer {self.name!r} has ids 0 to {self.vocab_size - 1}")
        return ids if max(ids) < self.vocab_size else [i for i in ids if i < self.vocab_size]

    def decoding(self) -> Decoding:
        """An empty ``Decoding``: ``decode`` of a list of ids that grows one id at a time, kept up
        to date (``wiola.text_stream`` streams a sequence's text through one). This base decodes
        the whole list at every id; a byte-level tokenizer keeps its text as it grows."""
        return Decoding(self)

    def token_byte_lengths(self, at_start: bool = False) -> list[int]:
        """The UTF-8 bytes each id adds to a text (``vocab_size`` entries); special tokens count 0.

        ``at_start``: the bytes as a text's first token. They differ only for a Metaspace
        vocabulary (Llama-2's, Mistral's: ``▁`` spells a space), whose tokenizer puts a ``▁``
        before the first word that the text does not have and whose decoder drops the space it
        stands for there; the other tokens of a text count that space. So a text's first token
        at its ``at_start`` length plus the rest at theirs sum to the UTF-8 bytes of its decoding.
        """
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes one token stands for (a special token: its text's UTF-8), which may be part of
        a character; ``None`` where the tokenizer's decoding does not tell them (a token whose text
        alone reads U+FFFD, or an id past ``vocab_size``). This base reads them from ``decode``;
        byte-level vocabularies override it."""
        text = self.decode([token])
        return None if "\ufffd" in text else text.encode("utf-8")

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of everything that decides the ids: a changed tokenizer has another one."""
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Write the tokenizer's files into ``directory``; returns what ``config.json`` records."""
        raise NotImplementedError

    @property
    def document_prefix(self) -> list[int]:
        """The ids put before every training document: ``<s>`` (or ``<|endoftext|>`` without one)."""
        first = self.bos_token_id if self.bos_token_id is not None else self.eos_token_id
        if first is None:
            raise ValueError(f"tokenizer {self.name!r} has neither a bos nor an eos token to separate documents")
        return [first]

    @property
    def document_suffix(self) -> list[int]:
        """The ids put after every training document: ``</s>`` when it differs from the prefix."""
        eos = self.eos_token_id
        return [eos] if eos is not None and self.bos_token_id is not None and eos != self.bos_token_id else []

    def with_special_ids(
        self, bos_token_id: int | None = None, eos_token_id: int | None = None, pad_token_id: int | None = None
    ) -> Tokenizer:
        """A copy whose bos/eos/pad ids are those given (a checkpoint's ``config.json`` wins over
        the tokenizer's files, as in ``transformers``' generation); ``None`` keeps the tokenizer's."""
        out = copy.copy(self)
        for role, value in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if value is not None:
                if not 0 <= value < self.vocab_size:
                    raise ValueError(f"{role}_token_id {value} is outside {self.name!r}'s {self.vocab_size} ids")
                setattr(out, f"{role}_token_id", value)
        return out

    def check_fits(self, model_vocab_size: int) -> None:
        """``ValueError`` when this tokenizer has more ids than the model's ``model_vocab_size``
        embedding rows, in ``check_ids``' words: its higher ids would otherwise fail only once some
        text (a prompt, a whole data set) is tokenised. Fewer ids are fine (padded embedding rows,
        as the published Wiola13M has); what a model generates past them has no text."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"tokenizer {self.name!r} has {self.vocab_size:,} ids, more than the model's vocabulary of "
                f"{model_vocab_size:,}: this tokenizer does not belong to this model"
            )

    def check_ids(self, ids: list[int], model_vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first id the model has no embedding row for."""
        bad = [i for i in ids if not 0 <= i < model_vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} from tokenizer {self.name!r} ({self.vocab_size:,} ids) is outside the model's "
                f"vocabulary of {model_vocab_size:,}: this tokenizer does not belong to this model"
            )

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens' text by role (``bos_token``, ``eos_token``, ...), as ``transformers``'
        ``special_tokens_map`` gives them for this tokenizer's saved folder: what a chat template
        sees (``wiola.chat.render_chat``). Roles the tokenizer lacks are left out."""
        ids = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": getattr(self, "unk_token_id", None),
            "pad_token": self.pad_token_id,
        }
        return {role: self.decode([i]) for role, i in ids.items() if i is not None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(Tokenizer):
    """``gpt2`` / ``gpt2-32k`` (``get_encoding``); ``<|endoftext|>`` is eos, there is no bos or pad."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        self.name, self.vocab_size, self.eos_token_id = encoding.name, encoding.n_vocab, encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def encode_batch(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(self._decodable(ids))  # tiktoken raises on the rest

    def token_bytes(self, token: int) -> bytes | None:
        return self.encoding.decode_single_token_bytes(token) if 0 <= token < self.vocab_size else None

    def decoding(self) -> Decoding:
        """tiktoken's ``decode`` is the UTF-8 decoding (U+FFFD for what is not UTF-8) of its ids'
        bytes, special tokens' text included: a ``ByteDecoding``."""
        return ByteDecoding(self, self.encoding.decode_single_token_bytes)

    def token_byte_lengths(self, at_start: bool = False) -> list[int]:
        enc = self.encoding
        special = {enc.encode_single_token(s) for s in enc.special_tokens_set}
        return [0 if i in special else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]

    @functools.cached_property
    def fingerprint(self) -> str:
        enc = self.encoding
        h = hashlib.sha256(f"tiktoken {enc.name} {enc._pat_str} {sorted(enc._special_tokens.items())}".encode())
        for token, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
        return h.hexdigest()

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """``<|endoftext|>`` as bos, eos and unk, as in the exported folder (``to_hf``); a bos id
        set by a checkpoint (``with_special_ids``) is the bos."""
        eot = self.decode([self.eos_token_id])
        return {"bos_token": self.decode(self.document_prefix), "eos_token": eot, "unk_token": eot}

    def save(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Nothing but the name goes to ``config.json``; a chat template goes to ``tokenizer_config.json``."""
        if self.chat_template is not None:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            config = {"chat_template": self.chat_template}
            (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return {"tokenizer": self.name}

    def to_hf(self) -> HFTokenizer:
        """The same tokenizer as a ``tokenizers`` byte-level BPE (for export to ``transformers``):
        GPT-2's pre-tokenizer regex, and each rank's merge recovered by running BPE below that rank."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTok

        ranks = self.encoding._mergeable_ranks
        to_str = _bytes_to_unicode()
        text = lambda b: "".join(to_str[x] for x in b)
        merges = []
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            if len(token) > 1:
                left, right = _bpe_below(ranks, token, rank)
                merges.append((text(left), text(right)))
        tok = HFTok(models.BPE({text(b): r for b, r in ranks.items()}, merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(self.encoding._pat_str), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(sorted(self.encoding._special_tokens, key=self.encoding._special_tokens.get))
        eot = self.encoding.decode([self.eos_token_id])
        out = HFTokenizer(tok, self.name, {"bos_token": eot, "eos_token": eot, "unk_token": eot})
        out.chat_template = self.chat_template
        return out


def _bpe_below(ranks: dict[bytes, int], token: bytes, max_rank: int) -> tuple[bytes, bytes]:
    """The two pieces tiktoken's BPE reaches on ``token`` using merges of rank below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        found = [(ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
        rank, i = min(found)
        if rank >= max_rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank {max_rank} ({token!r}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


class Decoding:
    """``tokenizer.decode(ids)`` of a list of ids that grows one id at a time: ``add(token)``
    appends it and returns the text of every id added so far, exactly what ``decode`` gives for
    ``ids`` (the list added). This one decodes the whole list at every id (any tokenizer);
    ``ByteDecoding`` keeps the text of a byte-level tokenizer as it grows. A token that ``decode``
    refuses (a negative id: ``ValueError``) is not added."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def add(self, token: int) -> str:
        text = self.tokenizer.decode([*self.ids, token])
        self.ids.append(token)
        return text


class ByteDecoding(Decoding):
    """The ``Decoding`` of a tokenizer whose ``decode`` is the UTF-8 decoding, with U+FFFD for
    each maximal part that is not UTF-8, of the concatenation of its ids' bytes (``token_bytes``
    of each id below ``vocab_size``; the ids past it have no text), then ``finish`` applied to the
    whole text (the clean-up of spaces of some ``tokenizer.json`` folders; none by default).

    The bytes go through Python's incremental UTF-8 decoder: the text of the bytes it has finished
    is kept, and the at most 3 bytes of a character still incomplete are decoded, alone, at each
    add (one U+FFFD, as ``decode`` gives while the character is incomplete). So an add costs the
    id's bytes and a copy of the text, not a decoding of every id (tests/test_tokenizer.py
    compares every add against ``decode``, through every kind of malformed UTF-8)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        token_bytes: Callable[[int], bytes | None],
        finish: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self._bytes, self._finish = token_bytes, finish
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._done = ""  # the text of the bytes the UTF-8 decoder has finished

    def add(self, token: int) -> str:
        kept = self.tokenizer._decodable([token])  # ValueError on a negative id; [] past vocab_size
        if kept:
            data = self._bytes(kept[0])
            if data:
                self._done += self._utf8.decode(data)
        self.ids.append(token)
        pending = self._utf8.getstate()[0]
        text = self._done + pending.decode("utf-8", "replace") if pending else self._done
        return text if self._finish is None else self._finish(text)


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies are spelled in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of ``_bytes_to_unicode``: a byte-level spelling's character -> its byte."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level(spell: str) -> bytes | None:
    """The bytes of a byte-level spelling, one a character (``_bytes_to_unicode``); None where a
    character is not one of the 256."""
    byte_of = _unicode_to_bytes()
    return bytes(byte_of[c] for c in spell) if all(c in byte_of for c in spell) else None


def _template_bos_eos(tok: Any, specials: dict[str, str | None], settings: dict[str, Any], file: Path) -> None:
    """Set ``tok``'s post-processor as transformers' ``BOS_EOS_FLAG_CLASSES`` rebuild it on load:
    ``<bos> $A <eos>`` with each end present where ``add_bos_token`` (default True) /
    ``add_eos_token`` (default False) says, so that ``encode`` adds what their ``tokenizer(text)``
    adds. ``ValueError`` for a flag whose token is not set or not in the vocabulary."""
    from tokenizers import processors

    ends = []
    for role, flag, default in (("bos_token", "add_bos_token", True), ("eos_token", "add_eos_token", False)):
        if not settings.get(flag, default):
            continue
        text = specials.get(role)
        token_id = None if text is None else tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"{file.parent}: {flag} is set but its {role} {text!r} is not in the vocabulary")
        ends.append((role, text, token_id))
    bos = [t for r, t, _ in ends if r == "bos_token"]
    eos = [t for r, t, _ in ends if r == "eos_token"]
    single = [*(f"{t}:0" for t in bos), "$A:0", *(f"{t}:0" for t in eos)]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=[(t, i) for _, t, i in ends]
    )


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (any ``tokenizer.json``) and its special tokens.

    ``specials`` maps ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` to token text.
    Raises ``ValueError`` for a special token the vocabulary does not hold.
    """

    def __init__(self, tok: Any, name: str, specials: dict[str, str | None], clean_up_spaces: bool = False) -> None:
        self._tok = tok
        self._plain = tok.__class__.from_str(tok.to_str())
        self._plain.encode_special_tokens = True  # documents' "<s>" text is text, not a control token
        self.name, self.vocab_size, self.clean_up_spaces = (
            name,
            tok.get_vocab_size(with_added_tokens=True),
            clean_up_spaces,
        )
        self.unk_token_id = None
        self.carried: dict[str, Any] = {}  # CARRIED_SETTINGS read from the folder, written back by save
        self.other_specials: dict[str, str] = {}  # OTHER_ROLES' text read from the folder, saved back
        for role in SPECIAL_ROLES:
            text = specials.get(role)
            if text is None:
                continue
            token_id = tok.token_to_id(text)
            if token_id is None:
                raise ValueError(f"tokenizer {name!r}: its {role} {text!r} is not in the vocabulary")
            setattr(self, f"{role}_id", token_id)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> HFTokenizer:
        """Read ``tokenizer.json`` (a folder holding it, or the file) and, beside it,
        ``tokenizer_config.json`` and ``special_tokens_map.json`` (the map wins, as in ``transformers``).

        Raises ``FileNotFoundError`` when ``tokenizer.json`` is missing, ``ValueError`` when a file is corrupt.
        """
        from tokenizers import Tokenizer as HFTok

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: no tokenizer.json to read")
        try:
            tok = HFTok.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{file} is not a valid tokenizers file: {e}") from e
        settings: dict[str, Any] = {}
        for extra in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
            if (file.parent / extra).is_file():
                try:
                    data = json.loads((file.parent / extra).read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{file.parent / extra} is not valid JSON: {e}") from e
                if not isinstance(data, dict):
                    raise ValueError(f"{file.parent / extra} does not hold a JSON object")
                settings.update(data)
        specials = {role: _token_text(settings.get(role)) for role in SPECIAL_ROLES}
        if settings.get("tokenizer_class") in BOS_EOS_FLAG_CLASSES:
            _template_bos_eos(tok, specials, settings, file)
        name = file.parent.name if file.name == TOKENIZER_FILE else file.stem
        out = cls(tok, name, specials, bool(settings.get("clean_up_tokenization_spaces", False)))
        out.carried = {key: settings[key] for key in CARRIED_SETTINGS if key in settings}
        if "padding_side" not in out.carried and settings.get("tokenizer_class") in LEFT_PADDING_CLASSES:
            out.carried["padding_side"] = "left"
        for role in OTHER_ROLES:
            text = _token_text(settings.get(role))
            if text is not None:
                if tok.token_to_id(text) is None:
                    raise ValueError(f"tokenizer {name!r}: its {role} {text!r} is not in the vocabulary")
                out.other_specials[role] = text
        out.chat_template = read_chat_template(file.parent)
        return out

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str], *, num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(self._decodable(ids), skip_special_tokens=False)
        return self._clean_up(text) if self.clean_up_spaces else text

    @staticmethod
    def _clean_up(text: str) -> str:
        for a, b in CLEAN_UP_REPLACEMENTS:
            text = text.replace(a, b)
        return text

    def decoding(self) -> Decoding:
        """A byte-level vocabulary's ``decode`` (``decoders.ByteLevel``: Wiola13M's, GPT-2's) joins
        the bytes of every token, added ones included (``_level_bytes``), and decodes them as UTF-8
        with U+FFFD for each maximal part that is not (Rust's ``from_utf8_lossy``, Python's
        ``"replace"``), then cleans up spaces where the folder says so: a ``ByteDecoding``, the
        clean-up applied to the whole text at each id as ``decode`` applies it. Other decoders
        (Metaspace, byte fallback, WordPiece): the base's whole decoding at every id."""
        from tokenizers import decoders

        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return Decoding(self)
        return ByteDecoding(self, self._level_bytes, self._clean_up if self.clean_up_spaces else None)

    def _level_bytes(self, token: int) -> bytes | None:
        """What ``tokenizers``' ``ByteLevel`` decoder makes of id ``token`` (below ``vocab_size``):
        its spelling one byte a character (``_bytes_to_unicode``) where every character is one of
        the 256, else the spelling's UTF-8 (an added token such as ``日本``); None for an id with
        no token. Kept per id once read."""
        cache = self.__dict__.setdefault("_level_cache", {})
        if token not in cache:
            spell = self._tok.id_to_token(token)
            cache[token] = None if spell is None else _byte_level(spell) or spell.encode()
        return cache[token]

    @property
    def decode_reach(self) -> int:
        """How many characters at the end of ``decode(ids)`` ``decode(ids + more)`` may rewrite:
        the clean-up's longest patterns (``" n't"``, ``" 're"``) are 4 characters, so one that
        later ids complete begins within the last 3; without the clean-up decoding only appends."""
        return 3 if self.clean_up_spaces else 0

    def _special_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def _byte_fallback(self) -> bool:
        return bool(getattr(self._tok.model, "byte_fallback", False))

    @functools.cached_property
    def _spelled_steps(self) -> list[dict[str, Any]] | None:
        """The decoder's steps, in order, when a token's bytes follow from its spelling through
        them (Llama-2's ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``, ``Strip``, or a
        ``Metaspace`` decoder); None for any other decoder (byte-level vocabularies are read
        apart, WordPiece and the rest through ``decode``)."""

        def flat(step: dict[str, Any]) -> list[dict[str, Any]]:
            return [s for inner in step["decoders"] for s in flat(inner)] if step["type"] == "Sequence" else [step]

        decoder = json.loads(self._tok.to_str()).get("decoder")
        if decoder is None:
            return None
        steps, fused = flat(decoder), False
        for step in steps:
            kind = step["type"]
            if kind not in ("Replace", "ByteFallback", "Fuse", "Strip", "Metaspace") or (
                kind == "Replace" and "String" not in step["pattern"]
            ):
                return None
            if kind == "Strip" and fused and step["stop"]:  # strips the end of the whole text: no one token's
                return None
            fused = fused or kind == "Fuse"
        return steps

    def _spelled_bytes(self, token: int, at_start: bool) -> bytes:
        """The bytes of ``token`` (not an added token) through ``_spelled_steps``: within a text,
        or as its first token (``at_start``), where ``Strip`` once the tokens are fused and a
        ``Metaspace`` decoder drop the space of the ``▁`` the tokenizer put before the first word."""
        out = self._tok.id_to_token(token).encode()
        fused = False
        for step in self._spelled_steps or []:
            kind = step["type"]
            if kind == "Replace":
                out = out.replace(step["pattern"]["String"].encode(), step["content"].encode())
            elif kind == "ByteFallback" and (byte := re.fullmatch(rb"<0x([0-9A-Fa-f]{2})>", out)):
                out = bytes([int(byte[1], 16)])
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip" and (at_start or not fused):  # fused, it strips the text's ends only
                content = step["content"].encode()
                for _ in range(step["start"]):
                    out = out.removeprefix(content)
                for _ in range(0 if fused else step["stop"]):
                    out = out.removesuffix(content)
            elif kind == "Metaspace":
                mark = step["replacement"].encode()
                scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
                # tokenizers' Metaspace decoder drops every mark of the first token where it prepends one
                out = out.replace(mark, b"" if at_start and scheme != "never" else b" ")
        return out

    def token_bytes(self, token: int) -> bytes | None:
        """A byte-level vocabulary's token (GPT-2's, Wiola13M's) is spelled one character a byte
        (``_bytes_to_unicode``); a Metaspace or byte-fallback one (Llama-2's) spells a space
        ``▁`` and a byte ``<0xNN>`` (``_spelled_steps``): their bytes are read from the spelling,
        part of a character or not, a leading ``▁`` a space. Added tokens and other
        vocabularies: the base's."""
        from tokenizers import decoders

        if not 0 <= token < self.vocab_size:
            return None
        spell = self._tok.id_to_token(token)
        if spell is not None and token not in self._tok.get_added_tokens_decoder():
            if isinstance(self._tok.decoder, decoders.ByteLevel):
                if (spelled := _byte_level(spell)) is not None:
                    return spelled
            elif self._spelled_steps is not None:
                return self._spelled_bytes(token, at_start=False)
            elif self._byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", spell):
                return bytes([int(spell[3:5], 16)])
        return super().token_bytes(token)

    def token_byte_lengths(self, at_start: bool = False) -> list[int]:
        """Byte-level and Metaspace or byte-fallback vocabularies (``token_bytes``): read from each
        token's spelling, since decoding a token alone turns a byte that is part of a character into
        U+FFFD's 3 bytes and drops a leading ``▁``'s space (Llama-2's ``Strip`` decoder). Added
        tokens and other vocabularies: the bytes of each token decoded alone."""
        from tokenizers import decoders

        special = self._special_ids()
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            width = {c: 1 for c in _bytes_to_unicode().values()}
            spell = self._tok.id_to_token
            return [
                0 if i in special else sum(width.get(c, len(c.encode())) for c in spell(i))
                for i in range(self.vocab_size)
            ]
        added = self._tok.get_added_tokens_decoder()

        def length(i: int) -> int:
            if i in special:
                return 0
            if self._spelled_steps is not None and i not in added and self._tok.id_to_token(i) is not None:
                return len(self._spelled_bytes(i, at_start))
            return len(self._tok.decode([i]).encode())

        return [length(i) for i in range(self.vocab_size)]

    def _specials(self) -> dict[str, str | None]:
        return {
            role: None if getattr(self, f"{role}_id") is None else self._tok.id_to_token(getattr(self, f"{role}_id"))
            for role in SPECIAL_ROLES
        }

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {**{r: t for r, t in self._specials().items() if t is not None}, **self.other_specials}

    @functools.cached_property
    def fingerprint(self) -> str:
        ids = [getattr(self, f"{role}_id") for role in SPECIAL_ROLES]
        return hashlib.sha256(f"tokenizers {ids} {self.clean_up_spaces}\n{self._tok.to_str()}".encode()).hexdigest()

    def with_special_ids(
        self, bos_token_id: int | None = None, eos_token_id: int | None = None, pad_token_id: int | None = None
    ) -> Tokenizer:
        out = super().with_special_ids(bos_token_id, eos_token_id, pad_token_id)
        out.__dict__.pop("fingerprint", None)
        return out

    def with_added_tokens(self, tokens: list[str]) -> HFTokenizer:
        """A copy with ``tokens`` added as special tokens (each one id, never split; those it
        already has keep theirs): new ids follow the vocabulary, ``vocab_size`` grows."""
        from tokenizers import AddedToken

        tok = self._tok.__class__.from_str(self._tok.to_str())
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
        out = HFTokenizer(tok, self.name, self._specials(), self.clean_up_spaces)
        for role in ("bos", "eos", "pad"):  # ids a checkpoint's config set (with_special_ids) stay
            setattr(out, f"{role}_token_id", getattr(self, f"{role}_token_id"))
        out.chat_template, out.carried, out.other_specials = (
            self.chat_template,
            dict(self.carried),
            dict(self.other_specials),
        )
        return out

    def save(self, directory: str | os.PathLike) -> dict[str, Any]:
        """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, the files
        ``transformers.PreTrainedTokenizerFast.from_pretrained`` reads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        specials = self.special_tokens_map
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json's post-processor adds what it adds
            "clean_up_tokenization_spaces": self.clean_up_spaces,
            "model_max_length": 1 << 30,
            **self.carried,
            **specials,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)  # would win over the config's template
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (directory / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(specials, indent=2) + "\n")
        return {}


def load_tokenizer(spec: str | os.PathLike, bpe_file: str | None = None) -> Tokenizer:
    """A tokenizer by name (``gpt2``, ``gpt2-32k``) or path (a folder with ``tokenizer.json``, or the file).

    Raises ``ValueError`` for something that is neither, ``FileNotFoundError`` / ``ValueError``
    (see ``HFTokenizer.from_folder``) for a missing or corrupt file.
    """
    if str(spec) in ENCODINGS:
        return TiktokenTokenizer(get_encoding(str(spec), bpe_file))
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer.from_folder(path)
    raise ValueError(
        f"unknown tokenizer {str(spec)!r}: give {' or '.join(ENCODINGS)}, a folder holding tokenizer.json, or a tokenizer.json file"
    )


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, *, length: int | None = None, show_progress: bool = True
) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids on ``texts`` with ``tokenizers``.

    Ids 0..3 are Wiola13M's special tokens ``<unk> <s> </s> <pad>``, the next 256 the bytes; a
    prompt is encoded with a leading ``<s>``. Raises ``ValueError`` for a vocabulary too small
    to hold the specials and the 256 bytes.
    """
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    smallest = len(SPECIAL_TOKENS) + 256
    if vocab_size < smallest:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {smallest} ids")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    specials = dict(zip(SPECIAL_ROLES, SPECIAL_TOKENS))
    return HFTokenizer(tok, f"bpe-{tok.get_vocab_size()}", specials)
