"""Greedy ``generate`` of a 13m-preset fast model (random weights) with rank-8 LoRA adapters on all
seven projections, unmerged (the PyTorch path): tok/s at batch 1 and 8, 64 new tokens after a
100-token prompt, the median of 5 calls after one untimed. Run from a checkout's root; ab.sh runs
it alternately on two checkouts."""

import time

import peft
import torch

import wiola
import wiola.fast

torch.manual_seed(0)
base = wiola.fast.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "bypass_proj"]
lora = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
lora.eval()
gen = torch.Generator().manual_seed(1)
for B in (1, 8):
    ids = torch.randint(0, 32000, (B, 100), generator=gen)
    with torch.inference_mode():
        lora.generate(ids, 4, temperature=0)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            lora.generate(ids, 64, temperature=0)
            times.append(time.perf_counter() - start)
    print(f"B{B}: {B * 64 / sorted(times)[2]:.0f} tok/s", flush=True)
