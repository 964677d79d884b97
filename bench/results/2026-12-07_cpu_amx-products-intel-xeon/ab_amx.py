"""The amx variant of the C++ step against the avx512 one on the same 13m model (random weights,
``bench.two_builds.model_13m``), interleaved in one process: 128 steps a call at batch 1 and 8,
seven calls each, the order reversed every other round; the median tokens a second of each.

    python bench/results/2026-12-07_cpu_amx-products-intel-xeon/ab_amx.py bf16

Asserts first that the two variants' logits agree within the fp32 bound of two summation orders
(they differ only in the order of the products' sums)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.two_builds import model_13m
from wiola.fast.decode_step_cpu import DecodeStepCPU, cpu_info


def main(scheme: str) -> None:
    model = model_13m(scheme)
    print(f"CPU: {cpu_info()['name']}; weights {scheme}; torch threads {torch.get_num_threads()}")
    for batch in (1, 8):
        steps = {isa: DecodeStepCPU(model, model.new_cache(batch, 160), isa) for isa in ("amx", "avx512")}
        tokens = torch.arange(batch, dtype=torch.long) + 100
        first = {isa: step(tokens, 0).clone() for isa, step in steps.items()}
        scale = float(first["avx512"].abs().max())
        assert float((first["amx"] - first["avx512"]).abs().max()) <= 1e-4 * scale, "the variants disagree"
        rates: dict[str, list[float]] = {isa: [] for isa in steps}
        for r in range(7):
            for isa in list(steps) if r % 2 == 0 else list(steps)[::-1]:
                start = time.perf_counter()
                for slot in range(128):
                    steps[isa](tokens, slot)
                rates[isa].append(128 * batch / (time.perf_counter() - start))
        amx, avx512 = statistics.median(rates["amx"]), statistics.median(rates["avx512"])
        runs = "; ".join(f"{isa} " + " ".join(f"{v:,.0f}" for v in vs) for isa, vs in rates.items())
        print(f"batch {batch}: amx {amx:,.0f} tok/s, avx512 {avx512:,.0f} tok/s, {amx / avx512:.2f}x ({runs})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bf16")
