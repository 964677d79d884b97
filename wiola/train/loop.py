"""The trainer: AdamW with a warm-up + cosine schedule, bf16 autocast on GPU, gradient
accumulation, DDP through ``torchrun``, evaluation, plots, and checkpoints that resume exactly.

A run folder (``wiola.run_folder``) holds ``metrics.jsonl`` (one JSON object per log line and evaluation),
``loss_curve.png``, ``gates.png`` (mean gate per layer × head at the latest evaluation) and
``checkpoints/step_NNNNNNN/`` with

- ``config.json`` + ``model.safetensors`` (``WiolaModel.from_pretrained`` reads the folder),
- ``trainer.json``: the training configuration, step, data position and latest metrics,
- ``optimizer.pt``: optimizer and scheduler state and the RNG states.

Each checkpoint is written into a temporary folder and renamed into place, and
``checkpoints/latest`` names the newest, so a crash never leaves a half checkpoint behind.
``train(..., resume=DIR)`` continues bit for bit: model, optimizer, schedule, data position and
RNG states are restored, and the losses of an interrupted and resumed run equal those of an
uninterrupted one. SIGINT/SIGTERM stop after the current step with a checkpoint (under DDP,
after the next logging step, where the ranks agree). On resumption ``steps`` may be raised (the
cosine then stretches to the new end) and ``micro_batch`` changed (the same global batch,
accumulated differently); settings that change the numbers otherwise must match.

Weight decay applies to every matrix (``p.dim() >= 2``): the projections, the butterfly, the
gate's ``W_1``/``W_2`` and the embedding, which is also the tied output head. That is the paper's
"matrices only" read literally, and the Hugging Face Trainer's default (only biases and norm
weights exempt) for a model like ``wiola13m``. RMSNorm γ and the gate bias ``b_2`` are not
decayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wiola.config import WiolaConfig
from wiola.data import BatchStream, TokenData, check_split, prepare_data, resolve_source, token_byte_lengths
from wiola.evaluate import EvalResult, evaluate, gate_statistics
from wiola.run_folder import (
    METRICS_FILE,
    OPTIMIZER_FILE,
    TRAINER_FILE,
    MetricsLog,
    find_checkpoint,
    save_checkpoint,
    set_rng_state,
)

# The published 13M run (the paper's recipe). The paper gives no final learning rate: the cosine
# decays to 0 after the 5 % linear warm-up, as Hugging Face's "cosine" schedule does.
RECIPES: dict[str, dict[str, Any]] = {
    "paper": {
        "preset": "13m",
        "data": "tinystories",
        "seq_len": 512,
        "batch_size": 32,
        "steps": 20000,
        "lr": 3e-4,
        "min_lr_ratio": 0.0,
        "warmup": 0.05,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "eval_every": 500,
        "eval_windows": 512,
        "save_every": 1000,
    },
}


@dataclass
class TrainConfig:
    """Everything a run needs; ``--config FILE.json`` and ``--recipe`` fill it, flags override."""

    # model
    preset: str = "13m"
    model: dict[str, Any] = field(default_factory=dict)  # WiolaConfig overrides, e.g. {"d_model": 64}
    tokenizer: str | None = None  # None: the encoding whose vocabulary equals the model's
    # data
    data: str | None = "tinystories"  # "tinystories", "sample", or a path
    val_data: str | None = None
    val_fraction: float = 0.01
    cache_dir: str | None = None
    seq_len: int = 512  # T: windows hold T + 1 tokens, and T + 1 <= max_seq_len
    batch_size: int = 32  # global: windows per optimizer step over all ranks and micro-steps
    micro_batch: int | None = None  # windows per forward on one rank; None: batch_size / world_size
    shuffle: bool = True
    seed: int = 0
    # optimisation
    steps: int = 20000
    lr: float = 3e-4
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio
    warmup: float = 0.05  # warm-up: a fraction of steps (< 1) or a number of steps (>= 1)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0  # 0 disables clipping
    # evaluation, logging, checkpoints
    out_dir: str = "runs/wiola"
    eval_every: int = 500
    eval_windows: int | None = 512  # validation windows per evaluation (None: all)
    eval_batch_size: int | None = None  # None: micro_batch
    log_every: int = 10
    save_every: int = 1000
    keep_checkpoints: int = 2
    plots: bool = True
    # hardware
    device: str | None = None  # None: cuda when available, else cpu
    fast: bool = False  # wiola.fast.WiolaModel (fused Triton kernels)
    compile: bool = False  # torch.compile
    precision: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU), "bf16", "fp32"
    progress: bool = True
    num_threads: int | None = None  # tokeniser threads
    peak_flops: float | None = None  # per device, for MFU; None: looked up from the GPU name

    def __post_init__(self) -> None:
        positive = ("seq_len", "batch_size", "steps", "eval_every", "log_every", "save_every", "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("micro_batch", "eval_batch_size", "eval_windows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            raise ValueError("weight_decay and grad_clip must be >= 0 and eps > 0")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        self.betas = [float(b) for b in self.betas]

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup) if self.warmup >= 1 else round(self.warmup * self.steps)

    def model_config(self) -> WiolaConfig:
        return WiolaConfig.preset(self.preset, **self.model)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; known: {sorted(known)}")
        return cls(**data)


# Settings that may differ between a run and its resumption: the rest would change the numbers.
RESUMABLE_CHANGES = {
    "out_dir",
    "eval_every",
    "eval_windows",
    "eval_batch_size",
    "log_every",
    "save_every",
    "keep_checkpoints",
    "plots",
    "device",
    "fast",
    "compile",
    "progress",
    "num_threads",
    "peak_flops",
    "cache_dir",
    "micro_batch",
    "steps",
}


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a JSON config file (keys are ``TrainConfig`` fields)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object of TrainConfig fields")
    data.pop("_comment", None)
    return data


# ------------------------------------------------------------------------------------ schedule
class WarmupCosine:
    """``lr(step) / lr``: linear warm-up from ``1/warmup`` to 1 over ``warmup`` steps, then a
    cosine from 1 down to ``min_ratio`` at ``total`` steps. A picklable callable for ``LambdaLR``."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (see the module docstring); fused on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


