"""Time wiola.fast's CUDA-graph greedy decoding (13m preset, bf16, 512-token prompt, 256 new
tokens, batch 1 and 8), as bench/test_decode.py's headline does, in whichever ``wiola`` is first
on the path; print one JSON line per batch size. Run once per tree (before / after a change).

    PYTHONPATH=TREE python ab_decode.py LABEL
"""

import json
import sys
import time

import torch

import wiola
from wiola.fast import WiolaModel

label = sys.argv[1]
cfg = wiola.WiolaConfig.preset("13m")
torch.manual_seed(0)
model = WiolaModel(cfg).to("cuda", torch.bfloat16).eval()
for batch in (1, 8):
    ids = torch.randint(
        0, cfg.vocab_size, (batch, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    out = None
    for _ in range(3):  # compile, autotune, capture
        out = model.generate(ids, 256, temperature=0)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h = time.perf_counter()
        a.record()
        model.generate(ids, 256, temperature=0)
        b.record()
        torch.cuda.synchronize()
        times.append((a.elapsed_time(b) / 1e3, time.perf_counter() - h))
    gpu = sorted(t[0] for t in times)[len(times) // 2]
    host = sorted(t[1] for t in times)[len(times) // 2]
    print(
        json.dumps(
            {
                "label": label,
                "batch": batch,
                "median_s": gpu,
                "host_median_s": host,
                "tok_per_s": batch * 256 / gpu,
                "all_s": [round(t[0], 6) for t in times],
                "tokens_sha": hash(tuple(out.flatten().tolist())) % 10**12,
                "wiola": wiola.__file__,
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )
