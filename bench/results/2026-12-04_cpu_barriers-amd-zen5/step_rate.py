"""Steps of the C++ step built from SOURCE (a copy of wiola/fast/decode_step_cpu.cpp; "-" for the
checkout's), one binding, timed alone: python step_rate.py SOURCE SCHEME BATCH STEPS [THREADS], from the
checkout root. Prints microseconds a step over STEPS steps of the 13m preset (random weights, a
16-token prompt)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout root, for bench
from bench.two_builds import build, model_13m, rebind
from wiola.fast import decode_step_cpu as dsc

src, scheme, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if len(sys.argv) > 5:
    torch.set_num_threads(int(sys.argv[5]))
lib = build(dsc.SOURCE if src == "-" else Path(src))
with torch.no_grad():
    model = model_13m(scheme)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, 16))
    cache = model.new_cache(batch, 1024)
    model(ids, cache=cache)
    a = rebind(dsc.DecodeStepCPU(model, cache), lib)
    tok = ids[:, -1].contiguous()
    t0 = time.perf_counter()
    for i in range(n):
        a(tok, 16 + i % 100)
    print(src, scheme, batch, round((time.perf_counter() - t0) / n * 1e6), "us/step")
