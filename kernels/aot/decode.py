"""Ahead-of-time builds of ``wiola_kernels.decode`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

from wiola_kernels.aot import AotSpec
from wiola_kernels.decode import (
    REDUCE_CONFIG,
    WRITE_CONFIG,
    _decode_partial_kernel,
    _decode_reduce_kernel,
    _decode_write_kernel,
    _partial_config,
)


def _signature(fn, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    """Triton types of every argument of ``fn``: pointers as given, ``qk_scale`` fp32, other scalars i32."""
    kinds = {**pointers, **dict.fromkeys(constexprs, "constexpr"), "qk_scale": "fp32"}
    return {name: kinds.get(name, "i32") for name in fn.arg_names}


def specs() -> list[AotSpec]:
    """The write, partial and reduce kernels for every dtype and head width, start as int or pointer."""
    specs = []
    for dt in ("bf16", "fp16", "fp32"):
        for D in (16, 32, 64, 128):
            for in_memory in (False, True):
                tag = f"{dt},D{D},{'start_ptr' if in_memory else 'start_int'}"
                rope = {"COS": "*fp32", "SIN": "*fp32", "START": "*i64"}
                consts = {"HEAD_DIM": D, "START_IN_MEMORY": in_memory}
                ptrs = {"K": f"*{dt}", "V": f"*{dt}", "KC": f"*{dt}", "VC": f"*{dt}", **rope}
                specs.append(
                    AotSpec(f"decode_write[{tag}]", _decode_write_kernel,
                            _signature(_decode_write_kernel, ptrs, consts), consts, num_warps=WRITE_CONFIG.num_warps, num_stages=1)
                )  # fmt: skip
                cfg = _partial_config(D, dt == "fp32")
                consts = {**consts, **cfg.blocks, "IEEE": dt == "fp32"}
                ptrs = {"Q": f"*{dt}", "G": "*fp32", "KC": f"*{dt}", "VC": f"*{dt}", "MASK": "*u8", **rope}
                ptrs.update(M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32")
                specs.append(
                    AotSpec(f"decode_partial[{tag},BM{cfg['BLOCK_M']},BN{cfg['BLOCK_N']}]", _decode_partial_kernel,
                            _signature(_decode_partial_kernel, ptrs, consts), consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                )  # fmt: skip
            consts = {"HEAD_DIM": D, **REDUCE_CONFIG.blocks}
            ptrs = {"M_IN": "*fp32", "L_IN": "*fp32", "ACC_IN": "*fp32", "O": f"*{dt}"}
            specs.append(
                AotSpec(f"decode_reduce[{dt},D{D},BS{REDUCE_CONFIG['BLOCK_S']}]", _decode_reduce_kernel,
                        _signature(_decode_reduce_kernel, ptrs, consts), consts, num_warps=REDUCE_CONFIG.num_warps, num_stages=1)
            )  # fmt: skip
    return specs
