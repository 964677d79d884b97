"""Builds of the C++ step from several copies of its source, the amx variant, on the same 13m
model (random weights), interleaved in one process: 128 steps a call at batch 1 and 8, seven calls
each, the order reversed every other round; the median tokens a second of each, and its ratio to
the first source's.

    python bench/results/2026-12-07_cpu_amx-products-intel-xeon/ab_two_sources.py bf16 A.cpp B.cpp
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.two_builds import build, model_13m, rebind
from wiola.fast.decode_step_cpu import DecodeStepCPU


def main(scheme: str, sources: list[str]) -> None:
    model = model_13m(scheme)
    libs = {s: build(s, "amx") for s in sources}
    for batch in (1, 8):
        steps = {s: rebind(DecodeStepCPU(model, model.new_cache(batch, 160), "amx"), lib) for s, lib in libs.items()}
        tokens = torch.arange(batch, dtype=torch.long) + 100
        rates: dict[str, list[float]] = {s: [] for s in sources}
        for r in range(7):
            for s in sources if r % 2 == 0 else sources[::-1]:
                start = time.perf_counter()
                for slot in range(128):
                    steps[s](tokens, slot)
                rates[s].append(128 * batch / (time.perf_counter() - start))
        base = statistics.median(rates[sources[0]])
        cells = [
            f"{Path(s).name} {statistics.median(v):,.0f} ({statistics.median(v) / base:.2f}x)" for s, v in rates.items()
        ]
        print(f"batch {batch}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
