"""The fast model's prompt on each fp32 GEMM (WIOLA_CPU_GEMM=aten, =onednn), interleaved in one
process, order swapped every round: pp (a T-token prompt with a cache, the last position's
logits, as `wiola bench` and generate run it) for fp32 and int8 weights, and a scoring pass (no
cache, every position's logits, as `wiola eval` runs a window). Median ms of `rounds` calls;
the logits' largest difference between the two printed first. Then the first call at a prompt
length not seen before (oneDNN makes its primitives for new shapes), over `fresh` lengths.
python ab_prompt.py [rounds] [fresh] from the checkout root."""

import os
import statistics
import sys
import time

import torch

from bench.two_builds import interleaved, model_13m
from wiola.fast import prefill, speed
from wiola.fast.decode_step_cpu import cpu_info

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
fresh = int(sys.argv[2]) if len(sys.argv) > 2 else 10
GEMMS = ("aten", "onednn")


def on(gemm: str) -> None:
    os.environ[prefill.GEMM_ENV] = gemm


print(f"{cpu_info()['name']}; torch {torch.__version__}, {torch.get_num_threads()} threads")
for weights in ("fp32", "int8"):
    model = model_13m(weights)
    V = model.config.vocab_size
    for what, T in (("pp512", 512), ("pp128", 128), ("score512", 512)):
        ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(T))
        if what.startswith("pp"):
            run = speed.prompt_run(model, ids)
        else:

            def run(ids: torch.Tensor = ids, model: torch.nn.Module = model) -> torch.Tensor:
                with torch.inference_mode():
                    return model(ids).logits

        out = {}
        for gemm in GEMMS:
            on(gemm)
            out[gemm] = run()
        diff = float((out["aten"] - out["onednn"]).abs().max())
        median = interleaved({g: lambda g=g, run=run: (on(g), run()) for g in GEMMS}, rounds)
        a, o = median["aten"], median["onednn"]
        print(
            f"{weights} {what}: ATen {a * 1e3:.1f} ms ({T / a:,.0f} tok/s), oneDNN {o * 1e3:.1f} ms ({T / o:,.0f} tok/s): "
            f"oneDNN faster by {a / o:.2f}x; max |logit difference| {diff:.2e}"
        )
model = model_13m("fp32")
firsts = {g: [] for g in GEMMS}
for i in range(fresh):
    for gemm in GEMMS if i % 2 == 0 else GEMMS[::-1]:
        T = 300 + 2 * i + (gemm == "onednn")  # a length neither GEMM has seen
        run = speed.prompt_run(model, torch.randint(0, 100, (1, T)))
        on(gemm)
        start = time.perf_counter()
        run()
        firsts[gemm].append(time.perf_counter() - start)
print(
    f"first call at a new prompt length (~300 tokens, {fresh} lengths): ATen {statistics.median(firsts['aten']) * 1e3:.1f} ms, "
    f"oneDNN {statistics.median(firsts['onednn']) * 1e3:.1f} ms"
)
