"""The training loop: gradient accumulation, DDP through ``torchrun``, evaluation, plots, and
checkpoints that resume exactly (the optimizer and schedule are in ``wiola.train.optim``, the
device and precision rules in ``wiola.train.env``).

A run folder (``wiola.train.run_folder``) holds ``metrics.jsonl`` (one JSON object per log line
and evaluation), ``loss_curve.png``, ``gates.png`` (mean gate per layer × head at the latest
evaluation) and ``checkpoints/step_NNNNNNN/`` with

- ``config.json`` + ``model.safetensors`` (``WiolaModel.from_pretrained`` reads the folder),
- ``trainer.json``: the training configuration, step, data position and latest metrics,
- ``optimizer.pt``: optimizer and scheduler state and the RNG states.

Each checkpoint is written into a temporary folder and renamed into place, and
``checkpoints/latest`` names the newest, so a crash never leaves a half checkpoint behind (the
temporary folder of a killed run goes at the next save). A checkpoint that cannot be written (a
full disk) raises ``OSError`` naming the file and the last complete checkpoint, which stays the
latest. A run resumed into another ``out_dir`` starts its ``metrics.jsonl`` with the resumed
run's rows up to the checkpoint, so each run folder holds a whole history.
``train(..., resume=DIR)`` continues bit for bit: model, optimizer, schedule, data position and
RNG states are restored, and the losses of an interrupted and resumed run equal those of an
uninterrupted one. SIGINT/SIGTERM stop after the current step with a checkpoint (under DDP,
after the next logging step, where the ranks agree). On resumption ``steps`` may be raised (the
cosine then stretches to the new end; the warm-up keeps its length in steps, so a fractional
``warmup`` is read against the steps the run began with) and ``micro_batch`` changed (the same global batch,
accumulated differently); settings that change the numbers otherwise must match.

A run that diverges stops with ``TrainingDiverged``: a non-finite training loss or gradient norm at
a logging step, a non-finite validation loss, or non-finite weights or loss when a checkpoint is
due. Those are the points where the numbers reach the host anyway, so the check adds no sync to
the steps between them; no checkpoint (and no metrics line) holds a non-finite number, so the
checkpoints written before the divergence stay the run's latest.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wiola.checkpoint import (
    RUN_CHECKPOINTS,
    load_checkpoint_tokenizer,
    load_pretrained,
    read_config,
    resolve_checkpoint,
)
from wiola.config import WiolaConfig
from wiola.tokenizer import Tokenizer
from wiola.train.config import RESUMABLE_CHANGES, TrainConfig
from wiola.train.data import (
    BatchStream,
    TokenData,
    check_split,
    check_targets,
    eval_batches,
    eval_windows,
    prepare_data,
    resolve_source,
    token_byte_lengths,
    tokenizer_for,
)
from wiola.train.env import (
    Progress,
    autocast,
    init_distributed,
    model_class,
    peak_flops_per_device,
    require,
    resolve_device,
    uses_bf16,
)
from wiola.train.evaluate import EvalResult, evaluate, gate_statistics, layer_grad_norms
from wiola.train.optim import build_optimizer, build_scheduler, schedule
from wiola.train.run_folder import (
    METRICS_FILE,
    MetricsLog,
    check_apart,
    check_new_run,
    check_output_folder,
    clear_run,
    ensure_writable,
    find_checkpoint,
    read_optimizer_state,
    read_trainer_state,
    save_checkpoint,
    set_rng_state,
)

Log = Callable[[str], None]


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


class TrainingDiverged(RuntimeError):
    """The run stopped at a non-finite loss, gradient norm or weight (see the module docstring).

    ``step`` is the step it was found at; ``checkpoint`` the last checkpoint written before it
    (or resumed from), None when there is none. The message names both and what to change."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


