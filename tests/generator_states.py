"""torch CPU generators in chosen states, for the tests of the C++ Exp(1) noise
(``tests/test_exponential.py``, ``tests/test_decode_step_arm.py``): a state whose next draws are
chosen values of u (the MT19937's tempering inverted), and the values of u that are hard cases."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import torch

from wiola.fast.decode_step_cpu import STATE_BYTES


def untemper(y: int) -> int:
    """The MT19937 word whose tempered output is ``y``."""
    y ^= y >> 18
    y ^= (y << 15) & 0xEFC60000
    x = y
    for _ in range(5):
        x = y ^ ((x << 7) & 0x9D2C5680)
    y = x & 0xFFFFFFFF
    x = y
    for _ in range(3):
        x = y ^ (x >> 11)
    return x & 0xFFFFFFFF


def crafted(units: list[int], seed: int) -> torch.Generator:
    """A CPU generator whose next draws are u = units[i]·2^-53 (units < 2^53): two outputs each, set as
    the state's next words (the discarded top 11 bits random), before any refill."""
    rng = random.Random(seed)
    state = bytearray(torch.Generator().manual_seed(seed).get_state().numpy().tobytes())
    outputs = []
    for m in units:
        outputs += [(rng.getrandbits(11) << 21) | (m >> 32), m & 0xFFFFFFFF]
    assert len(outputs) < 624 and len(state) == STATE_BYTES
    for i, y in enumerate(outputs):
        struct.pack_into("<Q", state, 24 + 8 * i, untemper(y))
    struct.pack_into("<i", state, 8, len(outputs) + 1)  # left: len(outputs) outputs before a refill
    struct.pack_into("<Q", state, 16, 0)  # next
    g = torch.Generator()
    g.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return g


def hard_units(count: int, seed: int) -> list[int]:
    """u = 0, the two smallest, the largest, then u whose -log1p(-u) lies within a few ulp of the
    midpoint between two floats (u the 2^-53 multiple nearest 1 - e^-mid, mid in [2^-20, 30])."""
    rng = random.Random(seed)
    units = [0, 1, 2, 2**53 - 1]
    while len(units) < count:
        f = np.float32(math.exp(rng.uniform(math.log(2**-20), math.log(30))))
        mid = (float(f) + float(np.nextafter(f, np.float32(np.inf)))) / 2
        m = round(-math.expm1(-mid) * 2**53)
        if 0 < m < 2**53:
            units.append(m)
    return units
