"""The data pipeline: sources, tokenisation round trip, the token cache, batches and positions."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter

import numpy as np
import pytest
import torch
from token_splits import record_tokenised_splits

from wiola.tokenizer import TiktokenTokenizer
from wiola.train import token_cache
from wiola.train.batches import BatchStream, eval_batches, eval_windows, num_windows
from wiola.train.corpus import EOT, write_sample_corpus
from wiola.train.evaluate import token_byte_lengths, unigram_entropy
from wiola.train.sources import iter_documents, resolve_source
from wiola.train.token_cache import TokenSplit, prepare_data

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tokenizer")


@pytest.fixture(scope="module")
def enc():
    from wiola.tokenizer import get_encoding

    return get_encoding("gpt2-32k")


def _quiet(*_: object) -> None:
    pass


def _split(tokens: list[int] | np.ndarray, shard: int | None = None) -> TokenSplit:
    arr = np.asarray(tokens, dtype=np.uint16)
    shards = [arr] if shard is None else [arr[i : i + shard] for i in range(0, len(arr), shard)]
    return TokenSplit(shards, documents=1, text_bytes=0)


# ----------------------------------------------------------------------------------- sources
def test_token_cache_shares_the_build_cache_folder(monkeypatch, tmp_path) -> None:
    """Token shards default to the C++ step's cache folder (``$WIOLA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/wiola`` or ``~/.cache/wiola``); ``$WIOLA_CACHE`` sets theirs alone."""
    from wiola.fast import decode_step_cpu

    for name in ("WIOLA_CACHE", "WIOLA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert token_cache.default_cache_dir() == tmp_path / ".cache" / "wiola" == decode_step_cpu._cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.default_cache_dir() == tmp_path / "xdg" / "wiola" == decode_step_cpu._cache_dir()
    monkeypatch.setenv("WIOLA_CACHE_DIR", "~/both")
    assert token_cache.default_cache_dir() == tmp_path / "both" == decode_step_cpu._cache_dir()
    monkeypatch.setenv("WIOLA_CACHE", "~/tokens")
    assert token_cache.default_cache_dir() == tmp_path / "tokens"
    assert decode_step_cpu._cache_dir() == tmp_path / "both"


def test_sources_and_bad_paths(tmp_path) -> None:
    assert resolve_source(None).kind == "hf"
    assert resolve_source("sample").kind == "sample"
    assert resolve_source("sample:50").sample_size == (50, 100, 0)
    with pytest.raises(ValueError, match="sample:N"):
        resolve_source("sample:x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        resolve_source(tmp_path / "empty")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type"):
        resolve_source(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="val_fraction"):
        resolve_source("sample", val_fraction=1.5)


def test_what_a_folder_and_its_names_hold(tmp_path) -> None:
    """Hidden files and folders are not data; a file named ``stories.val.txt`` is validation data;
    a suffix is read in any case (``A.TXT``); a fraction near 1 still leaves every other document
    to training; ``sample:N`` holds out a tenth of N (at least 100)."""
    (tmp_path / "d" / ".hidden").mkdir(parents=True)
    (tmp_path / "d" / ".hidden" / "notes.txt").write_text("private notes")
    (tmp_path / "d" / ".notes.txt").write_text("more notes")
    (tmp_path / "d" / "a.txt").write_text("a story")
    (tmp_path / "d" / "stories.val.txt").write_text("a held story")
    src = resolve_source(tmp_path / "d")
    assert [p.name for p in src.train_files] == ["a.txt"] and [p.name for p in src.val_files] == ["stories.val.txt"]
    (tmp_path / "A.TXT").write_text("a story<|endoftext|>another<|endoftext|>a third")
    upper = resolve_source(tmp_path / "A.TXT", val_fraction=0.9)
    assert upper.holdout_every == 2, upper
    assert list(iter_documents(upper, "train")[0]) == ["a story", "a third"]
    assert list(iter_documents(upper, "val")[0]) == ["another"]
    assert resolve_source("sample:5000").sample_size == (5000, 500, 0)


def test_the_token_cache_key_follows_the_files_and_the_split(tmp_path) -> None:
    """The key (``source_fingerprint``) changes when a file is rewritten, even to another text of
    the same size, and when the held-out share changes; not when nothing did."""
    from wiola.train.sources import source_fingerprint

    f = tmp_path / "s.txt"
    f.write_text("a cat sat<|endoftext|>a dog ran")
    os.utime(f, ns=(10**18, 10**18))
    first = source_fingerprint(resolve_source(f))
    assert source_fingerprint(resolve_source(f)) == first
    f.write_text("a cow sat<|endoftext|>a dog ran")  # the same size
    os.utime(f, ns=(10**18 + 1000, 10**18 + 1000))
    edited = source_fingerprint(resolve_source(f))
    assert edited != first, "an edit of the same size kept the key: the old tokens would be read"
    assert source_fingerprint(resolve_source(f, val_fraction=0.5)) != edited, "another split kept the key"


def test_folder_with_validation_file(tmp_path) -> None:
    write_sample_corpus(tmp_path, n_train=7, n_val=3, seed=5)
    src = resolve_source(tmp_path)
    assert [p.name for p in src.train_files] == ["train.txt"], f"train files {src.train_files}"
    assert [p.name for p in src.val_files] == ["validation.txt"], f"val files {src.val_files}"
    from wiola.train.corpus import sample_corpus

    train, val = sample_corpus(7, 3, seed=5)
    assert list(iter_documents(src, "train")[0]) == train, "train documents differ from the written stories"
    assert list(iter_documents(src, "val")[0]) == val, "validation documents differ from the written stories"


def test_val_data_inside_the_data_folder_is_not_trained_on(tmp_path) -> None:
    write_sample_corpus(tmp_path / "corpus", n_train=7, n_val=3, seed=5)
    src = resolve_source(tmp_path / "corpus", val_data=tmp_path / "corpus" / "validation.txt")
    assert [p.name for p in src.train_files] == ["train.txt"] and [p.name for p in src.val_files] == ["validation.txt"]
    with pytest.raises(ValueError, match="holds no files besides the --val-data ones"):
        resolve_source(tmp_path / "corpus" / "train.txt", val_data=tmp_path / "corpus" / "train.txt")


def test_a_validation_subfolder_is_the_validation_split(tmp_path) -> None:
    for part, text in (("train/part0.txt", "a training story"), ("validation/part0.txt", "a held story"),
                       ("dev-set/b.txt", "a dev story"), ("interval/c.txt", "a story of intervals")):  # fmt: skip
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / part).write_text(text)
    src = resolve_source(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in src.val_files) == [
        "dev-set/b.txt",
        "validation/part0.txt",
    ]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in src.train_files) == ["interval/c.txt", "train/part0.txt"]


