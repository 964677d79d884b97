"""A static decoding cache: preallocated K/V buffers and the gate's running state."""

from __future__ import annotations

import operator

import torch

from wiola.config import WiolaConfig


def _integer(value: object) -> int | None:
    """``value`` as a Python int (an int, or a numpy/torch integer scalar), None for anything else
    (a bool included)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class Cache:
    """Preallocated decoding state for ``batch_size`` rows and up to ``max_len`` token slots.

    Buffers (``L`` layers, ``B`` rows, ``S = max_len`` slots, ``H`` heads, ``D`` head width):

    - ``k``, ``v``: ``(L, B, H, S, D)``, keys stored after rotation.
    - ``key_mask``: ``(B, S)`` bool, True where the slot holds a real (non-padding) token.
    - ``gate_sum``: ``(L, B, D)`` float32 (float64 in a float64 cache, the precision the gate sums
      in), running sum of the head-mean queries of real tokens.
    - ``gate_count``: ``(L, B)`` int64, number of real tokens summed.
    - ``n_real``: ``(B,)`` int64, real tokens seen per row (the next token's position).
    - ``length``: slots filled so far (the same for every row; padding occupies slots too).

    Nothing is reallocated while decoding: every call writes the next slots in place.
    """

    def __init__(
        self,
        config: WiolaConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        B, S = _integer(batch_size), _integer(max_len)  # numpy/torch integers: the ints they hold
        if B is None or B <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if S is None or not 0 < S <= config.max_seq_len:
            raise ValueError(f"cache max_len must be an int in [1, max_seq_len={config.max_seq_len}], got {max_len!r}")
        batch_size, max_len = B, S
        L, H, D = config.n_layers, config.n_heads, config.head_dim
        self.batch_size, self.max_len = batch_size, max_len
        self.k = torch.zeros(L, batch_size, H, max_len, D, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.key_mask = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)
        sum_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.gate_sum = torch.zeros(L, batch_size, D, device=device, dtype=sum_dtype)
        self.gate_count = torch.zeros(L, batch_size, device=device, dtype=torch.int64)
        self.n_real = torch.zeros(batch_size, device=device, dtype=torch.int64)
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def reset(self) -> None:
        """Forget every token (buffers are kept)."""
        for t in (self.k, self.v, self.key_mask, self.gate_sum, self.gate_count, self.n_real):
            t.zero_()
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (e.g. for beam search), in place."""
        for name in ("k", "v", "gate_sum", "gate_count"):
            buf = getattr(self, name)
            buf.copy_(buf.index_select(1, index))
        for name in ("key_mask", "n_real"):
            buf = getattr(self, name)
            buf.copy_(buf.index_select(0, index))
