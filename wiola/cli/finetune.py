"""``wiola finetune``: supervised fine-tuning of a checkpoint on JSONL conversations or
prompt/completion pairs, the whole model or LoRA adapters (``wiola.train.finetune``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from wiola.cli.arguments import add_length_arguments, add_progress_flag, non_empty, non_empty_path


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.model import ADAPTER_TARGETS
    from wiola.train.sft import FORMATS

    p = sub.add_parser(
        "finetune",
        help="supervised fine-tuning (chat or prompt/completion JSONL; full or LoRA)",
        description="Fine-tune a checkpoint on JSONL data; only the assistant/completion tokens count in the loss. "
        "With --lora-rank only LoRA adapters train and are saved in PEFT's format (wiola merge folds them in).",
    )
    p.add_argument("--init", type=non_empty, required=True, metavar="CHECKPOINT", help="the checkpoint to start from")
    p.add_argument("--data", type=non_empty_path, required=True, metavar="FILE.jsonl")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="chat",
        help="chat: {'messages': [...]}; completion: {'prompt', 'completion'}",
    )
    p.add_argument(
        "--out", type=non_empty_path, default="runs/finetune", help="output folder (a checkpoint, or the adapters)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a model or adapters already in --out (deleting their files)"
    )
    add_length_arguments(p, steps=200, batch_size=8, lr=3e-4)
    p.add_argument("--warmup", type=int, help="learning-rate warm-up steps, at most --steps (default 10, or --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank instead of every weight")
    p.add_argument("--lora-alpha", type=float, help="LoRA scale numerator (default 2 x rank); needs --lora-rank")
    p.add_argument(
        "--lora-targets",
        help=f"comma-separated projections to adapt (default all: {','.join(ADAPTER_TARGETS)}); needs --lora-rank",
    )
    p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default 0); needs --lora-rank")
    p.add_argument("--add-role-tokens", action="store_true", help="add <|system|> <|user|> <|assistant|> as tokens")
    p.add_argument("--device")
    p.add_argument("--fast", action="store_true", help="wiola.fast (fused kernels)")
    add_progress_flag(p)
    p.set_defaults(func=run_finetune)
    register_demo(sub)


def run_finetune(args: argparse.Namespace) -> int:
    """Fine-tune as the flags say. Exit codes: 0 done, 1 the run diverged (a non-finite loss,
    gradient or weight: nothing saved), 2 bad input (raised, printed by ``wiola.cli.main``), 130
    interrupted (``FinetuneInterrupted``, a ``KeyboardInterrupt``: the model as of the last step
    saved, as the log line says)."""
    from wiola.train.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(
        init=args.init,
        data=args.data,
        format=args.format,
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        seed=args.seed,
        log_every=args.log_every,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=None
        if args.lora_targets is None
        else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
        lora_dropout=args.lora_dropout,
        add_role_tokens=args.add_role_tokens,
        device=args.device,
        fast=args.fast,
        progress=args.progress,
    )
    return _exit_code("finetune", lambda: finetune(cfg, overwrite=args.overwrite))


INSTRUCT_OUT = "runs/instruct"  # the demo's own folder: each run replaces what the previous one left there


def register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "instruct-demo",
        help="fine-tune a story model on instruction examples; measure word-following before and after",
        description="Writes TinyStories-Instruct-style examples (required words, features, the story), measures how "
        "often the model's story holds every required word on held-out instructions, fine-tunes, measures again.",
    )
    p.add_argument(
        "--init",
        type=non_empty,
        required=True,
        metavar="CHECKPOINT",
        help="e.g. the checkpoint `wiola demo` wrote",
    )
    p.add_argument("--out", type=non_empty_path, default=INSTRUCT_OUT)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the data/, model/ and results.json an --out folder already holds (else refused; the default "
        f"{INSTRUCT_OUT} is always replaced: it holds the previous demo)",
    )
    p.add_argument("--examples", type=int, default=2000, help="training examples")
    p.add_argument("--samples", type=int, default=200, help="held-out instructions measured before and after")
    add_length_arguments(p, steps=300, batch_size=8, lr=1e-3)
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--seed", type=int, default=0)
    add_progress_flag(p)
    p.set_defaults(func=run_instruct_demo)


def run_instruct_demo(args: argparse.Namespace) -> int:
    """Exit codes as ``run_finetune``'s (1: the fine-tune diverged)."""
    from wiola.train.instruct import instruct_demo

    return _exit_code(
        "instruct-demo",
        lambda: instruct_demo(
            args.init,
            args.out,
            n_train=args.examples,
            samples=args.samples,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            lora_rank=args.lora_rank,
            seed=args.seed,
            progress=args.progress,
            overwrite=args.overwrite or args.out == INSTRUCT_OUT,
        ),
    )


def _exit_code(command: str, work: Callable[[], object]) -> int:
    """Run ``work``: 0 when done, 1 (one line on stderr) when its fine-tune diverged."""
    from wiola.train.loop import TrainingDiverged

    try:
        work()
    except TrainingDiverged as e:
        print(f"wiola {command}: error: {e}", file=sys.stderr)
        return 1
    return 0
