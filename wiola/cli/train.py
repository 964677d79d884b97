"""The training sub-commands of ``wiola``: ``train``, ``eval``, ``gates`` and ``demo``.

``wiola.cli`` calls ``register(subparsers)``; every handler takes the parsed arguments and
returns an exit code (0 done, 130 interrupted with a checkpoint saved).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

BPE_HINT = (
    "set WIOLA_BPE_FILE to a GPT-2 rank file in tiktoken's format (gpt2.tiktoken, e.g. the copy shipped "
    "with this repository's tokenizers folder or openai-whisper's assets), or run once with network access "
    "so tiktoken can download and cache GPT-2's files"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``eval``, ``gates`` and ``demo`` to the ``wiola`` command."""
    p = subparsers.add_parser(
        "train",
        help="train a model (TinyStories, local files or the sample corpus)",
        description="Train a Wiola model. Flags override --config/--recipe; under "
        "torchrun --nproc_per_node N every rank runs this command.",
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train)

    p = subparsers.add_parser("eval", help="validation loss, perplexity and bits per byte of a checkpoint")
    _add_eval_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_eval)

    p = subparsers.add_parser("gates", help="mean gate per layer × head of a checkpoint, as a heat-map PNG")
    _add_eval_arguments(p)
    p.add_argument("--out", help="PNG path (default: gates.png next to the checkpoint)")
    p.add_argument("--windows", type=int, default=8, help="validation windows to average over")
    p.set_defaults(func=run_gates)

    p = subparsers.add_parser(
        "demo", help="train the tiny model on the built-in sample corpus (~2 minutes), then generate"
    )
    p.add_argument("--out", default="runs/demo", help="run folder (checkpoint, metrics, PNGs)")
    p.add_argument(
        "--steps", type=int, help="training steps (default 300 on CPU, ~2 minutes on 2 idle cores; 1500 on GPU)"
    )
    p.add_argument("--seconds", type=float, help="instead of --steps: calibrate the steps to this much training time")
    p.add_argument("--samples", type=int, default=3, help="stories to generate at the end")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", help="token cache folder (default $WIOLA_CACHE or ~/.cache/wiola)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)


