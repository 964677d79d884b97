"""The settings of a training run (``TrainConfig``) and the named recipes.

A recipe is a JSON file of ``TrainConfig`` fields in ``wiola/train/recipes/`` (package data):
``--recipe paper`` reads ``recipes/paper.json``, the published 13M run. ``--config FILE.json``
reads the same format from anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from wiola.config import WiolaConfig, check_field_types, dataclass_from_dict
from wiola.train.sources import absolute_data_path, absolute_path

DEFAULT_SEQ_LEN = 512  # the paper's T, where the model allows it


def default_seq_len(model_config: WiolaConfig) -> int:
    """``min(512, max_seq_len - 1)``: windows hold ``T + 1`` tokens and must fit the model."""
    return min(DEFAULT_SEQ_LEN, model_config.max_seq_len - 1)


@dataclass
class TrainConfig:
    """Everything a run needs; ``--config FILE.json`` and ``--recipe`` fill it, flags override."""

    # model
    preset: str = "13m"
    model: dict[str, Any] = field(default_factory=dict)  # WiolaConfig overrides, e.g. {"d_model": 64}
    tokenizer: str | None = None  # gpt2, gpt2-32k or a tokenizer.json path; None: the tiktoken one matching vocab_size
    init: str | None = None  # start from this checkpoint's model, weights and tokenizer (folder, run or Hub id)
    activation_checkpointing: bool = False  # recompute each block in the backward pass (less memory)
    # data
    # Paths are kept absolute (``__post_init__``): a checkpoint's settings name the same files
    # from any working directory (``wiola eval``, ``--resume``).
    data: str | None = "tinystories"  # "tinystories", "sample", "sample:N", or a path
    val_data: str | None = None
    val_fraction: float = 0.01
    cache_dir: str | None = None
    seq_len: int | None = None  # T: windows hold T + 1 <= max_seq_len tokens; None: min(512, max_seq_len - 1)
    # (with ``init``, the checkpoint's max_seq_len: ``with_model`` fills it once the checkpoint is read)
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
        # Every field's kind first (a bool is a bool, a float finite), so a config file's
        # {"shuffle": "false"} or a NaN flag is refused by name before any work.
        check_field_types(self)
        self.data = absolute_data_path(self.data)  # a named corpus ("tinystories", "sample:N") stays a name
        self.val_data = None if self.val_data is None else absolute_path(self.val_data)
        self.cache_dir = None if self.cache_dir is None else absolute_path(self.cache_dir)
        model_config = self.model_config()  # an unknown preset or model field raises here
        if self.seq_len is None and self.init is None:
            self.seq_len = default_seq_len(model_config)
        self._check_counts()
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.warmup >= 1 and self.warmup != int(self.warmup):  # int() would drop the fraction
            raise ValueError(
                f"warmup {self.warmup} is a step count (>= 1), which must be whole; a fraction of steps is < 1"
            )
        if self.warmup_steps > self.steps:  # the rate would never reach lr, nor decay
            raise ValueError(
                f"warmup of {self.warmup_steps:,} steps is longer than the run's {self.steps:,} steps: "
                "lower --warmup (a fraction of the steps below 1, or a step count)"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        if not 0 <= self.seed < 2**64:  # torch.manual_seed's range; numpy refuses negative seeds
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {self.precision!r}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N (N the GPU's index), got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads (tokeniser threads) must be a positive int, got {self.num_threads}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"peak_flops (FLOP/s of one device, for MFU) must be positive, got {self.peak_flops:g}")
        if self.init is None:  # with --init the model is the checkpoint's: ``with_model`` checks it
            self._check_fit(model_config)

    def with_model(self, model_config: WiolaConfig) -> TrainConfig:
        """This configuration for ``model_config``, the model the run trains (an ``init``
        checkpoint's, which the preset does not describe): an unset ``seq_len`` becomes
        ``default_seq_len(model_config)``. ``ValueError`` when the windows do not fit the model."""
        seq_len = default_seq_len(model_config) if self.seq_len is None else self.seq_len
        cfg = dataclasses.replace(self, seq_len=seq_len)
        cfg._check_fit(model_config)
        return cfg

    def with_saved_paths(self, saved: dict[str, Any]) -> TrainConfig:
        """This configuration with the ``data`` and ``val_data`` of ``saved`` (the ``train_config``
        of the checkpoint it resumes) where they are spelled otherwise but name the same paths from
        this working directory. Older versions saved a path as typed (``train.txt``), and the
        checkpoint's data fingerprint and token cache are keyed by that spelling: resuming keeps it."""
        cfg = dataclasses.replace(self)
        for name in ("data", "val_data"):
            old, now = saved.get(name), getattr(cfg, name)
            if isinstance(old, str) and old != now and absolute_path(old) == now:
                setattr(cfg, name, old)  # not through __post_init__, which would make it absolute again
        return cfg

    def _check_fit(self, model_config: WiolaConfig) -> None:
        assert self.seq_len is not None
        if self.seq_len + 1 > model_config.max_seq_len:
            raise ValueError(
                f"windows of seq_len + 1 = {self.seq_len + 1} tokens do not fit "
                f"max_seq_len={model_config.max_seq_len}; use --seq-len {model_config.max_seq_len - 1} or less"
            )

    def _check_counts(self) -> None:
        positive = ("batch_size", "steps", "eval_every", "log_every", "save_every", "keep_checkpoints")
        positive += ("seq_len",) if self.seq_len is not None or self.init is None else ()
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("micro_batch", "eval_batch_size", "eval_windows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup) if self.warmup >= 1 else round(self.warmup * self.steps)

    def model_config(self) -> WiolaConfig:
        return WiolaConfig.preset(self.preset, **self.model)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return dataclass_from_dict(cls, data, "unknown training settings {unknown}; known: {known}")


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
    "activation_checkpointing",
    "progress",
    "num_threads",
    "peak_flops",
    "cache_dir",
    "micro_batch",
    "steps",
}


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a JSON config file (keys are ``TrainConfig`` fields; ``_comment`` is ignored).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for one that is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    return _parse_settings(path.read_text(), str(path))


def _parse_settings(text: str, name: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {name} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {name} must hold a JSON object of TrainConfig fields")
    data.pop("_comment", None)
    return data


def recipe_names() -> list[str]:
    """The names of the recipes shipped in ``wiola/train/recipes/``."""
    files = resources.files(__package__).joinpath("recipes").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def recipe(name: str) -> dict[str, Any]:
    """The ``TrainConfig`` settings of a named recipe (a fresh dict). Raises ``ValueError`` for an unknown name."""
    if name not in recipe_names():
        raise ValueError(f"unknown recipe {name!r}; choose one of {recipe_names()}")
    text = resources.files(__package__).joinpath("recipes", f"{name}.json").read_text()
    return _parse_settings(text, f"recipes/{name}.json")
