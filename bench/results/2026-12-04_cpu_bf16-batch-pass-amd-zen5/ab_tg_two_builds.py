"""Two builds of the C++ step in one process, interleaved, timed as a tg call (speed.decoding_only:
generate's C++ loop, greedy, 128 tokens after a 16-token prompt, so the sampling between steps
counts): the checkout's source against a patched copy (python ab_tg_two_builds.py PATCHED.cpp int8
1 20, from the checkout root). Tokens asserted equal first; then `rounds` rounds of one call each,
the order reversed every round; median microseconds a step printed."""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout root, for bench
from bench.two_builds import build, model_13m, rebind
from wiola.fast import speed

patched, scheme, batch, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lib_b = build(patched)
with torch.no_grad():
    model = model_13m(scheme)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, 16))
    a = speed.decoding_only(model, ids, 128)
    b = speed.decoding_only(model, ids, 128)
    rebind(b.step, lib_b)
    assert torch.equal(a().clone(), b().clone()), "tokens differ"
    times = {"checkout": [], "patched": []}
    for r in range(rounds):
        order = [("checkout", a), ("patched", b)] if r % 2 == 0 else [("patched", b), ("checkout", a)]
        for name, run in order:
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / (run.new - 1))
    c, p = statistics.median(times["checkout"]), statistics.median(times["patched"])
    print(
        f"{scheme} B{batch} tg128: checkout {c * 1e6:.0f} us, patched {p * 1e6:.0f} us a step: checkout faster by {p / c:.3f}x"
    )
