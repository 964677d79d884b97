"""The tile-unit GEMM of ``amx_gemm.patch`` (apply it to fdbb5d7) against torch's ``x @ w.T`` (MKL's
sgemm) on torch's threads: the median of 30 calls each, and each one's largest error over
``Σ|w·x|`` against float64; "rows alone equal": the first 5 rows computed alone equal the same rows
of the whole product, bit for bit.

    python bench/results/2026-12-07_cpu_prompt-amx-gemm-intel-xeon/gemm_ab.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from wiola.fast import decode_step_cpu as dsc

lib = dsc.load("amx")
print(dsc.BUILD_ERROR if lib is None else "built")


def amx(x, w):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N)
    a = torch.empty(lib.wiola_gemm_amx_halves(M, K), dtype=torch.int16)
    b = torch.empty(lib.wiola_gemm_amx_halves(N, K), dtype=torch.int16)
    rc = lib.wiola_gemm_amx(
        x.data_ptr(),
        x.stride(0),
        M,
        w.data_ptr(),
        w.stride(0),
        N,
        K,
        y.data_ptr(),
        y.stride(0),
        a.data_ptr(),
        b.data_ptr(),
        torch.get_num_threads(),
    )
    assert rc == 0
    return y


torch.manual_seed(0)
for M, K, N in [
    (512, 256, 768),
    (512, 256, 256),
    (512, 256, 1024),
    (512, 512, 256),
    (512, 256, 32000),
    (37, 100, 45),
    (1, 33, 17),
    (512, 768, 2304),
]:
    x = torch.randn(M, K)
    w = torch.randn(N, K) * 0.05
    ref = x.double() @ w.double().T
    ya = amx(x, w)
    ym = x @ w.T
    scale = x.double().abs() @ w.double().abs().T
    ea = ((ya.double() - ref).abs() / scale).max().item()
    em = ((ym.double() - ref).abs() / scale).max().item()

    def t(f, n=30):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[n // 2] * 1e3

    ta, tm = t(lambda x=x, w=w: amx(x, w)), t(lambda x=x, w=w: x @ w.T)
    print(
        f"{M}x{K}x{N}: amx {ta:.3f} ms, mkl {tm:.3f} ms ({tm / ta:.2f}x); rel err/Σ|wx|: amx {ea:.2e}, mkl {em:.2e}; rows alone equal: {torch.equal(amx(x[:5], w), ya[:5])}"
    )
