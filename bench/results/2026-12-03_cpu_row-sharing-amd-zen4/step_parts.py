# Per-part times of the step: decode_step_cpu.cpp with step_parts.patch applied, saved as
# /tmp/inst/inst.cpp; usage: python step_parts.py int8 1  (TSC at 2.596 GHz, this VM's)
import ctypes
import pathlib
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
dsc.SOURCE = pathlib.Path("/tmp/inst/inst.cpp")
lib = dsc._build(compiler, isa)
dsc.SOURCE = pathlib.Path("/work/main/wiola/fast/decode_step_cpu.cpp")
TSC = 2.596e9
names = {
    0: "qkv",
    1: "bar",
    2: "gate+cache",
    3: "bar",
    4: "attn",
    5: "bar",
    6: "Wo",
    7: "bar",
    8: "norm",
    9: "bar",
    10: "up",
    11: "bp",
    12: "bar",
    13: "silu",
    14: "bar",
    15: "down",
    16: "bar",
    18: "norm2",
    19: "bar",
    31: "head",
}
torch.manual_seed(0)
ref = wiola.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()
c = ref.config
bytes_per = {
    "qkv": 3 * c.d_model**2,
    "Wo": c.d_model**2,
    "up": 2 * c.d_ff * c.d_model,
    "bp": c.d_ff * c.d_model,
    "down": c.d_model * c.d_ff,
}
scheme, B = sys.argv[1], int(sys.argv[2])
nth = torch.get_num_threads()
m = FastModel(c).eval().requires_grad_(False)
m.load_state_dict(ref.state_dict())
if scheme != "fp32":
    quantize(m, scheme)
esize = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5 + 4 / 32}[scheme]
ids = torch.randint(0, 32000, (B, 80), generator=torch.Generator().manual_seed(1))
cache = m.new_cache(B, 200)
m(ids, cache=cache)
step = dsc.DecodeStepCPU(m, cache)
step.lib = lib
step.work = torch.empty(lib.wiola_workspace_floats(step.dims), dtype=torch.float32)
tok = ids[:, -1].contiguous()
buf = (ctypes.c_uint64 * 128)()
lib.wiola_prof(buf)
N = 400
for _ in range(50):
    step(tok, 80)
lib.wiola_prof(buf)
t = time.perf_counter()
for _ in range(N):
    step(tok, 80)
wall = (time.perf_counter() - t) / N
lib.wiola_prof(buf)
print(f"{scheme} B{B} threads {nth}: step {wall * 1e6:.0f} us")
tot = [0.0] * 4
for k, nm in sorted(names.items()):
    us = [buf[t * 32 + k] / TSC / N * 1e6 for t in range(2)]
    rate = ""
    if nm in bytes_per:
        rate = f"  {bytes_per[nm] * c.n_layers * esize / nth / (max(us) * 1e-6) / 1e9:.1f} GB/s/thread (slowest)"
    if nm == "head":
        rate = f"  {c.vocab_size * c.d_model * esize / nth / (max(us) * 1e-6) / 1e9:.1f} GB/s/thread (slowest)"
    print(f"{k:2d} {nm:11s} t0 {us[0]:7.1f} us  t1 {us[1]:7.1f} us{rate}")
    for t in range(2):
        tot[t] += us[t]
print("sum", [round(x, 1) for x in tot[:2]])
