"""A row-invariant fp32 GEMM sketch (``chain_gemm.cpp``: each output one FMA chain over k = 0..K-1,
x packed in 32-row panels, 32 × 12 register tiles, AVX-512) against oneDNN's fp32 matmul: time
(interleaved, medians of 11), largest error against float64, a row alone bitwise equal to the same
row among M, and whether it equals oneDNN bitwise. Build first, from this folder:
g++ -O3 -march=native -fopenmp -shared -fPIC chain_gemm.cpp -o /tmp/chain_gemm.so
python chain_gemm.py from the checkout root."""

import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from wiola.fast.speed import interleaved
from wiola.ops.linear import onednn_linear

lib = ctypes.CDLL("/tmp/chain_gemm.so")
lib.gk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]


def chain(x, w):
    (M, K), N = x.shape, w.shape[0]
    y = torch.empty(M, N)
    lib.gk(w.data_ptr(), N, K, x.data_ptr(), M, y.data_ptr())
    return y


print(
    "| in | out | rows | chain | oneDNN | oneDNN / chain | largest error, chain / oneDNN | row alone | equals oneDNN |"
)
print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
with torch.inference_mode():
    for K, N in [(256, 768), (256, 256), (256, 1024), (512, 256), (768, 384), (512, 1536), (1024, 512), (256, 32000)]:
        w = torch.randn(N, K)
        for M in (2, 100, 512):
            x = torch.randn(M, K)
            exact = x.double() @ w.double().t()
            a, b = chain(x, w), onednn_linear(x, w)
            errors = f"{float((a.double() - exact).abs().max()):.1e} / {float((b.double() - exact).abs().max()):.1e}"
            alone = torch.equal(chain(x[M // 2 : M // 2 + 1].contiguous(), w)[0], a[M // 2])
            runs = {"chain": lambda x=x, w=w: chain(x, w), "onednn": lambda x=x, w=w: onednn_linear(x, w)}
            m = interleaved(runs, 11)
            print(
                f"| {K} | {N} | {M} | {m['chain'] * 1e6:.0f} µs | {m['onednn'] * 1e6:.0f} µs | "
                f"{m['onednn'] / m['chain']:.2f} | {errors} | {alone} | {torch.equal(a, b)} |",
                flush=True,
            )
