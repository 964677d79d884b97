"""The checkout's step (x parts pinned at one batch row only) against a copy of the source that
pins them at every batch size (python ab_pins.py PINNED.cpp ROUNDS SCHEME:BATCH ..., from the
checkout root). For each weight type and batch: the tokens of a tg call (speed.decoding_only: 128
greedy tokens after a 16-token prompt, the sampling between steps counted) asserted equal, then
`rounds` rounds of one call each, the order reversed every round; the median microseconds a step
of each and the pinned build's median over the unpinned one's (above 1: unpinned faster)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout root, for bench
from bench.two_builds import build, interleaved, model_13m, rebind
from wiola.fast import speed

pinned, rounds, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
lib_pinned = build(pinned)
with torch.no_grad():
    for case in cases:
        scheme, batch = case.split(":")[0], int(case.split(":")[1])
        model = model_13m(scheme)
        ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(1))
        runs = {"unpinned": speed.decoding_only(model, ids, 128), "pinned": speed.decoding_only(model, ids, 128)}
        rebind(runs["pinned"].step, lib_pinned)
        assert torch.equal(runs["unpinned"]().clone(), runs["pinned"]().clone()), f"{case}: tokens differ"
        median = interleaved(runs, rounds)  # seconds a call; a call is 127 steps
        u, p = median["unpinned"] / 127, median["pinned"] / 127
        print(
            f"{scheme} B{batch}: unpinned {u * 1e6:.0f} us, pinned {p * 1e6:.0f} us a step; pinned/unpinned {p / u:.3f}"
        )
