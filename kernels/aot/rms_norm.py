"""Ahead-of-time builds of ``wiola_kernels.rms_norm`` (tests/test_compile.py builds them for sm_90 and sm_80)."""

from __future__ import annotations

from wiola_kernels.aot import AotSpec
from wiola_kernels.rms_norm import _block, _bwd_kernel, _fwd_kernel


def specs() -> list[AotSpec]:
    """Every launch shape ``_block`` gives (widths 64 … 8,192; any other width rounds up to one of
    these) for bf16, fp16 and fp32 alone and with a same-dtype residual (γ in the same dtype: a
    model cast to that dtype), and for bf16/fp16 with the fp32 residual stream and fp32 γ of
    autocast training, built as the JIT specializes 16-aligned inputs; and the unaligned build
    (a width like 1,000 or 8,000) for bf16 at the two widest blocks."""
    specs: list[AotSpec] = []
    widths = (64, 256, 1024, 4096, 8192)
    builds = [(block_d, t, True) for block_d in widths for t in ("bf16", "fp16", "fp32")]
    builds += [(block_d, "bf16", False) for block_d in (1024, 8192)]
    for block_d, t, aligned in builds:
        cfg = _block(block_d)
        block_r, warps, blocks = cfg["BLOCK_R"], cfg.num_warps, dict(cfg.blocks)
        for res in dict.fromkeys((None, "fp32") if not aligned else (None, t, "fp32")):
            h = "fp32" if res == "fp32" else t
            name = f"{t}{'' if res is None else f'+res{res}'},D{block_d}{'' if aligned else ',unaligned'}"
            name += f",R{block_r},w{warps}"
            w = "fp32" if res == "fp32" else t  # γ: fp32 beside an fp32 stream, else the model's dtype
            fwd = {"X": t, "RES": res or t, "W": w, "Y": h, "H": h, "RSTD": "fp32"}
            bwd = {"DY": h, "DH": h, "HX": h, "W": w, "RSTD": "fp32", "DX": t, "DRES": res or t}
            bwd["DW_PARTIAL"] = "fp32"
            fwd_flags = {"HAS_RESIDUAL": res is not None, **blocks}
            bwd_flags = {"HAS_DH": res is not None, "SEPARATE_DRES": res not in (None, t), **blocks}
            for kind, fn, pointers, sizes, flags in (
                ("fwd", _fwd_kernel, fwd, {"N": "i32", "D": "i32", "eps": "fp32"}, fwd_flags),
                ("bwd", _bwd_kernel, bwd, {"N": "i32", "D": "i32"}, bwd_flags),
            ):
                specs.append(
                    AotSpec(
                        name=f"rms_norm_{kind}[{name}]",
                        fn=fn,
                        signature={k: f"*{v}" for k, v in pointers.items()} | sizes | dict.fromkeys(flags, "constexpr"),
                        constexprs=flags,
                        num_warps=warps,
                        num_stages=1,
                        divisible_by_16=(*pointers, "D") if aligned else (),
                    )
                )
    return specs
