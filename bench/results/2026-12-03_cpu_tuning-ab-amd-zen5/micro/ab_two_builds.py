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

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the checkout root, for bench
from bench.two_builds import build, model_13m, rebind
from wiola.fast import decode_step_cpu as dsc

patched, scheme, batch, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
close = sys.argv[5:] == ["close"]
lib_b = build(patched)
with torch.no_grad():
    model = model_13m(scheme)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, 16))
    cache = model.new_cache(batch, 1024)
    model(ids, cache=cache)
    a = dsc.DecodeStepCPU(model, copy.deepcopy(cache))
    b = rebind(dsc.DecodeStepCPU(model, copy.deepcopy(cache)), lib_b)
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
