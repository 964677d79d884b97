"""``wiola export``: a checkpoint of ours (a folder, a run folder or a Hub id) in the
``wiola13m`` / ``transformers`` format: ``config.json``, ``model.safetensors`` under
``wiola13m``'s tensor names, and the tokenizer as ``tokenizer.json`` + its configs."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint in the wiola13m / transformers format")
    p.add_argument("--checkpoint", required=True, help="model folder, training run folder or Hub id")
    p.add_argument("--revision", help="with a Hub id: a branch, tag or commit")
    p.add_argument("--out", required=True, help="folder to write (loadable by wiola13m.WiolaForCausalLM)")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from wiola import WiolaModel
    from wiola.checkpoint import export_wiola13m, load_checkpoint_tokenizer, resolve_checkpoint

    path = resolve_checkpoint(args.checkpoint, args.revision)
    if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
        from wiola.train.run_folder import find_checkpoint

        path = find_checkpoint(path)
    model = WiolaModel.from_pretrained(path)
    tokenizer = load_checkpoint_tokenizer(path)
    out = Path(args.out)
    if out.resolve() == path.resolve():
        raise ValueError(f"--out {out} is the checkpoint itself; write the export to another folder")
    export_wiola13m(model, out, tokenizer)
    print(f"{path} -> {out} (wiola13m format, tokenizer {tokenizer.name!r}, {tokenizer.vocab_size:,} ids)")
    return 0
