"""The fused gate alone, in whichever ``wiola`` / ``wiola_kernels`` is first on the path: a hash
of its outputs on fixed inputs (so two trees can be held bitwise equal) and its time a call at a
decoding step's shape (13m: H 8, D 32, bf16 q, rotation, carry; T 1; batch 1 and 8), 200 calls
captured in one CUDA graph, the median of 7 replays. One JSON line.

    PYTHONPATH=TREE python gate_ab.py LABEL
"""

import hashlib
import json
import sys

import torch

from wiola_kernels.gate import gate

label = sys.argv[1]
dev = "cuda"
gen = torch.Generator(dev).manual_seed(0)


def inputs(B, T, H=8, D=32, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, D, device=dev, generator=gen).to(dtype)
    w1 = torch.randn(H, D, device=dev, generator=gen) * 0.2
    w2 = torch.randn(H, H, device=dev, generator=gen) * 0.2
    b2 = torch.randn(H, device=dev, generator=gen) * 0.1
    ang = torch.rand(B, T, D // 2, device=dev, generator=gen) * 6.3
    mask = torch.rand(B, T, device=dev, generator=gen) > 0.2
    carry = (torch.randn(B, D, device=dev, generator=gen), torch.randint(0, 50, (B,), device=dev, generator=gen))
    return q, w1, w2, b2, ang.cos(), ang.sin(), mask, carry


digest = hashlib.sha256()
with torch.no_grad():
    # Prefill shapes (several spans a row, the pre-pass), fp32/bf16, H 8 and 32, and decoding shapes.
    for B, T, H, D, dtype in [(3, 37, 8, 32, torch.bfloat16), (2, 700, 8, 32, torch.bfloat16),
                              (1, 4096, 8, 32, torch.float32), (4, 129, 32, 64, torch.bfloat16),
                              (8, 1, 8, 32, torch.bfloat16), (1, 1, 32, 128, torch.float32)]:  # fmt: skip
        q, w1, w2, b2, cos, sin, mask, carry = inputs(B, T, H, D, dtype)
        for kw in ({}, {"cos": cos, "sin": sin, "attention_mask": mask, "carry": carry}):
            for t in gate(q, w1, w2, b2, **kw):
                digest.update(t.contiguous().cpu().numpy().tobytes())
    times = {}
    for B in (1, 8):
        q, w1, w2, b2, cos, sin, mask, carry = inputs(B, 1)
        w1f, w2f, b2f = w1.float(), w2.float(), b2.float()
        for _ in range(3):
            gate(q, w1f, w2f, b2f, cos=cos, sin=sin, carry=carry, update_carry=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(200):
                gate(q, w1f, w2f, b2f, cos=cos, sin=sin, carry=carry, update_carry=True)
        runs = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            runs.append(a.elapsed_time(b) * 1e3 / 200)
        times[f"B{B}_us_per_call"] = sorted(runs)[3]
print(json.dumps({"label": label, "outputs_sha256": digest.hexdigest()[:16], **times}), flush=True)
