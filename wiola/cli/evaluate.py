"""``wiola eval`` (validation loss, perplexity, bits per byte) and ``wiola gates`` (the mean gate
per layer × head as a heat map) of a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from wiola.cli.arguments import add_progress_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a checkpoint")
    _add_eval_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    g = p.add_argument_group("lm-evaluation-harness (the eval extra): --tasks scores tasks instead of val loss")
    g.add_argument("--tasks", help="comma-separated lm-eval task names (or groups)")
    g.add_argument("--include-path", help="a folder of extra task YAML files")
    g.add_argument("--num-fewshot", type=int)
    g.add_argument("--limit", type=float, help="documents per task (a fraction when < 1)")
    g.add_argument(
        "--quantize", choices=["int8", "int4", "bf16"], help="weight-only int8/int4/bf16 (the C++ CPU step's forms)"
    )
    g.add_argument("--output", help="write lm-eval's results JSON here")
    p.set_defaults(func=run_eval)

    p = sub.add_parser("gates", help="mean gate per layer × head of a checkpoint, as a heat-map PNG")
    _add_eval_arguments(p)
    p.add_argument("--out", help="PNG path (default: gates.png next to the checkpoint)")
    p.add_argument("--windows", type=int, default=8, help="validation windows to average over")
    p.set_defaults(func=run_gates)


def _add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", required=True, help="a model folder (config.json + weights), a run folder or a Hub id"
    )
    p.add_argument("--data", help="default: the data the checkpoint was trained on (TinyStories if unknown)")
    p.add_argument("--val-data")
    p.add_argument("--cache-dir")
    p.add_argument("--seq-len", type=int, help="default: the training seq_len (or min(512, max_seq_len - 1))")
    p.add_argument("--eval-windows", type=int, help="validation windows to score (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="default: the training precision (or auto)")
    p.add_argument("--fast", action="store_true", help="wiola.fast (fused Triton kernels)")
    add_progress_flag(p)


def _check_eval_arguments(args: argparse.Namespace) -> None:
    """The counts ``eval``/``gates`` take, checked before anything loads: each >= 1 (None: the default)."""
    for flag in ("--seq-len", "--eval-windows", "--batch-size", "--windows"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _load_for_eval(args: argparse.Namespace) -> tuple[Any, Any, Any, int, str, Path]:
    """(model, encoding, token data, seq_len, precision, model folder) for ``eval``/``gates``."""
    from wiola.checkpoint import load_checkpoint_tokenizer, resolve_checkpoint
    from wiola.train.config import default_seq_len
    from wiola.train.data import prepare_data, resolve_source
    from wiola.train.env import model_class, resolve_device
    from wiola.train.run_folder import find_checkpoint, is_training_checkpoint, read_trainer_state

    path = resolve_checkpoint(args.checkpoint)
    if not (path / "config.json").is_file():
        path = find_checkpoint(path)
    trainer = read_trainer_state(path) if is_training_checkpoint(path) else {}
    device = resolve_device(args.device)
    model = model_class(args.fast).from_pretrained(path, device=device)
    model.eval()
    saved_cfg = trainer.get("train_config", {})
    data_arg = args.data or saved_cfg.get("data") or "tinystories"
    val_arg = args.val_data if args.data else (args.val_data or saved_cfg.get("val_data"))
    encoding = load_checkpoint_tokenizer(path)
    source = resolve_source(data_arg, val_arg, saved_cfg.get("val_fraction", 0.01))
    data = prepare_data(
        source, encoding, args.cache_dir or saved_cfg.get("cache_dir"), progress=args.progress, log=_say
    )
    seq_len = args.seq_len if args.seq_len is not None else saved_cfg.get("seq_len") or default_seq_len(model.config)
    if seq_len + 1 > model.config.max_seq_len:
        raise ValueError(
            f"--seq-len {seq_len}: windows of {seq_len + 1} tokens exceed max_seq_len={model.config.max_seq_len}"
        )
    precision = args.precision or saved_cfg.get("precision") or "auto"
    return model, encoding, data, seq_len, precision, path


def run_tasks(args: argparse.Namespace) -> int:
    """``wiola eval --tasks``: lm-eval's ``simple_evaluate`` on ``wiola.train.harness.WiolaLM``."""
    try:
        import lm_eval
    except ImportError as e:
        raise RuntimeError(f"wiola eval --tasks needs lm-eval ({e}): pip install 'wiola-slm[eval]'") from e

    from wiola.train.harness import WiolaLM, task_manager

    if args.include_path and not Path(args.include_path).is_dir():
        raise FileNotFoundError(f"--include-path {args.include_path!r} is not a folder")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks names no task")
    manager = task_manager(args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown} (add --include-path DIR for local YAML tasks)")
    lm = WiolaLM(
        args.checkpoint, batch_size=args.batch_size, device=args.device, quantize=args.quantize, progress=args.progress
    )
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=manager, log_samples=False
    )
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"results: {args.output}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    _check_eval_arguments(args)
    if args.tasks is not None:
        return run_tasks(args)
    if args.quantize:
        raise ValueError("--quantize goes with --tasks")
    from wiola.train.batches import eval_windows
    from wiola.train.data import token_byte_lengths
    from wiola.train.env import Progress
    from wiola.train.evaluate import evaluate

    model, encoding, data, seq_len, precision, path = _load_for_eval(args)
    windows = eval_windows(data.val, seq_len, args.eval_windows)
    progress = Progress(windows, "scoring", "window", show=args.progress, log=_say, leave=False)
    t0 = time.perf_counter()
    result = evaluate(
        model,
        data.val,
        token_byte_lengths(encoding),
        seq_len,
        batch_size=args.batch_size,
        max_windows=args.eval_windows,
        precision=precision,
        progress=progress.update,
    )
    progress.close(f"scored {result.windows:,} windows ({result.tokens:,} tokens) in {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(json.dumps({"checkpoint": str(path), "seq_len": seq_len, "precision": precision, **result.to_dict()}))
    else:
        print(f"{path}: {data.manifest['source']}, {result.windows} windows of {seq_len} tokens ({precision})")
        print(f"loss {result.loss:.4f}\nperplexity {result.perplexity:.3f}\nbits per byte {result.bits_per_byte:.4f}")
    return 0


def run_gates(args: argparse.Namespace) -> int:
    from wiola.train.data import eval_batches
    from wiola.train.env import autocast
    from wiola.train.evaluate import gate_statistics
    from wiola.train.plots import plot_gate_heatmap
    from wiola.train.run_folder import check_output_folder

    _check_eval_arguments(args)
    if args.out is not None:  # the PNG's folder, checked before the work
        if Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a folder; give the PNG file's path")
        check_output_folder(Path(args.out).parent, "the folder of --out")
    model, _, data, seq_len, precision, path = _load_for_eval(args)
    batch = next(eval_batches(data.val, seq_len, args.windows, max_windows=args.windows))
    device = next(model.parameters()).device
    with autocast(device, precision):
        gates = gate_statistics(model, batch.to(device))
    out = Path(args.out) if args.out else path / "gates.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_gate_heatmap(gates, out, title=f"mean gate per layer × head ({path.name})")
    print("layer  " + "  ".join(f"h{h:<4d}" for h in range(gates.shape[1])))
    for layer, row in enumerate(gates.tolist()):
        print(f"{layer:>5}  " + "  ".join(f"{g:.3f}" for g in row))
    print(f"gate heat map: {out}")
    return 0
