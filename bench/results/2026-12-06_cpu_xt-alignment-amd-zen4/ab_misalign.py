"""Interleaved A/B of the transposed-x buffer's alignment in the C++ step (bf16 and int4 products).

Needs misalign_knob.patch applied to wiola/fast/decode_step_cpu.cpp (it adds
``wiola_set_misalign``: the buffer put that many floats past its 64-byte boundary).

    python bench/results/2026-12-06_cpu_xt-alignment-amd-zen4/ab_misalign.py bf16 8
"""

import copy
import statistics
import sys
import time

import torch

import wiola
from bench.ab_tuning import _cpu, _model
from wiola.fast import decode_step_cpu

scheme, batch = sys.argv[1], int(sys.argv[2])
rounds, steps, prompt, offsets = 40, 5, 16, (0, 4)
torch.set_grad_enabled(False)
config = wiola.WiolaConfig.preset("13m")
model = _model(config, scheme)
ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
cache = model.new_cache(batch, prompt + 1 + rounds * steps * len(offsets))
model(ids, cache=cache)
step = decode_step_cpu.DecodeStepCPU(model, cache)
tok = ids[:, -1].contiguous()
logits = []
for off in offsets:  # the same step from copies of the same cache
    step.lib.wiola_set_misalign(off)
    logits.append(decode_step_cpu.DecodeStepCPU(model, copy.deepcopy(cache))(tok, prompt))
assert torch.equal(logits[0], logits[1]), "the offset changed the logits"
times = {off: [] for off in offsets}
slot = prompt
for r in range(rounds):
    for off in offsets if r % 2 == 0 else offsets[::-1]:
        step.lib.wiola_set_misalign(off)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(tok, slot)
            slot += 1
        times[off].append((time.perf_counter() - t0) / steps)
a, m = statistics.median(times[0]), statistics.median(times[4])
print(
    f"{_cpu(step.tuning)}: {scheme} B{batch} ({step.isa}, {torch.get_num_threads()} threads): 64-byte aligned {a * 1e6:.0f} us a step, "
    f"16 bytes past {m * 1e6:.0f} us; aligned {m / a:.3f}x as fast; logits bitwise equal"
)
