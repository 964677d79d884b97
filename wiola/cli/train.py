"""``wiola train``: flags, config files and recipes to a ``TrainConfig``, then ``wiola.train.train``.

Under ``torchrun --nproc_per_node N -m wiola train ...`` every rank runs this command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from wiola.cli.arguments import non_empty_path
from wiola.train.config import TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (TinyStories, local files or the sample corpus)",
        description="Train a Wiola model. Flags override --config, which overrides --recipe; under "
        "torchrun --nproc_per_node N -m wiola train every rank runs this command.",
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``wiola train`` flags. Every default is None: an unset flag takes the value from the
    config file, else the recipe, else the checkpoint (``--resume``), else ``TrainConfig``'s
    default; so a flag overrides ``--config``, which overrides ``--recipe``."""
    from wiola.config import PRESETS
    from wiola.train.config import recipe_names

    g = p.add_argument_group("setup")
    g.add_argument("--config", type=non_empty_path, help="JSON file of TrainConfig fields (the recipes' format)")
    g.add_argument("--recipe", choices=recipe_names(), help="a named recipe; 'paper' is the published 13M run")
    g.add_argument(
        "--resume",
        type=non_empty_path,
        metavar="DIR",
        help="continue exactly from a checkpoint or a run folder's latest one",
    )
    g.add_argument(
        "--out", dest="out_dir", type=non_empty_path, help="run folder (default runs/wiola; with --resume, the checkpoint's run folder); "
        "a folder that already holds a run is refused unless --resume or --overwrite is given",
    )  # fmt: skip
    g.add_argument(
        "--overwrite", action="store_true",
        help="start a new run in a --out folder that holds one: its metrics.jsonl, checkpoints and plots are deleted",
    )  # fmt: skip
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS))
    g.add_argument(
        "--init",
        metavar="CHECKPOINT",
        help="a new run from a checkpoint's weights, config and tokenizer (a folder, e.g. the published "
        "wiola13m layout, a run folder or a Hub id); --resume continues a run instead",
    )
    g.add_argument("--model", action="append", metavar="KEY=VALUE", help="override a WiolaConfig field (repeatable)")
    g.add_argument(
        "--tokenizer",
        help="gpt2, gpt2-32k, or a tokenizer folder / tokenizer.json (default: the tiktoken one matching vocab_size)",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", type=non_empty_path, help="'tinystories' (default), 'sample', or text/JSONL/Parquet files or a folder"
    )
    g.add_argument(
        "--val-data", type=non_empty_path, help="validation files (default: the folder's val files or a held-out share)"
    )
    g.add_argument("--val-fraction", type=float)
    g.add_argument(
        "--cache-dir",
        type=non_empty_path,
        help="token cache folder (default: $WIOLA_CACHE, else $WIOLA_CACHE_DIR, $XDG_CACHE_HOME/wiola or ~/.cache/wiola)",
    )
    g.add_argument("--seq-len", type=int, help="T: tokens predicted per window (default min(512, max_seq_len - 1))")
    g.add_argument("--batch-size", type=int, help="global batch: windows per optimizer step")
    g.add_argument("--micro-batch", type=int, help="windows per forward per rank (accumulates the rest)")
    g.add_argument(
        "--sequential", dest="shuffle", action="store_const", const=False, help="windows in order, not shuffled"
    )
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr-ratio", type=float)
    g.add_argument("--warmup", type=float, help="fraction of steps (< 1) or steps (>= 1)")
    g.add_argument("--betas", type=float, nargs=2)
    g.add_argument("--eps", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float)
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int)
    g.add_argument("--eval-windows", type=int)
    g.add_argument("--eval-batch-size", type=int)
    g.add_argument("--log-every", type=int)
    g.add_argument("--save-every", type=int)
    g.add_argument("--keep", dest="keep_checkpoints", type=int, help="checkpoints to keep")
    g.add_argument("--no-plots", dest="plots", action="store_const", const=False)
    g = p.add_argument_group("hardware")
    g.add_argument("--device")
    g.add_argument("--fast", action="store_const", const=True, help="wiola.fast (fused Triton kernels)")
    g.add_argument("--compile", action="store_const", const=True, help="torch.compile the model")
    g.add_argument(
        "--activation-checkpointing",
        action="store_const",
        const=True,
        help="recompute each block in the backward pass: less activation memory, ~1/3 more compute",
    )
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"])
    g.add_argument(
        "--no-progress", dest="progress", action="store_const", const=False,
        help="no progress bar (plain step lines instead; also what a pipe or log file gets)",
    )  # fmt: skip
    g.add_argument("--num-threads", type=int, help="tokeniser threads")
    g.add_argument("--peak-flops", type=float, help="peak FLOP/s of one device, for MFU")


def _parse_model_overrides(items: list[str] | None) -> dict[str, Any]:
    """``--model KEY=VALUE`` flags as ``WiolaConfig`` overrides. A VALUE is read as JSON (``64``,
    ``1e4``, ``null``) or else kept as a string (``ffn=gelu``); a bool field also takes ``True``
    and ``False`` in any case. ``WiolaConfig`` then refuses a value of the wrong kind by name
    (``gate=yes``: not a bool), so no flag silently means something else."""
    import typing

    from wiola.config import WiolaConfig

    fields = typing.get_type_hints(WiolaConfig)
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--model {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        if fields[key] is bool and value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of a ``wiola train`` command line (see ``add_train_arguments``).

    Settings not given anywhere take ``TrainConfig``'s defaults, which follow the preset (the
    default ``seq_len`` fits the model's ``max_seq_len``).
    """
    from wiola.train.config import load_config_file, recipe
    from wiola.train.run_folder import find_checkpoint, read_trainer_state

    settings: dict[str, Any] = {}
    if args.resume:
        checkpoint = find_checkpoint(args.resume)
        settings.update(read_trainer_state(checkpoint)["train_config"])
        settings["out_dir"] = str(checkpoint.parent.parent)  # the run folder, wherever it is now
    if args.recipe:
        settings.update(recipe(args.recipe))
    if args.config:
        settings.update(load_config_file(args.config))
    skip = {"config", "recipe", "resume", "overwrite", "func", "command", "model"}
    for key, value in vars(args).items():
        if key not in skip and value is not None:
            settings[key] = list(value) if isinstance(value, (list, tuple)) else value
    overrides = _parse_model_overrides(args.model)
    if overrides and isinstance(settings.get("model", {}), dict):  # else TrainConfig refuses the file's "model"
        settings["model"] = {**settings.get("model", {}), **overrides}
    return TrainConfig.from_dict(settings)


def run_train(args: argparse.Namespace) -> int:
    """Train as the flags say. Exit codes: 0 done, 1 the run diverged (a non-finite loss, gradient
    or weight: one line naming the step and what to change; the checkpoints written before it are
    kept), 2 bad input (raised, printed by ``wiola.cli.main``), 130 interrupted."""
    from wiola.train import train
    from wiola.train.loop import TrainingDiverged

    cfg = config_from_args(args)
    try:
        result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except TrainingDiverged as e:
        print(f"wiola train: error: {e}", file=sys.stderr)
        return 1
    if result.interrupted:  # the plots as far as the run went, then the exit status of a stop
        for name, path in result.plots.items():
            print(f"{name}: {path}")
        return 130
    if result.eval is not None and int(os.environ.get("RANK", "0")) == 0:  # once under torchrun: every rank has it
        print(f"final validation: {result.eval}")
    for name, path in result.plots.items():
        print(f"{name}: {path}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    return 0
