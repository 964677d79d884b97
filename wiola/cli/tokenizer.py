"""``wiola tokenizer train``: a byte-level BPE trained with ``tokenizers`` on any source the
trainer reads, with Wiola13M's special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3);
``wiola train --tokenizer DIR`` then uses it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wiola.cli.arguments import add_progress_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    actions = p.add_subparsers(dest="action", required=True)
    t = actions.add_parser("train", help="train a byte-level BPE on a corpus (written as tokenizer.json + configs)")
    t.add_argument("--data", required=True, help="'tinystories', 'sample[:N]', or text/JSONL/Parquet files or a folder")
    t.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, specials and bytes included")
    t.add_argument("--out", required=True, help="folder to write tokenizer.json, tokenizer_config.json, ...")
    t.add_argument("--max-documents", type=int, help="train on the first N training documents only")
    add_progress_flag(t)
    t.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from wiola.tokenizer import train_tokenizer
    from wiola.train.env import require
    from wiola.train.sources import iter_documents, resolve_source

    if args.max_documents is not None and args.max_documents < 1:
        raise ValueError(f"--max-documents must be >= 1, got {args.max_documents}")
    tqdm = require("tqdm.auto", "showing progress").tqdm
    source = resolve_source(args.data)
    docs, total = iter_documents(source, "train")
    if args.max_documents is not None:
        total = args.max_documents if total is None else min(total, args.max_documents)
        docs = (d for _, d in zip(range(args.max_documents), docs))
    bar = tqdm(docs, total=total, desc=f"reading {source.describe()}", unit="doc", disable=not args.progress)
    tokenizer = train_tokenizer(bar, args.vocab_size, length=total, show_progress=args.progress)
    bar.close()
    out = Path(args.out)
    tokenizer.name = out.name
    tokenizer.save(out)
    print(f"tokenizer: {tokenizer.vocab_size:,} ids (<unk> 0, <s> 1, </s> 2, <pad> 3) written to {out}")
    print(f"fingerprint {tokenizer.fingerprint[:16]}; train with it: wiola train --tokenizer {out}", file=sys.stderr)
    return 0
