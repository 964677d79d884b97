"""The fast model's prompts with the C++ step's product taking sequences of up to LIMIT positions
(``wiola.ops.linear._GEMV_ROWS`` set to LIMIT for the call) against the shipped 64, interleaved,
medians of ROUNDS; a preset with random weights, fp32, a prompt with a cache and the last position's
logits (what ``generate`` asks), or every position's with KEEP 0. Whether the two paths' logits are
bitwise equal is printed too (they need not be; each is the same alone and in a batch).

python ab_row_limit.py ROUNDS LIMIT PRESET B,T[,KEEP] ... from the checkout root."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import wiola.ops.linear as linear
from wiola import WiolaConfig
from wiola.fast import WiolaModel, prefill
from wiola.fast.decode_step_cpu import cpu_info
from wiola.fast.speed import interleaved

rounds, limit, preset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = WiolaModel(WiolaConfig.preset(preset)).eval()
print(cpu_info()["name"], torch.__version__, torch.get_num_threads(), "threads;", preset, ";", prefill._describe_gemm())
gen = torch.Generator().manual_seed(0)
print(f"| B | T | logits | limit 64 | limit {limit} | 64 / {limit} | bitwise equal |")
print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
for case in sys.argv[4:]:
    B, T, keep = ([int(v) for v in case.split(",")] + [1])[:3]
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen)

    def run(rows, ids=ids, keep=keep):
        shipped, linear._GEMV_ROWS = linear._GEMV_ROWS, rows
        try:
            cache = model.new_cache(ids.shape[0], ids.shape[1] + 1)
            return model(ids, cache=cache, logits_to_keep=keep).logits
        finally:
            linear._GEMV_ROWS = shipped

    with torch.inference_mode():
        same = torch.equal(run(64), run(limit))
        m = interleaved({"64": lambda: run(64), "other": lambda: run(limit)}, rounds)
    print(
        f"| {B} | {T} | {'last' if keep else 'every'} | {m['64'] * 1e3:.2f} ms | {m['other'] * 1e3:.2f} ms | "
        f"{m['64'] / m['other']:.2f}x | {same} |",
        flush=True,
    )
