"""Single products of 128 positions: the C++ step's product against oneDNN's fp32 matmul, with a hot
weight (the same matrix every call) and a cold one (cycled through copies of twice a 32 MiB L3),
interleaved, medians of 21 rounds, for the layer shapes (in, out) of the 13m, micro and small
presets. python single_products.py from the checkout root."""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from wiola.fast.decode_step_cpu import product
from wiola.fast.speed import interleaved
from wiola.ops.linear import onednn_linear

LLC = 32 << 20
SHAPES = [(256, 768), (256, 256), (256, 1024), (512, 256)]  # 13m
SHAPES += [(384, 1152), (384, 384), (384, 1536), (768, 384)]  # micro
SHAPES += [(512, 1536), (512, 512), (512, 2048), (1024, 512)]  # small
M = 128


def cycled(f, x, ws):
    turn = itertools.cycle(ws)
    return lambda: f(x, next(turn))


print("| in | out | C++ / oneDNN, cold weights | C++, oneDNN | C++ / oneDNN, hot weights |")
print("| ---: | ---: | ---: | --- | ---: |")
with torch.inference_mode():
    for K, N in SHAPES:
        ws = [torch.randn(N, K) for _ in range(max(2, 2 * LLC // (N * K * 4) + 1))]
        x = torch.randn(M, K)
        runs = {
            "rows": cycled(product, x, ws),
            "gemm": cycled(onednn_linear, x, ws),
            "rows_hot": cycled(product, x, ws[:1]),
            "gemm_hot": cycled(onednn_linear, x, ws[:1]),
        }
        m = interleaved(runs, 21)
        print(
            f"| {K} | {N} | {m['rows'] / m['gemm']:.2f} | {m['rows'] * 1e6:.0f} / {m['gemm'] * 1e6:.0f} µs | "
            f"{m['rows_hot'] / m['gemm_hot']:.2f} |",
            flush=True,
        )