# ------------------------------------------------------------------------------------- helpers
def model_class(fast: bool) -> type:
    """``wiola.WiolaModel``, or ``wiola.fast.WiolaModel`` when ``fast``.

    Raises ``RuntimeError`` when ``fast`` is asked for and ``wiola.fast`` cannot be imported.
    """
    if not fast:
        from wiola.model import WiolaModel

        return WiolaModel
    try:
        from wiola.fast import WiolaModel as FastModel
    except ImportError as e:
        raise RuntimeError(
            f"--fast needs wiola.fast (the fused Triton model), which cannot be imported here ({e}); "
            "drop --fast to use the reference model"
        ) from e
    return FastModel


def resolve_device(name: str | None, local_rank: int = 0) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def ensure_writable(directory: Path) -> None:
    """Create ``directory`` and check a file can be written there; ``ValueError`` if not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output folder {str(directory)!r} is not writable: {e}") from e


def tokenizer_for(config: WiolaConfig, name: str | None) -> Any:
    """The tiktoken encoding for ``config``. Raises ``ValueError`` when ``name``'s vocabulary
    differs from the model's, ``RuntimeError`` (saying what to set) when it cannot load."""
    from wiola.tokenizer import ENCODINGS, encoding_for_vocab, get_encoding

    if name is not None:
        if name not in ENCODINGS:
            raise ValueError(f"unknown tokenizer {name!r}; choose one of {sorted(ENCODINGS)}")
        if ENCODINGS[name] != config.vocab_size:
            raise ValueError(
                f"tokenizer {name!r} has {ENCODINGS[name]:,} tokens but the model's vocab_size is "
                f"{config.vocab_size:,}; use the matching tokenizer or set vocab_size to {ENCODINGS[name]}"
            )
        return get_encoding(name)
    return encoding_for_vocab(config.vocab_size)


