"""Whether a GEMM's row depends on the rows around it: for the 13m preset's product shapes, the
first M rows of a 600-row product computed as a product of M rows, on ATen's GEMM (F.linear: MKL's
sgemm), on MKL through the decoding layout (x @ Wᵀ stored (in, out)), on oneDNN's, and on the C++
step's product (wiola_product_rows); then MKL on the same rows at each offset from a 64-byte
boundary. Prints the row counts and offsets at which any bit differs.

python gemm_rows.py from the checkout root."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from wiola.fast import decode_step_cpu
from wiola.fast.decode_step_cpu import cpu_info
from wiola.ops.linear import onednn_linear

print(cpu_info()["name"], torch.__version__, torch.get_num_threads(), "threads")
torch.manual_seed(0)
SHAPES = [(256, 768), (256, 256), (256, 1024), (256, 512), (512, 256)]  # (in, out): q/k/v, o, up, bp, down
COUNTS = [*range(1, 80), 96, 100, 128, 130, 200, 256, 333, 512]
with torch.inference_mode():
    for K, N in SHAPES:
        W, X = torch.randn(N, K), torch.randn(600, K)
        Wt = W.t().contiguous()
        gemms = {
            "ATen (MKL)": lambda x, W=W: F.linear(x, W),
            "MKL, decoding layout": lambda x, Wt=Wt: x @ Wt,
            "oneDNN": lambda x, W=W: onednn_linear(x, W),
            "C++ step's product": lambda x, W=W: decode_step_cpu.product(x, W),
        }
        for name, f in gemms.items():
            full = f(X)
            differ = [M for M in COUNTS if not torch.equal(f(X[:M].clone()), full[:M])]
            print(f"{K}x{N} {name}: the first M rows differ from the 600-row product's at M = {differ or 'none'}")
    for K, N in ((256, 768), (32, 8)):  # q/k/v; the gate's first product (D 32 to H 8)
        W, X = torch.randn(N, K), torch.randn(65, K)
        want = F.linear(X, W)
        off = []
        for offset in range(16):
            buf = torch.empty(65 * K + 16)
            view = buf[offset : offset + 65 * K].view(65, K)
            view.copy_(X)
            if not torch.equal(F.linear(view, W), want):
                off.append(offset)
        print(f"MKL, 65x{K}x{N} at an offset of k floats from an aligned start: differs for k = {off or 'none'}")
