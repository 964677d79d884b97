"""Sampled decoding from one generator on the 13m preset (random weights, bf16, C++ step): one
``generate`` of 128 tokens after a 16-token prompt (the median of 5 after one untimed), and
``Rows.step`` with rows that take no seed (torch's default generator: one stream; the median of
200 steps after 5), at batch 1 and 8; one line a setting, with a digest of the tokens. Run it
from two checkouts in turn to compare them:

    PYTHONPATH=<checkout> python stream_ab.py LABEL
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time

import torch

import wiola
from wiola.fast import WiolaModel
from wiola.fast.quantize import quantize
from wiola.fast.rows import RowRequest, Rows

SETTINGS = {"temperature 0.8": {"temperature": 0.8}, "top-p 0.95": {"temperature": 0.8, "top_p": 0.95}}


def main(label: str) -> None:
    torch.manual_seed(0)
    model = quantize(WiolaModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False), "bf16")
    for batch in (1, 8):
        ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(1))
        for name, kw in SETTINGS.items():
            times, digest = [], hashlib.sha256()
            for n in range(6):
                gen = torch.Generator().manual_seed(n)
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=128, generator=gen, **kw)
                if n:
                    times.append(time.perf_counter() - start)
                digest.update(out.numpy().tobytes())
            s = statistics.median(times)
            print(
                f"{label}: generate, batch {batch}, {name}: {128 * batch / s:,.0f} tok/s, tokens {digest.hexdigest()[:16]}"
            )
        rows = Rows(model, max_rows=8)
        torch.manual_seed(3)
        for i in range(batch):
            rows.join(RowRequest(prompt=[5, 6, 7, 8 + i], max_new_tokens=210, temperature=0.8))
        times, digest = [], hashlib.sha256()
        for n in range(205):
            start = time.perf_counter()
            tokens = rows.step()
            if n >= 5:
                times.append(time.perf_counter() - start)
            digest.update(str([(t.row, t.token) for t in tokens]).encode())
        ms = statistics.median(times) * 1e3
        print(
            f"{label}: Rows.step, batch {batch}, temperature 0.8, no seed: {ms:.3f} ms ({batch / ms * 1e3:,.0f} tok/s), "
            f"tokens {digest.hexdigest()[:16]}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])
