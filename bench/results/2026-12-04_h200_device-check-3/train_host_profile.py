"""Where the host's time goes in ``wiola.fast``'s eager training step (13m, bf16 autocast, fused
AdamW: ``bench/test_train_step.make_step``, the headline benchmark's step), at B 32 and 64, T 512.

Per batch size, after 3 warm-up steps: the wall time of a step with a sync after it (median of
5), the host's time to return from one step issued after a sync (median of 5) beside that step's
GPU time (CUDA events), and a ``torch.profiler`` table (CPU and CUDA) of 2 steps sorted by the
host's own time, with the count of calls that wait for the device. One JSON line per batch size
on stdout; the tables to ``$OUT/train_host_profile_B{B}.txt``.

    PYTHONPATH=TREE python train_host_profile.py
"""

import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import wiola
from bench.test_train_step import make_step
from wiola.fast import WiolaModel

out_dir = os.environ.get("OUT", "/tmp")
cfg = wiola.WiolaConfig.preset("13m")
for B in (32, 64):
    torch.manual_seed(0)
    model = WiolaModel(cfg).to("cuda").train()
    step = make_step(model, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (B, 512), device="cuda")
    for _ in range(3):
        step(ids)
    torch.cuda.synchronize()
    walls, hosts, gpus = [], [], []
    for _ in range(5):
        t = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t = time.perf_counter()
        step(ids)
        hosts.append(time.perf_counter() - t)
        b.record()
        torch.cuda.synchronize()
        gpus.append(a.elapsed_time(b) / 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(ids)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    with open(f"{out_dir}/train_host_profile_B{B}.txt", "w") as f:
        f.write(table)
    waits = {}
    for e in prof.key_averages():
        if any(
            s in e.key for s in ("Synchronize", "cudaMemcpy", "item", "_local_scalar_dense", "cudaMalloc", "cudaFree")
        ):
            waits[e.key] = {"count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
    print(
        json.dumps(
            {
                "B": B,
                "wall_s_synced": statistics.median(walls),
                "host_issue_s": statistics.median(hosts),
                "gpu_s": statistics.median(gpus),
                "waits_in_2_steps": waits,
            }
        ),
        flush=True,
    )
    del model, step
    torch.cuda.empty_cache()