def test_a_byte_order_mark_is_not_text(tmp_path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfOnce upon a time.")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "One day."}\n')
    assert list(iter_documents(resolve_source(tmp_path / "a.txt"), "train")[0]) == ["Once upon a time."]
    assert list(iter_documents(resolve_source(tmp_path / "b.jsonl"), "train")[0]) == ["One day."]
    (tmp_path / "c.txt").write_bytes(b"\xef\xbb\xbfab\xffc")  # the offset counts the mark's bytes
    assert (
        _read_error(tmp_path / "c.txt")
        == f"{tmp_path / 'c.txt'}: not UTF-8 text (byte 0xff at offset 5: invalid start byte)"
    )


def test_text_jsonl_json_parquet_readers(tmp_path) -> None:
    docs = [f'Story number {i}. It has words, and "quotes" — and ünïcode {i * i}.' for i in range(10)]
    (tmp_path / "a.txt").write_text(f"\n{EOT}\n".join(docs[:3]))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[3:5]) + "\n\n")
    (tmp_path / "c.json").write_text(json.dumps([{"story": d} for d in docs[5:7]]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[7:], "id": list(range(3))}), tmp_path / "d.parquet")
    (tmp_path / "single.txt").write_text("One file without separators\n\nis one document.")
    src = resolve_source(tmp_path, val_fraction=0.5)  # every 2nd document held out
    got_train = list(iter_documents(src, "train")[0])
    got_val = list(iter_documents(src, "val")[0])
    everything = [*docs, "One file without separators\n\nis one document."]
    assert sorted(got_train + got_val) == sorted(everything), "documents lost or changed by the readers"
    assert got_val == everything[1::2] and got_train == everything[0::2], "held-out documents are not every 2nd"


