"""Greedy sampling alone, two builds interleaved: python argmax_time.py OTHER.cpp from the checkout
root. sample_rows over B rows of 32,000 random logits (the 13m preset's vocabulary), greedy; the
best of 9 blocks of 2,000 calls each, per build; tokens asserted equal."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout root, for bench
from bench.two_builds import build
from wiola.fast import decode_step_cpu as dsc

lib_a = dsc.load()
lib_b = build(Path(sys.argv[1]))
for B in (1, 8):
    logits = torch.randn(B, 32000, generator=torch.Generator().manual_seed(B))
    best = {}
    tokens = {}
    for name, lib in (("checkout", lib_a), ("other", lib_b)) * 9:
        s = dsc.Samplers(B, 32000, 1)
        s.mode.fill_(dsc.MODE["greedy"])
        t0 = time.perf_counter()
        for _ in range(2000):
            dsc.sample_rows(lib, logits, s)
        best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / 2000)
        tokens[name] = s.token.clone()
    assert torch.equal(tokens["checkout"], tokens["other"])
    print(
        f"B{B}: checkout {best['checkout'] * 1e6:.1f} us, other {best['other'] * 1e6:.1f} us a call (with the binding's Python)"
    )
