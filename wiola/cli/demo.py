"""``wiola demo``: train the tiny preset on the built-in sample corpus (~90 s on 2 idle CPU cores), then generate."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import torch

from wiola.cli.arguments import non_empty_path
from wiola.train.config import TrainConfig

BPE_HINT = (
    "set WIOLA_BPE_FILE to a GPT-2 rank file in tiktoken's format (gpt2.tiktoken, e.g. the copy shipped "
    "with this repository's tokenizers folder or openai-whisper's assets), or run once with network access "
    "so tiktoken can download and cache GPT-2's files"
)


DEMO_OUT = "runs/demo"  # the demo's own folder: each demo replaces the run the previous one left there


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train the tiny model on the built-in sample corpus (~90 s on 2 CPU cores), then generate"
    )
    p.add_argument("--out", type=non_empty_path, default=DEMO_OUT, help="run folder (checkpoint, metrics, PNGs)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the run an --out folder already holds (else refused; the default {DEMO_OUT} is always "
        "replaced: it holds the previous demo)",
    )
    p.add_argument("--steps", type=int, help="training steps (default 300 on CPU, ~90 s on 2 idle cores; 1500 on GPU)")
    p.add_argument("--seconds", type=float, help="instead of --steps: calibrate the steps to this much training time")
    p.add_argument("--samples", type=int, default=3, help="stories to generate at the end")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--cache-dir",
        type=non_empty_path,
        help="token cache folder (default: $WIOLA_CACHE, else $WIOLA_CACHE_DIR, $XDG_CACHE_HOME/wiola or ~/.cache/wiola)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from wiola.train import TrainingDiverged, train
    from wiola.train.env import resolve_device
    from wiola.train.evaluate import unigram_entropy
    from wiola.train.run_folder import check_new_run, check_output_folder
    from wiola.train.sources import resolve_source
    from wiola.train.token_cache import prepare_data

    _check_flags(args)
    check_output_folder(args.out, "--out")
    overwrite = args.overwrite or args.out == DEMO_OUT  # running the demo again replaces the last demo
    if not overwrite:
        check_new_run(args.out)
    t_start = time.perf_counter()
    device = resolve_device(args.device)
    _spare_a_busy_cpu(device)
    encoding = _demo_tokenizer()
    cfg = _demo_config(args, device)
    data = prepare_data(resolve_source(cfg.data), encoding, args.cache_dir, progress=not args.no_progress)
    entropy = unigram_entropy(np.asarray(data.train.tokens()), encoding.vocab_size)
    print(
        f"sample corpus: {data.train.documents:,} train stories ({data.train.text_bytes / 1e3:.0f} KB, "
        f"{len(data.train):,} tokens), {data.val.documents:,} validation stories"
    )
    print(f"unigram entropy of the training tokens: {entropy:.3f} nats/token (the loss of a context-free model)")
    cfg.steps = _demo_steps(args, cfg, device, len(data.train))
    cfg.eval_every = max(1, cfg.steps // 4)
    t_train = time.perf_counter()
    try:
        result = train(cfg, references={"unigram entropy": entropy}, overwrite=overwrite)
    except TrainingDiverged as e:  # the demo's settings are fixed: no flag to change, so the step and checkpoint
        where = "no checkpoint was saved" if e.checkpoint is None else f"the last checkpoint before it: {e.checkpoint}"
        print(f"wiola demo: error: the demo's training diverged at step {e.step:,} ({where})", file=sys.stderr)
        return 1
    train_seconds = time.perf_counter() - t_train
    if result.interrupted or result.checkpoint is None:
        return 130
    _print_stories(result.checkpoint, encoding, args.samples, args.seed, device)
    ev = result.eval
    print("\n--- result ---")
    print(f"training: {result.step} steps in {train_seconds:.0f} s; final train loss {result.train_loss:.3f}")
    if ev is not None:
        print(
            f"validation: loss {ev.loss:.3f} nats/token (unigram entropy {entropy:.3f}), perplexity {ev.perplexity_text()}, "
            f"{ev.bits_per_byte:.3f} bits/byte"
        )
    print(f"checkpoint: {result.checkpoint}")
    for name, path in result.plots.items():
        print(f"{name}: {path}")
    print(f"total wall time: {time.perf_counter() - t_start:.0f} s")
    if ev is not None and not ev.loss < entropy:
        print("warning: the validation loss did not fall below the unigram entropy", file=sys.stderr)
    return 0 if ev is None or math.isfinite(ev.loss) else 1


def _spare_a_busy_cpu(device: torch.device) -> None:
    cores = os.cpu_count() or 1
    if device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] >= cores:
        # Other processes already keep every core busy: several intra-op threads would only wait
        # for each other (measured 6x slower on a loaded 2-core machine).
        torch.set_num_threads(1)
        print(f"the CPU is busy (load {os.getloadavg()[0]:.1f} on {cores} cores): training on one thread")


def _demo_tokenizer() -> Any:
    from wiola.tokenizer import load_tokenizer

    try:
        return load_tokenizer("gpt2-32k")
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        raise RuntimeError(f"the demo cannot load the GPT-2 tokenizer: {e}\nTo fix: {BPE_HINT}.") from e


def _demo_config(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    """The demo's run: the tiny preset, the fast model on a GPU when it imports."""
    from wiola.train.env import model_class

    gpu = device.type == "cuda"
    fast = False
    if gpu:
        try:
            model_class(True)
            fast = True
        except RuntimeError:
            print("wiola.fast is not available: the GPU demo uses the reference model")
    # CPU: small batches learn most per second (4 × 128 reaches a validation loss near 0.7 in
    # ~300 steps). GPU: a 20× larger generated corpus, so two minutes do not just memorise it.
    return TrainConfig(
        preset="tiny",
        data="sample:20000" if gpu else "sample",
        cache_dir=args.cache_dir,
        seq_len=256 if gpu else 128,
        batch_size=32 if gpu else 4,
        steps=100,  # replaced by _demo_steps
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


def _check_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming a flag this run cannot use, before any work."""
    if args.steps is not None and args.seconds is not None:
        raise ValueError("give --steps or --seconds, not both")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.seconds is not None and not (math.isfinite(args.seconds) and args.seconds > 0):
        raise ValueError(f"--seconds must be a positive number of seconds, got {args.seconds}")
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0 (0: no stories), got {args.samples}")


def _demo_steps(args: argparse.Namespace, cfg: TrainConfig, device: torch.device, train_tokens: int) -> int:
    """``--steps`` (checked by ``_check_flags``), the steps that fit ``--seconds``, or the fixed default."""
    if args.seconds is None:
        # A fixed default makes the demo's losses the same on every machine (only the time varies).
        return args.steps if args.steps is not None else (1500 if device.type == "cuda" else 300)
    steps, per_step = _calibrate(cfg, args.seconds, device)
    epochs = 8  # more passes over the corpus only overfit
    steps = min(steps, max(30, epochs * train_tokens // (cfg.batch_size * cfg.seq_len)))
    print(f"calibrated: {per_step * 1e3:.0f} ms/step -> {steps} steps for ~{args.seconds:.0f} s of training")
    return steps


def _calibrate(cfg: TrainConfig, seconds: float, device: torch.device) -> tuple[int, float]:
    """Steps that fit ``seconds`` of training, from timing a few steps of a throw-away model."""
    from wiola.train.env import autocast, model_class
    from wiola.train.optim import build_optimizer

    torch.manual_seed(1234)
    model = model_class(cfg.fast)(cfg.model_config()).to(device)
    opt = build_optimizer(model, cfg, device)
    x = torch.randint(0, 2000, (cfg.batch_size, cfg.seq_len + 1), device=device)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with autocast(device, cfg.precision):
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


def _print_stories(checkpoint: Any, encoding: Any, samples: int, seed: int, device: torch.device) -> None:
    from wiola.model import WiolaModel

    if samples == 0:
        return

    model = WiolaModel.from_pretrained(checkpoint, device=device)
    model.eval()
    eot = encoding.eos_token_id
    prompts = ["Once upon a time", "One day,", ""]
    generator = torch.Generator(device=device).manual_seed(seed)
    print("\n--- generated stories (temperature 0.8, top-k 40) ---")
    for i in range(samples):
        prompt = prompts[i % len(prompts)]
        ids = torch.tensor([[*encoding.document_prefix, *encoding.encode_batch([prompt])[0]]], device=device)
        out = model.generate(ids, 160, temperature=0.8, top_k=40, eos_token_id=eot, generator=generator)
        new = out[0, 1:].tolist()
        if eot in new:
            new = new[: new.index(eot)]
        print(f"\n[{i + 1}] {encoding.decode(new).strip()}")
