"""The in-cache rate of two builds' products (int8 weights, the 13m preset's head rows, amx
variant), interleaved, each thread the whole product (``wiola_product_reps``); the outputs
compared bitwise. ``NTH`` sets the threads (default 2).

    NTH=1 python products_ab.py int8 A.cpp B.cpp
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.two_builds import build, model_13m
from wiola.fast.decode_step_cpu import DecodeStepCPU

NTH = int(os.environ.get("NTH", "2"))


def main(scheme: str, sources: list[str]) -> None:
    model = model_13m(scheme)
    libs = {s: build(s, "amx") for s in sources}
    step = DecodeStepCPU(model, model.new_cache(8, 160), "amx")
    head, scale = step.step_tensors[0], step.scales[0]
    K = model.config.d_model
    for B in (8, 16, 9, 4, 1):
        for N in (1024, 32000):
            x = torch.randn(B, K, generator=torch.Generator().manual_seed(0))
            outputs, rates = {}, {s: [] for s in sources}
            reps = max(1, 40_000_000 // (N * K * B))
            for r in range(9):
                for s in sources if r % 2 == 0 else sources[::-1]:
                    y = torch.empty(NTH, B, N)
                    start = time.perf_counter()
                    rc = libs[s].wiola_product_reps(
                        step.dims, head.data_ptr(), None if scale is None else scale.data_ptr(), N, K, x.data_ptr(),
                        B, y.data_ptr(), reps, NTH,
                    )  # fmt: skip
                    elapsed = time.perf_counter() - start
                    assert rc == 0
                    if r:
                        rates[s].append(NTH * reps * N * K * B / elapsed / 1e9)
                    outputs[s] = y
            same = all(torch.equal(outputs[sources[0]], outputs[s]) for s in sources)
            base = statistics.median(rates[sources[0]])
            cells = [
                f"{Path(s).name} {statistics.median(v):.1f} GMAC/s ({statistics.median(v) / base:.2f}x)"
                for s, v in rates.items()
            ]
            print(f"B={B} N={N}: " + "  ".join(cells), "bitwise same" if same else "DIFFERENT", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
