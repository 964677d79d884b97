"""pp (a T-token prompt at batch B through the 13m preset's fast model, random weights) with the
checkout's C++ library against another build's (python ab_pp_two_builds.py OTHER.cpp rounds B T,
from the checkout root), interleaved, the order swapped every round; the last position's logits
asserted bitwise equal first. Median ms."""

import sys

import torch

sys.path.insert(0, ".")  # the checkout root, for bench
from bench.two_builds import build, interleaved, model_13m
from wiola.fast import decode_step_cpu as dsc
from wiola.fast import speed

other, rounds, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
libs = {"checkout": dsc.load(None), "other build": build(other)}
load = dsc.load
model = model_13m("fp32")
ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(T))
prompt = speed.prompt_run(model, ids)


def run(name: str) -> torch.Tensor:
    dsc.load = lambda isa=None: libs[name]
    try:
        return prompt()
    finally:
        dsc.load = load


assert torch.equal(run("checkout"), run("other build")), "the logits differ"
median = interleaved({name: lambda name=name: run(name) for name in libs}, rounds)
a, b = median["checkout"], median["other build"]
print(
    f"pp{T} B{B}: checkout {a * 1e3:.2f} ms ({B * T / a:,.0f} tok/s), other build {b * 1e3:.2f} ms: "
    f"checkout faster by {b / a:.3f}x (logits bitwise equal)"
)
