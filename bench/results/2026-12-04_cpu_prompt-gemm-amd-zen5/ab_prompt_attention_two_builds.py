"""The prompt attention (decode_step_cpu.decode_attention, 8 heads of 32) of the checkout's C++ library
against another build's (python ab_prompt_attention_two_builds.py OTHER.cpp rounds B T, from the
checkout root), interleaved, the order swapped every round; the outputs and both caches asserted
bitwise equal first. Median ms."""

import sys

import torch

sys.path.insert(0, ".")  # the checkout root, for bench
from bench.two_builds import build, interleaved
from wiola.fast import decode_step_cpu as dsc

other, rounds = sys.argv[1], int(sys.argv[2])
B, T, H, D = int(sys.argv[3]), int(sys.argv[4]), 8, 32
S = T + 8
libs = {"checkout": dsc.load(None), "other build": build(other)}
torch.manual_seed(0)
qkv = torch.randn(B, T, 3, H, D)
q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
g = torch.rand(B, T, H)
angle = torch.rand(B, T, D // 2) * 6
cos, sin = angle.cos(), angle.sin()
mask = torch.ones(B, S, dtype=torch.bool)
if B > 1:
    mask[1, :5] = False  # a left-padded row
load = dsc.load


def run(name: str) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
    dsc.load = lambda isa=None: libs[name]
    try:
        return dsc.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, mask, 0), k_cache, v_cache
    finally:
        dsc.load = load


for a, b, what in zip(run("checkout"), run("other build"), ("output", "key cache", "value cache")):
    assert torch.equal(a, b), f"the {what} differs"
median = interleaved({name: lambda name=name: run(name) for name in libs}, rounds)
a, b = median["checkout"], median["other build"]
print(
    f"B{B} T{T}: checkout {a * 1e3:.3f} ms, other build {b * 1e3:.3f} ms: checkout faster by {b / a:.3f}x (bitwise equal)"
)
