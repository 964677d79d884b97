"""Continuous batching over one static cache: rows that join and leave between steps.

    rows = Rows(model, max_rows=8)
    r = rows.join(RowRequest(prompt=[1, 2, 3], max_new_tokens=32, temperature=0.8, seed=7))
    while rows.live:
        for t in rows.step():          # one new token for every live row
            ...                        # t.row, t.token, t.logprob, t.top, t.finish_reason

Each row decodes exactly as ``model.generate(torch.tensor([prompt]), max_new_tokens,
temperature=..., top_k=..., top_p=..., eos_token_id=..., generator=torch.Generator().manual_seed(seed))``
would, token for token (bitwise), whatever rows join and leave beside it and whichever row it
lands on: its prompt is prefilled exactly as ``generate`` prefills it, its sampler draws from its
own generator in ``generate``'s order, and every step computes each row from its own
activations and cache row only (batch invariance, docs/SPEC.md).

Two backends, chosen when the ``Rows`` is made:

- **C++** (``wiola.fast.WiolaModel`` on a plain CPU with its kernels on and the C++ step built;
  fp32, bf16 or int8 weights): one static cache of ``max_rows`` rows, each row with its own
  slot. A joining row's prompt is prefilled by the model alone (batch 1, as ``generate`` does)
  and copied into its cache row; ``step`` is one call of the C++ step for every live row, each at
  its own slot (``DecodeStepCPU.rows``).
- **PyTorch** (everything else: the reference ``wiola.WiolaModel``, CUDA, no compiler,
  ``use_kernels(False)``): each row keeps a batch-1 cache and ``step`` runs the model's
  one-token forward per row, as ``generate`` does, in one Python call for the batch.

A row's first token comes from its prefill (``join``) and is returned by the next ``step``; a
row is freed as soon as it emits ``eos_token_id`` (``finish_reason`` ``"stop"``) or its
``max_new_tokens``-th token (``"length"``). A ``Rows`` is not thread-safe: one caller steps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from wiola.cache import Cache
from wiola.generation import Sampling, as_int, resolve_sampling, sample_next, token_id


@dataclass
class RowRequest:
    """One generation request. ``prompt`` token ids (non-empty, within the vocabulary);
    ``prompt + max_new_tokens <= max_len``; ``temperature`` 0 is greedy (``top_k``/``top_p``
    then ignored), as ``wiola.generation.generate``; ``seed`` seeds the row's
    ``torch.Generator`` (None: torch's default generator); ``logprobs``: how many of the best
    log-probabilities to return with each token (0: none)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    logprobs: int = 0


@dataclass
class RowToken:
    """One token of one row: ``logprob`` is its log-softmax under the unfiltered logits, ``top``
    the ``logprobs`` best ``(id, logprob)`` pairs, best first; ``finish_reason`` None, ``"stop"``
    (the token is the eos) or ``"length"`` (the last of ``max_new_tokens``)."""

    row: int
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Row:
    request: RowRequest
    sampling: Sampling
    generator: torch.Generator | None
    slot: int  # the cache slot of the next token fed (the C++ backend); the prompt fills [0, slot)
    cache: Cache | None  # the row's own batch-1 cache (the PyTorch backend)
    pending: RowToken | None = None  # sampled, returned by the next step
    produced: int = 0


class Rows:
    """Rows of one model that join and leave between steps (see the module).

    Args:
        model: a ``wiola.WiolaModel`` or ``wiola.fast.WiolaModel`` (any weight type).
        max_rows: how many rows may be live at once (the static cache's rows).
        max_len: the longest prompt + new tokens a row may take (default ``max_seq_len``).
        isa: the C++ step's instruction-set variant (default ``$WIOLA_CPU_ISA`` or the best).

    Raises ``ValueError`` for ``max_rows < 1`` or ``max_len`` outside ``[1, max_seq_len]``.
    """

    def __init__(self, model: Any, max_rows: int, max_len: int | None = None, *, isa: str | None = None) -> None:
        config = model.config
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        max_len = config.max_seq_len if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= config.max_seq_len:
            raise ValueError(f"max_len must be an int in [1, max_seq_len={config.max_seq_len}], got {max_len!r}")
        self.model, self.max_rows, self.max_len, self.isa = model, max_rows, max_len, isa
        self._rows: list[_Row | None] = [None] * max_rows
        self.cache: Cache | None = None
        self._step = self._bind_cpp()
        self.backend = "C++" if self._step is not None else "PyTorch"

    @torch.inference_mode()
    def _bind_cpp(self) -> Any:
        """The C++ step bound to a fresh ``max_rows`` cache, or None where it does not apply."""
        from wiola.fast import ops

        if not hasattr(self.model, "kernels_enabled"):
            return None  # the reference model: no C++ step
        cache = self.model.new_cache(self.max_rows, self.max_len)
        probe = torch.zeros(1, 1, dtype=torch.int64, device=cache.device)
        if ops.cpu_decode_step(self.model, probe, cache) is None:
            return None
        from wiola.fast.decode_step_cpu import DecodeStepCPU

        self.cache = cache
        return DecodeStepCPU(self.model, cache, isa=self.isa)

    # ------------------------------------------------------------------ the public API
    @property
    def live(self) -> list[int]:
        """The handles of the live rows, ascending."""
        return [i for i, row in enumerate(self._rows) if row is not None]

    @property
    def free(self) -> int:
        """How many more rows may join now."""
        return sum(row is None for row in self._rows)

    def join(self, request: RowRequest) -> int:
        """Prefill ``request``'s prompt into a free row and return its handle (the row index).
        Its first token is sampled here and returned by the next ``step``.

        Raises ``ValueError`` naming the problem: an empty prompt, an id that is not an int
        (numpy and torch integer scalars are taken) or is outside the vocabulary (the prompt's or
        ``eos_token_id``), ``max_new_tokens < 1``, prompt + new tokens past ``max_len``, sampling
        settings that mean nothing, a bad ``seed``/``logprobs``, or ``full``
        when every row is live (nothing is allocated before the checks)."""
        sampling, request = self._check(request)
        row_index = next((i for i, row in enumerate(self._rows) if row is None), None)
        if row_index is None:
            raise ValueError(f"full: all {self.max_rows} rows are live; wait for one to finish or leave")
        generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
        T = len(request.prompt)
        row = _Row(request, sampling, generator, slot=T, cache=None)
        logits = self._prefill(row, row_index)
        row.pending = self._sample(row, row_index, logits)
        self._rows[row_index] = row
        return row_index

    def leave(self, row: int) -> None:
        """Free ``row`` at once (a client that went away); its tokens not yet returned are dropped.
        ``row`` is an int (or a numpy/torch integer scalar). Raises ``ValueError`` when it is not a
        live row's handle (a bool or another type included)."""
        index = as_int("row (a handle from join)", row, ValueError)
        if not (0 <= index < self.max_rows and self._rows[index] is not None):
            raise ValueError(f"row {index} is not live (live rows: {self.live})")
        self._rows[index] = None

    def step(self) -> list[RowToken]:
        """One new token for every live row, ascending by row; rows that finish are freed. Then
        the model advances every row that goes on (one C++ call for all of them)."""
        out: list[RowToken] = []
        going: list[int] = []
        for i in self.live:
            row = self._rows[i]
            token = row.pending
            row.produced += 1
            eos = row.request.eos_token_id
            if eos is not None and token.token == eos:
                token.finish_reason = "stop"
            elif row.produced == row.request.max_new_tokens:
                token.finish_reason = "length"
            out.append(token)
            if token.finish_reason is None:
                going.append(i)
            else:
                self._rows[i] = None
        if going:
            self._advance(going)
        return out

    # ------------------------------------------------------------------ internals
    def _check(self, request: RowRequest) -> tuple[Sampling, RowRequest]:
        """The request's sampling settings and a copy of it whose ids are Python ints (every id
        checked: ``wiola.generation.token_id``, its ``TypeError`` raised as ``ValueError``, this
        method's one error type for a bad request)."""
        if not isinstance(request, RowRequest):
            raise TypeError(f"join takes a RowRequest, got {type(request).__name__}")
        V = self.model.config.vocab_size
        prompt = request.prompt
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        try:
            prompt = [token_id("prompt token id", t, V) for t in prompt]
            eos = None if request.eos_token_id is None else token_id("eos_token_id", request.eos_token_id, V)
        except TypeError as e:
            raise ValueError(str(e)) from None
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
        if len(prompt) + n > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + {n} new tokens = {len(prompt) + n} is past max_len={self.max_len}"
            )
        if request.seed is not None and (isinstance(request.seed, bool) or not isinstance(request.seed, int)):
            raise ValueError(f"seed must be an int or None, got {request.seed!r}")
        k = request.logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= V:
            raise ValueError(f"logprobs must be an int in [0, vocab_size={V}], got {k!r}")
        sampling = resolve_sampling(request.temperature, request.top_k, request.top_p, V)
        return sampling, dataclasses.replace(request, prompt=prompt, eos_token_id=eos)

    @torch.inference_mode()
    def _prefill(self, row: _Row, index: int) -> torch.Tensor:
        """The prompt through the model alone, on a batch-1 cache sized as ``generate`` sizes it;
        ``(1, V)`` logits of its last position. The C++ backend copies that cache into its row."""
        request = row.request
        T = len(request.prompt)
        cache = self.model.new_cache(1, T + request.max_new_tokens)
        ids = torch.tensor([request.prompt], dtype=torch.int64, device=cache.device)
        logits = self.model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
        if self.cache is None:
            row.cache = cache
        else:
            big = self.cache
            big.k[:, index, :, :T] = cache.k[:, 0, :, :T]
            big.v[:, index, :, :T] = cache.v[:, 0, :, :T]
            big.key_mask[index] = False
            big.key_mask[index, :T] = cache.key_mask[0, :T]
            big.gate_sum[:, index] = cache.gate_sum[:, 0]
            big.gate_count[:, index] = cache.gate_count[:, 0]
            big.n_real[index] = cache.n_real[0]
        return logits

    @torch.inference_mode()
    def _advance(self, going: list[int]) -> None:
        """Feed each going row's pending token and sample its next one (the new pending)."""
        rows = [self._rows[i] for i in going]
        if self._step is None:
            for i, row in zip(going, rows, strict=True):
                ids = torch.tensor([[row.pending.token]], dtype=torch.int64, device=row.cache.device)
                logits = self.model(ids, cache=row.cache, logits_to_keep=1).logits[:, -1]
                row.pending = self._sample(row, i, logits)
            return
        if not self._step.is_current():  # a weight was replaced or moved: bind again
            from wiola.fast.decode_step_cpu import DecodeStepCPU

            self._step = DecodeStepCPU(self.model, self.cache, isa=self.isa)
        samplers = self._samplers(rows)
        index = torch.tensor(going, dtype=torch.int64)
        tokens = torch.tensor([row.pending.token for row in rows], dtype=torch.int64)
        slots = torch.tensor([row.slot for row in rows], dtype=torch.int64)
        logits = self._step.step_rows(index, tokens, slots, samplers)
        for n, (i, row) in enumerate(zip(going, rows, strict=True)):
            row.slot += 1
            if row.sampling.top_p is not None:  # the nucleus: wiola.generation's own sampler
                row.pending = self._sample(row, i, logits[n : n + 1])
                continue
            token, k = int(samplers.token[n]), row.request.logprobs
            ids, values = samplers.top_ids[n, :k].tolist(), samplers.top_values[n, :k].tolist()
            row.pending = RowToken(i, token, float(samplers.logprob[n]), list(zip(ids, values, strict=True)))

    def _samplers(self, rows: list[_Row]) -> Any:
        """The C++ sampler's settings for ``rows``, each sampled row's noise drawn from its own
        generator and its log taken exactly as ``wiola.generation.sample_next`` does."""
        from wiola.fast.decode_step_cpu import MODE, Samplers

        V = self.model.config.vocab_size
        samplers = Samplers(len(rows), V, max(row.request.logprobs for row in rows))
        for n, row in enumerate(rows):
            s = row.sampling
            samplers.n_logprobs[n] = row.request.logprobs
            if s.greedy:
                samplers.mode[n] = MODE["greedy"]
            elif s.top_p is not None:
                samplers.mode[n] = MODE["caller"]
            else:
                samplers.mode[n] = MODE["sample"]
                samplers.temperature[n] = s.temperature
                samplers.top_k[n] = s.top_k or 0
                noise = torch.empty(1, V).exponential_(generator=row.generator)
                samplers.log_noise[n] = torch.log(noise.clamp_min(1e-30))[0]
        return samplers

    def _sample(self, row: _Row, index: int, logits: torch.Tensor) -> RowToken:
        """The row's next token from ``(1, V)`` logits, drawn as ``wiola.generation`` draws it."""
        s = row.sampling
        token = int(sample_next(logits, s.temperature, s.top_k, s.top_p, row.generator)[0])
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        top: list[tuple[int, float]] = []
        if row.request.logprobs:
            values, ids = torch.topk(logp, row.request.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return RowToken(index, token, float(logp[token]), top)
