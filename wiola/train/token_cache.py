"""The token cache: documents of a ``DataSource`` tokenised once into memmap shards.

Tokenisation uses the run's tokenizer (``--tokenizer``: ``gpt2``, ``gpt2-32k``, or a
``tokenizer.json``; default: the tiktoken encoding matching the model vocabulary). Every document
is framed by ``Tokenizer.document_prefix`` / ``document_suffix``: ``<|endoftext|>`` before it with
GPT-2's, ``<s> ... </s>`` with a tokenizer that has a bos token. It runs in batches behind a tqdm
bar on a terminal (a plain line every 30 s elsewhere) and is cached as memmap shards (uint16 for
up to 65,536 ids, uint32 beyond) plus a ``manifest.json`` (source fingerprint, tokenizer
fingerprint, counts), in a folder keyed by both: a second run opens the memmaps and skips
tokenisation; a changed tokenizer never reuses them.

Scoring needs the validation split alone (``prepare_val_data``, ``wiola eval``): it opens a
training run's cache when there is one, else tokenises that split only, into a folder of its own
(``<the training cache's folder>.val``) that ``prepare_data`` never opens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wiola.tokenizer import Tokenizer
from wiola.train.env import Progress
from wiola.train.sources import (
    EOT_TEXT,
    PIPELINE_VERSION,
    TEXT_SUFFIXES,
    DataSource,
    iter_documents,
    source_fingerprint,
)
from wiola.user_cache import user_cache_dir

SHARD_TOKENS = 1 << 28  # 256 Mi tokens = 512 MiB per uint16 shard
SPLITS = ("train", "val")
VAL_ONLY_SUFFIX = ".val"  # the folder of a cache of the validation split alone: <cache folder>.val


def default_cache_dir() -> Path:
    """Where token shards are kept: ``$WIOLA_CACHE`` (token shards only, ``~`` expanded), else
    ``wiola.user_cache.user_cache_dir()`` (``$WIOLA_CACHE_DIR``, ``$XDG_CACHE_HOME/wiola`` or
    ``~/.cache/wiola``), beside the C++ step's builds."""
    tokens_only = os.environ.get("WIOLA_CACHE")
    return Path(tokens_only).expanduser() if tokens_only else user_cache_dir()


@dataclass
class TokenSplit:
    """One split's tokens: uint16 memmap shards read as one sequence."""

    shards: list[np.ndarray]
    documents: int
    text_bytes: int  # UTF-8 bytes of the documents (without the separators)

    def __post_init__(self) -> None:
        self._ends = np.cumsum([len(s) for s in self.shards]) if self.shards else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64 (crossing shard boundaries if needed)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) are outside the split of {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self._ends, start, side="right"))
        offset = start - (int(self._ends[shard - 1]) if shard else 0)
        while filled < length:
            piece = self.shards[shard][offset : offset + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard, offset = shard + 1, 0
        return out

    def tokens(self) -> np.ndarray:
        """All tokens as one int64 array (small splits; tests and statistics)."""
        return self.read(0, len(self))


@dataclass
class TokenData:
    """Both splits of a tokenised source, and the manifest that describes them (the train split
    is empty, and absent from the manifest's ``splits``, in a cache of the validation split alone)."""

    train: TokenSplit
    val: TokenSplit
    manifest: dict[str, Any]
    directory: Path

    @property
    def tokenizer(self) -> str:
        """The tokenizer's name."""
        return self.manifest["tokenizer"]


class _ShardWriter:
    def __init__(self, directory: Path, split: str, shard_tokens: int) -> None:
        self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):04d}.bin"
                self._file = open(self.directory / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
                self._in_shard = 0
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            tokens[:take].tofile(self._file)
            self._in_shard += take
            self.shards[-1]["tokens"] += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _tokenize_split(
    docs: Iterator[str],
    total: int | None,
    tokenizer: Tokenizer,
    writer: _ShardWriter,
    *,
    num_threads: int,
    batch_docs: int,
    desc: str,
    progress: bool,
    log: Callable[[str], None] | None = None,
) -> tuple[int, int, int]:
    prefix, suffix = tokenizer.document_prefix, tokenizer.document_suffix
    dtype = token_dtype(tokenizer.vocab_size)
    n_docs = n_tokens = n_bytes = 0
    bar = Progress(total, desc, "doc", show=progress, log=log)  # a bar on a terminal, else a line every 30 s
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_docs, n_tokens, n_bytes
        if not batch:
            return
        encoded = tokenizer.encode_batch(batch, num_threads=num_threads)
        lengths = [len(prefix) + len(e) + len(suffix) for e in encoded]
        flat = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for e, n in zip(encoded, lengths):
            flat[pos : pos + len(prefix)] = prefix
            flat[pos + len(prefix) : pos + n - len(suffix)] = e
            flat[pos + n - len(suffix) : pos + n] = suffix
            pos += n
        writer.write(flat)
        n_docs += len(batch)
        n_tokens += len(flat)
        n_bytes += sum(len(d.encode("utf-8")) for d in batch)
        bar.update(len(batch))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) >= batch_docs:
            flush()
    flush()
    writer.close()
    bar.close()
    return n_docs, n_tokens, n_bytes


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The shard dtype: uint16 for up to 65,536 ids, uint32 beyond."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _open_cache(directory: Path) -> TokenData:
    manifest = json.loads((directory / "manifest.json").read_text())
    dtype = np.dtype(manifest.get("dtype", "uint16"))
    splits = {}
    for split in SPLITS:
        info = manifest["splits"].get(split)
        if info is None:  # a cache of the validation split alone holds no train split
            splits[split] = TokenSplit([], 0, 0)
            continue
        shards = []
        for shard in info["shards"]:
            path = directory / shard["file"]
            if path.stat().st_size != dtype.itemsize * shard["tokens"]:
                raise ValueError(
                    f"token cache {directory} is damaged: {path.name} has the wrong size; delete the folder"
                )
            shards.append(np.memmap(path, dtype=dtype, mode="r") if shard["tokens"] else np.zeros(0, dtype))
        splits[split] = TokenSplit(shards, info["documents"], info["bytes"])
    return TokenData(splits["train"], splits["val"], manifest, directory)


