"""Batches of ``T + 1``-token windows over a split of the token cache.

Window ``k`` of a split is ``tokens[k·T : k·T + T + 1]`` (consecutive windows share one token, so
every token of the windows is a target exactly once per epoch). ``BatchStream`` draws the full
windows in a seeded per-epoch permutation (or in order), ``G = micro_batch × grad_accum ×
world_size`` per optimizer step, and gives rank ``r`` the micro-batches ``(a·world + r)`` of that
list: the ranks see disjoint windows and the union over ranks does not depend on how the global
batch is split; the last ``(n − 1) mod T`` targets, too few for a window, are not trained on. Its
position is one integer, saved in checkpoints. ``eval_batches`` gives the evaluation windows in
order: the full windows, then those last targets as one shorter window (the model takes any
length up to ``max_seq_len``), so an evaluation of all windows scores every target once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from wiola.train.token_cache import TokenSplit


def num_windows(n_tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1``-token windows at stride ``seq_len`` fit in ``n_tokens`` tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def check_split(split: TokenSplit, seq_len: int, name: str) -> None:
    """Raise ``ValueError`` unless ``split`` holds at least one window of ``seq_len + 1`` tokens."""
    if len(split) < seq_len + 1:
        raise ValueError(
            f"the {name} split holds {len(split)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}; "
            "use more data or a shorter --seq-len"
        )


def check_targets(split: TokenSplit, name: str) -> None:
    """Raise ``ValueError`` unless ``split`` holds a target to score (two tokens): what an evaluation
    needs, since ``eval_batches`` scores the targets past the last full window as one shorter window."""
    if len(split) < 2:
        raise ValueError(
            f"the {name} split holds {len(split)} token{'s' if len(split) != 1 else ''}, no target to score "
            "(a target needs a token before it); use more data"
        )


class BatchStream:
    """The training windows of one rank, ``micro_batch × grad_accum`` per optimizer step.

    Args:
        split: the training ``TokenSplit``.
        seq_len: ``T``; windows hold ``T + 1`` tokens.
        micro_batch: windows per forward pass on one rank.
        grad_accum: micro-batches per optimizer step.
        rank, world_size: this process and the number of data-parallel processes.
        shuffle: seeded random order (a fresh permutation of the windows every epoch) or in order.
        seed: seed of the permutations.

    ``next_step()`` returns ``grad_accum`` int64 tensors of shape ``(micro_batch, T + 1)``.
    ``state_dict()`` / ``load_state_dict()`` save and restore the exact position.
    """

    def __init__(
        self,
        split: TokenSplit,
        seq_len: int,
        micro_batch: int,
        grad_accum: int = 1,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch", micro_batch),
            ("grad_accum", grad_accum),
            ("world_size", world_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        check_split(split, seq_len, "training")
        self.split, self.seq_len = split, seq_len
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.n_windows = num_windows(len(split), seq_len)
        self.consumed = 0  # windows taken by all ranks together since the start of training
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def _window(self, index: int) -> int:
        """The window number of the ``index``-th window drawn since the start."""
        epoch, j = divmod(index, self.n_windows)
        if not self.shuffle:
            return j
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return int(self._perm[1][j])

    def next_step(self) -> list[torch.Tensor]:
        T, B = self.seq_len, self.micro_batch
        batches = []
        for a in range(self.grad_accum):
            first = self.consumed + (a * self.world_size + self.rank) * B
            rows = [self.split.read(self._window(first + i) * T, T + 1) for i in range(B)]
            batches.append(torch.from_numpy(np.stack(rows)))
        self.consumed += self.global_batch
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows_consumed": self.consumed,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "n_windows": self.n_windows,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises ``ValueError`` when the windows would differ."""
        for key in ("seq_len", "shuffle", "seed", "n_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"saved data position has {key}={state[key]!r} but this run has {getattr(self, key)!r}: "
                    "the run would not continue on the same data"
                )
        self.consumed = int(state["windows_consumed"])


def eval_windows(split: TokenSplit, seq_len: int, max_windows: int | None = None) -> int:
    """How many validation windows an evaluation reads: the full windows and, where targets are left
    after them, one shorter window of those (all of them, or at most the first ``max_windows``)."""
    n = -(-max(0, len(split) - 1) // seq_len)  # ⌈targets / T⌉
    return n if max_windows is None else min(n, max_windows)


def eval_batches(
    split: TokenSplit,
    seq_len: int,
    batch_size: int,
    *,
    max_windows: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """The validation windows in order, ``(≤ batch_size, T + 1)`` int64; a last window shorter than
    ``T + 1`` tokens (``eval_windows``) comes alone, ``(1, ≤ T)``. Rank ``r`` takes windows
    ``r, r + world, …`` so the ranks together read each window once."""
    check_targets(split, "validation")
    n = eval_windows(split, seq_len, max_windows)
    mine = list(range(rank, n, world_size))
    full = [k for k in mine if k * seq_len + seq_len + 1 <= len(split)]
    for i in range(0, len(full), batch_size):
        rows = [split.read(k * seq_len, seq_len + 1) for k in full[i : i + batch_size]]
        yield torch.from_numpy(np.stack(rows))
    if len(full) < len(mine):  # the split's last window, shorter
        start = mine[-1] * seq_len
        yield torch.from_numpy(split.read(start, len(split) - start))[None]
