"""``Rows.step`` on the 13m preset (random weights, bf16, C++ backend), the median of 200 steps
after 5 untimed, for batch 1 and 8, greedy and at temperature 0.8; one line a setting. Run it from
two checkouts in turn (``PYTHONPATH=<checkout> python rows_ab.py LABEL``) to compare them; the
tokens' digest shows that both drew the same.

    PYTHONPATH=/tmp/before python rows_ab.py before
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


def main(label: str) -> None:
    torch.manual_seed(0)
    model = quantize(WiolaModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False), "bf16")
    for batch in (1, 8):
        for temperature in (0.0, 0.8):
            rows = Rows(model, max_rows=8)
            for i in range(batch):
                rows.join(RowRequest(prompt=[5, 6, 7, 8 + i], max_new_tokens=210, temperature=temperature, seed=i))
            digest = hashlib.sha256()
            times = []
            for n in range(205):
                start = time.perf_counter()
                tokens = rows.step()
                if n >= 5:
                    times.append(time.perf_counter() - start)
                digest.update(str([(t.row, t.token) for t in tokens]).encode())
            ms = statistics.median(times) * 1e3
            print(
                f"{label}: batch {batch}, temperature {temperature}: Rows.step {ms:.3f} ms "
                f"({batch / ms * 1e3:,.0f} tok/s), tokens {digest.hexdigest()[:16]}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1])