def _cache_folder(source: DataSource, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None) -> tuple[Path, str]:
    """The training cache's folder for ``source`` and ``tokenizer``, and the source's fingerprint."""
    fingerprint = source_fingerprint(source)
    slug = {"hf": "tinystories", "sample": "sample"}.get(source.kind) or Path(source.name).name.replace(".", "_")[:40]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{fingerprint} {tokenizer.fingerprint}".encode()).hexdigest()
    name = re.sub(r"[^\w.-]", "_", tokenizer.name)[:40]
    return root / "tokens" / f"{slug}-{name}-{key[:16]}", fingerprint


def _open_if_cached(
    directory: Path, fingerprint: str, tokenizer: Tokenizer, splits: tuple[str, ...]
) -> TokenData | None:
    """The cache in ``directory`` when it holds ``splits`` of this source and tokenizer, else None."""
    if not (directory / "manifest.json").is_file():
        return None
    data = _open_cache(directory)
    manifest = data.manifest
    if (manifest.get("fingerprint"), manifest.get("tokenizer_fingerprint")) != (fingerprint, tokenizer.fingerprint):
        return None
    return data if set(splits) <= set(manifest["splits"]) else None


def prepare_data(
    source: DataSource,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike | None = None,
    *,
    splits: tuple[str, ...] = SPLITS,
    num_threads: int | None = None,
    batch_docs: int = 1024,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    log: Any = print,
) -> TokenData:
    """Tokenise ``source`` with ``tokenizer`` (or open the cache of an earlier run) and return its splits.

    The cache folder is ``cache_dir/tokens/<source>-<tokenizer>-<hash of both fingerprints>``; it
    is built in a temporary folder and renamed into place, so an interrupted run leaves no half
    cache. ``splits=("val",)`` (``prepare_val_data``) opens that cache when it is there (its train
    split comes along), else tokenises the validation split alone into ``<that folder>.val``: its
    ``TokenData.train`` is empty and its manifest's ``splits`` holds ``val`` only, so a request for
    both splits never takes it for a complete cache (nor opens its folder). Raises ``ValueError``
    when a split is empty.
    """
    if splits not in (SPLITS, ("val",)):
        raise ValueError(f"splits must be {SPLITS} or ('val',), got {splits!r}")
    directory, fingerprint = _cache_folder(source, tokenizer, cache_dir)
    data = _open_if_cached(directory, fingerprint, tokenizer, SPLITS)  # a complete cache serves either
    if data is None and splits != SPLITS:
        directory = directory.with_name(directory.name + VAL_ONLY_SUFFIX)
        data = _open_if_cached(directory, fingerprint, tokenizer, splits)
    if data is not None:
        log(f"tokens: cached in {directory} ({_counts(data, splits)})")
        return data
    t0 = time.time()
    data = _build_cache(
        directory, source, fingerprint, tokenizer, splits, num_threads, batch_docs, shard_tokens, progress, log
    )
    log(f"tokens: {_counts(data, splits)} with {tokenizer.name} in {time.time() - t0:.1f}s, cached in {directory}")
    return data


