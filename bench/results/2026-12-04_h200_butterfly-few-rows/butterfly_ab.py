"""The fused butterfly block's forward alone, in whichever ``wiola_kernels`` is first on the path:
a hash of its outputs on fixed inputs (the training shapes must stay bitwise the same; the
decoding shapes may change tiles), its time a call at a decoding step's shape (13m: d 256,
d_ff 512, bf16, bf16 residual; N 1 and 8 rows), 200 calls captured in one CUDA graph, the median
of 7 replays, and the tiles the autotuner chose. Then the greedy tokens of a 13m ``generate``
(random weights, bf16, 512-token prompt, 256 new) hashed, at batch 1 and 8. One JSON line.

    PYTHONPATH=TREE python butterfly_ab.py LABEL
"""

import hashlib
import json
import sys

import torch

import wiola
from wiola.fast import WiolaModel
from wiola_kernels import butterfly as kb

label = sys.argv[1]
dev = "cuda"
gen = torch.Generator(dev).manual_seed(0)


def inputs(N, d=256, d_ff=512, dtype=torch.bfloat16):
    x = torch.randn(N, d, device=dev, generator=gen).to(dtype)
    w_up = (torch.randn(2 * d_ff, d, device=dev, generator=gen) * d**-0.5).to(dtype)
    w_bp = (torch.randn(d_ff, d, device=dev, generator=gen) * d**-0.5).to(dtype)
    w_down = (torch.randn(d, d_ff, device=dev, generator=gen) * d_ff**-0.5).to(dtype)
    res = torch.randn(N, d, device=dev, generator=gen).to(dtype)
    return x, w_up, w_bp, w_down, res


with torch.no_grad():
    digests = {}
    for group, sizes in (("many_rows", (65, 512, 4096)), ("few_rows", (1, 8, 64))):
        h = hashlib.sha256()
        for N in sizes:
            x, w_up, w_bp, w_down, res = inputs(N)
            h.update(kb.butterfly(x, w_up, w_bp, w_down, residual=res).float().cpu().numpy().tobytes())
        digests[f"{group}_sha256"] = h.hexdigest()[:16]
    times = {}
    for N in (1, 8):
        x, w_up, w_bp, w_down, res = inputs(N)
        for _ in range(3):
            kb.butterfly(x, w_up, w_bp, w_down, residual=res)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(200):
                kb.butterfly(x, w_up, w_bp, w_down, residual=res)
        runs = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            runs.append(a.elapsed_time(b) * 1e3 / 200)
        times[f"N{N}_us_per_call"] = round(sorted(runs)[3], 3)
    chosen = {}
    for name in ("_up_tuned", "_down_tuned"):
        for key, cfg in getattr(kb, name).cache.items():
            if key[0] <= 64:  # the N bucket: the decoding shapes'
                chosen[f"{name}{list(key[:3])}"] = str(cfg)
    cfg = wiola.WiolaConfig.preset("13m")
    torch.manual_seed(0)
    model = WiolaModel(cfg).to(dev, torch.bfloat16).eval()
    tokens = {}
    for batch in (1, 8):
        ids = torch.randint(0, cfg.vocab_size, (batch, 512), device=dev, generator=torch.Generator(dev).manual_seed(1))
        out = model.generate(ids, 256, temperature=0)
        tokens[f"B{batch}_tokens_sha256"] = hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()[:16]
print(json.dumps({"label": label, **digests, **times, **tokens, "chosen": chosen}), flush=True)
