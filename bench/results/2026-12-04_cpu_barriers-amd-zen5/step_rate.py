"""Steps of the C++ step built from SOURCE (a copy of wiola/fast/decode_step_cpu.cpp; "-" for the
checkout's), one binding, timed alone: python step_rate.py SOURCE SCHEME BATCH STEPS [THREADS], from the
checkout root. Prints microseconds a step over STEPS steps of the 13m preset (random weights, a
16-token prompt)."""

import sys
import time
from pathlib import Path

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu as dsc
from wiola.fast.quantize import quantize

src, scheme, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if len(sys.argv) > 5:
    torch.set_num_threads(int(sys.argv[5]))
dsc.load()
if src != "-":
    dsc.SOURCE = Path(src)
lib = dsc._build(dsc._compiler(), dsc.select_isa())
torch.manual_seed(0)
cfg = wiola.WiolaConfig.preset("13m")
with torch.no_grad():
    model = FastModel(cfg).eval().requires_grad_(False)
    if scheme != "fp32":
        model = quantize(model, scheme)
    ids = torch.randint(0, cfg.vocab_size, (batch, 16))
    cache = model.new_cache(batch, 1024)
    model(ids, cache=cache)
    a = dsc.DecodeStepCPU(model, cache)
    a.lib = lib
    a.work = torch.empty(lib.wiola_workspace_floats(a.dims), dtype=torch.float32)  # a patch may change its size
    tok = ids[:, -1].contiguous()
    t0 = time.perf_counter()
    for i in range(n):
        a(tok, 16 + i % 100)
    print(src, scheme, batch, round((time.perf_counter() - t0) / n * 1e6), "us/step")
