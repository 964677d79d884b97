"""Ahead-of-time builds of ``wiola_kernels.butterfly`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

import torch

from wiola_kernels._utils import TRITON_DTYPE
from wiola_kernels.aot import AotSpec
from wiola_kernels.butterfly import (
    _SMALL_CONFIG,
    _UP_BWD_CONFIGS,
    DOWN_CONFIGS,
    UP_CONFIGS,
    _down_kernel,
    _up_bwd_kernel,
    _up_kernel,
)


def specs() -> list[AotSpec]:
    """Every autotune config (both row classes), bf16 and fp16, built as the JIT specializes
    aligned inputs; the small fixed tile for fp32 (aligned and not), and for unaligned bf16/fp16
    inputs."""
    specs: list[AotSpec] = []
    blocks = {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRECISION": "constexpr"}
    sizes = {"N": "i32", "D": "i32", "F": "i32", "N_BUCKET": "i32"}

    def add(name, fn, pointers, table, aligned, flags=None):
        for cfg in table:
            (m, n, k), w, s = cfg.blocks.values(), cfg.num_warps, cfg.num_stages
            half = any(v in ("*bf16", "*fp16") for v in pointers.values())
            specs.append(
                AotSpec(
                    name=f"butterfly_{name}{'' if aligned else ',unaligned'},BM{m},BN{n},BK{k},w{w}s{s}]",
                    fn=fn,
                    signature={**pointers, **sizes, **dict.fromkeys(flags or {}, "constexpr"), **blocks},
                    constexprs={**(flags or {}), "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "PRECISION": "ieee"},
                    num_warps=w,
                    num_stages=s,
                    expect_wgmma=half and m >= 64,
                    divisible_by_16=(*pointers, "D", "F", "N_BUCKET") if aligned else ("N_BUCKET",),
                )
            )

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t, p = TRITON_DTYPE[dtype], f"*{TRITON_DTYPE[dtype]}"
        small = [_SMALL_CONFIG]
        tables = [(True, small, small, small)] if dtype == torch.float32 else []
        # "few" lists every config of both row classes ("many" is its tail)
        tables += [(True, UP_CONFIGS["few"], _UP_BWD_CONFIGS, DOWN_CONFIGS["few"])] if dtype != torch.float32 else []
        tables += [(False, small, small, small)]
        for aligned, up_table, bwd_table, down_table in tables:
            add(f"up[{t}", _up_kernel, {"X": p, "W_UP": p, "W_BP": p, "R": p}, up_table, aligned)
            bwd_pointers = {"DY": p, "X": p, "W_UP": p, "W_DOWN": p, "DABC": p}
            add(f"up_bwd[{t}", _up_bwd_kernel, bwd_pointers, bwd_table, aligned)
            # residual: none, same dtype, and the model's fp32 residual stream under autocast
            for res in dict.fromkeys([None, t, "fp32"]):
                pointers = {"R": p, "W_DOWN": p, "RES": f"*{res or t}", "Y": f"*{'fp32' if res == 'fp32' else t}"}
                tag = "" if res is None else f"+res{res}"
                flags = {"HAS_RESIDUAL": res is not None}
                add(f"down[{t}{tag}", _down_kernel, pointers, down_table, aligned, flags)
    return specs
