"""The data pipeline: documents -> tokens -> cached uint16 shards -> batches of T+1-token windows.

Sources (``--data``):
- ``None`` / ``"tinystories"``: ``roneneldan/TinyStories`` through ``datasets`` (train and
  validation splits); needs network (or the ``datasets`` cache).
- ``"sample"`` (or ``"sample:N"`` for N training stories, default 1000): the built-in generated
  corpus (``wiola.train.corpus``), no download.
- a path: text (``.txt``), JSON lines (``.jsonl``, ``.json`` lists), Parquet (``.parquet``)
  files, or a folder of them (searched recursively). In a text file, documents are separated by
  ``<|endoftext|>``; a file without that separator is one document. JSON and Parquet records
  carry their text in a ``text`` (or ``story``) field. The validation split is ``--val-data``
  when given; else the files of a folder whose names say ``val``/``valid``/``validation``; else
  every ``1/val_fraction``-th document.

Tokenisation uses the run's tokenizer (``--tokenizer``: ``gpt2``, ``gpt2-32k``, or a
``tokenizer.json``; default: the tiktoken encoding matching the model vocabulary). Every document
is framed by ``Tokenizer.document_prefix`` / ``document_suffix``: ``<|endoftext|>`` before it with
GPT-2's, ``<s> ... </s>`` with a tokenizer that has a bos token. It runs in batches behind a tqdm
bar and is cached as memmap shards (uint16 for up to 65,536 ids, uint32 beyond) plus a
``manifest.json`` (source fingerprint, tokenizer fingerprint, counts), in a folder keyed by both:
a second run opens the memmaps and skips tokenisation; a changed tokenizer never reuses them.

Batches: window ``k`` of a split is ``tokens[k·T : k·T + T + 1]`` (consecutive windows share one
token, so every token is a target exactly once per epoch). ``BatchStream`` draws windows in a
seeded per-epoch permutation (or in order), ``G = micro_batch × grad_accum × world_size`` per
optimizer step, and gives rank ``r`` the micro-batches ``(a·world + r)`` of that list: the ranks
see disjoint windows and the union over ranks does not depend on how the global batch is split.
Its position is one integer, saved in checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wiola.config import WiolaConfig
from wiola.tokenizer import Tokenizer
from wiola.train.env import TRAIN_EXTRA, require

PIPELINE_VERSION = 2  # part of the cache key: bump when tokenisation or the shard layout changes
TEXT_SUFFIXES = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
}
TEXT_FIELDS = ("text", "story")
EOT_TEXT = "<|endoftext|>"
VAL_NAMES = ("val", "valid", "validation", "dev", "test")
SHARD_TOKENS = 1 << 28  # 256 Mi tokens = 512 MiB per uint16 shard
DEFAULT_HF_DATASET = "roneneldan/TinyStories"


def default_cache_dir() -> Path:
    """``$WIOLA_CACHE`` or ``~/.cache/wiola``: where token shards are kept."""
    return Path(os.environ.get("WIOLA_CACHE") or Path.home() / ".cache" / "wiola")


# ------------------------------------------------------------------------------------- sources
@dataclass
class DataSource:
    """Where the documents of the train and validation splits come from."""

    kind: str  # "hf", "sample" or "files"
    name: str  # for messages and the manifest
    train_files: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)
    val_fraction: float = 0.01  # for "files" without a validation file: every round(1/f)-th document
    sample_size: tuple[int, int, int] = (1000, 100, 0)  # sample corpus: n_train, n_val, seed

    def describe(self) -> str:
        if self.kind == "files":
            val = f"{len(self.val_files)} validation file(s)" if self.val_files else f"1/{self.holdout_every} held out"
            return f"{self.name} ({len(self.train_files)} training file(s), {val})"
        return self.name

    @property
    def holdout_every(self) -> int:
        return max(2, round(1 / self.val_fraction))


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use {', '.join(sorted(TEXT_SUFFIXES))}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if not files:
        raise ValueError(f"{path}: the folder holds no {', '.join(sorted(TEXT_SUFFIXES))} files")
    return files


def _is_val_file(path: Path) -> bool:
    words = path.stem.lower().replace("-", "_").replace(".", "_").split("_")
    return any(w in VAL_NAMES for w in words)


def resolve_source(
    data: str | os.PathLike | None, val_data: str | os.PathLike | None = None, val_fraction: float = 0.01
) -> DataSource:
    """The ``DataSource`` for a ``--data`` value (see the module docstring).

    Raises ``FileNotFoundError`` for a path that does not exist and ``ValueError`` for an
    unsupported file or a folder with no data files, before anything is read.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if data is None or str(data).lower() in ("tinystories", DEFAULT_HF_DATASET.lower()):
        if val_data is not None:
            raise ValueError("--val-data needs --data PATH; TinyStories brings its own validation split")
        return DataSource("hf", DEFAULT_HF_DATASET)
    text = str(data).lower()
    if text == "sample" or text.startswith("sample:"):
        if val_data is not None:
            raise ValueError("--val-data needs --data PATH; the sample corpus brings its own validation split")
        n_train = 1000
        if text.startswith("sample:"):
            try:
                n_train = int(text.split(":", 1)[1])
            except ValueError:
                n_train = 0
            if n_train < 1:
                raise ValueError(f"--data {data!r}: expected sample:N with N a positive number of stories")
        return DataSource(
            "sample",
            f"sample corpus (wiola.corpus, {n_train} stories)",  # the module's old name: part of the cache key
            sample_size=(n_train, max(100, n_train // 10), 0),
        )
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data path {str(path)!r} does not exist; pass text/JSONL/Parquet files or a folder, "
            "'sample' for the built-in corpus, or 'tinystories'"
        )
    files = _data_files(path)
    if val_data is not None:
        val_path = Path(val_data).expanduser()
        if not val_path.exists():
            raise FileNotFoundError(f"validation data path {str(val_path)!r} does not exist")
        return DataSource("files", str(path), files, _data_files(val_path), val_fraction)
    if path.is_dir():
        val = [p for p in files if _is_val_file(p)]
        train = [p for p in files if not _is_val_file(p)]
        if val and train:
            return DataSource("files", str(path), train, val, val_fraction)
    return DataSource("files", str(path), files, [], val_fraction)


def _read_file(path: Path) -> Iterator[str]:
    kind = TEXT_SUFFIXES[path.suffix.lower()]
    if kind == "text":
        text = path.read_text(encoding="utf-8")
        for doc in text.split(EOT_TEXT) if EOT_TEXT in text else [text]:
            doc = doc.strip()
            if doc:
                yield doc
        return
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        column = next((c for c in TEXT_FIELDS if c in names), None)
        if column is None:
            raise ValueError(f"{path}: no text column; expected one of {TEXT_FIELDS}, found {names}")
        for batch in pf.iter_batches(columns=[column], batch_size=4096):
            for doc in batch.column(0).to_pylist():
                if doc and doc.strip():
                    yield doc.strip()
        return
    if kind == "json":
        records: Iterable[Any] = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json file must hold a list of records or strings")
    else:
        records = (json.loads(line) for line in path.open(encoding="utf-8") if line.strip())
    for i, record in enumerate(records):
        if isinstance(record, dict):
            text = next((record[c] for c in TEXT_FIELDS if c in record), None)
            if text is None:
                raise ValueError(f"{path}: record {i} has no text field; expected one of {TEXT_FIELDS}")
        else:
            text = record
        if not isinstance(text, str):
            raise ValueError(f"{path}: record {i} holds {type(text).__name__}, not a string")
        if text.strip():
            yield text.strip()


def _hf_split(name: str, split: str) -> Any:
    try:
        import datasets
    except Exception as e:  # not installed, or an incompatible huggingface_hub
        raise RuntimeError(
            f"cannot load {name}: the `datasets` package is not usable ({type(e).__name__}: {e}). "
            f"Install it ({TRAIN_EXTRA}), or train on local files with --data PATH "
            "(text/JSONL/Parquet files or a folder) or on the built-in sample corpus with --data sample."
        ) from e
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise RuntimeError(
            f"cannot load {name} (split {split!r}) through `datasets`: {type(e).__name__}: {e}. Without network, "
            "pass --data PATH (text/JSONL/Parquet files or a folder, e.g. TinyStories' parquet files) or "
            "--data sample for the built-in sample corpus."
        ) from e


def iter_documents(source: DataSource, split: str) -> tuple[Iterator[str], int | None]:
    """The documents of ``split`` (``"train"`` or ``"val"``) and their number when known."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if source.kind == "sample":
        from wiola.train.corpus import sample_corpus

        n_train, n_val, seed = source.sample_size
        train, val = sample_corpus(n_train, n_val, seed)
        docs = train if split == "train" else val
        return iter(docs), len(docs)
    if source.kind == "hf":
        ds = _hf_split(source.name, "train" if split == "train" else "validation")
        column = next((c for c in TEXT_FIELDS if c in ds.column_names), None)
        if column is None:
            raise ValueError(f"{source.name}: no text column; expected one of {TEXT_FIELDS}, found {ds.column_names}")
        return (d.strip() for d in ds[column] if d and d.strip()), len(ds)

    def from_files(files: list[Path], keep: Any) -> Iterator[str]:
        i = 0
        for path in files:
            for doc in _read_file(path):
                if keep(i):
                    yield doc
                i += 1

    every = source.holdout_every
    if source.val_files:
        return from_files(source.train_files if split == "train" else source.val_files, lambda i: True), None
    if split == "train":
        return from_files(source.train_files, lambda i: i % every != every - 1), None
    return from_files(source.train_files, lambda i: i % every == every - 1), None


def source_fingerprint(source: DataSource) -> str:
    """A hex digest that changes when the source's documents or split rule may have changed.

    Files are identified by resolved path, size and modification time (hashing the content of
    gigabytes on every start would cost more than it saves).
    """
    h = hashlib.sha256()
    h.update(f"wiola-data v{PIPELINE_VERSION} {source.kind} {source.name}".encode())
    if source.kind == "sample":
        from wiola.train.corpus import CORPUS_VERSION

        h.update(f"corpus v{CORPUS_VERSION} {source.sample_size}".encode())
    elif source.kind == "hf":
        for split in ("train", "validation"):
            h.update(str(getattr(_hf_split(source.name, split), "_fingerprint", "")).encode())
    else:
        h.update(f"holdout {source.holdout_every if not source.val_files else 0}".encode())
        for role, files in (("train", source.train_files), ("val", source.val_files)):
            for p in files:
                st = p.stat()
                h.update(f"{role} {p.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def tokenizer_for(config: WiolaConfig, spec: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer for a model of ``config``: ``spec`` (a name or a ``tokenizer.json`` path,
    ``wiola.tokenizer.load_tokenizer``), or the tiktoken encoding whose vocabulary is the model's.

    Raises ``ValueError`` when the tokenizer has more ids than the model has embedding rows (fewer
    is fine: padded embeddings), ``RuntimeError`` (saying what to set) when it cannot load.
    """
    from wiola.tokenizer import TiktokenTokenizer, encoding_for_vocab, load_tokenizer

    if spec is None:
        return TiktokenTokenizer(encoding_for_vocab(config.vocab_size))
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocab_size is "
            f"{config.vocab_size:,}; set vocab_size to at least {tokenizer.vocab_size} (--model vocab_size=N)"
        )
    return tokenizer