def test_reader_errors(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    src = resolve_source(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no text field"):
        list(iter_documents(src, "train")[0])


def _read_error(path) -> str:
    with pytest.raises(ValueError) as info:
        list(iter_documents(resolve_source(path), "train")[0])
    return str(info.value)


def test_a_parquet_text_column_of_other_values_is_named(tmp_path) -> None:
    """A Parquet ``text`` column of numbers or lists is refused naming the file, the column and
    its type (not an ``AttributeError`` from the reader); nulls in a string column are skipped;
    a dataset column's non-string value is named with its row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from wiola.train.sources import _column_texts

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    assert (
        _read_error(tmp_path / "ints.parquet") == f"{tmp_path / 'ints.parquet'}: column 'text' holds int64, not strings"
    )
    pq.write_table(pa.table({"story": [["a"], ["b"]]}), tmp_path / "lists.parquet")
    assert re.search(r": column 'story' holds list<\w+: string>, not strings$", _read_error(tmp_path / "lists.parquet"))
    pq.write_table(
        pa.table({"text": pa.array(["a large one", "b"], type=pa.large_string())}), tmp_path / "large.parquet"
    )
    assert list(iter_documents(resolve_source(tmp_path / "large.parquet", val_fraction=0.5), "train")[0]) == [
        "a large one"
    ]
    pq.write_table(pa.table({"text": ["a story", None, "  ", "another"]}), tmp_path / "nulls.parquet")
    assert list(iter_documents(resolve_source(tmp_path / "nulls.parquet", val_fraction=0.5), "train")[0]) == ["a story"]
    assert list(_column_texts(["a", None, " b "], "ds: 'text'")) == ["a", "b"]
    with pytest.raises(ValueError, match=r"^ds: 'text' row 2: holds int, not a string$"):
        list(_column_texts(["a", None, 7], "ds: 'text'"))


def test_bad_json_is_named_by_file_and_line(tmp_path) -> None:
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n\n" + '{"text": broken\n')
    assert _read_error(bad) == f"{bad}:3: not valid JSON (Expecting value at column 10)"
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert _read_error(tmp_path / "n.jsonl").startswith(f"{tmp_path / 'n.jsonl'}:2: no text field")
    (tmp_path / "l.json").write_text('[\n"a",\n]')
    assert _read_error(tmp_path / "l.json").startswith(f"{tmp_path / 'l.json'}:3: not valid JSON")


def test_text_that_is_not_utf8_is_named_by_file_and_offset(tmp_path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("Fine text.")
    (tmp_path / "data" / "b.txt").write_bytes(b"abc\xffdef")
    assert (
        _read_error(tmp_path / "data")
        == f"{tmp_path / 'data' / 'b.txt'}: not UTF-8 text (byte 0xff at offset 3: invalid start byte)"
    )
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xfe"}\n')
    assert "d.jsonl: not UTF-8 text (byte 0xfe at offset 24" in _read_error(tmp_path / "d.jsonl")


def test_tinystories_unreachable_message(monkeypatch) -> None:
    def unavailable(*a, **k):
        raise ConnectionError("no network")

    import types

    monkeypatch.setitem(__import__("sys").modules, "datasets", types.SimpleNamespace(load_dataset=unavailable))
    with pytest.raises(RuntimeError, match=r"--data PATH.*--data sample"):
        iter_documents(resolve_source(None), "train")


# ------------------------------------------------------------------------ tokenisation + cache
def test_round_trip_and_manifest(tmp_path, enc) -> None:
    write_sample_corpus(tmp_path / "c", n_train=30, n_val=5, seed=1)
    src = resolve_source(tmp_path / "c")
    data = prepare_data(src, TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet, shard_tokens=1000)
    from wiola.train.corpus import sample_corpus

    train, val = sample_corpus(30, 5, seed=1)
    for name, split, docs in (("train", data.train, train), ("val", data.val, val)):
        toks = split.tokens()
        assert toks.dtype == np.int64 and len(split.shards) == math.ceil(len(toks) / 1000), f"{name}: shard layout"
        assert int((toks == enc.eot_token).sum()) == len(docs), f"{name}: one <|endoftext|> per story"
        assert toks[0] == enc.eot_token, f"{name}: the stream starts with a separator"
        text = enc.decode(toks.tolist())
        assert text == "".join(EOT + d for d in docs), f"{name}: decoded tokens differ from the documents"
        assert split.documents == len(docs), f"{name}: document count"
        assert split.text_bytes == sum(len(d.encode()) for d in docs), f"{name}: byte count"
    m = data.manifest
    assert (
        m["tokenizer"] == "gpt2-32k"
        and m["vocab_size"] == 32000
        and m["document_prefix"] == [31999]
        and m["document_suffix"] == []
    )
    assert m["splits"]["train"]["tokens"] == len(data.train) and len(m["fingerprint"]) == 64
    assert json.loads((data.directory / "manifest.json").read_text()) == m
    assert not [p for p in data.directory.parent.iterdir() if ".tmp-" in p.name], "temporary folder left behind"


def test_second_run_skips_tokenisation(tmp_path, enc, monkeypatch) -> None:
    write_sample_corpus(tmp_path / "c", n_train=10, n_val=3)
    src = resolve_source(tmp_path / "c")
    first = prepare_data(src, TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet)
    calls = Counter()
    real = token_cache._tokenize_split

    def counting(*a, **k):
        calls["tokenize"] += 1
        return real(*a, **k)

    monkeypatch.setattr(token_cache, "_tokenize_split", counting)
    second = prepare_data(src, TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet)
    assert calls["tokenize"] == 0, "the second run tokenised again instead of using the cache"
    assert np.array_equal(first.train.tokens(), second.train.tokens()), "cached tokens differ"
    # Changing the source invalidates the cache.
    path = tmp_path / "c" / "train.txt"
    path.write_text(path.read_text() + f"\n{EOT}\nA new story.")
    third = prepare_data(
        resolve_source(tmp_path / "c"), TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet
    )
    assert calls["tokenize"] == 2, "a changed source did not trigger tokenisation"
    assert len(third.train) > len(first.train) and third.directory != first.directory


@pytest.mark.parametrize("change", [-2, 2], ids=["cut-short", "grown"])
def test_a_cache_shard_of_the_wrong_size_is_named(tmp_path, enc, change) -> None:
    """A shard shorter or longer than its manifest says (a copy cut short, a file appended to) is
    refused, naming the folder to delete, not read as other tokens."""
    write_sample_corpus(tmp_path / "c", n_train=10, n_val=3)
    src = resolve_source(tmp_path / "c")
    data = prepare_data(src, TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet)
    shard = sorted(data.directory.glob("train*"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:change] if change < 0 else raw + raw[:change])
    with pytest.raises(ValueError, match=rf"token cache .* is damaged: {shard.name} has the wrong size; delete the"):
        prepare_data(src, TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet)


def test_empty_corpus_raises(tmp_path, enc) -> None:
    (tmp_path / "train.txt").write_text(f"  \n{EOT}\n \n")
    (tmp_path / "val.txt").write_text("a story")
    with pytest.raises(ValueError, match="empty corpus"):
        prepare_data(resolve_source(tmp_path), TiktokenTokenizer(enc), tmp_path / "cache", progress=False, log=_quiet)
    assert not list((tmp_path / "cache" / "tokens").iterdir()), "a failed run left a cache folder"


def test_too_few_documents_to_hold_one_out_names_the_count_and_the_fix(tmp_path, enc) -> None:
    """A file of 50 documents holds none out at 1 in 100: the message says how many documents there
    are and which --val-fraction holds out one, and that fraction does; an empty .md file is told
    how documents are separated in text files."""
    docs = [f"Story {i}: the cat sat on the mat." for i in range(50)]
    (tmp_path / "s50.txt").write_text(EOT.join(docs))
    tok = TiktokenTokenizer(enc)
    with pytest.raises(ValueError) as info:
        prepare_data(resolve_source(tmp_path / "s50.txt"), tok, tmp_path / "c", progress=False, log=_quiet)
    assert str(info.value).endswith(
        "holds no documents: 1 document in 100 is held out for validation (--val-fraction 0.01), and the files "
        "hold 50; pass --val-data FILE, or --val-fraction 0.02 to hold out 1 of the 50"
    ), str(info.value)
    data = prepare_data(resolve_source(tmp_path / "s50.txt", val_fraction=0.02), tok, tmp_path / "c",
                        progress=False, log=_quiet)  # fmt: skip
    assert (data.val.documents, data.train.documents) == (1, 49)
    from wiola.train.token_cache import prepare_val_data

    with pytest.raises(ValueError) as info:  # the validation split alone (wiola eval): the count is not known
        prepare_val_data(resolve_source(tmp_path / "s50.txt"), tok, tmp_path / "v", progress=False, log=_quiet)
    assert str(info.value).endswith("and the files hold fewer than 100; pass --val-data FILE"), str(info.value)
    for n in (2, 3, 7, 99):  # the fraction printed holds out exactly one of n
        assert resolve_source(tmp_path / "s50.txt", val_fraction=float(f"{1 / n:.10g}")).holdout_every == n
    (tmp_path / "notes.md").write_text("  \n")
    with pytest.raises(ValueError, match=r"empty corpus\); in a \.md file documents are separated by <\|endoftext\|>"):
        prepare_data(resolve_source(tmp_path / "notes.md"), tok, tmp_path / "c", progress=False, log=_quiet)


def test_an_unwritable_cache_folder_is_named(tmp_path, enc) -> None:
    """A cache folder that cannot be made (here: under a file, which stops root too) is named with
    the flag that moves it, as an ``OSError`` (``wiola`` exits 2 with it)."""
    (tmp_path / "train.txt").write_text("a story")
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(OSError, match="cannot write the token cache under .*afile.*give a writable --cache-dir"):
        prepare_data(resolve_source(tmp_path / "train.txt"), TiktokenTokenizer(enc), tmp_path / "afile" / "cache",
                     progress=False, log=_quiet)  # fmt: skip


# -------------------------------------------------------------------------------------- batches
@pytest.mark.parametrize("shard", [None, 7], ids=["one-shard", "shards-of-7"])
def test_split_read_across_shards(shard) -> None:
    tokens = np.arange(50) % 65536
    split = _split(tokens, shard)
    for start, n in [(0, 50), (5, 9), (13, 1), (48, 2)]:
        assert np.array_equal(split.read(start, n), tokens[start : start + n]), f"read({start}, {n})"
    # Past the end, and a negative start (which, unchecked, would read another shard's tokens or
    # slice from the end): refused by the range check itself, named by its message.
    for start, n in [(45, 6), (50, 1), (-1, 2), (-3, 3)]:
        with pytest.raises(IndexError, match=rf"^tokens \[{start}, {start + n}\) are outside the split of 50 tokens$"):
            split.read(start, n)


@pytest.mark.parametrize("shuffle", [True, False], ids=["random", "sequential"])
def test_windows_cover_each_token_once_per_epoch(shuffle) -> None:
    T, tokens = 5, np.arange(3 * 100 + 1)
    split = _split(tokens, shard=37)
    stream = BatchStream(split, T, micro_batch=3, grad_accum=2, shuffle=shuffle, seed=4)
    n = num_windows(len(tokens), T)
    assert n == 60 and stream.global_batch == 6
    rows = torch.cat([b for _ in range(n // 6) for b in stream.next_step()])  # one epoch
    assert rows.shape == (n, T + 1) and rows.dtype == torch.int64
    starts = rows[:, 0].tolist()
    assert sorted(starts) == [k * T for k in range(n)], "an epoch does not visit every window once"
    assert torch.equal(rows, torch.stack([torch.arange(s, s + T + 1) for s in starts])), "window contents"
    targets = sorted(rows[:, 1:].reshape(-1).tolist())
    assert targets == list(range(1, n * T + 1)), "every token after the first must be a target exactly once"
    assert (starts == sorted(starts)) != shuffle, "order: shuffled vs sequential"
    # The next epoch uses a fresh permutation of the same windows.
    nxt = torch.cat(stream.next_step())[:, 0].tolist()
    assert (nxt == starts[:6]) != shuffle and stream.epoch == pytest.approx(66 / 60)


@pytest.mark.parametrize("world", [2, 3], ids=["world2", "world3"])
def test_ranks_disjoint_and_union_is_single_process_batch(world) -> None:
    split = _split(np.arange(4 * 240 + 1), shard=100)
    single = BatchStream(split, 4, micro_batch=2 * world, grad_accum=2, seed=9)
    ranks = [BatchStream(split, 4, micro_batch=2, grad_accum=2, rank=r, world_size=world, seed=9) for r in range(world)]
    for step in range(3):
        ref = {tuple(r.tolist()) for b in single.next_step() for r in b}
        parts = [{tuple(r.tolist()) for b in s.next_step() for r in b} for s in ranks]
        union = set().union(*parts)
        assert sum(len(p) for p in parts) == len(union), f"step {step}: ranks share windows"
        assert union == ref, f"step {step}: the ranks' windows differ from the single-process global batch"


def test_position_state_continues_exactly() -> None:
    split = _split(np.arange(3 * 50 + 1))
    a = BatchStream(split, 3, micro_batch=4, seed=2)
    for _ in range(7):  # past the first epoch (50 windows)
        a.next_step()
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON (it goes into trainer.json)
    b = BatchStream(split, 3, micro_batch=4, seed=2)
    b.load_state_dict(state)
    for step in range(20):
        assert torch.equal(torch.cat(a.next_step()), torch.cat(b.next_step())), f"step {step} after restore"
    c = BatchStream(split, 3, micro_batch=4, seed=3)
    with pytest.raises(ValueError, match="seed"):
        c.load_state_dict(state)


def test_stream_bad_arguments() -> None:
    split = _split(np.arange(10))
    with pytest.raises(ValueError, match="fewer than one window"):
        BatchStream(split, 10, 1)
    with pytest.raises(ValueError, match="micro_batch"):
        BatchStream(split, 3, 0)
    with pytest.raises(ValueError, match="rank"):
        BatchStream(split, 3, 1, rank=2, world_size=2)


def test_eval_batches_ranks_cover_all() -> None:
    """46 targets at T = 4: 11 full windows, then the last 2 targets as a shorter window in a
    batch of its own; every target once, in order, over any number of ranks."""
    split = _split(np.arange(4 * 11 + 3))
    batches = list(eval_batches(split, 4, 3))
    assert [tuple(b.shape) for b in batches] == [(3, 5)] * 3 + [(2, 5), (1, 3)], "full batches, then the tail"
    assert eval_windows(split, 4) == 12 and eval_windows(split, 4, 5) == 5
    targets = [t for b in batches for row in b.tolist() for t in row[1:]]
    assert targets == list(range(1, 4 * 11 + 3)), "every target once, in order"
    assert batches[-1].tolist() == [[44, 45, 46]]
    parts = [list(eval_batches(split, 4, 2, rank=r, world_size=3)) for r in range(3)]
    got = sorted(t for p in parts for b in p for row in b.tolist() for t in row[1:])
    assert got == targets, "ranks together must read every validation target once"
    assert sum(len(b) for b in eval_batches(split, 4, 3, max_windows=5)) == 5
    assert len(list(eval_batches(_split(np.arange(4 * 11 + 1)), 4, 3))) == 4, "no tail: no shorter window"
    short = list(eval_batches(_split(np.arange(3)), 4, 3))  # fewer tokens than one window: one short one
    assert [b.tolist() for b in short] == [[[0, 1, 2]]] and eval_windows(_split(np.arange(3)), 4) == 1
    with pytest.raises(ValueError, match="the validation split holds 1 token, no target to score"):
        list(eval_batches(_split(np.arange(1)), 4, 3))


# ------------------------------------------------------------------------------------ statistics
def test_token_byte_lengths_match_decoded_text(enc) -> None:
    lengths = token_byte_lengths(TiktokenTokenizer(enc))
    assert lengths.shape == (32000,) and int(lengths[enc.eot_token]) == 0
    text = 'Once upon a time, Zoë said "héllo" 🙂 to the cat.\n\nThe end.'
    ids = enc.encode_ordinary(text)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8")), "byte lengths do not sum to the text's bytes"


def test_unigram_entropy_against_float64() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=5000) ** 2 % 97
    counts = Counter(tokens.tolist())
    ref = -sum(c / 5000 * math.log(c / 5000) for c in counts.values())
    assert abs(unigram_entropy(tokens, 100) - ref) < 1e-12, "unigram entropy"
    assert unigram_entropy(np.zeros(10, dtype=np.int64), 4) == 0.0


# ------------------------------------------------------------- the validation split alone, paths
def test_val_only_cache_matches_the_full_one_and_tokenises_no_train(tmp_path, enc, monkeypatch) -> None:
    from wiola.train.corpus import generate_stories
    from wiola.train.token_cache import VAL_ONLY_SUFFIX, prepare_val_data

    docs = generate_stories(12, seed=4)
    (tmp_path / "all.txt").write_text(f"\n{EOT}\n".join(docs))
    src = resolve_source(tmp_path / "all.txt", val_fraction=0.25)  # every 4th document held out
    tok = TiktokenTokenizer(enc)
    full = prepare_data(src, tok, tmp_path / "full", progress=False, log=_quiet)  # today's path, its own cache
    seen = record_tokenised_splits(monkeypatch)
    val = prepare_val_data(src, tok, tmp_path / "cache", progress=False, log=_quiet)
    assert seen == ["val"], f"tokenised {seen}, not the validation split alone"
    assert np.array_equal(val.val.tokens(), full.val.tokens()), "the held-out split differs from the full cache's"
    assert enc.decode(val.val.tokens().tolist()) == "".join(EOT + d for d in docs[3::4]), "held-out documents"
    assert len(val.train) == 0 and set(val.manifest["splits"]) == {"val"}
    assert val.directory.name == full.directory.name + VAL_ONLY_SUFFIX, "the val cache is not beside the full one"
    assert (val.val.documents, val.val.text_bytes) == (full.val.documents, full.val.text_bytes)
    # Training never takes the val-only cache for a complete one: it tokenises both splits.
    again = prepare_data(src, tok, tmp_path / "cache", progress=False, log=_quiet)
    assert seen == ["val", "train", "val"] and again.directory == val.directory.with_name(full.directory.name)
    assert np.array_equal(again.train.tokens(), full.train.tokens()), "training's cache lost its train split"
    # ... and scoring opens training's complete cache, with no tokenising.
    reused = prepare_val_data(src, tok, tmp_path / "cache", progress=False, log=_quiet)
    assert seen == ["val", "train", "val"] and reused.directory == again.directory
    assert np.array_equal(reused.val.tokens(), full.val.tokens())


def test_validation_source_alone_and_an_empty_train_file(tmp_path, enc, monkeypatch) -> None:
    from wiola.train.sources import validation_source
    from wiola.train.token_cache import prepare_val_data

    write_sample_corpus(tmp_path / "c", n_train=8, n_val=3, seed=2)
    (tmp_path / "empty.txt").write_text("")
    tok = TiktokenTokenizer(enc)
    c = tmp_path / "c"
    full = prepare_data(
        resolve_source(c / "train.txt", c / "validation.txt"), tok, tmp_path / "full", progress=False, log=_quiet
    )
    seen = record_tokenised_splits(monkeypatch)
    alone = prepare_val_data(validation_source(c / "validation.txt"), tok, tmp_path / "a", progress=False, log=_quiet)
    empty = prepare_val_data(
        resolve_source(tmp_path / "empty.txt", c / "validation.txt"), tok, tmp_path / "e", progress=False, log=_quiet
    )
    assert seen == ["val", "val"], f"tokenised {seen}"
    for name, data in (("--val-data alone", alone), ("an empty train file", empty)):
        assert np.array_equal(data.val.tokens(), full.val.tokens()), f"{name}: validation tokens differ"
    assert alone.manifest["source"].endswith("(1 validation file(s))"), alone.manifest["source"]
    with pytest.raises(FileNotFoundError, match="validation data path"):
        validation_source(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"the val split .* holds no documents .*separated by <\|endoftext\|>"):
        prepare_val_data(validation_source(tmp_path / "empty.txt"), tok, tmp_path / "x", progress=False, log=_quiet)


def test_val_only_tinystories_tokenises_its_validation_split_alone(tmp_path, enc, monkeypatch) -> None:
    """The default of a checkpoint without a training config: TinyStories' validation split,
    without tokenising its 2 M training stories (here a stand-in for ``datasets``)."""
    from wiola.train import sources
    from wiola.train.corpus import generate_stories
    from wiola.train.token_cache import prepare_val_data

    class Split:
        def __init__(self, docs: list[str], fingerprint: str) -> None:
            self.docs, self._fingerprint, self.column_names = docs, fingerprint, ["text"]

        def __getitem__(self, column: str) -> list[str]:
            return self.docs

        def __len__(self) -> int:
            return len(self.docs)

    splits = {"train": Split(generate_stories(9, seed=5), "t1"), "validation": Split(generate_stories(3, seed=6), "v1")}
    monkeypatch.setattr(sources, "_hf_split", lambda name, split: splits[split])
    tok = TiktokenTokenizer(enc)
    full = prepare_data(resolve_source("tinystories"), tok, tmp_path / "full", progress=False, log=_quiet)
    seen = record_tokenised_splits(monkeypatch)
    val = prepare_val_data(resolve_source("tinystories"), tok, tmp_path / "cache", progress=False, log=_quiet)
    assert seen == ["val"], f"tokenised {seen}, not the validation split alone"
    assert np.array_equal(val.val.tokens(), full.val.tokens()) and val.val.documents == 3


def test_training_paths_are_kept_absolute(tmp_path, monkeypatch) -> None:
    from wiola.train.config import TrainConfig
    from wiola.train.sources import absolute_data_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for named in (None, "tinystories", "roneneldan/TinyStories", "sample", "sample:50", "SAMPLE:7"):
        assert absolute_data_path(named) == named, f"{named!r} is a corpus name, not a path"
    assert absolute_data_path("d/../train.txt") == str(tmp_path / "train.txt")
    assert absolute_data_path("~/x.txt") == str(tmp_path / "home" / "x.txt")
    cfg = TrainConfig(preset="tiny", data="train.txt", val_data="./v/val.txt", cache_dir="cache")
    assert (cfg.data, cfg.val_data, cfg.cache_dir) == (
        str(tmp_path / "train.txt"),
        str(tmp_path / "v" / "val.txt"),
        str(tmp_path / "cache"),
    )
    assert TrainConfig(preset="tiny", data="sample:20").data == "sample:20"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg, "saved settings change when read back"
    # Resuming an older checkpoint: its relative spelling stays where it names the same file here.
    old = {**cfg.to_dict(), "data": "train.txt", "val_data": "v/val.txt"}
    kept = cfg.with_saved_paths(old)
    assert (kept.data, kept.val_data) == ("train.txt", "v/val.txt")
    other = cfg.with_saved_paths({**old, "data": "elsewhere/train.txt"})
    assert (other.data, other.val_data) == (str(tmp_path / "train.txt"), "v/val.txt")


def _trainer_state(run) -> dict:
    from wiola.train.run_folder import find_checkpoint, read_trainer_state

    return read_trainer_state(find_checkpoint(run))


def test_resume_with_absolute_and_older_relative_data_paths(tmp_path, monkeypatch, capsys) -> None:
    """A run started with relative paths saves them absolute and resumes from anywhere; a
    checkpoint of an older version (relative paths, and a data fingerprint keyed by them) still
    resumes from the folder it was trained in."""
    import shutil

    from wiola.cli import main
    from wiola.train import TrainConfig, train
    from wiola.train.corpus import generate_stories
    from wiola.train.sources import source_fingerprint

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    (root / "train.txt").write_text(f"\n{EOT}\n".join(generate_stories(20, seed=1)))
    (root / "val.txt").write_text(f"\n{EOT}\n".join(generate_stories(4, seed=2)))
    monkeypatch.chdir(root)
    model = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_seq_len": 32}
    cfg = TrainConfig(
        preset="tiny", model=model, data="train.txt", val_data="val.txt", cache_dir="cache", seq_len=16,
        batch_size=2, steps=1, eval_windows=2, out_dir="run", progress=False, plots=False, device="cpu",
    )  # fmt: skip
    train(cfg, log=_quiet)
    saved = _trainer_state(root / "run")["train_config"]
    assert (saved["data"], saved["val_data"], saved["cache_dir"]) == tuple(
        str(root / n) for n in ("train.txt", "val.txt", "cache")
    ), "the run saved its paths as typed"

    legacy = root / "legacy"
    shutil.copytree(root / "run", legacy)
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", str(root / "run"), "--steps", "2", "--no-progress"]) == 0, capsys.readouterr().err
    monkeypatch.chdir(root)
    flags = ["--data", "train.txt", "--val-data", "./val.txt", "--no-progress"]
    assert main(["train", "--resume", "run", "--steps", "3", *flags]) == 0, capsys.readouterr().err
    assert _trainer_state(root / "run")["step"] == 3

    # An older checkpoint: the paths as typed, and the fingerprint the older version computed from them.
    checkpoint = next((legacy / "checkpoints").glob("step_*"))
    state = json.loads((checkpoint / "trainer.json").read_text())
    state["train_config"].update(data="train.txt", val_data="val.txt")
    state["data"]["fingerprint"] = source_fingerprint(resolve_source("train.txt", "val.txt"))
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    assert main(["train", "--resume", "legacy", "--steps", "2", "--no-progress"]) == 0, capsys.readouterr().err
    resumed = _trainer_state(legacy)
    assert resumed["step"] == 2 and resumed["train_config"]["data"] == "train.txt", "the older spelling was not kept"
    assert resumed["data"]["fingerprint"] == state["data"]["fingerprint"]
    # From elsewhere its relative path names nothing: refused, naming the setting, before any step.
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["train", "--resume", str(legacy), "--steps", "3", "--data", str(root / "train.txt")]) == 2
    assert "data: checkpoint 'train.txt'" in capsys.readouterr().err
    assert _trainer_state(legacy)["step"] == 2


def test_windows_of_a_split_whose_length_is_a_multiple_of_seq_len() -> None:
    """A window is ``seq_len + 1`` tokens (inputs and shifted targets): 16 tokens hold 3 windows of
    4, not 4, and a stream draws every one of them without reading past the split."""
    from wiola.train.batches import BatchStream, num_windows

    assert (num_windows(16, 4), num_windows(17, 4), num_windows(5, 4), num_windows(4, 4)) == (3, 4, 1, 0)
    stream = BatchStream(TokenSplit([np.arange(16, dtype=np.uint16)], 1, 16), 4, micro_batch=1, shuffle=False)
    assert stream.n_windows == 3
    drawn = [stream.next_step()[0].tolist() for _ in range(stream.n_windows)]
    assert drawn == [[[0, 1, 2, 3, 4]], [[4, 5, 6, 7, 8]], [[8, 9, 10, 11, 12]]], drawn


def test_a_position_from_another_number_of_windows_is_refused() -> None:
    from wiola.train.batches import BatchStream

    a = BatchStream(TokenSplit([np.arange(41, dtype=np.uint16)], 1, 41), 4, 2)
    b = BatchStream(TokenSplit([np.arange(81, dtype=np.uint16)], 1, 81), 4, 2)
    a.next_step()
    with pytest.raises(ValueError, match="n_windows"):
        b.load_state_dict(a.state_dict())


def test_token_shards_hold_large_vocabularies_and_count_utf8_bytes(tmp_path) -> None:
    """Ids of a vocabulary past 65,536 are stored as uint32, losslessly; a split's ``text_bytes``
    is its documents' UTF-8 bytes, not characters."""
    from wiola.tokenizer import Tokenizer
    from wiola.train.token_cache import _ShardWriter, _tokenize_split, token_dtype

    assert (token_dtype(1 << 16), token_dtype((1 << 16) + 1)) == (np.uint16, np.uint32)

    class Wide(Tokenizer):
        name, vocab_size, bos_token_id, eos_token_id = "wide", 100_000, 1, 2

        def encode_batch(self, texts, *, num_threads=1):
            return [[70_000 + len(t), 5] for t in texts]

    docs = ["héllo wörld", "ünïcode"]
    writer = _ShardWriter(tmp_path, "train", 1 << 20)
    n_docs, n_tokens, n_bytes = _tokenize_split(
        iter(docs), None, Wide(), writer, num_threads=1, batch_docs=8, desc="x", progress=False
    )
    assert (n_docs, n_bytes) == (2, sum(len(d.encode()) for d in docs)) == (2, 22)
    stored = np.fromfile(tmp_path / "train_0000.bin", dtype=token_dtype(100_000)).tolist()
    assert 70_011 in stored and 70_007 in stored and len(stored) == n_tokens, stored
