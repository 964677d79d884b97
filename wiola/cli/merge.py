"""``wiola merge``: fold a LoRA folder's adapters into its base checkpoint's weights."""

from __future__ import annotations

import argparse

from wiola.cli.arguments import non_empty, non_empty_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="fold LoRA adapters into the weights (for the fast model, quantization, export)",
        description="Write a plain checkpoint whose weights are the base's plus the adapters' low-rank update.",
    )
    p.add_argument(
        "--adapter",
        type=non_empty_path,
        required=True,
        metavar="DIR",
        help="a folder written by wiola finetune --lora-rank",
    )
    p.add_argument("--out", type=non_empty_path, required=True, metavar="DIR")
    p.add_argument(
        "--base",
        type=non_empty,
        metavar="CHECKPOINT",
        help="the base checkpoint (default: the one the adapter names)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a model or adapters already in --out (deleting their files)"
    )
    p.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from wiola.train.finetune import merge_adapters

    # merge_adapters checks --out (not a file, holding no training run, apart from the adapters and
    # their base, holding no model unless --overwrite) before loading, and the adapters (their
    # weights file there, their shapes the base's) before merging
    print(f"merged checkpoint: {merge_adapters(args.adapter, args.out, args.base, overwrite=args.overwrite)}")
    return 0
