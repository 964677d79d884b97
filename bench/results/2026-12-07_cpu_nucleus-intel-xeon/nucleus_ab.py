"""Top-p sampling on a CPU, timed in the tree it runs from (run it from two checkouts, alternating,
to compare them): `PYTHONPATH=<tree> python nucleus_ab.py LABEL`. 13m preset, random weights, bf16.

- the nucleus mask of one row of 32,000 random logits (``cpu_nucleus``, top-p 0.95 and 0.5);
- Rows.step with every row sampled at temperature 0.8, top-p 0.95 (a seed each), batch 1 and 8:
  the median of 200 steps;
- model.generate of 128 tokens at temperature 0.8 with top-p 0.95 (``wiola generate``'s default
  sampling), top-k 40 (the control: no nucleus) and greedy, batch 1 and 8: tokens/s, best of 3.

Prints one line per figure and a digest of the generated tokens (two trees agree where the digests do).
"""

import hashlib
import statistics
import sys
import time

import torch

import wiola.fast
from wiola import WiolaConfig
from wiola.fast.generation import cpu_nucleus
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

LABEL = sys.argv[1] if len(sys.argv) > 1 else "tree"


def rows_step(model, B: int) -> float:
    rows = Rows(model, 8)
    for i in range(B):
        rows.join(RowRequest([5] * 16, 300, seed=i, temperature=0.8, top_p=0.95))
    for _ in range(10):
        rows.step()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        rows.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def generate(model, B: int, digest, **sampling) -> float:
    ids = torch.full((B, 16), 5, dtype=torch.int64)
    best = 0.0
    for _ in range(3):
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=128, generator=g, **sampling)
        best = max(best, B * 128 / (time.perf_counter() - t0))
    digest.update(out.numpy().tobytes())
    return best


torch.manual_seed(0)
model = quantize(wiola.fast.WiolaModel(WiolaConfig(eos_token_id=None)).eval().requires_grad_(False), "bf16")
logits = torch.randn(1, 32000, generator=torch.Generator().manual_seed(1)) * 2
for top_p in (0.95, 0.5):
    cpu_nucleus(logits, top_p)
    t0 = time.perf_counter()
    for _ in range(50):
        cpu_nucleus(logits, top_p)
    print(f"{LABEL}: nucleus mask, 1 row of 32,000, top-p {top_p} (us): {1e6 * (time.perf_counter() - t0) / 50:,.0f}")
for B in (1, 8):
    print(f"{LABEL}: Rows.step, bf16, batch {B}, top-p 0.95 (us): {1e6 * rows_step(model, B):,.0f}")
digest = hashlib.sha256()
for B in (1, 8):
    for name, sampling in (("top-p 0.95", {"temperature": 0.8, "top_p": 0.95}),
                           ("top-k 40", {"temperature": 0.8, "top_k": 40}), ("greedy", {"temperature": 0})):  # fmt: skip
        print(f"{LABEL}: generate 128, bf16, batch {B}, {name} (tok/s): {generate(model, B, digest, **sampling):,.0f}")
print(f"{LABEL}: tokens digest {digest.hexdigest()[:16]}")