def prepare_val_data(
    source: DataSource, tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None, **options: Any
) -> TokenData:
    """``prepare_data`` of the validation split alone (``wiola eval``): the same tokens, without
    tokenising (or needing) the training split. The documents are those of
    ``iter_documents(source, "val")``: a held-out share is still chosen by reading every document
    in order. ``options``: ``prepare_data``'s keywords."""
    return prepare_data(source, tokenizer, cache_dir, splits=("val",), **options)


def _counts(data: TokenData, splits: tuple[str, ...]) -> str:
    """``"N train / M val"`` (the counts of ``splits``) for the cache's log line."""
    return " / ".join(f"{len(getattr(data, split)):,} {split}" for split in splits)


def _empty_split(source: DataSource, split: str, train_documents: int | None) -> str:
    """The message for a split without documents: a held-out split too small to get one says how
    many documents there are and what to pass; an empty text file says how documents are separated."""
    every = source.holdout_every
    if split == "val" and source.kind == "files" and not source.val_files:
        held = f"1 document in {every} is held out for validation (--val-fraction {source.val_fraction:g})"
        if train_documents is None:  # the validation split alone was asked for
            return (
                f"the val split of {source.describe()} holds no documents: {held}, and the files hold "
                f"fewer than {every}; pass --val-data FILE"
            )
        n = train_documents
        fraction = "" if n < 2 else f", or --val-fraction {1 / n:.10g} to hold out 1 of the {n}"
        return (
            f"the val split of {source.describe()} holds no documents: {held}, and the files hold {n}; "
            f"pass --val-data FILE{fraction}"
        )
    hint = ""
    text_files = [f for f in source.train_files + source.val_files if TEXT_SUFFIXES.get(f.suffix.lower()) == "text"]
    if source.kind == "files" and text_files:
        hint = f"; in a {text_files[0].suffix} file documents are separated by {EOT_TEXT} (a file without it is one document)"
    return f"the {split} split of {source.describe()} holds no documents (empty corpus){hint}"


def _build_cache(
    directory: Path,
    source: DataSource,
    fingerprint: str,
    tokenizer: Tokenizer,
    splits: tuple[str, ...],
    num_threads: int | None,
    batch_docs: int,
    shard_tokens: int,
    progress: bool,
    log: Any,
) -> TokenData:
    """Tokenise ``splits`` of ``source`` into ``directory`` (through a temporary folder) and open it."""
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot write the token cache under {directory.parent} ({e.strerror}): give a writable "
            "--cache-dir (or $WIOLA_CACHE_DIR)",
        ) from None
    threads = num_threads or min(8, os.cpu_count() or 1)
    written: dict[str, Any] = {}
    t0 = time.time()
    try:
        for split in splits:
            docs, total = iter_documents(source, split)
            writer = _ShardWriter(tmp, split, shard_tokens)
            n_docs, n_tokens, n_bytes = _tokenize_split(
                docs,
                total,
                tokenizer,
                writer,
                num_threads=threads,
                batch_docs=batch_docs,
                desc=f"tokenising {split} ({tokenizer.name})",
                progress=progress,
                log=log,
            )
            if n_docs == 0:
                raise ValueError(_empty_split(source, split, written.get("train", {}).get("documents")))
            written[split] = {"shards": writer.shards, "documents": n_docs, "tokens": n_tokens, "bytes": n_bytes}
        manifest = {
            "format": PIPELINE_VERSION,
            "source": source.describe(),
            "fingerprint": fingerprint,
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "document_prefix": tokenizer.document_prefix,
            "document_suffix": tokenizer.document_suffix,
            "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
            "splits": written,
            "seconds": round(time.time() - t0, 3),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _open_cache(directory)
