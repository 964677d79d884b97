"""Ahead-of-time builds of ``wiola_kernels.attention`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

import inspect

from wiola_kernels._utils import LaunchConfig
from wiola_kernels.aot import AotSpec
from wiola_kernels.attention import (
    DKDV_CONFIGS,
    DQ_CONFIGS,
    FWD_CONFIGS,
    PREPROCESS_BLOCK_M,
    SUPPORTED_HEAD_DIMS,
    _dtype_class,
)
from wiola_kernels.attention_triton import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, _attn_fwd

# Every kernel x autotune config x {bf16, fp16, fp32} x head width.

_FP32_POINTERS = {"G", "COS", "SIN", "LSE", "DELTA", "DG"}
_INT_ARGS = {"T", "H", "T_BUCKET"}


def _signature(fn, dtype: str) -> dict[str, str]:
    sig = {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            sig[name] = "constexpr"
        elif name.startswith("stride_") or name in _INT_ARGS:
            sig[name] = "i32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name == "KMASK":
            sig[name] = "*u8"
        else:
            sig[name] = "*fp32" if name in _FP32_POINTERS else f"*{dtype}"
    return sig


def _divisible(fn, D: int) -> tuple[str, ...]:
    """The arguments Triton's JIT sees as multiples of 16 in the common case (and specialises on):
    every pointer (fresh allocations; q/k/v slices of a fused QKV at multiples of H·D elements),
    the (B, T, H) strides of (B, T, H, D) tensors, T_BUCKET, and the cos/sin strides when D/2 ≥ 16.
    T itself and the gate/mask strides (multiples of H or T only) are left unaligned."""
    tensor_strides = {f"stride_{x}{d}" for x in ("q", "k", "v", "o", "do", "grad") for d in "bth"}
    if D >= 32:
        tensor_strides |= {"stride_cb", "stride_ct"}
    aligned = []
    for name, param in inspect.signature(fn.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            continue
        pointer = name.isupper() and name not in ("T", "H", "T_BUCKET")
        if pointer or name in tensor_strides or name == "T_BUCKET":
            aligned.append(name)
    return tuple(aligned)


def _spec(kernel: str, cfg: LaunchConfig, dtype: str, D: int, has_mask: bool, store_residual: bool = False) -> AotSpec:
    """One build of the forward (``kernel="attention_fwd"``), dq or dkdv kernel as the launcher runs it."""
    fn = {"attention_fwd": _attn_fwd, "attention_bwd_dq": _attn_bwd_dq, "attention_bwd_dkdv": _attn_bwd_dkdv}[kernel]
    constexprs = {"D": D, "HALF_PAD": max(16, D // 2), "HAS_MASK": has_mask,
                  "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", **cfg.blocks}  # fmt: skip
    flags = ",mask" if has_mask else ""
    if fn is _attn_fwd:
        constexprs["STORE_RESIDUAL"] = store_residual
        flags += ",res" if store_residual else ""
    held = cfg["BLOCK_N"] if fn is _attn_bwd_dkdv else cfg["BLOCK_M"]
    return AotSpec(
        name=f"{kernel}[{dtype},D{D},{cfg.tag()}{flags}]",
        fn=fn,
        signature=_signature(fn, dtype),
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        expect_wgmma=held >= 64 and dtype != "fp32",
        divisible_by_16=_divisible(fn, D),
    )


def specs() -> list[AotSpec]:
    """Every kernel x autotune config of its dtype's list x head width x dtype, unmasked and masked;
    the half-precision forward with and without the residual store (training and inference)."""
    specs = []
    for dtype in ("bf16", "fp16", "fp32"):
        has_residual = dtype != "fp32"
        for D in SUPPORTED_HEAD_DIMS:
            specs.append(
                AotSpec(
                    name=f"attention_bwd_preprocess[{dtype},D{D},BM{PREPROCESS_BLOCK_M}{',res' if has_residual else ''}]",
                    fn=_attn_bwd_preprocess,
                    signature=_signature(_attn_bwd_preprocess, dtype),
                    constexprs={"D": D, "BLOCK_M": PREPROCESS_BLOCK_M, "HAS_RESIDUAL": has_residual},
                    num_warps=4,
                    num_stages=1,
                    divisible_by_16=_divisible(_attn_bwd_preprocess, D),
                )
            )
            for kernel, configs in (("attention_fwd", FWD_CONFIGS), ("attention_bwd_dq", DQ_CONFIGS),
                                    ("attention_bwd_dkdv", DKDV_CONFIGS)):  # fmt: skip
                for cfg in configs[_dtype_class(dtype)]:
                    if D not in cfg.head_dims:
                        continue
                    for has_mask in (False, True):
                        for store_residual in (False, True) if kernel == "attention_fwd" and has_residual else (False,):
                            specs.append(_spec(kernel, cfg, dtype, D, has_mask, store_residual))
    return specs
