"""Per-token forward (``model(tok, cache=cache)``, greedy, 128 steps after a 16-token prompt) and
``Rows.step`` times of the tree on ``PYTHONPATH``: 13m preset, batch 1, fp32 and int8, the median
of 7 repetitions each, in µs a step, as one JSON line."""

import json
import statistics
import time

import torch

import wiola
from wiola.fast import WiolaModel
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

torch.manual_seed(0)
out = {}
for scheme in (None, "int8"):
    m = WiolaModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False)
    if scheme:
        quantize(m, scheme)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.inference_mode():
        for _ in range(7):
            cache = m.new_cache(1, 16 + 130)
            m(ids, cache=cache)
            tok = ids[:, -1:]
            t0 = time.perf_counter()
            for _ in range(128):
                tok = m(tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            times.append((time.perf_counter() - t0) / 128)
    rows = Rows(m, max_rows=1)
    rt = []
    for _ in range(7):
        rows.join(RowRequest(prompt=ids[0].tolist(), max_new_tokens=129, temperature=0))
        t0, n = time.perf_counter(), 0
        while rows.live:
            rows.step()
            n += 1
        rt.append((time.perf_counter() - t0) / n)
    out[scheme or "fp32"] = {"forward_us": statistics.median(times) * 1e6, "rows_step_us": statistics.median(rt) * 1e6}
print(json.dumps(out))
