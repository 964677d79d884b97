"""The int8 step A/B of results/2026-12-03_cpu_int8-vnni-amd-zen4 (needs int8_vnni_step.patch applied):
one DecodeStepCPU binding, the int8_dot dimension toggled between 0 (widening) and 1 (VNNI) in
alternating blocks of 10 steps, 40 rounds; median and fastest step per path.

    python ab_int8_dot.py 13m 1 8   # preset, then batch sizes
"""

import statistics
import sys
import time

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu as dsc
from wiola.fast import step_layout
from wiola.fast.quantize import quantize


def main() -> None:
    torch.set_grad_enabled(False)
    idx = step_layout.DIMS.index("int8_dot")
    torch.manual_seed(0)
    base = wiola.WiolaConfig.preset(sys.argv[1])
    for batch in [int(b) for b in sys.argv[2:]]:
        model = FastModel(base).eval().requires_grad_(False)
        quantize(model, "int8")
        ids = torch.randint(0, base.vocab_size, (batch, 80), generator=torch.Generator().manual_seed(1))
        cache = model.new_cache(batch, 1024)
        model(ids, cache=cache)
        step = dsc.DecodeStepCPU(model, cache)
        tok = ids[:, -1].contiguous()
        times = {0: [], 1: []}
        slot = 80
        for rnd in range(40):
            for v in (0, 1) if rnd % 2 == 0 else (1, 0):
                step.dims[idx] = v
                start = time.perf_counter()
                for _ in range(10):
                    step(tok, slot)
                    slot += 1
                times[v].append((time.perf_counter() - start) / 10)
        w, n = statistics.median(times[0]), statistics.median(times[1])
        print(
            f"{sys.argv[1]} int8 B{batch} ({dsc.select_isa()}, {torch.get_num_threads()} threads): step widen "
            f"{w * 1e6:.0f} us, vnni {n * 1e6:.0f} us: vnni {w / n:.3f}x "
            f"(min {min(times[0]) * 1e6:.0f} / {min(times[1]) * 1e6:.0f} us)"
        )


if __name__ == "__main__":
    main()
