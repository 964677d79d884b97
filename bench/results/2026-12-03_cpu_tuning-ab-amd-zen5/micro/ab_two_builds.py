"""Two builds of the C++ step in one process, interleaved: the checkout's source against a patched
copy (python ab_two_builds.py PATCHED.cpp int4 1 40, from the checkout root). Logits asserted
bitwise equal first (with a fifth argument `close`, for a patch that changes the order of a sum:
their largest difference printed instead); then `rounds` rounds of 10 steps each, the order reversed every round, both
bindings over the same cache slots; medians printed."""

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu as dsc
from wiola.fast.quantize import quantize

patched, scheme, batch, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
close = sys.argv[5:] == ["close"]
dsc.load()
dsc.SOURCE = patched
lib_b = dsc._build(dsc._compiler(), dsc.select_isa())
torch.manual_seed(0)
cfg = wiola.WiolaConfig.preset("13m")
with torch.no_grad():
    model = FastModel(cfg).eval().requires_grad_(False)
    if scheme != "fp32":
        model = quantize(model, scheme)
    ids = torch.randint(0, cfg.vocab_size, (batch, 16))
    cache = model.new_cache(batch, 1024)
    model(ids, cache=cache)
    a = dsc.DecodeStepCPU(model, copy.deepcopy(cache))
    b = dsc.DecodeStepCPU(model, copy.deepcopy(cache))
    b.lib = lib_b
    b.work = torch.empty(lib_b.wiola_workspace_floats(b.dims), dtype=torch.float32)  # a patch may change its size
    tok = ids[:, -1].contiguous()
    la, lb = a(tok, 16), b(tok, 16)
    if close:
        print(f"largest |difference| {(la - lb).abs().max().item():.3g}, largest |logit| {la.abs().max().item():.3g}")
    else:
        assert torch.equal(la, lb), "logits differ"
    times = {"old": [], "new": []}
    slot = 17
    for r in range(rounds):
        order = [("old", a), ("new", b)] if r % 2 == 0 else [("new", b), ("old", a)]
        for name, step in order:
            start = time.perf_counter()
            for i in range(10):
                step(tok, slot + i)
            times[name].append((time.perf_counter() - start) / 10)
        slot += 10
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{scheme} B{batch}: old {old * 1e6:.0f} us, new {new * 1e6:.0f} us, new faster by {old / new:.3f}x")
