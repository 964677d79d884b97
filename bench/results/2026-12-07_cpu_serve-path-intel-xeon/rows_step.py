"""The median Rows.step of 600 at batch 1 and 8 (13m preset, random weights, the scheme named):
`python rows_step.py bf16`."""

import sys
import time

import torch

import wiola.fast
from wiola import WiolaConfig
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

torch.manual_seed(0)
scheme = sys.argv[1]
m = wiola.fast.WiolaModel(WiolaConfig(eos_token_id=None)).eval().requires_grad_(False)
if scheme != "fp32":
    m = quantize(m, scheme)
rows = Rows(m, 8)
out = []
for B in (1, 8):
    hs = [rows.join(RowRequest([5] * 16, 700, logprobs=0)) for _ in range(B)]
    for _ in range(20):
        rows.step()
    ts = []
    for _ in range(600):
        t0 = time.perf_counter()
        rows.step()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    out.append(f"B{B} {ts[300] * 1e6:.0f}")
    for h in hs:
        rows.leave(h)
print(scheme, " ".join(out))
