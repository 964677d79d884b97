"""``wiola eval`` (validation loss, perplexity, bits per byte) and ``wiola gates`` (the mean gate
per layer × head as a heat map) of a checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from wiola.cli.arguments import add_progress_flag, non_empty, non_empty_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a checkpoint")
    _add_eval_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON (with --tasks: lm-eval's results)")
    g = p.add_argument_group(
        "lm-evaluation-harness (the eval extra): --tasks scores tasks instead of val loss",
        "With --tasks: --seq-len is the context one forward sees (lm-eval's max_length, default max_seq_len); "
        "--json prints lm-eval's results JSON instead of its table; --batch-size, --device and --no-progress "
        "apply; the model is always wiola.fast (--fast changes nothing). --data, --val-data, --cache-dir and "
        "--eval-windows (the tasks bring their documents) and --precision (tasks score in fp32) are refused, as "
        "the flags below are without --tasks.",
    )
    g.add_argument("--tasks", help="comma-separated lm-eval task names (or groups)")
    g.add_argument("--include-path", type=non_empty_path, help="a folder of extra task YAML files")
    g.add_argument("--num-fewshot", type=int, help="examples put before each question (>= 0; default: each task's)")
    g.add_argument("--limit", type=float, help="documents per task: a whole number, or a fraction of them when < 1")
    g.add_argument(
        "--quantize", choices=["int8", "int4", "bf16"], help="weight-only int8/int4/bf16 (the C++ CPU step's forms)"
    )
    g.add_argument("--output", type=non_empty_path, help="write lm-eval's results JSON here")
    p.set_defaults(func=run_eval)

    p = sub.add_parser("gates", help="mean gate per layer × head of a checkpoint, as a heat-map PNG")
    _add_eval_arguments(p, scoring=False)
    p.add_argument(
        "--out",
        type=non_empty_path,
        help="PNG path (default: gates.png next to a local checkpoint; ./gates.png for a Hub id)",
    )
    p.add_argument("--windows", type=int, default=8, help="validation windows to average over")
    p.set_defaults(func=run_gates)


def _add_eval_arguments(p: argparse.ArgumentParser, scoring: bool = True) -> None:
    """The flags ``eval`` and ``gates`` share; ``scoring``: also ``--eval-windows`` and
    ``--batch-size``, which ``gates`` does not take (it averages ``--windows`` windows in one
    forward pass), so that there they are refused rather than ignored."""
    p.add_argument(
        "--checkpoint",
        type=non_empty,
        required=True,
        help="a model folder (config.json + weights), a run folder or a Hub id",
    )
    p.add_argument(
        "--data", type=non_empty_path, help="default: the data the checkpoint was trained on (TinyStories if unknown)"
    )
    p.add_argument("--val-data", type=non_empty_path)
    p.add_argument("--cache-dir", type=non_empty_path)
    p.add_argument("--seq-len", type=int, help="default: the training seq_len (or min(512, max_seq_len - 1))")
    if scoring:
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


# ``eval`` scores either the validation loss or lm-eval tasks: each mode's own flags, and why the
# other mode refuses them (a flag it would silently ignore). Their defaults are None: None is "not given".
_TASK_FLAGS = ("--include-path", "--num-fewshot", "--limit", "--quantize", "--output")
_VAL_LOSS_FLAGS = {
    "--data": "the tasks bring their own documents",
    "--val-data": "the tasks bring their own documents",
    "--cache-dir": "the tasks bring their own documents",
    "--eval-windows": "the tasks bring their own documents (--limit caps them)",
    "--precision": "tasks score in fp32 (--quantize bf16 gives bf16 weights)",
}


def _given(args: argparse.Namespace, flag: str) -> bool:
    return getattr(args, flag[2:].replace("-", "_"), None) is not None


def _check_task_arguments(args: argparse.Namespace) -> None:
    """``eval``'s flags of one mode refused in the other, by name, and ``--tasks``' own values
    (``--limit`` > 0, whole from 1 on; ``--num-fewshot`` >= 0; ``--output`` writable), checked
    before anything loads. A whole ``--limit`` becomes an int (lm-eval reads a float < 1 as a fraction)."""
    if args.tasks is None:
        for flag in _TASK_FLAGS:
            if _given(args, flag):
                raise ValueError(f"{flag} goes with --tasks")
        return
    for flag, why in _VAL_LOSS_FLAGS.items():
        if _given(args, flag):
            raise ValueError(f"{flag} does not go with --tasks: {why}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.limit is not None:
        if not args.limit > 0:  # NaN too
            raise ValueError(
                f"--limit must be > 0 (documents per task, or a fraction of them when < 1), got {args.limit:g}"
            )
        if args.limit >= 1:
            if not args.limit.is_integer():
                raise ValueError(f"--limit {args.limit:g}: a number of documents is whole (a fraction is < 1)")
            args.limit = int(args.limit)
    if args.output is not None:
        _check_output_file(args.output, "--output")


def _check_output_file(path: str | Path, flag: str) -> None:
    """``ValueError`` naming ``flag`` unless a file can be written at ``path``: not a folder, its
    folder a folder or makeable (``check_output_folder``), and, where that folder exists, one that
    takes a new file (a probe file, removed at once: a pseudo file system such as /proc passes the
    permission checks and refuses files only when one is written). Called before the work."""
    import tempfile

    from wiola.train.run_folder import check_output_folder

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give the file's path")
    check_output_folder(path.parent, f"the folder of {flag}")
    if path.parent.is_dir():
        try:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
                pass
        except OSError as e:
            raise ValueError(
                f"{flag} {str(path)!r}: no file can be written in {str(path.parent)!r} ({e.strerror or e})"
            ) from None


def _write_failed(flag: str, path: Path, error: OSError) -> ValueError:
    """The one-line error of an output file that the early check let through but that failed to write."""
    return ValueError(f"{flag} {str(path)!r} could not be written: {error.strerror or error}")


def _eval_source(args: argparse.Namespace, saved: dict[str, Any], checkpoint: Path) -> Any:
    """The ``DataSource`` whose validation split ``eval``/``gates`` score: ``--data`` (with
    ``--val-data``), ``--val-data`` alone, else the data of the checkpoint's training config
    (``saved``; TinyStories when there is none); that config's validation files, which alone
    decide the split, are scored without its training data when that is not here.
    ``FileNotFoundError`` for a path of the training config that is not here names where it came from."""
    from wiola.train.data import absolute_data_path, is_named_source, resolve_source, validation_source

    fraction = saved.get("val_fraction", 0.01)
    # Absolute, as training keeps them: a relative --data then opens the run's token cache.
    val_flag = absolute_data_path(args.val_data or None)
    if args.data:
        return resolve_source(absolute_data_path(args.data), val_flag, fraction)
    if val_flag:
        return validation_source(val_flag)
    data, val_data = saved.get("data") or "tinystories", saved.get("val_data")
    paths = {"data": None if is_named_source(data) else data, "validation data": val_data}
    missing = {what: value for what, value in paths.items() if value and not Path(value).expanduser().exists()}
    if list(missing) == ["data"] and val_data is not None:
        return validation_source(val_data)
    for what, value in missing.items():
        relative = "" if Path(value).expanduser().is_absolute() else ", read from this working directory"
        raise FileNotFoundError(
            f"{what} path {value!r} (from the training config of checkpoint {checkpoint}{relative}) "
            "does not exist; pass --data PATH (and --val-data PATH), or --val-data PATH alone, for the data to score"
        )
    return resolve_source(data, val_data, fraction)


def _load_for_eval(args: argparse.Namespace) -> tuple[Any, Any, Any, int, str, Path]:
    """(model, encoding, token data, seq_len, precision, model folder) for ``eval``/``gates``."""
    from wiola.checkpoint import load_checkpoint_tokenizer, quantization_of, resolve_checkpoint
    from wiola.train.config import default_seq_len
    from wiola.train.data import prepare_val_data
    from wiola.train.env import model_class, resolve_device
    from wiola.train.run_folder import find_checkpoint, is_training_checkpoint, read_trainer_state

    path = resolve_checkpoint(args.checkpoint)
    if not (path / "config.json").is_file():
        path = find_checkpoint(path)
    trainer = read_trainer_state(path) if is_training_checkpoint(path) else {}
    device = resolve_device(args.device)
    # a quantized checkpoint loads only as wiola.fast, which runs it (its forward on the dequantized weights)
    model = model_class(args.fast or quantization_of(path) is not None).from_pretrained(path, device=device)
    model.eval()
    saved_cfg = trainer.get("train_config", {})
    seq_len = args.seq_len if args.seq_len is not None else saved_cfg.get("seq_len") or default_seq_len(model.config)
    if seq_len + 1 > model.config.max_seq_len:  # before any tokenising
        raise ValueError(
            f"--seq-len {seq_len}: windows of {seq_len + 1} tokens exceed max_seq_len={model.config.max_seq_len}"
        )
    encoding = load_checkpoint_tokenizer(path)
    encoding.check_fits(model.config.vocab_size)  # before a whole data set is tokenised with it
    source = _eval_source(args, saved_cfg, path)
    data = prepare_val_data(  # the validation split alone: the train split is not tokenised
        source, encoding, args.cache_dir or saved_cfg.get("cache_dir"), progress=args.progress, log=_say
    )
    precision = args.precision or saved_cfg.get("precision") or "auto"
    return model, encoding, data, seq_len, precision, path


def run_tasks(args: argparse.Namespace) -> int:
    """``wiola eval --tasks``: lm-eval's ``simple_evaluate`` on ``wiola.train.harness.WiolaLM``."""
    try:
        import lm_eval
    except ImportError as e:
        raise RuntimeError(f"wiola eval --tasks needs lm-eval ({e}): pip install 'wiola-slm[eval]'") from e

    from wiola.train.harness import WiolaLM, lm_eval_bars, load_for_harness, task_manager

    if args.include_path and not Path(args.include_path).is_dir():
        raise FileNotFoundError(f"--include-path {args.include_path!r} is not a folder")
    tasks = [t.strip() for t in args.tasks.split(",")]
    if not any(tasks):
        raise ValueError("--tasks names no task")
    if not all(tasks):  # "a,,b" or a trailing comma: a name left out by mistake, not silently dropped
        raise ValueError(f"--tasks {args.tasks!r} has an empty name between its commas")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise ValueError(f"--tasks names {', '.join(twice)} more than once")
    manager = task_manager(args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown} (add --include-path DIR for local YAML tasks)")
    model, tokenizer = load_for_harness(args.checkpoint, args.device, args.quantize)
    if args.seq_len is not None and not 2 <= args.seq_len <= model.config.max_seq_len:
        raise ValueError(
            f"--seq-len {args.seq_len}: with --tasks it is the context one forward sees and must be in "
            f"[2, max_seq_len={model.config.max_seq_len}]"
        )
    lm = WiolaLM(
        args.checkpoint, batch_size=args.batch_size, max_length=args.seq_len, progress=args.progress,
        model=model, tokenizer=tokenizer,
    )  # fmt: skip
    try:
        # what lm-eval prints as it goes goes to stderr: stdout is the table, or the JSON of --json
        with lm_eval_bars(args.progress), contextlib.redirect_stdout(sys.stderr):
            results = lm_eval.simple_evaluate(
                model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=manager,
                log_samples=False,
            )  # fmt: skip
    except Exception as e:
        if not _hub_unreachable(e):
            raise
        offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if _env_flag(v)]
        raise RuntimeError(
            "a task's dataset must come from the Hugging Face Hub, which could not be reached"
            f"{f' ({offline[0]} is set)' if offline else ''}: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
            "Run once with network (the dataset is then cached) or use --include-path with a local task"
        ) from None
    from lm_eval.utils import make_table

    print(json.dumps(results, default=str) if args.json else make_table(results))
    if args.output:
        out = Path(args.output)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        except OSError as e:
            raise _write_failed("--output", out, e) from None
        print(f"results: {args.output}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the Hugging Face Hub could not be reached: no
    network, offline mode, a timeout. ``datasets`` raises the builtin ``ConnectionError`` then (an
    ``OSError``); older versions let ``requests``' and ``httpx``' errors through."""
    names = {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "OfflineModeIsEnabled"}
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, BrokenPipeError):  # a ConnectionError too, but a closed pipe of ours
            return False
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in names:
            return True
        e = e.__cause__ or e.__context__
    return False


def run_eval(args: argparse.Namespace) -> int:
    _check_eval_arguments(args)
    _check_task_arguments(args)
    if args.tasks is not None:
        return run_tasks(args)
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
        full, short = divmod(result.tokens, seq_len)  # windows of seq_len targets, and a shorter last one's
        if full:
            windows = f"{full} window{'s' if full != 1 else ''} of {seq_len} tokens" + (
                f" and one of {short}" if short else ""
            )
        else:
            windows = f"one window of {short} tokens"
        print(f"{path}: {data.manifest['source']}, {windows} ({precision})")
        print(
            f"loss {result.loss:.4f}\nperplexity {result.perplexity_text()}\nbits per byte {result.bits_per_byte:.4f}"
        )
    return 0


def run_gates(args: argparse.Namespace) -> int:
    from wiola.train.data import eval_batches
    from wiola.train.env import autocast
    from wiola.train.evaluate import gate_statistics
    from wiola.train.plots import plot_gate_heatmap

    _check_eval_arguments(args)
    # A Hub id's folder is a snapshot in the Hugging Face cache, named by its commit: the PNG goes
    # to the working folder instead, and the plot is titled with the repo id.
    hub = not Path(args.checkpoint).exists()
    out = Path(args.out) if args.out is not None else Path("gates.png") if hub else None
    if out is not None:  # checked before the work (a local checkpoint's own folder is known only once found)
        _check_output_file(out, "--out")
    model, _, data, seq_len, precision, path = _load_for_eval(args)
    batch = next(eval_batches(data.val, seq_len, args.windows, max_windows=args.windows))
    device = next(model.parameters()).device
    with autocast(device, precision):
        gates = gate_statistics(model, batch.to(device))
    out = path / "gates.png" if out is None else out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_gate_heatmap(gates, out, title=f"mean gate per layer × head ({args.checkpoint if hub else path.name})")
    except OSError as e:
        raise _write_failed("--out", out, e) from None
    print("layer  " + "  ".join(f"h{h:<4d}" for h in range(gates.shape[1])))
    for layer, row in enumerate(gates.tolist()):
        print(f"{layer:>5}  " + "  ".join(f"{g:.3f}" for g in row))
    print(f"gate heat map: {out}")
    return 0
