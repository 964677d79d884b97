"""The host's own cost of one fast-model forward (13m, bf16, batch 1) with every Triton kernel's
body skipped: the Python of the modules, the custom ops' dispatch and the ATen calls, which on a
GPU are what the host spends before the GPU has work (an eager prefill, an eager step). Runs on
the CPU under TRITON_INTERPRET=1 with ``InterpretedFunction.run`` replaced by a no-op; the ATen
ops still compute on the CPU (the tied head's 32,000 x 256 product is most of it at T 1).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python host_forward.py T
"""

import cProfile
import pstats
import sys
import time
from unittest import mock

import torch
import triton.runtime.interpreter as interpreter

import wiola.model
from wiola.config import WiolaConfig
from wiola.fast import WiolaModel
from wiola.fast.generation import _get_step, _Mode

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.manual_seed(0)
model = WiolaModel(WiolaConfig.preset("13m")).to(torch.bfloat16).eval()
mode = _Mode(capture=False, batch=1, greedy=True, top_k=None, top_p=False, eos=None, pad=None)
ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(0))
model._sync_checks = lambda t: False  # as on CUDA: no token-id range reads
with torch.inference_mode(), mock.patch.object(wiola.model, "uses_decode_layout", lambda x: False):
    step = _get_step(model, mode)

    def forward():
        step.cache.reset()
        model(ids, cache=step.cache, logits_to_keep=1)

    forward()  # kernels built (interpreted) once
    with mock.patch.object(interpreter.InterpretedFunction, "run", lambda self, *a, **k: None):
        for _ in range(3):
            forward()
        n = 50
        start = time.perf_counter()
        for _ in range(n):
            forward()
        print(f"T {T}: {(time.perf_counter() - start) / n * 1e3:.2f} ms a forward, kernel bodies skipped")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            forward()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