# --------------------------------------------------------------------------------- token cache
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
    """Both splits of a tokenised source, and the manifest that describes them."""

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
) -> tuple[int, int, int]:
    tqdm = require("tqdm.auto", "tokenising a corpus").tqdm
    prefix, suffix = tokenizer.document_prefix, tokenizer.document_suffix
    dtype = token_dtype(tokenizer.vocab_size)
    n_docs = n_tokens = n_bytes = 0
    bar = tqdm(total=total, desc=desc, unit="doc", disable=not progress, dynamic_ncols=True)
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
    for split in ("train", "val"):
        info = manifest["splits"][split]
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


def prepare_data(
    source: DataSource,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike | None = None,
    *,
    num_threads: int | None = None,
    batch_docs: int = 1024,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    log: Any = print,
) -> TokenData:
    """Tokenise ``source`` with ``tokenizer`` (or open the cache of an earlier run) and return both splits.

    The cache folder is ``cache_dir/tokens/<source>-<tokenizer>-<hash of both fingerprints>``; it
    is built in a temporary folder and renamed into place, so an interrupted run leaves no half
    cache. Raises ``ValueError`` when a split is empty.
    """
    fingerprint = source_fingerprint(source)
    slug = {"hf": "tinystories", "sample": "sample"}.get(source.kind) or Path(source.name).name.replace(".", "_")[:40]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{fingerprint} {tokenizer.fingerprint}".encode()).hexdigest()
    name = re.sub(r"[^\w.-]", "_", tokenizer.name)[:40]
    directory = root / "tokens" / f"{slug}-{name}-{key[:16]}"
    if (directory / "manifest.json").is_file():
        data = _open_cache(directory)
        if (data.manifest.get("fingerprint"), data.manifest.get("tokenizer_fingerprint")) == (
            fingerprint,
            tokenizer.fingerprint,
        ):
            log(f"tokens: cached in {directory} ({len(data.train):,} train / {len(data.val):,} val)")
            return data
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = num_threads or min(8, os.cpu_count() or 1)
    splits: dict[str, Any] = {}
    t0 = time.time()
    try:
        for split in ("train", "val"):
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
            )
            if n_docs == 0:
                raise ValueError(f"the {split} split of {source.describe()} holds no documents (empty corpus)")
            splits[split] = {"shards": writer.shards, "documents": n_docs, "tokens": n_tokens, "bytes": n_bytes}
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
            "splits": splits,
            "seconds": round(time.time() - t0, 3),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    data = _open_cache(directory)
    log(
        f"tokens: {len(data.train):,} train / {len(data.val):,} val with {tokenizer.name} in {time.time() - t0:.1f}s, cached in {directory}"
    )
    return data


