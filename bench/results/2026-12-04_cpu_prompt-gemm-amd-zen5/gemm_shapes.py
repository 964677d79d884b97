"""The 13m preset's prompt products on ATen's fp32 GEMM (F.linear: MKL's sgemm) and oneDNN's
(torch.ops.mkldnn._linear_pointwise, as wiola.ops.linear runs it), interleaved in one process:
median microseconds of `reps` calls each, GFLOP/s, and each one's largest error against the
float64 product as a fraction of the fp32 bound (λ·√K·u·Σ|w·x|, tests/numerics.py).
python gemm_shapes.py [reps] from the checkout root."""

import math
import sys

import torch
import torch.nn.functional as F

from bench.two_builds import interleaved
from wiola.fast.decode_step_cpu import cpu_info
from wiola.ops.linear import onednn_linear as onednn

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 40


# (what, rows, in, out): per layer q/k/v (one product), o, up (a, b), bp (c), down; the tied head
# (a scoring pass: every position's logits).
SHAPES = [
    ("qkv", 512, 256, 768),
    ("o", 512, 256, 256),
    ("up", 512, 256, 1024),
    ("bp", 512, 256, 512),
    ("down", 512, 512, 256),
    ("head, all positions", 512, 256, 32000),
    ("qkv, 128-token prompt", 128, 256, 768),
]
print(f"{cpu_info()['name']}; torch {torch.__version__}, {torch.get_num_threads()} threads; median of {reps}")
print(
    "| product | rows x in x out | ATen us | oneDNN us | ATen GFLOP/s | oneDNN GFLOP/s | oneDNN faster by | error / bound (ATen, oneDNN) |"
)
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
gen = torch.Generator().manual_seed(0)
for what, m, k, n in SHAPES:
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / math.sqrt(k)
    want = x.double() @ w.double().T
    allowed = 6.0 * math.sqrt(k) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    fns = {"aten": lambda x=x, w=w: F.linear(x, w), "onednn": lambda x=x, w=w: onednn(x, w)}
    ratio = {name: float(((f().double() - want).abs() / allowed).max()) for name, f in fns.items()}
    median = interleaved(fns, reps)
    a, o = median["aten"], median["onednn"]
    flop = 2 * m * k * n
    print(
        f"| {what} | {m} x {k} x {n} | {a * 1e6:,.0f} | {o * 1e6:,.0f} | {flop / a / 1e9:.0f} | {flop / o / 1e9:.0f} | "
        f"{a / o:.2f}x | {ratio['aten']:.3f}, {ratio['onednn']:.3f} |"
    )
