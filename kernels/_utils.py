"""The conventions every kernel module follows, written once.

- **Where kernels run** (``kernels_usable``): CUDA tensors, or CPU tensors under Triton's
  interpreter (``TRITON_INTERPRET=1``, how the tests run without a GPU; ``interpreting``).
- **Launch configs**: one type, ``LaunchConfig`` (block sizes, warps, stages, and for attention
  the head widths a config is built for), one autotune-and-prune helper, ``autotuned``, and one
  launcher, ``launch``, with one rule for choosing the config: a config the caller passes wins;
  under the interpreter the module's ``interpret`` config runs (the autotuner cannot time anything
  there, and the interpreter's cost is per operation, not per element, so its config is small and
  chosen so the tests cross several blocks and ragged ends); then the autotuner where the module
  has one for these inputs; then the module's fixed ``default``.
- **The SM count** (``sm_count``): the GPU's, or ``INTERPRETER_SMS`` under the interpreter, so small
  tests still split work across programs.
- **Allocation**: every buffer a kernel writes comes from ``empty``; inside ``poisoned_outputs()``
  those buffers start as NaN (integers as -1), so an element a kernel never writes shows up in the
  tests.
- **Input checks**: ``check_tensor`` and ``fail`` raise with one message style,
  ``"<op>: <what is wrong>, got <what was passed>"`` (``TypeError`` for a wrong type or dtype,
  ``ValueError`` for a wrong shape, device or value).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:  # imported where used: wiola.fast reads kernels_usable from here without triton installed
    import triton

TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_SMS = 2  # what sm_count reports under the interpreter: a couple of programs per split


# ------------------------------------------------------------------------------ where kernels run
def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: on CUDA, or on CPU under the interpreter."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device); ``INTERPRETER_SMS`` elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


# ------------------------------------------------------------------------------ launch configs
@dataclass(frozen=True, eq=True)
class LaunchConfig:
    """One launch configuration of a ``@triton.jit`` kernel.

    ``blocks`` maps the kernel's block-size constexprs to values (``{"BLOCK_M": 64, ...}``);
    ``head_dims`` (attention) lists the head widths the config is built for without spills (empty:
    every width).
    """

    blocks: Mapping[str, int]
    num_warps: int = 4
    num_stages: int = 2
    head_dims: tuple[int, ...] = field(default=())

    def __getitem__(self, name: str) -> int:
        """The block size ``name`` (``cfg["BLOCK_M"]``); ``KeyError`` if the config has none."""
        return self.blocks[name]

    def __hash__(self) -> int:
        return hash(self.key())

    def kwargs(self) -> dict[str, int]:
        """Keyword arguments of a launch: the block sizes, ``num_warps`` and ``num_stages``."""
        return {**self.blocks, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def key(self) -> tuple[int, ...]:
        """The block sizes in order, then warps and stages: what identifies the config."""
        return (*self.blocks.values(), self.num_warps, self.num_stages)

    def tag(self) -> str:
        """Short name, e.g. ``"BM64,BN32,w4,s3"`` (``BLOCK_M`` → ``BM``)."""
        short = lambda name: "B" + name.removeprefix("BLOCK_")[:1] if name.startswith("BLOCK_") else name
        return ",".join(
            [*(f"{short(k)}{v}" for k, v in self.blocks.items()), f"w{self.num_warps}", f"s{self.num_stages}"]
        )

    def triton(self) -> triton.Config:
        """The ``triton.Config`` an autotuner tries for this config."""
        import triton

        return triton.Config(dict(self.blocks), num_warps=self.num_warps, num_stages=self.num_stages)


def autotuned(
    fn: Any,
    configs: Sequence[LaunchConfig] | Mapping[str, Sequence[LaunchConfig]],
    key: list[str],
    classify: Callable[[dict[str, Any], dict[str, Any]], tuple[str, int]] | None = None,
) -> Any:
    """``fn`` under ``triton.autotune`` over ``configs``, keyed on ``key``.

    ``configs`` is a list, or lists by class (e.g. ``"half"``/``"fp32"``, or by row count) with
    ``classify(named_args, constexprs) -> (class, head_dim)``: a launch then tries only its class's
    configs that list its head width (a config with no ``head_dims`` serves every width). Raises
    ``ValueError`` for a config listed twice in a class.
    """
    import triton

    if not isinstance(configs, Mapping):
        return triton.autotune(configs=[c.triton() for c in configs], key=key)(fn)
    assert classify is not None, "configs by class need classify"
    allowed: dict[tuple, tuple[int, ...]] = {}
    for cls, listed in configs.items():
        for c in listed:
            if (cls, c.key()) in allowed:
                raise ValueError(f"autotuned: {cls} config {c.tag()} is listed twice for {fn.__name__}")
            allowed[cls, c.key()] = c.head_dims
    union: dict[tuple[int, ...], LaunchConfig] = {}
    for listed in configs.values():
        for c in listed:
            union.setdefault(c.key(), c)
    names = list(next(iter(union.values())).blocks)

    def prune(candidates: list[triton.Config], named_args: dict[str, Any], **constexprs: Any) -> list[triton.Config]:
        cls, d = classify(named_args, constexprs)
        ckey = lambda c: (*(c.kwargs[n] for n in names), c.num_warps, c.num_stages)
        kept = []
        for c in candidates:
            dims = allowed.get((cls, ckey(c)))  # None: not listed for this class
            if dims is not None and (not dims or d in dims):  # empty: every width
                kept.append(c)
        return kept

    return triton.autotune(
        configs=[c.triton() for c in union.values()], key=key, prune_configs_by={"early_config_prune": prune}
    )(fn)


def launch(
    kernel: Any,
    grid: Callable[[Mapping[str, int]], tuple[int, ...]],
    args: Sequence[Any],
    constexprs: Mapping[str, Any],
    *,
    config: LaunchConfig | None = None,
    tuned: Any = None,
    interpret: LaunchConfig | None = None,
    default: LaunchConfig | None = None,
) -> None:
    """Launch ``kernel(*args, **constexprs)`` over ``grid(blocks)``, the config chosen by the one rule:
    ``config`` if given; else ``interpret`` under the interpreter; else the autotuner ``tuned``
    (``triton.autotune`` of ``kernel``) if given; else ``default``."""
    if config is None and interpreting():
        config = interpret
    if config is None and tuned is not None:
        tuned[grid](*args, **constexprs)
        return
    config = config or default
    assert config is not None, f"{kernel.__name__}: no launch config"
    kernel[grid(config.blocks)](*args, **constexprs, **config.kwargs())


# ------------------------------------------------------------------------------ allocation
_POISON: contextvars.ContextVar[bool] = contextvars.ContextVar("wiola_kernels_poison", default=False)


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A buffer a kernel writes, shape ``shape``: uninitialised, or inside ``poisoned_outputs()``
    filled with NaN (floating point) or -1 (integers)."""
    if not _POISON.get():
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside the block every buffer from ``empty`` starts as NaN (or -1): the tests' check that a
    kernel writes every element of its outputs."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


# ------------------------------------------------------------------------------ input checks
def fail(op: str, message: str, error: type[Exception] = ValueError) -> NoReturn:
    """Raise ``error(f"{op}: {message}")``: the one message style of the kernels' checks."""
    raise error(f"{op}: {message}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_tensor(
    op: str,
    name: str,
    t: Any,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    """Check an input of ``op``: a tensor, of ``shape`` (``None`` entries match any size), of one
    of ``dtypes``, on ``device``. Raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError``
    (wrong shape or device), the message starting ``"<op>: <name>"``."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if shape is not None and (t.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        want = tuple("*" if s is None else s for s in shape)
        fail(op, f"{name} must have shape {want}, got {_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(op, f"{name} must be {names}, got {t.dtype}", TypeError)
    if device is not None and t.device != device:
        fail(op, f"{name} is on {t.device}, expected {device}")


def check_runnable(op: str, t: torch.Tensor, fallback: str) -> None:
    """Refuse tensors the kernels cannot run on (a CPU tensor without the interpreter), naming the
    PyTorch function to use instead."""
    if not kernels_usable(t):
        fail(
            op,
            f"the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {t.device}; "
            f"use {fallback} instead",
        )