def check_split(split: TokenSplit, seq_len: int, name: str) -> None:
    """Raise ``ValueError`` unless ``split`` holds at least one window of ``seq_len + 1`` tokens."""
    if len(split) < seq_len + 1:
        raise ValueError(
            f"the {name} split holds {len(split)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}; "
            "use more data or a shorter --seq-len"
        )


# ------------------------------------------------------------------------------------- batches
def num_windows(n_tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1``-token windows at stride ``seq_len`` fit in ``n_tokens`` tokens."""
    return max(0, (n_tokens - 1) // seq_len)


class BatchStream:
    """The training windows of one rank, ``micro_batch × grad_accum`` per optimizer step.

    Args:
        split: the training ``TokenSplit``.
        seq_len: ``T``; windows hold ``T + 1`` tokens.
        micro_batch: windows per forward pass on one rank.
        grad_accum: micro-batches per optimizer step.
        rank, world_size: this process and the number of data-parallel processes.
        shuffle: seeded random order (a fresh permutation of the windows every epoch) or in order.
        seed: seed of the permutations.

    ``next_step()`` returns ``grad_accum`` int64 tensors of shape ``(micro_batch, T + 1)``.
    ``state_dict()`` / ``load_state_dict()`` save and restore the exact position.
    """

    def __init__(
        self,
        split: TokenSplit,
        seq_len: int,
        micro_batch: int,
        grad_accum: int = 1,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch", micro_batch),
            ("grad_accum", grad_accum),
            ("world_size", world_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        check_split(split, seq_len, "training")
        self.split, self.seq_len = split, seq_len
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.n_windows = num_windows(len(split), seq_len)
        self.consumed = 0  # windows taken by all ranks together since the start of training
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def _window(self, index: int) -> int:
        """The window number of the ``index``-th window drawn since the start."""
        epoch, j = divmod(index, self.n_windows)
        if not self.shuffle:
            return j
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return int(self._perm[1][j])

    def next_step(self) -> list[torch.Tensor]:
        T, B = self.seq_len, self.micro_batch
        batches = []
        for a in range(self.grad_accum):
            first = self.consumed + (a * self.world_size + self.rank) * B
            rows = [self.split.read(self._window(first + i) * T, T + 1) for i in range(B)]
            batches.append(torch.from_numpy(np.stack(rows)))
        self.consumed += self.global_batch
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows_consumed": self.consumed,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "n_windows": self.n_windows,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises ``ValueError`` when the windows would differ."""
        for key in ("seq_len", "shuffle", "seed", "n_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"saved data position has {key}={state[key]!r} but this run has {getattr(self, key)!r}: "
                    "the run would not continue on the same data"
                )
        self.consumed = int(state["windows_consumed"])


def eval_windows(split: TokenSplit, seq_len: int, max_windows: int | None = None) -> int:
    """How many validation windows an evaluation reads (all of them, or at most ``max_windows``)."""
    n = num_windows(len(split), seq_len)
    return n if max_windows is None else min(n, max_windows)


def eval_batches(
    split: TokenSplit,
    seq_len: int,
    batch_size: int,
    *,
    max_windows: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """The validation windows in order, ``(≤ batch_size, T + 1)`` int64; rank ``r`` takes windows
    ``r, r + world, …`` so the ranks together read each window once."""
    check_split(split, seq_len, "validation")
    n = eval_windows(split, seq_len, max_windows)
    mine = list(range(rank, n, world_size))
    for i in range(0, len(mine), batch_size):
        rows = [split.read(k * seq_len, seq_len + 1) for k in mine[i : i + batch_size]]
        yield torch.from_numpy(np.stack(rows))


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """``(vocab_size,)`` int64: the UTF-8 bytes each token decodes to; special tokens count 0.

    Byte-level BPE decodes a sequence to the concatenation of its tokens' bytes, so summing this
    table over the targets gives the exact byte count of the decoded text.
    """
    return torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.int64)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the tokens' empirical unigram distribution: the loss of the best model
    that ignores context, the bar a trained model must get well below."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
