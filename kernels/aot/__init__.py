"""The ahead-of-time builds of every kernel, kept apart from the kernels (nothing here is imported
when a kernel runs): ``aot_specs(op)`` lists the builds of ``wiola_kernels.<op>``, one module per op
(``wiola_kernels.aot.<op>``). ``tests/test_compile.py`` builds them all for sm_90 and sm_80 and
checks for spills; ``bench/plan.py`` prices them."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AotSpec:
    """One ahead-of-time build of a ``@triton.jit`` kernel.

    ``signature`` maps every argument name to a Triton type string (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``); ``constexprs`` gives the values of the ``constexpr`` ones.
    """

    name: str  # e.g. "attention_fwd[bf16,D32,BM64,BN64]"
    fn: Any  # the @triton.jit function (not an autotuner wrapper: pass `.fn` for those)
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    expect_wgmma: bool = False  # sm_90 PTX must contain wgmma (tensor-core attention kernels)
    # Arguments built as multiples of 16 (pointers 16-byte aligned, ints % 16 == 0), as Triton's JIT
    # specializes them at run time when true; without it the build models only the unaligned case.
    divisible_by_16: tuple[str, ...] = ()

    @property
    def kernel(self) -> str:
        """The kernel's name: the part of ``name`` before the bracket (``"attention_fwd"``)."""
        return self.name.split("[", 1)[0]

    @property
    def config(self) -> str:
        """The bracketed part of ``name``: dtype, shape and tiles (``"bf16,D32,BM64,BN64"``)."""
        return self.name[len(self.kernel) :].strip("[]")

    @property
    def dtype(self) -> str:
        """The compute dtype every spec name starts its bracket with: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        found = re.match(r"(fp32|bf16|fp16)\b", self.config)
        if found is None:
            raise ValueError(f"AOT spec {self.name!r}: the bracket must start with fp32, bf16 or fp16")
        return found.group(1)


# Every op named here has a module wiola_kernels.aot.<op> defining ``specs() -> list[AotSpec]``.
AOT_OPS = ("attention", "gate", "butterfly", "rms_norm", "cross_entropy", "decode")


def aot_specs(op: str) -> list[AotSpec]:
    """Every ahead-of-time build of ``wiola_kernels.<op>``: each kernel x launch/autotune config x dtype.

    Raises ``ValueError`` for an op not in ``AOT_OPS``."""
    if op not in AOT_OPS:
        raise ValueError(f"aot_specs: unknown op {op!r}; the registered ops are {AOT_OPS}")
    return importlib.import_module(f"wiola_kernels.aot.{op}").specs()
