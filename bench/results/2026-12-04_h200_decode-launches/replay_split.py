"""Where a CUDA-graph decoding step's time goes (13m preset, bf16, batch 1 and 8, after a
512-token prompt): the generate call's time a token, against the captured step replayed
back to back with no host loop between replays (CUDA events), and the kernels' own time a step
(torch.profiler, CUDA activity). One JSON line per batch size.

    PYTHONPATH=TREE python replay_split.py
"""

import json

import torch
from torch.profiler import ProfilerActivity, profile

import wiola
from wiola.fast import WiolaModel

cfg = wiola.WiolaConfig.preset("13m")
torch.manual_seed(0)
model = WiolaModel(cfg).to("cuda", torch.bfloat16).eval()
N = 256
# generate makes the cache's tensors under inference_mode: resetting them needs it too.
inference = torch.inference_mode()  # held: the guard ends when the object is collected
inference.__enter__()
for batch in (1, 8):
    ids = torch.randint(
        0, cfg.vocab_size, (batch, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    for _ in range(2):
        model.generate(ids, N, temperature=0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    model.generate(ids, N, temperature=0)
    b.record()
    torch.cuda.synchronize()
    per_token_generate = a.elapsed_time(b) / 1e3 / N
    step = next(s for m, s in model.cuda_graphs.steps.items() if m.batch == batch)
    graph = step.graph
    # Replays past the cache's last slot would read and write outside it (generate never does):
    # each run of replays starts from an empty cache (its buffers stay where the graph has them).
    step.cache.reset()
    for _ in range(3):
        graph.replay()
    step.cache.reset()
    torch.cuda.synchronize()
    a.record()
    for _ in range(N):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    per_replay = a.elapsed_time(b) / 1e3 / N
    step.cache.reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / 20  # µs -> s, per step
    top = {}
    for e in kernels:
        top[e.name[:60]] = top.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 20
    top = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    print(
        json.dumps(
            {
                "batch": batch,
                "generate_s_per_token": per_token_generate,
                "replay_s_per_step": per_replay,
                "kernel_busy_s_per_step": busy,
                "kernels_per_step": len(kernels) / 20,
                "top_kernels_us_per_step": [(n, round(t, 2)) for n, t in top],
            }
        ),
        flush=True,
    )