def peak_flops_per_device(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (from its name), or None when unknown (then no MFU is shown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    table = [
        ("H200", 989e12),
        ("H100", 989e12),
        ("H800", 989e12),
        ("A100", 312e12),
        ("A800", 312e12),
        ("L40S", 362e12),
        ("L4", 121e12),
        ("A10", 125e12),
        ("4090", 165e12),
        ("3090", 71e12),
    ]
    return next((flops for key, flops in table if key in name), None)


@dataclass
class TrainResult:
    step: int  # optimizer steps done
    interrupted: bool
    out_dir: Path
    checkpoint: Path | None
    train_loss: float | None  # loss of the last logged interval
    eval: EvalResult | None  # last evaluation
    losses: list[tuple[int, float]]  # (step, loss) of every log line of this process's run
    plots: dict[str, Path]


class _StopFlag:
    """SIGINT/SIGTERM: finish the step, save, exit. A second SIGINT raises KeyboardInterrupt."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.requested = False
        self.log = log
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.log(
            f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
            "(Ctrl-C again to abort without saving)"
        )

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handler, no clean stop
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _distributed() -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, initialised_here) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0, False
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return rank, world, local_rank, False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), local_rank, True


def _check_resume(saved: dict[str, Any], cfg: TrainConfig, model_config: WiolaConfig, checkpoint: Path) -> None:
    saved_model = WiolaConfig.from_dict(saved["model_config"])
    if saved_model != model_config:
        diff = [
            f"{k}: checkpoint {v!r} vs this run {getattr(model_config, k)!r}"
            for k, v in saved_model.to_dict().items()
            if getattr(model_config, k) != v
        ]
        raise ValueError(
            f"cannot resume {checkpoint}: it is a checkpoint of another model configuration ({'; '.join(diff)})"
        )
    saved_cfg, now = saved["train_config"], cfg.to_dict()
    diff = [
        f"{k}: checkpoint {saved_cfg.get(k)!r} vs this run {now[k]!r}"
        for k in now
        if k not in RESUMABLE_CHANGES and k != "model" and saved_cfg.get(k) != now[k]
    ]
    if diff:
        raise ValueError(
            f"cannot resume {checkpoint} exactly: training settings differ ({'; '.join(diff)}). "
            "Leave them out to keep the checkpoint's values."
        )


# --------------------------------------------------------------------------------------- train
def train(
    cfg: TrainConfig,
    *,
    resume: str | os.PathLike | None = None,
    stop_at: int | None = None,
    log: Callable[[str], None] | None = None,
    references: dict[str, float] | None = None,
) -> TrainResult:
    """Train (or continue training) a Wiola model as ``cfg`` says.

    Args:
        cfg: the run's settings.
        resume: a checkpoint folder, or a run folder (its latest checkpoint), to continue from.
            Settings that change the numbers must match the checkpoint's (``ValueError`` naming
            them otherwise).
        stop_at: stop after this step as an interruption would (checkpoint, ``interrupted``);
            for tests and time-boxed runs.
        log: where messages go (rank 0 only); default ``tqdm.write`` (stdout, below the progress bar).
        references: named horizontal lines for the loss curve (e.g. the unigram entropy).

    Under ``torchrun`` every rank calls ``train``; the process group comes from the environment
    (NCCL on GPU, gloo on CPU). Bad settings, a missing or empty corpus, a tokenizer that does
    not fit the model, a non-writable output folder or a checkpoint of another configuration
    raise ``ValueError``/``FileNotFoundError``/``RuntimeError`` before training starts.
    """
    rank, world, local_rank, own_group = _distributed()
    main = rank == 0
    if log is None:
        from tqdm.auto import tqdm

        log = tqdm.write
    say = log if main else (lambda msg: None)
    try:
        return _train(cfg, resume, stop_at, say, references or {}, rank, world, local_rank)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(
    cfg: TrainConfig,
    resume: str | os.PathLike | None,
    stop_at: int | None,
    log: Callable[[str], None],
    references: dict[str, float],
    rank: int,
    world: int,
    local_rank: int,
) -> TrainResult:
    main = rank == 0
    device = resolve_device(cfg.device, local_rank)
    out_dir = Path(cfg.out_dir)

    # ---- everything that can be wrong is checked before any work
    micro = cfg.micro_batch or max(1, cfg.batch_size // world)
    if cfg.batch_size % (micro * world):
        raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of micro_batch {micro} × world_size {world}")
    grad_accum = cfg.batch_size // (micro * world)
    model_config = cfg.model_config()
    if cfg.seq_len + 1 > model_config.max_seq_len:
        raise ValueError(
            f"windows of seq_len + 1 = {cfg.seq_len + 1} tokens do not fit max_seq_len={model_config.max_seq_len}; "
            f"use --seq-len {model_config.max_seq_len - 1} or less"
        )
    cls = model_class(cfg.fast)
    checkpoint = saved = None
    if resume is not None:
        checkpoint = find_checkpoint(resume)
        saved = json.loads((checkpoint / TRAINER_FILE).read_text())
        _check_resume(saved, cfg, model_config, checkpoint)
    if main:
        ensure_writable(out_dir)
    encoding = tokenizer_for(model_config, cfg.tokenizer)
    source = resolve_source(cfg.data, cfg.val_data, cfg.val_fraction)

    # ---- data: rank 0 tokenises (or opens the cache), the others wait and open it
    data: TokenData | None = None
    if main:
        data = prepare_data(
            source, encoding, cfg.cache_dir, num_threads=cfg.num_threads, progress=cfg.progress, log=log
        )
    if world > 1:
        dist.barrier()
    if not main:
        data = prepare_data(source, encoding, cfg.cache_dir, progress=False, log=lambda m: None)
    assert data is not None
    check_split(data.train, cfg.seq_len, "training")
    check_split(data.val, cfg.seq_len, "validation")
    if saved is not None and saved["data"].get("fingerprint") != data.manifest["fingerprint"]:
        raise ValueError(f"cannot resume {checkpoint} exactly: the training data changed since it was written")
    stream = BatchStream(
        data.train, cfg.seq_len, micro, grad_accum, rank=rank, world_size=world, shuffle=cfg.shuffle, seed=cfg.seed
    )
    byte_lengths = token_byte_lengths(encoding)

    # ---- model, optimizer, schedule
    torch.manual_seed(cfg.seed)
    raw_model = cls(model_config).to(device)
    optimizer = build_optimizer(raw_model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    )
    step = 0
    if checkpoint is not None:
        from wiola.checkpoint import load_pretrained

        loaded = load_pretrained(cls, checkpoint, device=device)
        raw_model.load_state_dict(loaded.state_dict())
        del loaded
        opt_state = torch.load(checkpoint / OPTIMIZER_FILE, map_location="cpu", weights_only=False)
        optimizer.load_state_dict(opt_state["optimizer"])
        scheduler.load_state_dict(opt_state["scheduler"])
        scheduler.lr_lambdas[0] = WarmupCosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)  # a new --steps
        set_rng_state(opt_state["rng"])
        stream.load_state_dict(saved["data"]["position"])
        step = int(saved["step"])
        log(f"resumed from {checkpoint} at step {step:,}")
        if step >= cfg.steps:
            log(
                f"the checkpoint is at step {step:,} and the run has {cfg.steps:,} steps: nothing to do (raise --steps)"
            )
    model: torch.nn.Module = raw_model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        model = torch.compile(model)
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext

    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_token = _training_flops(model_config, cfg.seq_len)
    peak = (cfg.peak_flops or peak_flops_per_device(device) or 0.0) * world
    metrics = MetricsLog(out_dir / METRICS_FILE, main, step if checkpoint is not None else None)
    if main and checkpoint is None:
        metrics.write(
            {
                "kind": "run",
                "step": 0,
                "config": cfg.to_dict(),
                "model_config": model_config.to_dict(),
                "world_size": world,
                "grad_accum": grad_accum,
                "micro_batch": micro,
                "parameters": raw_model.num_parameters(),
                "data": data.manifest["source"],
            }
        )
        for name, value in references.items():
            metrics.write({"kind": "reference", "step": 0, "name": name, "value": value})
    log(
        f"model: {raw_model.num_parameters():,} parameters ({'wiola.fast' if cfg.fast else 'reference'}) on {device}"
        f"{', bf16 autocast' if use_bf16 else ''}{', compiled' if cfg.compile else ''}; "
        f"batch {cfg.batch_size} × {cfg.seq_len} = {tokens_per_step:,} tokens/step "
        f"({world} rank(s) × {micro} × {grad_accum} accumulation); {cfg.steps:,} steps"
    )

    plots: dict[str, Path] = {}
    last_eval: EvalResult | None = None
    last_ckpt: Path | None = None
    losses: list[tuple[int, float]] = []
    train_loss: float | None = None

    def run_eval() -> None:
        nonlocal last_eval
        last_eval = evaluate(
            raw_model,
            data.val,
            byte_lengths,
            cfg.seq_len,
            batch_size=cfg.eval_batch_size or micro,
            max_windows=cfg.eval_windows,
            rank=rank,
            world_size=world,
        )
        if not main:
            return
        first = next(iter(_first_val_batch(data, cfg.seq_len, min(8, cfg.eval_batch_size or micro)))).to(device)
        with autocast():
            gates = gate_statistics(raw_model, first)
        metrics.write({"kind": "eval", "step": step, **last_eval.to_dict(), "gates": gates.tolist()})
        log(f"step {step:,}: validation {last_eval}")
        if cfg.plots:
            from wiola.plots import plot_gate_heatmap, plot_loss_curve

            plots["loss_curve"] = plot_loss_curve(metrics.records, out_dir / "loss_curve.png")
            plots["gates"] = plot_gate_heatmap(
                gates, out_dir / "gates.png", title=f"mean gate per layer × head, step {step:,}"
            )

    def save() -> None:
        nonlocal last_ckpt
        if main:
            last_ckpt = save_checkpoint(
                out_dir, raw_model, optimizer, scheduler, stream, cfg, model_config, data, step, last_eval, train_loss
            )
        if world > 1:
            dist.barrier()

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=step, disable=not (main and cfg.progress), dynamic_ncols=True, unit="step")
    interrupted = False
    loss_sum = torch.zeros((), device=device)
    interval_steps, interval_start = 0, time.perf_counter()
    with _StopFlag(log) as stop:
        while step < cfg.steps:
            batches = stream.next_step()
            for a, batch in enumerate(batches):
                x = batch.to(device, non_blocking=True)
                sync = contextlib.nullcontext() if a + 1 == grad_accum or world == 1 else model.no_sync()
                with sync:
                    with autocast():
                        loss = model(x, labels=x).loss / grad_accum
                    loss.backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            interval_steps += 1

            last = step == cfg.steps
            log_now = step % cfg.log_every == 0 or last
            want_stop = stop_at is not None and step >= stop_at  # the same on every rank
            if world == 1:
                want_stop = want_stop or stop.requested
            elif log_now:  # a signal may reach some ranks only: agree at log steps (one sync per log)
                flag = torch.tensor([float(stop.requested)], device=device)
                dist.all_reduce(flag)
                want_stop = want_stop or bool(flag.item() > 0)
            if log_now or want_stop:
                if world > 1:
                    dist.all_reduce(loss_sum)
                    loss_sum /= world
                train_loss = float(loss_sum) / interval_steps
                elapsed = time.perf_counter() - interval_start
                tok_s = interval_steps * tokens_per_step / elapsed
                record = {
                    "kind": "train",
                    "step": step,
                    "loss": train_loss,
                    "lr": lr,
                    "tokens": step * tokens_per_step,
                    "tokens_per_s": tok_s,
                    "epoch": stream.epoch,
                }
                if grad_norm is not None:
                    record["grad_norm"] = float(grad_norm)
                postfix = {"loss": f"{train_loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}"}
                if peak:
                    record["mfu"] = tok_s * flops_per_token / peak
                    postfix["MFU"] = f"{record['mfu']:.1%}"
                metrics.write(record)
                losses.append((step, train_loss))
                bar.set_postfix(postfix, refresh=False)
                loss_sum.zero_()
                interval_steps, interval_start = 0, time.perf_counter()
            bar.update(1)
            if step % cfg.eval_every == 0 or last:
                run_eval()
            if want_stop and not last:
                interrupted = True
                save()
                break
            if step % cfg.save_every == 0 or last:
                save()
    bar.close()
    if main and cfg.plots and metrics.records and "loss_curve" not in plots:
        from wiola.plots import plot_loss_curve

        plots["loss_curve"] = plot_loss_curve(metrics.records, out_dir / "loss_curve.png")
    metrics.close()
    if interrupted:
        log(
            f"interrupted at step {step:,}; checkpoint saved to {last_ckpt}; continue with: wiola train --resume {out_dir}"
        )
    return TrainResult(step, interrupted, out_dir, last_ckpt, train_loss, last_eval, losses, plots)


def _training_flops(config: WiolaConfig, seq_len: int) -> float:
    from wiola.budget import budget

    return budget(config, seq_len + 1).training_flops * (seq_len + 1) / seq_len  # per target token


def _first_val_batch(data: TokenData, seq_len: int, batch_size: int) -> Any:
    from wiola.data import eval_batches

    return eval_batches(data.val, seq_len, batch_size, max_windows=batch_size)


def main(argv: list[str] | None = None) -> int:
    """``python -m wiola.train ...``: the ``wiola train`` command (for torchrun without the entry point)."""
    import argparse

    from wiola.cli_train import add_train_arguments, run_train

    parser = argparse.ArgumentParser(prog="python -m wiola.train", description="train a Wiola model")
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_train(args)
    except (ValueError, FileNotFoundError, RuntimeError, TypeError) as e:
        print(f"wiola train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
