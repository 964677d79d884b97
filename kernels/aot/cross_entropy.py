"""Ahead-of-time builds of ``wiola_kernels.cross_entropy`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

import torch

from wiola_kernels._utils import TRITON_DTYPE
from wiola_kernels.aot import AotSpec
from wiola_kernels.cross_entropy import _HALF, ROW_CONFIG, _dw_accumulate_kernel, _dw_config, _softmax_grad_rows_kernel


def specs() -> list[AotSpec]:
    """The row kernel (loss only, and loss + gradient) and the dW kernel (first chunk and
    accumulating, fp32 or final output) for every dtype, as the JIT specializes aligned inputs."""
    specs = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = TRITON_DTYPE[dtype]
        for grad in (True, False):
            specs.append(
                AotSpec(
                    name=f"cross_entropy_rows[{t},BR1,BV{ROW_CONFIG['BLOCK_V']},{'grad' if grad else 'loss'}]",
                    fn=_softmax_grad_rows_kernel,
                    signature={
                        "LOGITS": f"*{t}",
                        "stride_row": "i32",
                        "LABELS": "*i64",
                        "LOSS": "*fp32",
                        "INV_COUNT": "*fp32",
                        "R": "i32",
                        "V": "i32",
                        "ignore_index": "i32",
                        "BLOCK_ROWS": "constexpr",
                        "BLOCK_V": "constexpr",
                        "COMPUTE_GRAD": "constexpr",
                    },
                    constexprs={"BLOCK_ROWS": 1, "BLOCK_V": ROW_CONFIG["BLOCK_V"], "COMPUTE_GRAD": grad},
                    num_warps=ROW_CONFIG.num_warps,
                    num_stages=1,
                    # aligned pointers, the padded row stride
                    divisible_by_16=("LOGITS", "stride_row", "LABELS", "LOSS", "INV_COUNT"),
                )
            )
        # fp16/bf16 write either the fp32 accumulator or (last chunk) the final gradient
        cfg = _dw_config(dtype)
        for out in ["fp32", t] if dtype in _HALF else ["fp32"]:
            for accumulate in (False, True):
                specs.append(
                    AotSpec(
                        name=(
                            f"cross_entropy_dw[{t}->{out},BV{cfg['BLOCK_V']},BD{cfg['BLOCK_D']},"
                            f"BR{cfg['BLOCK_R']},{'acc' if accumulate else 'init'}]"
                        ),
                        fn=_dw_accumulate_kernel,
                        signature={
                            "G": f"*{t}",
                            "H": f"*{t}",
                            "ACC": "*fp32",
                            "OUT": f"*{out}",
                            "R": "i32",
                            "V": "i32",
                            "D": "i32",
                            "stride_g": "i32",
                            "stride_h": "i32",
                            "stride_out": "i32",
                            "BLOCK_V": "constexpr",
                            "BLOCK_D": "constexpr",
                            "BLOCK_R": "constexpr",
                            "ACCUMULATE": "constexpr",
                            "INPUT_PRECISION": "constexpr",
                        },
                        constexprs={
                            "BLOCK_V": cfg["BLOCK_V"],
                            "BLOCK_D": cfg["BLOCK_D"],
                            "BLOCK_R": cfg["BLOCK_R"],
                            "ACCUMULATE": accumulate,
                            "INPUT_PRECISION": "ieee",
                        },
                        num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages,
                        expect_wgmma=dtype in _HALF,
                        divisible_by_16=("G", "H", "ACC", "OUT", "D", "stride_g", "stride_h", "stride_out"),
                    )
                )
    return specs