# ---------------------------------------------------------------------------------------- train
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``wiola train`` flags. Every default is None: an unset flag keeps the value from the
    checkpoint (``--resume``), the recipe, the config file or ``TrainConfig``, in that order."""
    from wiola.config import PRESETS
    from wiola.train import RECIPES

    g = p.add_argument_group("setup")
    g.add_argument("--config", help="JSON file of TrainConfig fields (e.g. recipes/paper.json)")
    g.add_argument("--recipe", choices=sorted(RECIPES), help="a named recipe; 'paper' is the published 13M run")
    g.add_argument("--resume", metavar="DIR", help="continue exactly from a checkpoint or a run folder's latest one")
    g.add_argument(
        "--out", dest="out_dir", help="run folder (default runs/wiola; with --resume, the checkpoint's run folder)"
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS))
    g.add_argument("--model", action="append", metavar="KEY=VALUE", help="override a WiolaConfig field (repeatable)")
    g.add_argument("--tokenizer", help="gpt2 or gpt2-32k (default: the one matching vocab_size)")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="'tinystories' (default), 'sample', or text/JSONL/Parquet files or a folder")
    g.add_argument("--val-data", help="validation files (default: the folder's val files or a held-out share)")
    g.add_argument("--val-fraction", type=float)
    g.add_argument("--cache-dir", help="token cache folder (default $WIOLA_CACHE or ~/.cache/wiola)")
    g.add_argument("--seq-len", type=int, help="T: tokens predicted per window")
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
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"])
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False)
    g.add_argument("--num-threads", type=int, help="tokeniser threads")
    g.add_argument("--peak-flops", type=float, help="peak FLOP/s of one device, for MFU")


def _parse_model_overrides(items: list[str] | None) -> dict[str, Any]:
    from wiola.config import WiolaConfig

    fields = WiolaConfig.__dataclass_fields__
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--model {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def config_from_args(args: argparse.Namespace) -> Any:
    """The ``TrainConfig`` of a ``wiola train`` command line (see ``add_train_arguments``)."""
    from wiola.run_folder import find_checkpoint
    from wiola.train import RECIPES, TrainConfig, load_config_file

    settings = TrainConfig().to_dict()
    if args.resume:
        checkpoint = find_checkpoint(args.resume)
        saved = json.loads((checkpoint / "trainer.json").read_text())
        settings.update(saved["train_config"])
        settings["out_dir"] = str(checkpoint.parent.parent)  # the run folder, wherever it is now
    if args.recipe:
        settings.update(RECIPES[args.recipe])
    if args.config:
        settings.update(load_config_file(args.config))
    skip = {"config", "recipe", "resume", "func", "command", "model"}
    for key, value in vars(args).items():
        if key not in skip and value is not None:
            settings[key] = list(value) if isinstance(value, (list, tuple)) else value
    if args.model:
        settings["model"] = {**settings.get("model", {}), **_parse_model_overrides(args.model)}
    return TrainConfig.from_dict(settings)


def run_train(args: argparse.Namespace) -> int:
    from wiola.train import train

    cfg = config_from_args(args)
    result = train(cfg, resume=args.resume)
    if result.interrupted:
        return 130
    if result.eval is not None:
        print(f"final validation: {result.eval}")
    for name, path in result.plots.items():
        print(f"{name}: {path}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    return 0


# ------------------------------------------------------------------------------------ eval/gates
def _add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a model folder (config.json + weights) or a run folder")
    p.add_argument("--data", help="default: the data the checkpoint was trained on (TinyStories if unknown)")
    p.add_argument("--val-data")
    p.add_argument("--cache-dir")
    p.add_argument("--seq-len", type=int, help="default: the training seq_len (or min(512, max_seq_len - 1))")
    p.add_argument("--eval-windows", type=int, help="validation windows to score (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--fast", action="store_true", help="wiola.fast (fused Triton kernels)")


def _load_for_eval(args: argparse.Namespace) -> tuple[Any, Any, Any, int, Path]:
    """(model, encoding, token data, seq_len, model folder) for ``eval``/``gates``."""
    from wiola.data import prepare_data, resolve_source
    from wiola.run_folder import TRAINER_FILE, find_checkpoint
    from wiola.train import model_class, resolve_device, tokenizer_for

    path = Path(args.checkpoint)
    if not (path / "config.json").is_file():
        path = find_checkpoint(path)
    trainer = json.loads((path / TRAINER_FILE).read_text()) if (path / TRAINER_FILE).is_file() else None
    device = resolve_device(args.device)
    model = model_class(args.fast).from_pretrained(path, device=device)
    model.eval()
    saved_cfg = trainer["train_config"] if trainer else {}
    data_arg = args.data or saved_cfg.get("data") or "tinystories"
    val_arg = args.val_data if args.data else (args.val_data or saved_cfg.get("val_data"))
    encoding = tokenizer_for(model.config, trainer.get("tokenizer") if trainer else None)
    source = resolve_source(data_arg, val_arg, saved_cfg.get("val_fraction", 0.01))
    data = prepare_data(
        source, encoding, args.cache_dir or saved_cfg.get("cache_dir"), log=lambda m: print(m, file=sys.stderr)
    )
    seq_len = args.seq_len or saved_cfg.get("seq_len") or min(512, model.config.max_seq_len - 1)
    if seq_len + 1 > model.config.max_seq_len:
        raise ValueError(
            f"--seq-len {seq_len}: windows of {seq_len + 1} tokens exceed max_seq_len={model.config.max_seq_len}"
        )
    return model, encoding, data, seq_len, path


def run_eval(args: argparse.Namespace) -> int:
    from wiola.data import token_byte_lengths
    from wiola.evaluate import evaluate

    model, encoding, data, seq_len, path = _load_for_eval(args)
    result = evaluate(
        model,
        data.val,
        token_byte_lengths(encoding),
        seq_len,
        batch_size=args.batch_size,
        max_windows=args.eval_windows,
    )
    if args.json:
        print(json.dumps({"checkpoint": str(path), "seq_len": seq_len, **result.to_dict()}))
    else:
        print(f"{path}: {data.manifest['source']}, {result.windows} windows of {seq_len} tokens")
        print(f"loss {result.loss:.4f}\nperplexity {result.perplexity:.3f}\nbits per byte {result.bits_per_byte:.4f}")
    return 0


def run_gates(args: argparse.Namespace) -> int:
    from wiola.data import eval_batches
    from wiola.evaluate import autocast_context, gate_statistics
    from wiola.plots import plot_gate_heatmap

    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")
    model, _, data, seq_len, path = _load_for_eval(args)
    batch = next(eval_batches(data.val, seq_len, args.windows, max_windows=args.windows))
    device = next(model.parameters()).device
    with autocast_context(device):
        gates = gate_statistics(model, batch.to(device))
    out = Path(args.out) if args.out else path / "gates.png"
    plot_gate_heatmap(gates, out, title=f"mean gate per layer × head ({path.name})")
    print("layer  " + "  ".join(f"h{h:<4d}" for h in range(gates.shape[1])))
    for layer, row in enumerate(gates.tolist()):
        print(f"{layer:>5}  " + "  ".join(f"{g:.3f}" for g in row))
    print(f"gate heat map: {out}")
    return 0


# ------------------------------------------------------------------------------------------ demo
def _demo_tokenizer() -> Any:
    from wiola.tokenizer import get_encoding

    try:
        return get_encoding("gpt2-32k")
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        raise RuntimeError(f"the demo cannot load the GPT-2 tokenizer: {e}\nTo fix: {BPE_HINT}.") from e


def _calibrate(cfg: Any, seconds: float, device: torch.device) -> tuple[int, float]:
    """Steps that fit ``seconds`` of training, from timing a few steps of a throw-away model."""
    from wiola.train import build_optimizer, model_class

    torch.manual_seed(1234)
    model = model_class(cfg.fast)(cfg.model_config()).to(device)
    opt = build_optimizer(model, cfg, device)
    x = torch.randint(0, 2000, (cfg.batch_size, cfg.seq_len + 1), device=device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with autocast:
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    per_step = sorted(times[1:])[1]  # median of the warm steps
    # ~12 % of the time goes to evaluations, plots and checkpoints.
    return max(30, min(20000, int(0.88 * seconds / per_step))), per_step


def run_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from wiola.data import prepare_data, resolve_source, unigram_entropy
    from wiola.model import WiolaModel
    from wiola.train import TrainConfig, model_class, resolve_device, train

    t_start = time.perf_counter()
    device = resolve_device(args.device)
    cores = os.cpu_count() or 1
    if device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores:
        # Other processes already keep every core busy: several intra-op threads would only wait
        # for each other (measured 6x slower on a loaded 2-core machine).
        torch.set_num_threads(1)
        print(f"the CPU is busy (load {os.getloadavg()[0]:.1f} on {cores} cores): training on one thread")
    encoding = _demo_tokenizer()
    fast = False
    if device.type == "cuda":
        try:
            model_class(True)
            fast = True
        except RuntimeError:
            print("wiola.fast is not available: the GPU demo uses the reference model")
    gpu = device.type == "cuda"
    # CPU: small batches learn most per second (4 × 128 reaches a validation loss near 0.7 in
    # ~300 steps). GPU: a 20× larger generated corpus, so two minutes do not just memorise it.
    cfg = TrainConfig(
        preset="tiny",
        data="sample:20000" if gpu else "sample",
        cache_dir=args.cache_dir,
        seq_len=256 if gpu else 128,
        batch_size=32 if gpu else 4,
        steps=100,  # replaced below
        lr=3e-3,
        min_lr_ratio=0.1,
        warmup=0.05,
        weight_decay=0.1,
        out_dir=args.out,
        eval_windows=64,
        eval_batch_size=16,
        log_every=5,
        save_every=10**9,
        keep_checkpoints=1,
        device=str(device),
        fast=fast,
        seed=args.seed,
        progress=not args.no_progress,
    )
    data = prepare_data(resolve_source(cfg.data), encoding, args.cache_dir, progress=not args.no_progress)
    entropy = unigram_entropy(np.asarray(data.train.tokens()), encoding.n_vocab)
    print(
        f"sample corpus: {data.train.documents:,} train stories ({data.train.text_bytes / 1e3:.0f} KB, "
        f"{len(data.train):,} tokens), {data.val.documents:,} validation stories"
    )
    print(f"unigram entropy of the training tokens: {entropy:.3f} nats/token (the loss of a context-free model)")
    if args.seconds is not None:
        if args.steps is not None:
            raise ValueError("give --steps or --seconds, not both")
        steps, per_step = _calibrate(cfg, args.seconds, device)
        epochs = 8  # more passes over the corpus only overfit
        steps = min(steps, max(30, epochs * len(data.train) // (cfg.batch_size * cfg.seq_len)))
        print(f"calibrated: {per_step * 1e3:.0f} ms/step -> {steps} steps for ~{args.seconds:.0f} s of training")
    else:
        # A fixed default makes the demo's losses the same on every machine (only the time varies).
        steps = args.steps if args.steps is not None else (1500 if gpu else 300)
        if steps < 1:
            raise ValueError(f"--steps must be >= 1, got {steps}")
    cfg.steps = steps
    cfg.eval_every = max(1, steps // 4)
    t_train = time.perf_counter()
    result = train(cfg, references={"unigram entropy": entropy})
    train_seconds = time.perf_counter() - t_train
    if result.interrupted or result.checkpoint is None:
        return 130

    model = WiolaModel.from_pretrained(result.checkpoint, device=device)
    model.eval()
    eot = encoding.eot_token
    prompts = ["Once upon a time", "One day,", ""]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    print("\n--- generated stories (temperature 0.8, top-k 40) ---")
    for i in range(args.samples):
        prompt = prompts[i % len(prompts)]
        ids = torch.tensor([[eot, *encoding.encode_ordinary(prompt)]], device=device)
        out = model.generate(ids, 160, temperature=0.8, top_k=40, eos_token_id=eot, generator=generator)
        new = [t for t in out[0, 1:].tolist()]
        if eot in new:
            new = new[: new.index(eot)]
        print(f"\n[{i + 1}] {encoding.decode(new).strip()}")
    ev = result.eval
    print("\n--- result ---")
    print(f"training: {result.step} steps in {train_seconds:.0f} s; final train loss {result.train_loss:.3f}")
    if ev is not None:
        print(
            f"validation: loss {ev.loss:.3f} nats/token (unigram entropy {entropy:.3f}), perplexity {ev.perplexity:.2f}, "
            f"{ev.bits_per_byte:.3f} bits/byte"
        )
    print(f"checkpoint: {result.checkpoint}")
    for name, path in result.plots.items():
        print(f"{name}: {path}")
    print(f"total wall time: {time.perf_counter() - t_start:.0f} s")
    if ev is not None and not ev.loss < entropy:
        print("warning: the validation loss did not fall below the unigram entropy", file=sys.stderr)
    return 0 if ev is None or math.isfinite(ev.loss) else 1
