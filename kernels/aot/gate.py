"""Ahead-of-time builds of ``wiola_kernels.gate`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

from wiola_kernels._utils import TRITON_DTYPE
from wiola_kernels.aot import AotSpec
from wiola_kernels.gate import (
    NUM_STAGES,
    _configs,
    _gate_bwd_kernel,
    _gate_bwd_scan_kernel,
    _gate_fwd_kernel,
    _gate_span_sums_kernel,
)

# Every kernel at every configuration _configs picks for H <= 32 and D in {16..128} (block_h 16/32 x
# block_half 16/32/64), bf16, fp16 and fp32 q; all features on, and the forward once with all of them off.

_ROT = {"COS": "*fp32", "SIN": "*fp32", "MASK": "*u8"}
_SIZES = {"T": "i32", "H": "i32", "HALF": "i32", "SPAN": "i32", "NS": "i32"}
_Q_STRIDES = {"stride_qb": "i32", "stride_qt": "i32", "stride_qh": "i32"}
_RC_STRIDES = {"stride_cb": "i32", "stride_ct": "i32", "stride_mb": "i32", "stride_mt": "i32"}


def _spec(name: str, fn, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict, warps: int) -> AotSpec:
    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    return AotSpec(name, fn, signature, constexprs, num_warps=warps, num_stages=NUM_STAGES)


def specs() -> list[AotSpec]:
    """Every kernel at every configuration ``_configs`` picks (see the comment above), per dtype."""
    specs = []
    shapes = [(H, D) for H in (8, 32) for D in (32, 64, 128)]  # one per (block_h, block_half)
    builds = [(dt, H, D) for dt in ("bf16", "fp16", "fp32") for H, D in shapes]
    dtypes = {name: dtype for dtype, name in TRITON_DTYPE.items()}
    for dt, H, D in builds:
        configs = _configs(H, D, dtypes[dt])
        scan, sums, fwd, bwd = configs["scan"], configs["sums"], configs["fwd"], configs["bwd"]
        block_t, block_h, block_half = fwd["BLOCK_T"], fwd["BLOCK_H"], fwd["BLOCK_HALF"]
        q, feats = {"Q": f"*{dt}"}, {"ROTATE": True, "HAS_MASK": True}
        blocks = dict(scan.blocks)
        scalars = {**_SIZES, **_Q_STRIDES, **_RC_STRIDES}
        tag = f"{dt},H{block_h},D{2 * block_half}"
        name = f"gate_span_sums[{dt},BT{block_t},D{2 * block_half},U{sums['HEADS_AT_ONCE']}]"
        if name not in {spec.name for spec in specs}:  # the pre-pass depends on H only through U
            specs.append(
                _spec(name, _gate_span_sums_kernel, {**q, **_ROT, "SPAN_SUM": "*fp32", "SPAN_COUNT": "*i32"},
                      scalars, {**feats, **sums.blocks}, sums.num_warps)
            )  # fmt: skip
        if H == 8:  # the reverse scan does not depend on H
            specs.append(
                _spec(f"gate_bwd_scan[{dt},BT{block_t},D{2 * block_half}]", _gate_bwd_scan_kernel,
                      {**_ROT, "E": "*fp32", "E_SPAN": "*fp32", "DSUM": "*fp32", "DQ": f"*{dt}", "DCARRY": "*fp32"},
                      {**_SIZES, **_RC_STRIDES}, {**feats, "HAS_DSUM": True, **blocks}, fwd.num_warps)
            )  # fmt: skip
        weights = {"W1": "*fp32", "W2": "*fp32", "B2": "*fp32"}
        for on in (True, False) if (dt, H, D) == ("bf16", 8, 32) else (True,):
            fwd_flags = {"ROTATE": on, "HAS_MASK": on, "HAS_CARRY": on, **fwd.blocks}
            specs.append(
                _spec(f"gate_fwd[{tag},BT{block_t},U{fwd['HEADS_AT_ONCE']}{'' if on else ',plain'}]", _gate_fwd_kernel,
                      {**q, **_ROT, **weights, "CARRY_SUM": "*fp32", "CARRY_COUNT": "*i64", "SPAN_SUM": "*fp32",
                       "SPAN_COUNT": "*i32", "G": "*fp32", "SUM_OUT": "*fp32", "COUNT_OUT": "*i64",
                       "PREFIX_SUM": "*fp32", "PREFIX_COUNT": "*i32"},
                      scalars, fwd_flags, fwd.num_warps)
            )  # fmt: skip
        bwd_flags = {**feats, **bwd.blocks}
        specs.append(
            _spec(f"gate_bwd[{tag},BT{bwd['BLOCK_T']},U{bwd['HEADS_AT_ONCE']}]", _gate_bwd_kernel,
                  {**q, **_ROT, **weights, "PREFIX_SUM": "*fp32", "PREFIX_COUNT": "*i32", "DG": "*fp32",
                   "E": "*fp32", "E_SPAN": "*fp32", "C": "*fp32", "DA": "*fp32", "DW2_PART": "*fp32", "DB2_PART": "*fp32"},
                  {**scalars, "stride_gb": "i32", "stride_gt": "i32", "stride_gh": "i32"}, bwd_flags, bwd.num_warps)
        )  # fmt: skip
    return specs