# --------------------------------------------------------------------------------------- train
def train(
    cfg: TrainConfig,
    *,
    resume: str | os.PathLike | None = None,
    stop_at: int | None = None,
    log: Log | None = None,
    references: dict[str, float] | None = None,
    overwrite: bool = False,
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
        overwrite: start a new run in a folder that already holds one, deleting its metrics,
            checkpoints and plots (``run_folder.clear_run``) once every check has passed;
            without it such a folder is refused (``ValueError``), so no run is lost by accident.

    Raises ``TrainingDiverged`` (a ``RuntimeError``) when the loss, a gradient norm or the weights
    stop being finite; the checkpoints written before stay as they were.

    Under ``torchrun`` every rank calls ``train``; the process group comes from the environment
    (NCCL on GPU, gloo on CPU). Bad settings, a missing or empty corpus, a tokenizer that does
    not fit the model, a non-writable output folder, an output folder that holds another run, a
    checkpoint of another configuration or a missing package of the ``train`` extra raise
    ``ValueError``/``FileNotFoundError``/``RuntimeError`` before training starts.

    Progress: a tqdm bar on stderr where stderr is a terminal and ``cfg.progress`` is set;
    otherwise a plain line (``log``) at every logging step. A summary line ends the run.
    """
    tqdm = require("tqdm.auto", "training").tqdm
    if cfg.plots:
        require("matplotlib", "training with plots (--no-plots trains without them)")
    rank, world, local_rank, own_group = init_distributed()
    say = (log or tqdm.write) if rank == 0 else (lambda msg: None)
    try:
        run = _start(cfg, resume, say, references or {}, rank, world, local_rank, overwrite)
        return _loop(run, stop_at)
    finally:
        if own_group:
            dist.destroy_process_group()


def build_model(cfg: TrainConfig, model_config: WiolaConfig, device: torch.device) -> torch.nn.Module:
    """The freshly initialised model of ``cfg`` (seeded by ``cfg.seed``) on ``device``, with
    ``activation_checkpointing`` set as ``cfg`` says."""
    torch.manual_seed(cfg.seed)
    model = model_class(cfg.fast)(model_config).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


@dataclass
class _Run:
    """One process's share of a run: settings, data, model, optimizer and position."""

    cfg: TrainConfig
    log: Log
    rank: int
    world: int
    device: torch.device
    micro: int  # windows per forward on this rank
    grad_accum: int
    model_config: WiolaConfig
    data: TokenData
    tokenizer: Tokenizer
    stream: BatchStream
    byte_lengths: torch.Tensor
    raw_model: torch.nn.Module
    model: torch.nn.Module  # raw_model, or its DDP / compiled wrapper
    optimizer: torch.optim.Optimizer
    scheduler: Any
    metrics: MetricsLog
    step: int = 0
    train_loss: float | None = None
    last_eval: EvalResult | None = None
    last_ckpt: Path | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    plots: dict[str, Path] = field(default_factory=dict)
    layer_grad_norms: torch.Tensor | None = None  # (L,) of the latest step, before clipping
    log_interval: dict[str, Any] | None = None  # the checkpoint's partial log interval (``_Meter.state_dict``)
    init: Path | None = None  # the --init checkpoint the weights came from
    # (step, folder) of the newest checkpoint of finite numbers: the last one saved, or the one
    # resumed from; the folder is None on ranks other than 0, which do not write it
    last_good: tuple[int, Path | None] | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)


