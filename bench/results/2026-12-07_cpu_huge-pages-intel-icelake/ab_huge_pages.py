"""One process, two copies of the 13m model (random weights, seed 0) quantized to SCHEME (bf16,
int8 or int4): one with its packed matrices where ``quantize`` puts them (one mapping on 2 MiB
pages, ``wiola.fast.quantize.on_huge_pages``), one with them cloned onto torch's allocations (4 KiB
pages: transparent huge pages are in ``madvise`` mode here). Greedy tokens asserted equal; ROUNDS
rounds of one 64-token generate each, the order reversed every round; prints the median of the
paired time ratios (4 KiB over 2 MiB: above 1 means huge pages ran faster).

    python ab_huge_pages.py SCHEME ROUNDS
"""

from __future__ import annotations

import re
import statistics
import sys
import time

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast.quantize import quantize

NEW = 64


def build(scheme: str, huge: bool) -> FastModel:
    """The 13m model in ``scheme``: its packed matrices where ``quantize`` puts them (one mapping on
    2 MiB pages, ``wiola.fast.quantize.on_huge_pages``), or (``huge`` False) cloned onto torch's
    allocations (4 KiB pages)."""
    torch.manual_seed(0)
    m = quantize(FastModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False), scheme)
    if not huge:
        m.quantized = {name: (q.clone(), scale) for name, (q, scale) in m.quantized.items()}
    return m


def anon_huge_kb() -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+)", open("/proc/self/smaps_rollup").read()).group(1))


def main(scheme: str, rounds: int) -> None:
    small = build(scheme, False)
    print(f"AnonHugePages {anon_huge_kb()} kB beside the 4 KiB copy")
    huge = build(scheme, True)
    print(f"AnonHugePages {anon_huge_kb()} kB with the 2 MiB one")
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1235))
    assert torch.equal(small.generate(ids, NEW, temperature=0), huge.generate(ids, NEW, temperature=0))
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(rounds):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            model = (small, huge)[which]
            start = time.perf_counter()
            model.generate(ids, NEW, temperature=0)
            times[which].append(time.perf_counter() - start)
    ratios = sorted(a / b for a, b in zip(times[0], times[1]))
    q = len(ratios) // 4
    print(
        f"{scheme}: 4K median {NEW / statistics.median(times[0]):.0f} tok/s, "
        f"2M median {NEW / statistics.median(times[1]):.0f} tok/s, paired 4K/2M time ratio median "
        f"{statistics.median(ratios):.3f} (q1 {ratios[q]:.3f}, q3 {ratios[-q - 1]:.3f})"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
