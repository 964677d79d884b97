"""Where training text comes from (``--data``, ``--val-data``): a ``DataSource`` and its documents.

- ``None`` / ``"tinystories"``: ``roneneldan/TinyStories`` through ``datasets`` (train and
  validation splits); needs network (or the ``datasets`` cache).
- ``"sample"`` (or ``"sample:N"`` for N training stories, default 1000): the built-in generated
  corpus (``wiola.train.corpus``), no download.
- a path: text (``.txt``), JSON lines (``.jsonl``, ``.json`` lists), Parquet (``.parquet``)
  files, or a folder of them (searched recursively). In a text file, documents are separated by
  ``<|endoftext|>``; a file without that separator is one document. JSON and Parquet records
  carry their text in a ``text`` (or ``story``) field. The validation split is ``--val-data``
  when given (files of it inside the ``--data`` folder are not trained on); else the files of a
  folder whose names, or whose subfolders' names, say ``val``/``valid``/``validation``/``dev``/
  ``test``; else every ``1/val_fraction``-th document. A file's UTF-8 byte-order mark is not
  part of its text.

A training run keeps its paths as absolute ones (``absolute_data_path``), so that its checkpoint's
settings name the same files from any working directory. ``validation_source`` is the source of
``--val-data`` alone (``wiola eval``: a validation split and no training files).
``source_fingerprint`` keys the token cache (``wiola.train.token_cache``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
DEFAULT_HF_DATASET = "roneneldan/TinyStories"


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
        if self.kind == "files" and not self.train_files:
            return f"{self.name} ({len(self.val_files)} validation file(s))"
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


def _is_val_file(path: Path, root: Path) -> bool:
    """Whether a file of the folder ``root`` is validation data: its name, or the name of a folder
    it lies in below ``root``, holds a word of ``VAL_NAMES`` (``val.txt``, ``validation/part0.txt``)."""
    names = [path.stem, *path.relative_to(root).parts[:-1]]
    words = [w for name in names for w in name.lower().replace("-", "_").replace(".", "_").split("_")]
    return any(w in VAL_NAMES for w in words)


def is_named_source(data: str | os.PathLike | None) -> bool:
    """Whether a ``--data`` value names a corpus (None, ``tinystories``, ``sample``, ``sample:N``)
    rather than a path: ``resolve_source`` reads these without looking at the file system."""
    text = str(data).lower()
    return data is None or text in ("tinystories", DEFAULT_HF_DATASET.lower(), "sample") or text.startswith("sample:")


def absolute_data_path(data: str | os.PathLike | None) -> str | None:
    """A ``--data`` value with its path made absolute (``~`` expanded, ``..`` folded, symlinks
    kept); a named corpus (``is_named_source``) as it is. A path that does not exist stays a
    path: ``resolve_source`` says so."""
    if data is None or is_named_source(data):
        return None if data is None else str(data)
    return absolute_path(data)


def absolute_path(path: str | os.PathLike) -> str:
    """``path`` absolute, ``~`` expanded and ``..`` folded, symlinks kept."""
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def validation_source(val_data: str | os.PathLike) -> DataSource:
    """The source of ``--val-data`` alone: its files are the validation split, the training split
    is empty. The validation documents are those ``resolve_source(DATA, val_data)`` gives for any
    ``DATA``, so their numbers are the same. Raises as ``resolve_source`` does."""
    path = Path(val_data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"validation data path {str(path)!r} does not exist")
    return DataSource("files", str(path), [], _data_files(path))


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
        val_files = _data_files(val_path)
        held = {p.resolve() for p in val_files}  # --val-data inside the --data folder: not trained on
        train = [p for p in files if p.resolve() not in held]
        if not train:
            raise ValueError(f"--data {str(path)!r} holds no files besides the --val-data ones")
        return DataSource("files", str(path), train, val_files, val_fraction)
    if path.is_dir():
        val = [p for p in files if _is_val_file(p, path)]
        train = [p for p in files if not _is_val_file(p, path)]
        if val and train:
            return DataSource("files", str(path), train, val, val_fraction)
    return DataSource("files", str(path), files, [], val_fraction)


def _read_file(path: Path) -> Iterator[str]:
    """The documents of one data file. ``ValueError`` naming the file (and the line of a JSONL
    file, the byte offset of text that is not UTF-8) for content that cannot be read."""
    kind = TEXT_SUFFIXES[path.suffix.lower()]
    if kind == "text":
        text = _decode(path.read_bytes(), path)
        for doc in text.split(EOT_TEXT) if EOT_TEXT in text else [text]:
            doc = doc.strip()
            if doc:
                yield doc
        return
    if kind == "parquet":
        pq = require("pyarrow.parquet", "reading Parquet files")
        pa = require("pyarrow", "reading Parquet files")

        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        column = next((c for c in TEXT_FIELDS if c in names), None)
        if column is None:
            raise ValueError(f"{path}: no text column; expected one of {TEXT_FIELDS}, found {names}")
        held = pf.schema_arrow.field(column).type
        if not (pa.types.is_string(held) or pa.types.is_large_string(held) or str(held) == "string_view"):
            raise ValueError(f"{path}: column {column!r} holds {held}, not strings")
        for batch in pf.iter_batches(columns=[column], batch_size=4096):
            for doc in batch.column(0).to_pylist():
                if doc and doc.strip():
                    yield doc.strip()
        return
    if kind == "json":
        try:
            records = json.loads(_decode(path.read_bytes(), path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json file must hold a list of records or strings")
        for i, record in enumerate(records):
            text = _record_text(record, f"{path}: record {i}")
            if text.strip():
                yield text.strip()
        return
    for where, record in _jsonl_records(path):
        text = _record_text(record, where)
        if text.strip():
            yield text.strip()


def _decode(data: bytes, path: Path, offset: int = 0) -> str:
    """``data`` (read from ``path`` at byte ``offset``) as UTF-8; ``ValueError`` naming the file
    and the byte offset of the first byte that is not UTF-8."""
    if offset == 0 and data.startswith(codecs.BOM_UTF8):  # a byte-order mark is not text
        data, offset = data[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {offset + e.start}: {e.reason})"
        ) from e


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``("path:N", record)`` for each non-blank line N of a JSONL file, read one line at a time."""
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, offset)
            offset += len(raw)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e


def _record_text(record: Any, where: str) -> str:
    """The text of one record: a string, or a dict's first ``TEXT_FIELDS`` entry."""
    if isinstance(record, dict):
        text = next((record[c] for c in TEXT_FIELDS if c in record), None)
        if text is None:
            raise ValueError(f"{where}: no text field; expected one of {TEXT_FIELDS}")
    else:
        text = record
    if not isinstance(text, str):
        raise ValueError(f"{where}: holds {type(text).__name__}, not a string")
    return text


def _column_texts(values: Iterable[Any], where: str) -> Iterator[str]:
    """The stripped, non-empty texts of a dataset column; a null is skipped, anything else that is
    not a string is a ``ValueError`` naming its row."""
    for i, value in enumerate(values):
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where} row {i}: holds {type(value).__name__}, not a string")
        if value.strip():
            yield value.strip()


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
        return _column_texts(ds[column], f"{source.name}: {column!r}"), len(ds)

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