# ----------------------------------------------------------------------------------- set-up
def _start(
    cfg: TrainConfig,
    resume: str | os.PathLike | None,
    log: Log,
    references: dict[str, float],
    rank: int,
    world: int,
    local_rank: int,
    overwrite: bool = False,
) -> _Run:
    """Check everything that can be wrong before any work, then build the data, model and optimizer."""
    device = resolve_device(cfg.device, local_rank)
    micro = cfg.micro_batch or max(1, cfg.batch_size // world)
    if cfg.batch_size % (micro * world):
        raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of micro_batch {micro} × world_size {world}")
    if resume is not None and overwrite:
        raise ValueError("--overwrite starts a new run and --resume continues one: give one of them")
    checkpoint = find_checkpoint(resume) if resume is not None else None
    saved = read_trainer_state(checkpoint) if checkpoint is not None else None
    # An --init run's model (config, tokenizer) is its checkpoint's; a resumed one reads them from
    # the checkpoint it resumes, so the --init folder may since have moved or been deleted.
    init = _init_checkpoint(cfg, checkpoint)
    model_source = init if checkpoint is None else checkpoint if cfg.init is not None else None
    model_config = read_config(model_source)[0] if model_source is not None else cfg.model_config()
    cfg = cfg.with_model(model_config)  # the default seq_len and the window check follow the trained model
    model_class(cfg.fast)  # --fast without wiola.fast raises here
    if saved is not None:
        cfg = cfg.with_saved_paths(saved["train_config"])  # an older checkpoint's relative data paths
        _check_resume(saved, cfg, model_config, checkpoint)
        cfg = _keep_warmup(cfg, saved["train_config"])
    check_output_folder(cfg.out_dir, "--out")
    if init is not None:  # --overwrite would delete it, and a run written around it would hide it
        check_apart(cfg.out_dir, init, "--out", "--init checkpoint")
    # A new run (or a resumed one written elsewhere) must not land on another run's folder.
    if not overwrite and (checkpoint is None or Path(cfg.out_dir).resolve() != checkpoint.parent.parent.resolve()):
        check_new_run(cfg.out_dir)
    if model_source is not None and cfg.tokenizer is None:
        tokenizer = load_checkpoint_tokenizer(model_source, tokenizer_flag="--tokenizer")
    else:
        tokenizer = tokenizer_for(model_config, cfg.tokenizer)
    data = _load_data(cfg, tokenizer, rank, world, log)
    if saved is not None and saved["data"].get("fingerprint") != data.manifest["fingerprint"]:
        raise ValueError(f"cannot resume {checkpoint} exactly: the training data changed since it was written")
    if saved is not None and saved.get("tokenizer_fingerprint", tokenizer.fingerprint) != tokenizer.fingerprint:
        raise ValueError(
            f"cannot resume {checkpoint} exactly: the tokenizer {tokenizer.name!r} changed since it was written"
        )
    grad_accum = cfg.batch_size // (micro * world)
    if rank == 0:  # created only now that every check has passed: a refused run leaves no folder
        ensure_writable(Path(cfg.out_dir))
    if overwrite and rank == 0:
        gone = clear_run(cfg.out_dir)
        if gone:
            log(f"--overwrite: deleted {', '.join(gone)} of the earlier run in {cfg.out_dir}")
    stream = BatchStream(
        data.train, cfg.seq_len, micro, grad_accum, rank=rank, world_size=world, shuffle=cfg.shuffle, seed=cfg.seed
    )
    raw_model = build_model(cfg, model_config, device)
    optimizer = build_optimizer(raw_model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg)
    # A run resumed into another folder starts its log with the checkpoint's run's rows up to the step.
    history = (
        checkpoint.parent.parent / METRICS_FILE if checkpoint and checkpoint.parent.name == RUN_CHECKPOINTS else None
    )
    resume_step = None if saved is None else int(saved["step"])
    run = _Run(
        cfg, log, rank, world, device, micro, grad_accum, model_config, data, tokenizer, stream,
        token_byte_lengths(tokenizer),
        raw_model, raw_model, optimizer, scheduler,
        MetricsLog(Path(cfg.out_dir) / METRICS_FILE, rank == 0, resume_step, history, log),
    )  # fmt: skip
    run.init = init
    if checkpoint is not None:
        _restore(run, checkpoint, saved)
    else:
        if init is not None:
            raw_model.load_state_dict(load_pretrained(model_class(cfg.fast), init, device=device).state_dict())
            log(f"initialised from {init}")
        if run.main:
            _write_run_record(run, references)
    run.model = _wrap(raw_model, cfg, world, device)
    _announce(run)
    if run.step >= cfg.steps:
        log(
            f"the checkpoint is at step {run.step:,} and the run has {cfg.steps:,} steps: nothing to do (raise --steps)"
        )
    return run


def _init_checkpoint(cfg: TrainConfig, resumed: Path | None = None) -> Path | None:
    """The model folder of ``cfg.init`` (a folder, a run folder's latest checkpoint, a Hub id);
    None without --init, and when resuming (``resumed``: the weights come from that checkpoint)."""
    if cfg.init is None:
        return None
    if cfg.model:
        raise ValueError("--init takes the model configuration from the checkpoint; drop --model")
    return None if resumed is not None else resolve_checkpoint(cfg.init)


def _load_data(cfg: TrainConfig, tokenizer: Tokenizer, rank: int, world: int, log: Log) -> TokenData:
    """Rank 0 tokenises (or opens the cache); the others wait for it and open the cache."""
    source = resolve_source(cfg.data, cfg.val_data, cfg.val_fraction)
    data: TokenData | None = None
    if rank == 0:
        data = prepare_data(
            source, tokenizer, cfg.cache_dir, num_threads=cfg.num_threads, progress=cfg.progress, log=log
        )
    if world > 1:
        dist.barrier()
    if rank != 0:
        data = prepare_data(source, tokenizer, cfg.cache_dir, progress=False, log=lambda m: None)
    assert data is not None
    check_split(data.train, cfg.seq_len, "training")
    check_targets(data.val, "validation")
    return data


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
    if int(saved["step"]) > cfg.steps:  # equal: a finished run, nothing to do (said after loading)
        raise ValueError(
            f"cannot resume {checkpoint} with --steps {cfg.steps:,}: it is at step {int(saved['step']):,} "
            "already (a run does not go back; raise --steps, or start a new run from it with --init)"
        )


def _keep_warmup(cfg: TrainConfig, saved_cfg: dict[str, Any]) -> TrainConfig:
    """``cfg`` with the warm-up of the run it resumes, as a step count: a fractional ``warmup``
    is a share of ``steps``, so a raised ``--steps`` would otherwise lengthen the warm-up and put
    a step past it back inside it (the rate falling to a fraction of ``lr`` mid-run). The count
    is what later checkpoints record."""
    saved_steps = saved_cfg.get("steps", cfg.steps)
    if saved_steps == cfg.steps or cfg.warmup >= 1:
        return cfg
    kept = copy.copy(cfg)  # not dataclasses.replace: __post_init__ would undo with_saved_paths' spelling
    kept.warmup = round(cfg.warmup * saved_steps)
    return kept


def _restore(run: _Run, checkpoint: Path, saved: dict[str, Any]) -> None:
    """Model, optimizer, schedule, RNG states and data position from ``checkpoint``."""

    cfg = run.cfg
    loaded = load_pretrained(model_class(cfg.fast), checkpoint, device=run.device)
    run.raw_model.load_state_dict(loaded.state_dict())
    del loaded
    opt_state = read_optimizer_state(checkpoint)
    run.optimizer.load_state_dict(opt_state["optimizer"])
    run.scheduler.load_state_dict(opt_state["scheduler"])
    # A new --steps stretches the cosine, for every parameter group (the decayed matrices and the
    # undecayed norms and bias), from the next step on: each group's rate is set again as
    # LambdaLR sets it, base rate times the multiplier at the step reached, so that the first
    # resumed step does not run at the saved schedule's rate. With the same --steps it is the
    # value the optimizer holds already, bit for bit, so resuming stays exact.
    multiplier = schedule(cfg)
    groups = run.optimizer.param_groups
    run.scheduler.lr_lambdas = [multiplier] * len(groups)
    for group, base in zip(groups, run.scheduler.base_lrs, strict=True):
        group["lr"] = base * multiplier(run.scheduler.last_epoch)
    run.scheduler._last_lr = [group["lr"] for group in groups]
    set_rng_state(opt_state["rng"])
    run.stream.load_state_dict(saved["data"]["position"])
    run.step = int(saved["step"])
    run.train_loss = saved.get("train_loss")
    run.log_interval = saved.get("log_interval")
    run.last_good = (run.step, checkpoint)
    run.log(f"resumed from {checkpoint} at step {run.step:,}")


def _wrap(raw_model: torch.nn.Module, cfg: TrainConfig, world: int, device: torch.device) -> torch.nn.Module:
    """DDP over the ranks, then ``torch.compile``, as ``cfg`` asks."""
    model = raw_model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        model = torch.compile(model)
    return model


def _write_run_record(run: _Run, references: dict[str, float]) -> None:
    """The first lines of a new run's ``metrics.jsonl``: its settings, model, data and where the
    weights start from (``init``: the --init checkpoint's folder; None: a fresh initialisation),
    then the named reference lines of the loss curve."""
    run.metrics.write(
        {
            "kind": "run",
            "step": 0,
            "config": run.cfg.to_dict(),
            "model_config": run.model_config.to_dict(),
            "world_size": run.world,
            "grad_accum": run.grad_accum,
            "micro_batch": run.micro,
            "parameters": run.raw_model.num_parameters(),
            "data": run.data.manifest["source"],
            "init": None if run.init is None else str(run.init),
        }
    )
    for name, value in references.items():
        run.metrics.write({"kind": "reference", "step": 0, "name": name, "value": value})


def _announce(run: _Run) -> None:
    cfg = run.cfg
    extras = [", bf16 autocast" if uses_bf16(run.device, cfg.precision) else ""]
    extras += [
        ", compiled" if cfg.compile else "",
        ", activation checkpointing" if cfg.activation_checkpointing else "",
    ]
    run.log(
        f"model: {run.raw_model.num_parameters():,} parameters ({'wiola.fast' if cfg.fast else 'reference'}) "
        f"on {run.device}{''.join(extras)}; batch {cfg.batch_size} × {cfg.seq_len} = "
        f"{cfg.batch_size * cfg.seq_len:,} tokens/step ({run.world} rank(s) × {run.micro} × {run.grad_accum} "
        f"accumulation); {cfg.steps:,} steps"
    )


# ------------------------------------------------------------------------------------- the loop
def _loop(run: _Run, stop_at: int | None) -> TrainResult:
    cfg = run.cfg
    bar = Progress(cfg.steps, "", "step", show=run.main and cfg.progress, initial=run.step)
    meter = _Meter(run, run.log_interval)
    interrupted = False
    first_step, start = run.step, time.perf_counter()
    try:
        with StopFlag(run.log) as stop:
            while run.step < cfg.steps:
                lr, grad_norm = _optimizer_step(run, meter.loss_sum)
                last = run.step == cfg.steps
                log_now = run.step % cfg.log_every == 0 or last
                want_stop = _stop_requested(run, stop, stop_at, log_now)
                # Train rows only on the log schedule: a stop between log steps carries the partial
                # interval into the checkpoint (``_Meter.state_dict``), so the resumed run logs the
                # same rows as an uninterrupted one.
                if log_now:
                    bar.postfix(**meter.record(lr, grad_norm))
                    if not bar.drawn:  # no bar (a pipe, a log file, --no-progress): a plain line instead
                        fields = ", ".join(f"{k} {v}" for k, v in bar.fields.items())
                        run.log(f"step {run.step:,}/{cfg.steps:,}: {fields}")
                bar.update(1)
                if run.step % cfg.eval_every == 0 or last:
                    _evaluate(run)
                if want_stop and not last:
                    interrupted = True
                    _save(run, meter)
                    break
                if run.step % cfg.save_every == 0 or last:
                    _save(run, meter)
    except TrainingDiverged:
        run.metrics.close()
        raise
    finally:
        bar.close()
    _summarise(run, first_step, time.perf_counter() - start)
    # Each evaluation draws the curve after writing its record: train rows after the last one (an
    # interrupted run), or no curve drawn by this process, mean drawing it again here.
    records = run.metrics.records
    if run.main and cfg.plots and records and ("loss_curve" not in run.plots or records[-1]["kind"] != "eval"):
        _plot_loss_curve(run)
    run.metrics.close()
    if interrupted:
        run.log(
            f"interrupted at step {run.step:,}; checkpoint saved to {run.last_ckpt}; "
            f"continue with: wiola train --resume {run.out_dir}"
        )
    return TrainResult(
        run.step, interrupted, run.out_dir, run.last_ckpt, run.train_loss, run.last_eval, run.losses, run.plots
    )


def _plot_loss_curve(run: _Run) -> None:
    """``loss_curve.png`` of every metrics record so far."""
    from wiola.train.plots import plot_loss_curve

    run.plots["loss_curve"] = plot_loss_curve(run.metrics.records, run.out_dir / "loss_curve.png")


def _summarise(run: _Run, first_step: int, seconds: float) -> None:
    """One line at the end of the loop: the steps this process ran, their time and the last losses."""
    steps = run.step - first_step
    if steps == 0:
        return
    rate = steps * run.cfg.batch_size * run.cfg.seq_len / max(seconds, 1e-9)
    parts = [f"trained steps {first_step + 1:,}-{run.step:,} in {seconds:.1f} s ({rate:,.0f} tokens/s)"]
    if run.train_loss is not None:
        parts.append(f"train loss {run.train_loss:.4f}")
    if run.last_eval is not None:
        parts.append(f"validation loss {run.last_eval.loss:.4f}")
    run.log("; ".join(parts))


def _optimizer_step(run: _Run, loss_sum: torch.Tensor) -> tuple[float, torch.Tensor | None]:
    """One optimizer step over ``grad_accum`` micro-batches; adds the loss to ``loss_sum``.
    Returns the step's learning rate and gradient norm (None without clipping)."""
    cfg, model = run.cfg, run.model
    for a, batch in enumerate(run.stream.next_step()):
        x = batch.to(run.device, non_blocking=True)
        sync = contextlib.nullcontext() if a + 1 == run.grad_accum or run.world == 1 else model.no_sync()
        with sync:
            with autocast(run.device, cfg.precision):
                loss = model(x, labels=x).loss / run.grad_accum
            loss.backward()
        loss_sum += loss.detach()
    run.layer_grad_norms = layer_grad_norms(run.raw_model)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return lr, grad_norm


def _stop_requested(run: _Run, stop: StopFlag, stop_at: int | None, log_now: bool) -> bool:
    """Whether to stop after this step, the same answer on every rank."""
    want_stop = stop_at is not None and run.step >= stop_at
    if run.world == 1:
        return want_stop or stop.requested
    if log_now:  # a signal may reach some ranks only: agree at log steps (one sync per log)
        flag = torch.tensor([float(stop.requested)], device=run.device)
        dist.all_reduce(flag)
        want_stop = want_stop or bool(flag.item() > 0)
    return want_stop


class _Meter:
    """The training loss, throughput and MFU of the steps since the last log line.

    The loss of the open interval (its per-rank sum and first step) goes into each checkpoint
    (``state_dict``) and comes back on resume, so a run stopped between log steps logs the same
    interval losses, bit for bit, as an uninterrupted one. Throughput counts only the steps this
    process ran: time spent before the stop is not known after it.
    """

    def __init__(self, run: _Run, state: dict[str, Any] | None = None) -> None:
        self.run = run
        self.loss_sum = torch.zeros((), device=run.device)
        self.tokens_per_step = run.cfg.batch_size * run.cfg.seq_len
        self.flops_per_token = _training_flops(run.model_config, run.cfg.seq_len)
        self.peak = (run.cfg.peak_flops or peak_flops_per_device(run.device) or 0.0) * run.world
        self.start_step = run.step  # the first step of the interval is start_step + 1
        if state is not None:
            sums = state["loss_sums"]  # one per rank: each rank sums its own losses until the log step
            if len(sums) != run.world:
                raise ValueError(
                    f"the checkpoint's open log interval was summed over {len(sums)} rank(s), this run has "
                    f"{run.world}; resume with the same number of ranks"
                )
            self.loss_sum.fill_(sums[run.rank])
            self.start_step = int(state["start_step"])
        self.timed_step, self.start = run.step, time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        """The open interval: its start step and every rank's loss sum (a collective under DDP)."""
        sums = [self.loss_sum.clone() for _ in range(self.run.world)]
        if self.run.world > 1:
            dist.all_gather(sums, self.loss_sum)
        return {"start_step": self.start_step, "loss_sums": [float(t) for t in sums]}

    def record(self, lr: float, grad_norm: torch.Tensor | None) -> dict[str, str]:
        """Write the interval's metrics line, start a new interval; returns the progress-bar postfix."""
        run = self.run
        if run.world > 1:
            dist.all_reduce(self.loss_sum)
            self.loss_sum /= run.world
        steps = run.step - self.start_step
        loss = float(self.loss_sum) / steps
        _check_finite(run, "the training loss", loss)
        # A non-finite gradient has already made the weights non-finite (clipping scales by NaN,
        # AdamW divides inf by inf), though this interval's loss was computed before it.
        if grad_norm is not None:
            grad_norm = float(grad_norm)
            _check_finite(run, "the gradient norm", grad_norm)
        layer_norms = None if run.layer_grad_norms is None else run.layer_grad_norms.tolist()
        for layer, norm in enumerate(layer_norms or []):
            _check_finite(run, f"the gradient norm of layer {layer}", norm)
        run.train_loss = loss
        tok_s = (run.step - self.timed_step) * self.tokens_per_step / (time.perf_counter() - self.start)
        record = {
            "kind": "train",
            "step": run.step,
            "loss": run.train_loss,
            "lr": lr,
            "tokens": run.step * self.tokens_per_step,
            "tokens_per_s": tok_s,
            "epoch": run.stream.epoch,
        }
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        if layer_norms is not None:
            record["layer_grad_norms"] = layer_norms
        postfix = {"loss": f"{run.train_loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}"}
        if self.peak:
            record["mfu"] = tok_s * self.flops_per_token / self.peak
            postfix["MFU"] = f"{record['mfu']:.1%}"
        run.metrics.write(record)
        run.losses.append((run.step, run.train_loss))
        self.loss_sum.zero_()
        self.start_step = self.timed_step = run.step
        self.start = time.perf_counter()
        return postfix


def _evaluate(run: _Run) -> None:
    """Validation numbers on every rank; gate statistics, the metrics line and the plots on rank 0."""
    cfg = run.cfg
    eval_batch = cfg.eval_batch_size or run.micro
    windows = -(-eval_windows(run.data.val, cfg.seq_len, cfg.eval_windows) // run.world)  # this rank's share
    shown = Progress(windows, "validation", "window", show=run.main and cfg.progress, leave=False)
    try:  # a bar of its own under the steps' (which stands still meanwhile), on a terminal only
        run.last_eval = evaluate(
            run.raw_model,
            run.data.val,
            run.byte_lengths,
            cfg.seq_len,
            batch_size=eval_batch,
            max_windows=cfg.eval_windows,
            precision=cfg.precision,
            rank=run.rank,
            world_size=run.world,
            progress=shown.update,
        )
    finally:
        shown.close()
    _check_finite(run, "the validation loss", run.last_eval.loss)  # every rank: the loss is all-reduced
    if not run.main:
        return
    first = next(iter(eval_batches(run.data.val, cfg.seq_len, min(8, eval_batch), max_windows=min(8, eval_batch))))
    with autocast(run.device, cfg.precision):
        gates = gate_statistics(run.raw_model, first.to(run.device))
    run.metrics.write({"kind": "eval", "step": run.step, **run.last_eval.to_dict(), "gates": gates.tolist()})
    run.log(f"step {run.step:,}: validation {run.last_eval}")
    if cfg.plots:
        from wiola.train.plots import plot_gate_heatmap

        _plot_loss_curve(run)
        run.plots["gates"] = plot_gate_heatmap(
            gates, run.out_dir / "gates.png", title=f"mean gate per layer × head, step {run.step:,}"
        )


def _save(run: _Run, meter: _Meter) -> None:
    """A checkpoint of this step, once its numbers are known to be finite (``_check_finite``)."""
    log_interval = meter.state_dict()  # every rank: it gathers the ranks' loss sums
    steps = run.step - log_interval["start_step"]
    if steps:  # the open interval since the last log line (at a log step it is empty)
        _check_finite(run, "the training loss", sum(log_interval["loss_sums"]) / run.world / steps)
    # The loss of a step is computed before its update: a step whose gradient broke the weights
    # still has a finite loss. The ranks hold the same weights, so they agree here.
    params = [p.detach() for p in run.raw_model.parameters()]
    if not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        raise _diverged(run, "the model's weights are not finite")
    if run.main:
        run.last_ckpt = save_checkpoint(
            run.out_dir, run.raw_model, run.optimizer, run.scheduler, run.stream, run.cfg, run.model_config,
            run.data, run.tokenizer, run.step, run.last_eval, run.train_loss, log_interval,
        )  # fmt: skip
    run.last_good = (run.step, run.last_ckpt)
    if run.world > 1:
        dist.barrier()


def _check_finite(run: _Run, what: str, value: float) -> None:
    """Raise ``TrainingDiverged`` when ``value`` (``what``, e.g. "the training loss") is NaN or infinite."""
    if not math.isfinite(value):
        raise _diverged(run, f"{what} is {value}")


def _diverged(run: _Run, what: str) -> TrainingDiverged:
    """The error that stops a diverged run: ``what`` went wrong at this step, what to change, and
    the last checkpoint before it (finite, though not always healthy: a run can blow its weights up
    before they overflow). ``--resume`` would repeat the same steps bit for bit (and refuses another
    --lr), so the way on is a lower --lr from the start or from that checkpoint's weights."""
    cfg = run.cfg
    change = f"lower --lr (now {cfg.lr:g})" + ("" if cfg.grad_clip else " or clip the gradients (--grad-clip 1)")
    if run.last_good is None:
        way_on = "then start again (no checkpoint was saved before it)"
        checkpoint = None
    else:
        step, checkpoint = run.last_good
        init = "--init" if checkpoint is None else f"--init {checkpoint}"
        way_on = (
            f"then start again or go on from the last checkpoint before it, step {step:,}, "
            f"with {init} and a new --out (without --model)"
        )
    return TrainingDiverged(f"{what} at step {run.step:,}: the run diverged; {change}, {way_on}", run.step, checkpoint)


def _training_flops(config: WiolaConfig, seq_len: int) -> float:
    from wiola.budget import budget

    return budget(config, seq_len + 1).training_flops * (seq_len + 1) / seq_len  # per target token


class StopFlag:
    """SIGINT/SIGTERM: finish the step, save, exit. A second SIGINT raises KeyboardInterrupt."""

    def __init__(self, log: Log) -> None:
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

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handler, no clean stop
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
