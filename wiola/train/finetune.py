"""Supervised fine-tuning of a checkpoint (``wiola finetune``): the whole model, or LoRA
adapters through ``peft`` (docs/SPEC.md "Chat and fine-tuning").

The data is ``wiola.train.sft``'s (only answer tokens in the loss). A full fine-tune saves a
checkpoint (``WiolaModel.from_pretrained`` reads it); a LoRA run saves the adapters in PEFT's
own format (``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained(base, folder)`` reads), naming the base checkpoint;
``load_finetuned`` reads either and ``merge_adapters`` folds adapters into the weights. Both
write the tokenizer with its chat template beside them.

As ``wiola train`` does: a non-finite loss, gradient norm or weight stops the run with
``TrainingDiverged`` and saves nothing (a model already in ``--out`` stays); SIGINT (Ctrl-C) or
SIGTERM finishes the step, saves the model or adapters as of it and raises ``FinetuneInterrupted``
(a second Ctrl-C aborts without saving).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from wiola.chat import add_role_tokens, resize_token_embeddings, with_chat_template
from wiola.checkpoint import REPO_ID, load_checkpoint_tokenizer, quantization_of, read_json_object, resolve_checkpoint
from wiola.model import ADAPTER_TARGETS
from wiola.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer, read_chat_template
from wiola.train.env import Progress, autocast, model_class, require, resolve_device
from wiola.train.loop import StopFlag, TrainingDiverged
from wiola.train.optim import WarmupCosine
from wiola.train.run_folder import (
    MODEL_FILES,
    check_apart,
    check_not_a_run,
    check_output_folder,
    clear_model_folder,
    describe_model_files,
    held_files,
    held_model_files,
)
from wiola.train.sft import FORMATS, batches, collate, load_sft_data

# What finetune writes into --out, among run_folder.MODEL_FOLDER_FILES: an --out holding any of
# those is refused without --overwrite, since two models' files would mix there (load_finetuned
# prefers adapter_config.json), and cleared first with it.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's names, the first what it writes
RUN_FILE = "finetune.json"
LOSS_CURVE = "loss_curve.png"  # the logged losses against the step
DEFAULT_WARMUP = 10  # steps, at most --steps
COMMIT = re.compile(r"[0-9a-f]{40}")  # a Hub snapshot folder's name: the commit it holds


@dataclass
class FinetuneConfig:
    """One fine-tuning run's settings (the ``wiola finetune`` flags)."""

    init: str  # the checkpoint to start from
    data: str  # JSONL file
    format: str = "chat"  # "chat" or "completion" (wiola.train.sft)
    out: str = "runs/finetune"
    steps: int = 200
    batch_size: int = 8
    lr: float = 3e-4  # a LoRA rate; a full fine-tune wants ~1e-4 or less
    warmup: int | None = None  # None: DEFAULT_WARMUP steps, at most steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    lora_rank: int | None = None  # None: every weight trains
    # The other LoRA settings; None: not given (an error without lora_rank), then their defaults
    lora_alpha: float | None = None  # 2 x rank
    lora_targets: tuple[str, ...] | None = None  # ADAPTER_TARGETS
    lora_dropout: float | None = None  # 0
    add_role_tokens: bool = False
    device: str | None = None
    fast: bool = False
    precision: str = "auto"
    progress: bool = True

    @property
    def warmup_steps(self) -> int:
        return min(DEFAULT_WARMUP, self.steps) if self.warmup is None else self.warmup

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections LoRA adapts (``lora_targets``, by default every one of ``ADAPTER_TARGETS``)."""
        return ADAPTER_TARGETS if self.lora_targets is None else self.lora_targets

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting (by its ``wiola finetune`` flag)."""
        if self.format not in FORMATS:
            raise ValueError(f"--format {self.format!r}: choose one of {', '.join(FORMATS)}")
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.warmup is not None and self.warmup > self.steps:
            raise ValueError(
                f"--warmup {self.warmup} is more than --steps {self.steps}: the learning rate would never reach "
                f"--lr; give at most {self.steps}"
            )
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (self.grad_clip > 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip must be a positive number, got {self.grad_clip}")
        if self.lora_rank is None:
            given = [
                flag
                for flag, value in (
                    ("--lora-alpha", self.lora_alpha),
                    ("--lora-targets", self.lora_targets),
                    ("--lora-dropout", self.lora_dropout),
                )
                if value is not None
            ]
            if given:
                flags = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
                raise ValueError(
                    f"{flags} {'applies' if len(given) == 1 else 'apply'} to LoRA adapters, which only --lora-rank "
                    "makes: add --lora-rank (without it every weight trains)"
                )
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:  # p = 1 would zero every adapter input
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha is not None and not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise ValueError(f"--lora-alpha must be a positive number, got {self.lora_alpha}")
        if self.lora_rank is not None:
            if self.lora_rank <= 0:
                raise ValueError(f"--lora-rank must be positive, got {self.lora_rank}")
            bad = sorted(set(self.targets) - set(ADAPTER_TARGETS))
            if bad or not self.targets:
                raise ValueError(f"--lora-targets {bad or '(none)'}: choose among {', '.join(ADAPTER_TARGETS)}")
            if self.add_role_tokens:
                raise ValueError(
                    "--add-role-tokens with --lora-rank: the new embedding rows would stay untrained and the adapters' "
                    "base would lack them; add role tokens in a full fine-tune first"
                )


@dataclass
class FinetuneResult:
    out: Path
    losses: list[tuple[int, float]]  # (step, mean answer-token loss since the last log line)
    examples: int
    dropped: int
    seconds: float


class FinetuneInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped ``finetune`` after step ``step``; the model or adapters
    as of that step are saved in ``out`` (``None``: no step was done, nothing saved). A
    ``KeyboardInterrupt``, so a caller stops as on any Ctrl-C (``wiola finetune`` exits 130)."""

    def __init__(self, step: int, out: Path | None) -> None:
        super().__init__(f"interrupted at step {step}" + ("" if out is None else f"; saved {out}"))
        self.step, self.out = step, out


def finetune(cfg: FinetuneConfig, log: Callable[[str], None] = print, *, overwrite: bool = False) -> FinetuneResult:
    """Run ``cfg``: load, encode the data, train, save into ``cfg.out``. Raises
    ``ValueError``/``FileNotFoundError``/``RuntimeError`` naming bad settings, data, an output
    folder that is a file, overlaps the ``init`` checkpoint, holds a training run or already
    holds a model or adapters (unless ``overwrite``: their files are then deleted before the new
    ones are written), or a missing package before any training.

    Raises ``TrainingDiverged`` at a non-finite loss or gradient norm, or weights that are not
    finite when saving; nothing is saved then. SIGINT or SIGTERM: the step finishes, the model as
    of it is saved, and ``FinetuneInterrupted`` is raised (a second SIGINT: ``KeyboardInterrupt``,
    nothing saved).

    Progress: a tqdm bar on stderr where stderr is a terminal and ``cfg.progress`` is set;
    otherwise a plain line (``log``) every ``log_every`` steps. A summary line ends the run."""
    cfg.check()
    require("tqdm.auto", "fine-tuning")
    check_output_folder(cfg.out, "--out")
    check_not_a_run(cfg.out, "--out")
    device = resolve_device(cfg.device)
    init = checkpoint_dir(cfg.init)
    check_apart(cfg.out, init, "--out", "--init checkpoint")
    check_model_out(cfg.out, overwrite)
    check_full_precision(init, "--init checkpoint", "fine-tune")
    model = model_class(cfg.fast).from_pretrained(init, device=device)
    if cfg.lora_rank is not None:
        check_lora_rank(model, cfg.lora_rank, cfg.targets)
    tokenizer = with_chat_template(load_checkpoint_tokenizer(init))
    if cfg.add_role_tokens:
        tokenizer = add_role_rows(model, tokenizer)
    data = load_sft_data(cfg.data, cfg.format, tokenizer, model.config.max_seq_len)
    log(f"data: {data.summary(model.config.max_seq_len)}")
    torch.manual_seed(cfg.seed)  # before the adapters' random init: a seed repeats a LoRA run too
    if cfg.lora_rank is not None:
        model = attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.targets, cfg.lora_dropout or 0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    log(f"training {sum(p.numel() for p in trainable):,} of {sum(p.numel() for p in model.parameters()):,} weights")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = WarmupCosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    stream = batches(data, cfg.batch_size, cfg.seed)
    losses, total, count, start = [], 0.0, 0, time.perf_counter()
    model.train()
    bar = Progress(cfg.steps, "finetune", "step", show=cfg.progress)
    step = 0
    try:
        with StopFlag(log) as stop:
            while step < cfg.steps and not stop.requested:
                ids, mask, labels = (t.to(device) for t in collate(next(stream), pad))
                with autocast(device, cfg.precision):
                    loss = model(ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
                # Before the update: a non-finite loss or gradient norm would make the weights so.
                _check_finite(cfg, step + 1, "the training loss", float(loss.detach()))
                _check_finite(cfg, step + 1, "the gradient norm", float(grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step, total, count = step + 1, total + float(loss.detach()), count + 1
                if step % cfg.log_every == 0 or step == cfg.steps:
                    losses.append((step, total / count))
                    bar.postfix(loss=f"{total / count:.3f}")
                    if not bar.drawn:  # no bar (a pipe, a log file, --no-progress): a plain line instead
                        log(f"step {step}/{cfg.steps}: loss {total / count:.4f}")
                    total, count = 0.0, 0
                bar.update(1)
    finally:
        bar.close()
    model.eval()
    seconds = time.perf_counter() - start
    if count:  # an interrupted run's open interval since the last log line
        losses.append((step, total / count))
    interrupted = step < cfg.steps
    if interrupted and step == 0:
        log("interrupted before the first step ended: nothing saved")
        raise FinetuneInterrupted(step, None)
    # The loss of a step is computed before its update: a step whose update broke the weights
    # still has a finite loss and gradient norm.
    if not bool(torch.stack([torch.isfinite(p.detach()).all() for p in trainable]).all()):
        raise _diverged(cfg, step, "the model's weights are not finite")
    out = save_finetuned(model, tokenizer, cfg, init, overwrite=overwrite)
    record = {"config": asdict(cfg), "losses": losses, "examples": len(data.examples), "dropped": data.dropped}
    record |= {"steps_done": step, "seconds": seconds}
    (out / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")
    curve = _plot_losses(losses, out / LOSS_CURVE, log)
    what = "the adapters" if cfg.lora_rank is not None else "the model"
    if interrupted:
        log(f"interrupted at step {step}/{cfg.steps}; {what} as of that step saved to {out}{curve}")
        raise FinetuneInterrupted(step, out)
    log(f"{step} step{'s' if step != 1 else ''} in {seconds:.0f} s; final loss {losses[-1][1]:.4f}; saved {out}{curve}")
    return FinetuneResult(out, losses, len(data.examples), len(data.dropped), seconds)


def _check_finite(cfg: FinetuneConfig, step: int, what: str, value: float) -> None:
    """Raise ``TrainingDiverged`` when ``value`` (``what``, e.g. "the training loss") is NaN or infinite."""
    if not math.isfinite(value):
        raise _diverged(cfg, step, f"{what} is {value}")


def _diverged(cfg: FinetuneConfig, step: int, what: str) -> TrainingDiverged:
    """The error that stops a diverged fine-tune (``wiola finetune`` exits 1): nothing was saved."""
    held = bool(held_files(cfg.out, MODEL_FILES))
    kept = f" (the model in {cfg.out} is unchanged)" if held else ""
    return TrainingDiverged(
        f"{what} at step {step}: the fine-tune diverged; lower --lr (now {cfg.lr:g}) and start again; "
        f"nothing was saved{kept}",
        step,
        None,
    )


def check_lora_rank(model: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> None:
    """``ValueError`` when ``rank`` exceeds the narrowest side of a projection that ``targets``
    names in ``model``: an update of that rank is not low-rank and costs more than the weight."""
    widths = [
        min(module.in_features, module.out_features)
        for name, module in model.named_modules()
        if hasattr(module, "in_features") and name.rsplit(".", 1)[-1] in targets
    ]
    if widths and rank > min(widths):  # none: attach_lora's peft names the missing targets
        raise ValueError(
            f"--lora-rank {rank} exceeds the smallest adapted projection ({min(widths)}): choose at most "
            f"{min(widths)}, and far less for a low-rank update"
        )


@torch.no_grad()
def add_role_rows(model: torch.nn.Module, tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` with the role tokens (``wiola.chat.add_role_tokens``), and ``model``'s embedding
    (the tied head too) with a row for each: the mean of the rows of the tokenizer's own ids.

    The new ids follow the tokenizer's vocabulary; on a model padded past it they take padded
    rows, which hold whatever the model left there, so they are set too. Rows of the tokenizer's
    ids are unchanged (so are their logits); tokens already added keep their rows."""
    real = tokenizer.vocab_size
    tokenizer = add_role_tokens(tokenizer)
    resize_token_embeddings(model, max(model.config.vocab_size, tokenizer.vocab_size))
    weight = model.embed.weight
    weight[real : tokenizer.vocab_size] = weight[:real].mean(dim=0)
    if hasattr(model, "derived_weights"):  # the fast model's copies of the head would go stale
        model.derived_weights.clear()
    return tokenizer


def attach_lora(
    model: torch.nn.Module, rank: int, alpha: float | None, targets: tuple[str, ...], dropout: float = 0.0
) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with LoRA adapters (rank ``rank``, scale
    ``alpha / rank``) on the projections named ``targets`` in every block; only they train."""
    peft = require_peft()
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets), lora_dropout=dropout
    )
    return peft.get_peft_model(model, config)


def require_peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise RuntimeError(
            f"LoRA needs the `peft` package ({e}); install the finetune extra: pip install 'wiola-slm[finetune]'"
        ) from e
    return peft


def _plot_losses(losses: list[tuple[int, float]], path: Path, log: Callable[[str], None]) -> str:
    """``path``, the logged answer-token losses against the step; the words naming it for the
    summary line, or, where matplotlib (the train extra) is missing, a line saying so and ""."""
    from wiola.train.plots import plot_loss_curve

    try:
        plot_loss_curve([{"kind": "train", "step": s, "loss": v} for s, v in losses], path, title="Wiola fine-tuning")
    except ImportError as e:
        log(f"no {path.name}: {e}")
        return ""
    return f" (loss curve: {path})"


def save_finetuned(
    model: torch.nn.Module, tokenizer: Tokenizer, cfg: FinetuneConfig, init: Path, *, overwrite: bool = False
) -> Path:
    """Write a full checkpoint, or (a peft model) the adapters in PEFT's format naming their base
    (``base_source``). With ``overwrite``, the files of a model already in ``cfg.out`` are deleted
    first (``check_model_out`` refused such a folder without it)."""
    out = Path(cfg.out)
    if overwrite:
        clear_model_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.lora_rank is None:
        model.save_pretrained(out, tokenizer)
        return out
    peft_config = model.peft_config["default"]
    peft_config.base_model_name_or_path, peft_config.revision = base_source(cfg.init, init)
    model.save_pretrained(str(out), save_embedding_layers=False)  # adapters only (the embedding is never one)
    tokenizer.save(out)  # its files (GPT-2's: the chat template alone); config.json is the base's
    return out


def check_model_out(out: str | os.PathLike, overwrite: bool) -> None:
    """``ValueError`` when ``out`` already holds a model, adapters or the files saved beside them
    (``run_folder.held_model_files``) and ``overwrite`` is not set: writing there would replace
    them or mix two models' files."""
    held = held_model_files(out)
    if held and not overwrite:
        raise ValueError(
            f"--out {str(out)!r} already holds {describe_model_files(held, 'a model or adapters')}; "
            "choose another --out, or pass --overwrite to replace them"
        )


def base_source(name: str | os.PathLike, resolved: Path) -> tuple[str, str | None]:
    """``(base_model_name_or_path, revision)`` for adapters trained on the checkpoint ``name``
    (as given) read from ``resolved``: a local one's absolute path and no revision; a Hub id as
    given, with the commit of the snapshot it was read from, so that the adapters load on those
    very weights later (``resolve_adapter_base``), from the local Hub cache offline too."""
    if Path(name).exists() or not REPO_ID.match(str(name)):
        return str(Path(resolved).resolve()), None
    resolved = Path(resolved)
    commit = resolved.name if resolved.parent.name == "snapshots" and COMMIT.fullmatch(resolved.name) else None
    return str(name), commit


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a run folder (its latest checkpoint) or a Hub id."""
    from wiola.train.run_folder import find_checkpoint

    if (Path(path) / "checkpoints" / "latest").is_file():
        return find_checkpoint(path)
    return resolve_checkpoint(path)


def is_adapter_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    return read_json_object(Path(path) / ADAPTER_CONFIG)


def adapter_base(path: str | os.PathLike) -> str:
    """The base checkpoint a LoRA folder's ``adapter_config.json`` names; ``ValueError`` when it
    names none (then ``--base`` gives it)."""
    base = _adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG} names no base model: give it with --base")
    return base


def resolve_adapter_base(path: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """The local folder of a LoRA folder's base: ``base`` when given, else the checkpoint its
    ``adapter_config.json`` names, a Hub id at the ``revision`` recorded there
    (``resolve_checkpoint``: the local Hub cache does offline)."""
    if base is not None:
        return resolve_checkpoint(base)
    name = adapter_base(path)
    revision = _adapter_config(path).get("revision")
    if revision is not None and not isinstance(revision, str):
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG}: revision {revision!r} is not a string")
    # peft records a revision for Hub ids; for a local folder there is none to apply
    return resolve_checkpoint(name, None if Path(name).exists() else revision)


def load_finetuned(
    path: str | os.PathLike, *, base: str | os.PathLike | None = None, fast: bool = False, device: str = "cpu"
) -> tuple[torch.nn.Module, Tokenizer]:
    """``(model, tokenizer)`` of a checkpoint, or of a LoRA folder on its base (``base``, else
    the one its ``adapter_config.json`` names) as a ``peft.PeftModel``; in eval mode. The
    tokenizer is the folder's own when it has one (with the chat template), else the base's.
    ``ValueError`` for a LoRA folder without its weights file or with adapters that do not fit
    the base (``check_adapter_shapes``), and for ``base`` given with a path that is not a LoRA
    folder (it would be ignored)."""
    path = Path(path)
    cls = model_class(fast)
    if not is_adapter_folder(path):
        if base is not None:  # it would be ignored: only adapters sit on a base
            raise ValueError(
                f"--base is for a LoRA adapter folder (the model its adapters sit on); {path} is not one: "
                "leave --base out"
            )
        path = checkpoint_dir(path)
        return cls.from_pretrained(path, device=device).eval(), load_checkpoint_tokenizer(path)
    peft = require_peft()
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):  # peft would look for them on the Hub
        raise ValueError(
            f"{path} holds {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS[0]}: the adapters' weights are missing"
        )
    base_dir = resolve_adapter_base(path, base)
    base_model = cls.from_pretrained(base_dir, device=device)
    check_adapter_shapes(path, base_model, base_dir)
    model = peft.PeftModel.from_pretrained(base_model, str(path)).eval()
    tokenizer = load_checkpoint_tokenizer(base_dir)
    if (path / TOKENIZER_FILE).is_file():  # role tokens added: the folder's own tokenizer
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        tokenizer = load_tokenizer(path).with_special_ids(*ids)
    tokenizer.chat_template = read_chat_template(path) or tokenizer.chat_template
    return model, tokenizer


def check_adapter_shapes(path: str | os.PathLike, base: torch.nn.Module, base_dir: str | os.PathLike) -> None:
    """``ValueError`` naming the first projection whose adapters in the folder ``path`` do not fit
    ``base`` (read from ``base_dir``): adapters trained on a base of another shape, or adapting a
    projection the base lacks. Reads only the tensors' shapes (``adapter_model.safetensors``; a
    ``.bin`` file is left to peft)."""
    from safetensors import safe_open

    weights = Path(path) / ADAPTER_WEIGHTS[0]
    if not weights.is_file():
        return
    modules = dict(base.named_modules())
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            # base_model.model.<projection>.lora_A.weight: (rank, in); lora_B.weight: (out, rank)
            name, sep, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
            if not sep or kind not in ("A.weight", "B.weight"):
                continue
            module = modules.get(name)
            if not hasattr(module, "in_features"):
                raise ValueError(f"the adapters in {path} adapt {name}, which the base {base_dir} lacks")
            side, want = ("input", module.in_features) if kind == "A.weight" else ("output", module.out_features)
            got = f.get_slice(key).get_shape()[1 if kind == "A.weight" else 0]
            if got != want:
                raise ValueError(
                    f"the adapters in {path} were trained on a base of another shape: {name} has {got} {side}s "
                    f"there, {want} in the base {base_dir}"
                )


def check_full_precision(checkpoint: str | os.PathLike, role: str, action: str) -> None:
    """``ValueError`` when ``checkpoint`` holds quantized weights (``wiola.fast.quantize``): they
    are a decoding form, not weights to train or add an update to."""
    scheme = quantization_of(checkpoint)
    if scheme is not None:
        raise ValueError(
            f"the {role} {checkpoint} holds {scheme}-quantized weights, which only decode: {action} its "
            "full-precision checkpoint, then quantize the result (--quantize, or wiola.fast.quantize)"
        )


def merge_adapters(
    path: str | os.PathLike,
    out: str | os.PathLike,
    base: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Fold a LoRA folder's adapters into its base's weights and save a plain checkpoint in
    ``out`` (for the fast model, quantization and ONNX export). Raises ``ValueError`` when
    ``path`` holds no adapters or adapters that do not fit the base, ``out`` holds a training
    run, or ``out`` already holds a model or adapters and ``overwrite`` is not set (with it,
    their files are deleted before the merged model is written)."""
    if not is_adapter_folder(path):
        raise ValueError(f"{path} holds no {ADAPTER_CONFIG}: nothing to merge")
    check_output_folder(out, "--out")
    check_not_a_run(out, "--out")
    check_apart(out, path, "--out", "adapter folder")
    base_dir = resolve_adapter_base(path, base)
    check_apart(out, base_dir, "--out", "base checkpoint")
    check_model_out(out, overwrite)
    check_full_precision(base_dir, "base checkpoint", "merge the adapters into")
    model, tokenizer = load_finetuned(path, base=base_dir)
    merged = model.merge_and_unload()
    if overwrite:
        clear_model_folder(out)
    merged.save_pretrained(Path(out), tokenizer)
    return Path(out)
