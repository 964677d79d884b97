"""``wiola tokenizer train``: a byte-level BPE trained with ``tokenizers`` on any source the
trainer reads, with Wiola13M's special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3);
``wiola train --tokenizer DIR`` then uses it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from wiola.cli.arguments import add_progress_flag, non_empty_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    actions = p.add_subparsers(dest="action", required=True)
    t = actions.add_parser("train", help="train a byte-level BPE on a corpus (written as tokenizer.json + configs)")
    t.add_argument(
        "--data",
        type=non_empty_path,
        required=True,
        help="'tinystories', 'sample[:N]', or text/JSONL/Parquet files or a folder",
    )
    t.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, specials and bytes included")
    t.add_argument(
        "--out", type=non_empty_path, required=True, help="folder to write tokenizer.json, tokenizer_config.json, ..."
    )
    t.add_argument("--max-documents", type=int, help="train on the first N training documents only")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the tokenizer an --out already holds (a folder holding a model or a training run is refused)",
    )
    add_progress_flag(t)
    t.set_defaults(func=run_train)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what save writes


def check_tokenizer_out(out: Path, overwrite: bool) -> None:
    """``ValueError`` when ``out`` holds a model (its tokenizer is the one its ids mean: a new one
    written there would be read with its weights, by ``wiola eval`` and ``generate`` alike) or a
    training run, whatever ``overwrite`` says; or a tokenizer, unless ``overwrite``."""
    from wiola.train.run_folder import check_no_model, held_files

    check_no_model(out, ", whose ids its own tokenizer defines")
    held = held_files(out, TOKENIZER_FILES)
    if held and not overwrite:
        raise ValueError(
            f"--out {str(out)!r} already holds a tokenizer ({', '.join(held)}): pass --overwrite to replace it, "
            "or write to another folder"
        )


def run_train(args: argparse.Namespace) -> int:
    from wiola.tokenizer import SPECIAL_TOKENS, train_tokenizer
    from wiola.train.env import Progress, draws_bars
    from wiola.train.run_folder import check_output_folder
    from wiola.train.sources import iter_documents, resolve_source

    if args.max_documents is not None and args.max_documents < 1:
        raise ValueError(f"--max-documents must be >= 1, got {args.max_documents}")
    smallest = len(SPECIAL_TOKENS) + 256
    if args.vocab_size < smallest:
        raise ValueError(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least {smallest} ids")
    check_output_folder(args.out, "--out")
    check_tokenizer_out(Path(args.out), args.overwrite)
    source = resolve_source(args.data)
    docs, total = iter_documents(source, "train")
    if args.max_documents is not None:
        total = args.max_documents if total is None else min(total, args.max_documents)
        docs = (d for _, d in zip(range(args.max_documents), docs))
    bars = draws_bars(args.progress)  # on a terminal the tokenizers library draws its own bars, reading included
    progress = Progress(
        total, f"reading {source.describe()}", "doc", show=False,
        log=None if bars else (lambda m: print(m, file=sys.stderr)),
    )  # fmt: skip
    seen = {"documents": 0, "text": 0}

    def counted() -> Iterator[str]:
        for doc in docs:
            seen["documents"] += 1
            seen["text"] += bool(doc.strip())
            progress.update()
            yield doc

    tokenizer = train_tokenizer(counted(), args.vocab_size, length=total, show_progress=bars)
    progress.close()
    if not seen["text"]:  # a BPE of nothing would be the 260 specials and bytes alone
        found = f"{seen['documents']:,} blank documents" if seen["documents"] else "no documents"
        raise ValueError(f"--data {args.data}: its training split holds no text to train on ({found}); nothing written")
    out = Path(args.out)
    tokenizer.name = out.name
    tokenizer.save(out)
    print(f"tokenizer: {tokenizer.vocab_size:,} ids (<unk> 0, <s> 1, </s> 2, <pad> 3) written to {out}")
    if tokenizer.vocab_size < args.vocab_size:  # BPE stops when no pair is left to merge
        print(
            f"note: --vocab-size {args.vocab_size:,} asked for more ids than this corpus gives: its text has no "
            f"pair left to merge after {tokenizer.vocab_size:,}; a model for it needs vocab_size >= {tokenizer.vocab_size:,}",
            file=sys.stderr,
        )
    print(
        f"trained on {seen['documents']:,} documents; fingerprint {tokenizer.fingerprint[:16]}; "
        f"train with it: wiola train --tokenizer {out}",
        file=sys.stderr,
    )
    return 0
