# A/B of two builds of the step in one process: /tmp/bw/old.cpp (the source before) and /tmp/bw/new.cpp
# (after); usage: ROUNDS=80 python ab_pair.py fp32:1 int8:8 ...
import pathlib
import statistics
import sys
import time

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu as dsc
from wiola.fast.quantize import quantize

torch.set_grad_enabled(False)
compiler = dsc._compiler()
isa = dsc.select_isa()
libs = {}
for name in ("old", "new"):
    dsc.SOURCE = pathlib.Path(f"/tmp/bw/{name}.cpp")
    libs[name] = dsc._build(compiler, isa)
dsc.SOURCE = pathlib.Path("/work/main/wiola/fast/decode_step_cpu.cpp")
torch.manual_seed(0)
ref = wiola.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()
for scheme, B in [(s, int(b)) for s, b in (a.split(":") for a in sys.argv[1:])]:
    m = FastModel(ref.config).eval().requires_grad_(False)
    m.load_state_dict(ref.state_dict())
    if scheme != "fp32":
        quantize(m, scheme)
    ids = torch.randint(0, 32000, (B, 80), generator=torch.Generator().manual_seed(1))
    cache = m.new_cache(B, 96)
    m(ids, cache=cache)
    step = dsc.DecodeStepCPU(m, cache)
    step.work = torch.empty(max(l.wiola_workspace_floats(step.dims) for l in libs.values()), dtype=torch.float32)
    tok = ids[:, -1].contiguous()
    times = {"old": [], "new": []}
    outs = {}
    for rnd in range(int(__import__("os").environ.get("ROUNDS", "30"))):
        for name in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            step.lib = libs[name]
            step(tok, 80)
            t = time.perf_counter()
            for _ in range(20):
                lg = step(tok, 80)
            times[name].append((time.perf_counter() - t) / 20)
            outs[name] = lg
    r = sorted(o / n for o, n in zip(times["old"], times["new"]))
    q = lambda f, r=r: r[int(f * (len(r) - 1))]
    same = f"paired old/new q10 {q(0.1):.3f} q25 {q(0.25):.3f} median {q(0.5):.3f} q75 {q(0.75):.3f} q90 {q(0.9):.3f}"
    mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
    print(
        f"{scheme} B{B}: step old {mo * 1e6:.0f} us, new {mn * 1e6:.0f} us, old/new {mo / mn:.3f} (min {min(times['old']) * 1e6:.0f} / {min(times['new']) * 1e6:.0f}); {same}"
    )
