"""A/B: does reading the floor between the timed calls (wiola.fast.speed.READS_BETWEEN reads of
the step's bytes after each call) change the step's own rate? tg128 after a 16-token prompt, 13m
preset, batch 1, per weight form given as arguments; 8 rounds of 5 calls each way, the order
alternating; prints each way's median tok/s over the rounds, the rounds, and the read floor."""

import statistics
import sys
import time

import torch

from wiola import WiolaConfig
from wiola.fast import WiolaModel, speed
from wiola.fast.quantize import quantize

torch.manual_seed(0)
cfg = WiolaConfig.preset("13m")
base = WiolaModel(cfg).eval().requires_grad_(False)
ids = torch.randint(0, cfg.vocab_size, (1, 16))
for form in sys.argv[1:]:
    m = base if form == "fp32" else quantize(__import__("copy").deepcopy(base), form)
    run = speed.decoding_only(m, ids, 128)
    nbytes = speed.step_bytes(run.step)
    run()
    res = {"plain": [], "between": []}
    for rnd in range(8):
        for mode in ("plain", "between") if rnd % 2 else ("between", "plain"):
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
                if mode == "between":
                    speed.read_floor(nbytes, speed.READS_BETWEEN)
            res[mode].append(127 / statistics.median(ts))
    fl = speed.read_floor(nbytes, 1)
    print(
        form,
        {k: (round(statistics.median(v)), [round(x) for x in v]) for k, v in res.items()},
        "floor GB/s",
        round(nbytes / fl["s"] / 1e9, 1),
    )
