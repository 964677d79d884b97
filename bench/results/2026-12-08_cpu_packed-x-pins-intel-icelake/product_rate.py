"""The product kernels alone: wiola_product_reps on one thread over the first KIB KiB of the 13m
head's rows (held in the caches, read again and again), the checkout's build against a pinned copy
(python product_rate.py PINNED.cpp SCHEMES BATCHES KIB, from the checkout root; SCHEMES and
BATCHES comma-separated): the outputs asserted equal, then 15 calls of each, alternating; the best
rate of each in G multiply-adds a second."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout root, for bench
from bench.two_builds import build, model_13m
from wiola.fast import speed


def call(lib, step, head, scale, N, K, x, B, y, reps):
    """reps products of the first N rows of head with x (B rows) on one thread, by lib."""
    s = None if scale is None else scale.data_ptr()
    lib.wiola_product_reps(step.dims, head.data_ptr(), s, N, K, x.data_ptr(), B, y.data_ptr(), reps, 1)


pinned, schemes, batches, kib = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])
lib_pinned = build(pinned)
with torch.no_grad():
    for scheme in schemes:
        model = model_13m(scheme)
        run = speed.decoding_only(model, torch.randint(0, model.config.vocab_size, (1, 16)), 4)
        run()  # binds the step
        step = run.step
        head, scale = step.step_tensors[0], step.scales[0]
        K, V = model.config.d_model, model.config.vocab_size
        N = (kib << 10) // (head.numel() * head.element_size() // V) // 8 * 8
        libs = {"checkout": step.lib, "pinned": lib_pinned}
        for B in map(int, batches):
            x, y = torch.randn(B, K), torch.empty(1, B, N)
            reps = max(1, (1 << 23) // (N * K * B))
            out = {}
            for name, lib in libs.items():
                call(lib, step, head, scale, N, K, x, B, y, reps)
                out[name] = y.clone()
            assert torch.equal(out["checkout"], out["pinned"]), f"{scheme} B{B}: outputs differ"
            best = {name: float("inf") for name in libs}
            for r in range(30):
                name = ("checkout", "pinned")[r % 2]
                start = time.perf_counter()
                call(libs[name], step, head, scale, N, K, x, B, y, reps)
                best[name] = min(best[name], time.perf_counter() - start)
            rate = {name: reps * N * K * B / t / 1e9 for name, t in best.items()}
            print(
                f"{scheme} B{B}, {kib} KiB: checkout {rate['checkout']:.1f}, pinned {rate['pinned']:.1f} G/s;"
                f" checkout/pinned {rate['checkout'] / rate['pinned']:.3f}"
            )
