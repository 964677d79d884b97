"""The fast model's prompts with their products and gate a sequence at a time (``rows``: up to 64
positions a sequence on the C++ step's product, longer ones on the GEMM once a sequence, the gate
in C++), against one product over the batch's rows (MKL on the decoding layout up to 64 rows, the
chosen fp32 GEMM above, ATen's gate: ``batch``), interleaved, medians of ROUNDS. The 13m preset with
random weights, fp32. Each case is B,T,KEEP,CACHE: KEEP 1 for the last position's logits (what
``generate`` asks), 0 for every position's; CACHE 1 for a prompt, 0 for a scoring pass (which keeps
one product over the batch in both).

python ab_rows.py ROUNDS B,T,KEEP,CACHE ... from the checkout root."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.two_builds import model_13m
from wiola.fast import prefill
from wiola.fast.decode_step_cpu import cpu_info
from wiola.fast.speed import interleaved
from wiola.ops.linear import cpu_gemm

real = prefill.context


def one_product(model, ids, cache):
    """``prefill.context`` without ``rows``: one product over the batch's rows."""
    if prefill.gemm_applies(model, ids) and not (prefill.applies(model, ids, cache) and prefill.select() == "bf16"):
        return cpu_gemm(prefill.select_gemm())
    return real(model, ids, cache)


model = model_13m("fp32")
print(cpu_info()["name"], torch.__version__, torch.get_num_threads(), "threads;", prefill._describe_gemm())
rounds = int(sys.argv[1])
gen = torch.Generator().manual_seed(0)
print("| B | T | forward | rows | one product | one product / rows | max abs difference |")
print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
for B, T, keep, cache in [tuple(int(v) for v in c.split(",")) for c in sys.argv[2:]]:
    ids = torch.randint(0, 32000, (B, T), generator=gen)

    def rows(ids=ids, keep=keep, cache=cache):
        c = model.new_cache(ids.shape[0], ids.shape[1] + 1) if cache else None
        return model(ids, cache=c, logits_to_keep=keep).logits

    def batch():
        prefill.context = one_product
        try:
            return rows()
        finally:
            prefill.context = real

    with torch.inference_mode():
        diff = float((rows() - batch()).abs().max())
        m = interleaved({"rows": rows, "batch": batch}, rounds)
    what = ("prompt" if cache else "scoring pass") + (", last logits" if keep else ", every position's logits")
    print(
        f"| {B} | {T} | {what} | {m['rows'] * 1e3:.2f} ms | {m['batch'] * 1e3:.2f} ms | "
        f"{m['batch'] / m['rows']:.2f}x | {diff:.1e} |",
        flush=True,
    )
