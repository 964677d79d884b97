"""wiola_sample_rows on one greedy row of 32,000 logits with its logprob, per variant named on the
command line: `python sample_rows.py amx avx2 portable` (median of 7 x 400 calls)."""

import sys
import time

import torch

from wiola.fast import decode_step_cpu as d

for isa in sys.argv[1:]:
    lib = d.load(isa)
    V = 32000
    torch.manual_seed(0)
    logits = (torch.randn(1, V) * 3).contiguous()
    s = d.Samplers(1, V, 4)
    s.mode[0] = d.MODE["greedy"]
    s.temperature[0] = 1.0
    for _ in range(50):
        d.sample_rows(lib, logits, s)
    ts = []
    for _r in range(7):
        t0 = time.perf_counter()
        for _ in range(400):
            d.sample_rows(lib, logits, s)
        ts.append((time.perf_counter() - t0) / 400)
    ts.sort()
    want = torch.log_softmax(logits.double(), -1)[0, int(s.token[0])]
    print(
        isa,
        f"sample_rows B1 V32000 greedy+logprob: median {ts[3] * 1e6:.1f} us (min {ts[0] * 1e6:.1f}); logprob {float(s.logprob[0])!r} f64 {float(want)!r}",
    )
