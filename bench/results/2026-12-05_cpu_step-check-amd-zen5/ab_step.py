"""Per-token forward (model(tok, cache=cache)) and Rows.step time of one tree, 13m, batch 1."""
import sys, time, json, statistics
import torch, wiola
from wiola.fast import WiolaModel
from wiola.fast.quantize import quantize
from wiola.fast.rows import Rows, RowRequest
torch.manual_seed(0)
out = {}
for scheme in (None, "int8"):
    m = WiolaModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False)
    if scheme: quantize(m, scheme)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.inference_mode():
        for rep in range(7):
            cache = m.new_cache(1, 16 + 130)
            m(ids, cache=cache)
            tok = ids[:, -1:]
            t0 = time.perf_counter()
            for _ in range(128):
                tok = m(tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            times.append((time.perf_counter() - t0) / 128)
    rows = Rows(m, max_rows=1)
    rt = []
    for rep in range(7):
        rows.join(RowRequest(prompt=ids[0].tolist(), max_new_tokens=129, temperature=0))
        t0 = time.perf_counter(); n = 0
        while rows.live:
            rows.step(); n += 1
        rt.append((time.perf_counter() - t0) / n)
    out[scheme or "fp32"] = {"forward_us": statistics.median(times) * 1e6, "rows_step_us": statistics.median(rt) * 1e6}
print(json.dumps(out))
