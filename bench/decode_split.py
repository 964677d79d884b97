"""Where a CUDA-graph ``generate`` call's time goes, one JSON line per batch size.

    python -m bench.decode_split                     # 13m, bf16, 512-token prompt, 256 greedy tokens, batch 1 and 8
    python -m bench.decode_split --batch 1 --prompt 128 --new 64
    python -m bench.decode_split --out split.jsonl   # the records to a file, nothing else in it

For each batch size, after two warm-up calls (compilation, autotuning, capture):

- ``generate_s``: one whole greedy ``generate`` call (CUDA events), and ``generate_host_s`` the
  host's time to return from it (a call that never waits for the GPU returns before it is done);
- ``prefill_s``: the prompt's forward alone on a fresh cache, eager as ``generate`` runs it
  (median of 5), and ``prefill_host_s`` the host's time to issue it: where it is as long as
  ``prefill_s``, the GPU waited for Python;
- ``replay_s_per_step``: the captured one-token step replayed back to back (CUDA events);
- ``kernel_busy_s_per_step``, ``kernels_per_step``, ``top_kernels_us_per_step``: the kernels' own
  time in 20 replays (``torch.profiler``, CUDA activity);
- ``generate_kernel_busy_s``, ``generate_kernels``: the kernels' own time in one whole call.

``generate_s − generate_kernel_busy_s`` is the time the GPU had nothing to run: gaps between
launches, or waiting for the host. ``generate_kernel_busy_s − prefill_s`` is the decoding
steps' kernels plus what the loop launches outside the graph (the copy of each step's token into
the output). Without CUDA it exits with code 2 and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable

import torch


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="13m", help="model preset (random weights), default 13m")
    p.add_argument("--batch", type=_positive, nargs="+", default=[1, 8], help="batch sizes, default 1 8")
    p.add_argument("--prompt", type=_positive, default=512, help="prompt tokens, default 512")
    p.add_argument("--new", type=_positive, default=256, help="greedy tokens generated, default 256")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--out",
        help="write the JSON lines to this file (default: stdout, where Triton's autotuning messages "
        "also go when TRITON_PRINT_AUTOTUNING is set)",
    )
    return p.parse_args(argv)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """``fn``'s GPU time (CUDA events) and the host's time to return from it (before syncing)."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3, host


def _kernels(fn: Callable[[], object]) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def split(model: torch.nn.Module, batch: int, prompt: int, new: int) -> dict:
    """The measurements above for one batch size (the model on CUDA, in eval mode)."""
    cfg = model.config
    gen = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda", generator=gen)
    for _ in range(2):
        model.generate(ids, new, temperature=0)
    torch.cuda.synchronize()
    generate_s, generate_host_s = _timed(lambda: model.generate(ids, new, temperature=0))
    cache = model.new_cache(batch, prompt + new)

    def prefill() -> None:
        cache.reset()
        model(ids, cache=cache, logits_to_keep=1)

    prefill()
    prefill_s, prefill_host_s = sorted(_timed(prefill) for _ in range(5))[2]
    in_call = _kernels(lambda: model.generate(ids, new, temperature=0))

    step = next(s for m, s in model.cuda_graphs.steps.items() if m.batch == batch)
    # Replays past the cache's last slot would read and write outside it (generate never does):
    # each run of replays starts from an empty cache and stays within its slots.
    replays = min(new, cfg.max_seq_len - 1)
    step.cache.reset()
    for _ in range(3):
        step.graph.replay()
    step.cache.reset()
    torch.cuda.synchronize()

    def replay() -> None:
        for _ in range(replays):
            step.graph.replay()

    replay_s = _timed(replay)[0] / replays
    step.cache.reset()
    profiled = min(20, replays)
    kernels = _kernels(lambda: [step.graph.replay() for _ in range(profiled)])
    step.cache.reset()
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name[:60]] = top.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / profiled
    return {
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "generate_s": generate_s,
        "generate_host_s": generate_host_s,
        "prefill_s": prefill_s,
        "prefill_host_s": prefill_host_s,
        "generate_kernel_busy_s": sum(e.time_range.elapsed_us() for e in in_call) / 1e6,
        "generate_kernels": len(in_call),
        "replay_s_per_step": replay_s,
        "kernel_busy_s_per_step": sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / profiled,
        "kernels_per_step": len(kernels) / profiled,
        "top_kernels_us_per_step": [(n, round(t, 2)) for n, t in sorted(top.items(), key=lambda kv: -kv[1])[:12]],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import wiola

    try:
        cfg = wiola.WiolaConfig.preset(args.preset)
    except (KeyError, ValueError) as exc:
        print(f"bench.decode_split: {exc}", file=sys.stderr)
        return 2
    if args.prompt + args.new > cfg.max_seq_len:
        print(
            f"bench.decode_split: --prompt {args.prompt} + --new {args.new} exceeds the {args.preset} preset's "
            f"{cfg.max_seq_len} positions",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("bench.decode_split: no CUDA device here; it times CUDA-graph decoding on a GPU", file=sys.stderr)
        return 2
    from wiola.fast import WiolaModel

    torch.manual_seed(0)
    model = WiolaModel(cfg).to("cuda", getattr(torch, args.dtype)).eval()
    out = open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout)
    # generate makes the cache's tensors under inference mode; resetting them needs it too
    with out as stream, torch.inference_mode():
        for batch in args.batch:
            record = {"preset": args.preset, "dtype": args.dtype, **split(model, batch, args.prompt, args.new)}
            print(json.dumps(record), file=stream, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
