"""Interleaved timing of ``wiola.fast`` greedy ``generate`` (13m preset, random weights, batch 1, a
16-token prompt, 128 new tokens, one torch thread) for fp32, bf16, int8 and int4 weights: each round
runs every weight type once, and each type keeps its best thread CPU time (and best wall time) over
the rounds, so that a loaded, shared machine's preemption drops out of the ratios. Beside each, the
read floor: the best thread CPU time of ``torch.mv`` over an fp32 matrix of that type's weight bytes.

Run from a checkout's root: ``PYTHONPATH=. python bench/results/2026-12-02_cpu_decode-packed/interleaved.py [ROUNDS]``.
"""

from __future__ import annotations

import sys
import time

import torch

import wiola
from bench import roofline
from wiola.fast import WiolaModel as FastModel
from wiola.fast.quantize import quantize

NEW = 128


def read_floor(nbytes: int) -> float:
    """Best thread CPU seconds of torch.mv over an fp32 (nbytes / 1024, 256) matrix."""
    A, x, best = torch.randn(nbytes // 4 // 256, 256), torch.randn(256), float("inf")
    for _ in range(30):
        t0 = time.thread_time()
        torch.mv(A, x)
        best = min(best, time.thread_time() - t0)
    return best


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = wiola.WiolaConfig.preset("13m")
    state = wiola.WiolaModel(config).eval().state_dict()
    models = {}
    for scheme in ("fp32", "bf16", "int8", "int4"):
        model = FastModel(config).eval().requires_grad_(False)
        model.load_state_dict(state)
        models[scheme] = model if scheme == "fp32" else quantize(model, scheme)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1235))
    for model in models.values():
        model.generate(ids, 4, temperature=0)
    best = {k: [float("inf"), float("inf")] for k in models}
    for _ in range(rounds):
        for k, model in models.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            model.generate(ids, NEW, temperature=0)
            c1, t1 = time.thread_time(), time.perf_counter()
            best[k] = [min(best[k][0], c1 - c0), min(best[k][1], t1 - t0)]
    for k, (cpu, wall) in best.items():
        nbytes = roofline.weight_bytes(config, None if k == "fp32" else k)
        floor = read_floor(nbytes)
        print(
            f"{k}: {NEW / cpu:7.1f} tok/s (thread CPU time; wall {NEW / wall:7.1f}), weights {nbytes / 1e6:4.1f} MB, "
            f"read floor {nbytes / floor / 1e9:4.1f} GB/s, {100 * (NEW - 1) * floor / cpu:4.1f}% of it"
        )
    print(
        f"int4/int8 {best['int8'][0] / best['int4'][0]:.2f}x (CPU time), {best['int8'][1] / best['int4'][1]:.2f}x (wall)"
    )
    print(f"bf16/fp32 {best['fp32'][0] / best['bf16'][0]:.2f}x, int8/fp32 {best['fp32'][0] / best['int8'][0]:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
