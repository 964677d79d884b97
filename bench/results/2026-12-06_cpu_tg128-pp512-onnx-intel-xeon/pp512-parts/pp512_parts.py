"""Where a prompt's time goes on this CPU: the 13m preset (random weights, seed 0) through
``wiola.fast`` with a new cache, the last position's logits (``wiola.fast.speed.prompt_run``, what
pp512 times), on the fp32 GEMM ``auto`` picks.

1. whole prompts of 16, 128 and 512 tokens (median of 30 after 5 warm-up);
2. a 512-token prompt with each C++ part (``decode_step_cpu``'s attention, gate, RMSNorms, SiLU gate
   and the one-row head product) wrapped in a timer, the products of the layers summed from
   ``wiola.ops.linear``'s per-sequence products, less the head's row (20 prompts after 5 warm-up);
3. each layer product's shape alone through ``F.linear`` (512 rows; median of 50).

    python pp512_parts.py
"""

import collections
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import wiola
import wiola.ops.linear as linear_ops
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu
from wiola.fast.speed import interleaved, prompt_run


def median_s(fn: Callable[[], object], reps: int, warm: int = 5) -> float:
    """``fn``'s median seconds over ``reps`` calls after ``warm`` untimed ones (``speed.interleaved``)."""
    for _ in range(warm):
        fn()
    return interleaved({"fn": fn}, reps)["fn"]


def main() -> None:
    torch.manual_seed(0)
    ref = wiola.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()
    model = FastModel(ref.config).eval().requires_grad_(False)
    model.load_state_dict(ref.state_dict())

    def ids(T: int) -> torch.Tensor:
        return torch.randint(0, ref.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(512))

    for T in (16, 128, 512):
        print(f"prompt of {T} tokens: {median_s(prompt_run(model, ids(T)), 30) * 1e3:.2f} ms (median of 30)")

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            spent[label] += time.perf_counter() - start
            return out

        setattr(owner, name, wrapper)

    for name in ("decode_attention", "gate", "rms_norm", "silu_gate", "product"):
        timed(decode_step_cpu, name, f"C++ {name}" + (" (the head's one row)" if name == "product" else ""))
    timed(linear_ops, "_sequence_products", "products (GEMM)")
    run = prompt_run(model, ids(512))
    for _ in range(5):
        run()
    spent.clear()
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        run()
    total = (time.perf_counter() - start) / n
    print(f"\n512-token prompt, timers on: {total * 1e3:.2f} ms a prompt (mean of {n})")
    head = "C++ product (the head's one row)"
    spent["products (GEMM)"] -= spent[head]  # the head's product runs inside _sequence_products
    for label, seconds in spent.items():
        print(f"  {label}: {seconds / n * 1e3:.2f} ms")
    rest = total - sum(spent.values()) / n
    print(f"  the rest (Python, embedding, rotation tables, small ATen calls): {rest * 1e3:.2f} ms")

    print("\neach layer product alone, 512 rows (N, K):")
    x = {256: torch.randn(512, 256), 512: torch.randn(512, 512)}
    for N, K in ((768, 256), (256, 256), (1024, 256), (512, 256), (256, 512)):
        w = torch.randn(N, K)
        s = median_s(lambda w=w, K=K: F.linear(x[K], w), 50)
        print(f"  ({N}, {K}): {s * 1e3:.3f} ms, {2 * 512 * N * K / s / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
