"""The environment a run executes in: the device, the precision (one autocast rule for training,
evaluation and the demo), the data-parallel process group, the model class, the training
extra's packages, and how progress is shown (``Progress``).

Precision: ``"auto"`` is bf16 autocast on CUDA and fp32 elsewhere; ``"bf16"`` is bf16 autocast on
any device; ``"fp32"`` is no autocast. Parameters, optimizer state and the loss stay fp32.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from wiola.config import WiolaConfig
    from wiola.tokenizer import Tokenizer

PRECISIONS = ("auto", "bf16", "fp32")
TRAIN_EXTRA = "pip install 'wiola-slm[train]'"


def require(module: str, purpose: str, extra: str = "train") -> ModuleType:
    """Import ``module`` (a package of the optional dependencies ``extra``, ``train`` by default),
    or raise ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{purpose} needs the `{module.split('.')[0]}` package, which cannot be imported ({e}); "
            f"install the {extra} extra: pip install 'wiola-slm[{extra}]' (in a checkout: pip install -e '.[{extra}]')"
        ) from e


def resolve_device(name: str | None, local_rank: int = 0) -> torch.device:
    """``name`` as a device (default: cuda when available, else cpu); a bare ``cuda`` becomes
    ``cuda:<local_rank>``. Raises ``RuntimeError`` when CUDA is asked for but absent."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def uses_bf16(device: torch.device | str, precision: str = "auto") -> bool:
    """Whether ``precision`` on ``device`` means bf16 autocast (see the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision == "bf16" or (precision == "auto" and torch.device(device).type == "cuda")


def autocast(device: torch.device | str, precision: str = "auto") -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device``: bf16 autocast or nothing (fp32)."""
    device = torch.device(device)
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def init_distributed() -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, initialised_here) from torchrun's environment; the process
    group is NCCL on GPU, gloo on CPU."""
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


def tokenizer_for(config: WiolaConfig, spec: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer for a model of ``config``: ``spec`` (a name or a ``tokenizer.json`` path,
    ``wiola.tokenizer.load_tokenizer``), or the tiktoken encoding whose vocabulary is the model's.

    Raises ``ValueError`` when the tokenizer has more ids than the model has embedding rows (fewer
    is fine: padded embeddings), ``RuntimeError`` (saying what to set) when it cannot load.
    """
    from wiola.tokenizer import TiktokenTokenizer, encoding_for_vocab, load_tokenizer

    if spec is None:
        return TiktokenTokenizer(encoding_for_vocab(config.vocab_size))
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} ids but the model's vocab_size is "
            f"{config.vocab_size:,}; set vocab_size to at least {tokenizer.vocab_size} (--model vocab_size=N)"
        )
    return tokenizer


def draws_bars(progress: bool = True) -> bool:
    """Whether a progress bar may be drawn: asked for (``progress``) and stderr is a terminal.
    A pipe or a log file gets plain lines instead, since a bar there is a stream of carriage
    returns."""
    return progress and sys.stderr.isatty()


class Progress:
    """Progress of long work: a tqdm bar on stderr where ``draws_bars(show)``; elsewhere a plain
    line through ``log`` at most every ``every`` seconds (nothing without ``log``), and one more
    by ``close(summary)``.

    ``update(n)`` counts ``n`` more ``unit``s of ``total`` (None: unknown); ``postfix`` sets the
    bar's trailing fields (the plain lines show them too)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        show: bool = True,
        log: Callable[[str], None] | None = None,
        every: float = 30.0,
        initial: int = 0,
        leave: bool = True,
    ) -> None:
        self.total, self.desc, self.unit, self.log, self.every = total, desc, unit, log, every
        self.n, self._last = initial, time.monotonic()
        self.fields: dict[str, str] = {}
        self.bar: Any = None
        if draws_bars(show):
            tqdm = require("tqdm.auto", "showing progress").tqdm
            self.bar = tqdm(
                total=total, initial=initial, desc=desc or None, unit=unit, leave=leave, dynamic_ncols=True,
                file=sys.stderr,
            )  # fmt: skip

    @property
    def drawn(self) -> bool:
        """Whether a bar is on the terminal (else plain lines, if any, stand for it)."""
        return self.bar is not None

    def postfix(self, **fields: str) -> None:
        """The bar's trailing fields (``loss=...``), kept for the plain lines too."""
        self.fields = fields
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.log is not None and (now := time.monotonic()) - self._last >= self.every:
            self._last = now
            self.log(self.line())

    def line(self) -> str:
        """The plain line of the count so far: ``desc: n/total units (p%), field value, ...``."""
        done = (
            f"{self.n:,}/{self.total:,} {self.unit}s ({self.n / self.total:.0%})"
            if self.total
            else f"{self.n:,} {self.unit}s"
        )
        fields = "".join(f", {k} {v}" for k, v in self.fields.items())
        return f"{self.desc}: {done}{fields}" if self.desc else f"{done}{fields}"

    def close(self, summary: str | None = None) -> None:
        """Remove the bar (``leave=False``) or leave it; then ``summary``, if any, through ``log``."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if summary is not None and self.log is not None:
            self.log(summary)
