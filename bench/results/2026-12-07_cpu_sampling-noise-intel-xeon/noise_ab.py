"""Sampled decoding with the Exp(1) noise and the nucleus' sort done by torch (exponential_,
torch.sort: "torch") or by the C++ (wiola_exponential, wiola_sort_descending: "C++"), interleaved in
one process (13m preset, random weights; both give the same values, so the same tokens; checked):
`python noise_ab.py [rounds]`.

- the draw alone: one row of 32,000 ids, and 8 rows of 8 generators; the sort of one row;
- Rows.step with sampled rows (temperature 0.8, top-k 40, a seed each; or top-p 0.95) at batch 1
  and 8, bf16 and int8: the median of 200 steps;
- model.generate of 128 tokens (temperature 0.8 with top-k 40, or with top-p 0.95, as `wiola
  generate` samples by default) at batch 1 and 8, bf16: tokens/s.
"""

import statistics
import sys
import time

import torch

import wiola.fast
import wiola.fast.decode_step_cpu as D
from wiola import WiolaConfig
from wiola.fast.generation import cpu_nucleus
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
TOP_K, TOP_P = {"temperature": 0.8, "top_k": 40}, {"temperature": 0.8, "top_p": 0.95}
real_agrees, real_sort = D.exponential_agrees, D.sort_descending


def use(path: str) -> None:
    D.exponential_agrees = real_agrees if path == "C++" else (lambda lib: False)
    D.sort_descending = real_sort if path == "C++" else (lambda x, isa=None: None)


def timed(run, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - t0) / n


def rows_step(model, B: int, **sampling) -> float:
    rows = Rows(model, 8)
    for i in range(B):
        rows.join(RowRequest([5] * 16, 300, seed=i, **sampling))
    for _ in range(10):
        rows.step()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter()
        rows.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


tokens: dict[tuple, torch.Tensor] = {}


def generate(model, B: int, **sampling) -> float:
    ids = torch.full((B, 16), 5, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=128, temperature=0.8, generator=g, **sampling)
    rate = B * 128 / (time.perf_counter() - t0)
    key = (B, *sampling.items())
    assert torch.equal(tokens.setdefault(key, out), out), f"the two paths made different tokens: {key}"
    return rate


torch.manual_seed(0)
base = wiola.fast.WiolaModel(WiolaConfig(eos_token_id=None)).eval().requires_grad_(False)
models = {"bf16": quantize(base, "bf16")}
torch.manual_seed(0)
models["int8"] = quantize(wiola.fast.WiolaModel(WiolaConfig(eos_token_id=None)).eval().requires_grad_(False), "int8")
gens = [torch.Generator().manual_seed(i) for i in range(8)]
results: dict[str, dict[str, list[float]]] = {}


def record(name: str, path: str, value: float) -> None:
    results.setdefault(name, {}).setdefault(path, []).append(value)


for r in range(ROUNDS):
    for path in ("torch", "C++") if r % 2 == 0 else ("C++", "torch"):
        use(path)
        record("draw, 1 row of 32,000 (us)", path, 1e6 * timed(lambda: D.exponential_rows(gens[:1], 32000), 50))
        record("draw, 8 rows of 32,000 (us)", path, 1e6 * timed(lambda: D.exponential_rows(gens, 32000), 10))
        logits = torch.randn(1, 32000)
        record("nucleus mask, 1 row of 32,000 (us)", path, 1e6 * timed(lambda x=logits: cpu_nucleus(x, 0.95), 20))
        for scheme, model in models.items():
            for B in (1, 8):
                record(f"Rows.step, {scheme}, batch {B}, top-k 40 (us)", path, 1e6 * rows_step(model, B, **TOP_K))
        for B in (1, 8):
            record(f"Rows.step, bf16, batch {B}, top-p 0.95 (us)", path, 1e6 * rows_step(models["bf16"], B, **TOP_P))
        for B in (1, 8):
            for name, sampling in (("top-k 40", {"top_k": 40}), ("top-p 0.95", {"top_p": 0.95})):
                record(f"generate 128, bf16, batch {B}, {name} (tok/s)", path, generate(models["bf16"], B, **sampling))
use("C++")
print(f"{'':48s} {'torch':>20s} {'C++':>20s}  ratio of medians")
for name, by in results.items():
    a, b = statistics.median(by["torch"]), statistics.median(by["C++"])
    ratio = a / b if "(us)" in name else b / a
    fmt = lambda v: "/".join(f"{x:,.0f}" for x in v)
    print(f"{name:48s} {fmt(by['torch']):>20s} {fmt(by['C++']):>20s}  {ratio:.2f}x")
