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
  fp32, bf16, int8 or int4 weights): one static cache of ``max_rows`` rows, each row with its own
  slot. A joining row's prompt is prefilled by the model alone (batch 1, as ``generate`` does)
  and copied into its cache row; ``step`` is one call of the C++ step for every live row, each at
  its own slot (``DecodeStepCPU.rows``).
- **PyTorch** (everything else: the reference ``wiola.WiolaModel``, CUDA, no compiler,
  ``use_kernels(False)``): each row keeps a batch-1 cache and ``step`` runs the model's
  one-token forward per row, as ``generate`` does, in one Python call for the batch.

A ``Rows`` made on the C++ backend moves its live rows to the PyTorch one (each row's cache
copied out, nothing lost) as soon as the C++ step stops applying to the model: LoRA adapters
attached, its kernels turned off, a weight the step cannot read, the model moved to another
dtype. From then on the rows compute on the model as it is (a weight changed between steps is
read from the next step on, on either backend).

A row's first token comes from its prefill (``join``) and is returned by the next ``step``; a
row is freed as soon as it emits ``eos_token_id`` (``finish_reason`` ``"stop"``) or its
``max_new_tokens``-th token (``"length"``). A handle (``join``'s answer, ``RowToken.row``)
names one request and is never reused, so a late ``leave`` of a finished row is refused
rather than freeing another. A ``step`` or ``join`` that raises leaves every row as it was
(no token lost, no generator moved). A ``Rows`` is not thread-safe: one caller steps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from wiola.cache import Cache
from wiola.fast.generation import CPU_SAMPLING
from wiola.generation import SEED_RANGE, Sampling, SamplingOps, as_int, resolve_sampling, sample_next, token_id


@dataclass
class RowRequest:
    """One generation request. ``prompt`` token ids (non-empty, within the vocabulary);
    ``prompt + max_new_tokens <= max_len``; sampling as ``wiola.generation.generate`` takes it:
    ``temperature`` None (the default) is greedy unless ``top_k``/``top_p`` is given (then 1.0),
    0 is greedy (``top_k``/``top_p`` then ignored); ``seed`` seeds the row's ``torch.Generator``
    on the model's device (None: torch's default generator); ``logprobs``: how many of the best
    log-probabilities to return with each token (0: none)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float | None = None
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

    row: int  # the row's handle (``join``'s answer)
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Row:
    request: RowRequest
    sampling: Sampling
    generator: torch.Generator | None
    handle: int
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
        isa: the C++ step's instruction-set variant (default ``$WIOLA_CPU_ISA`` or the best); a
            prompt's products run through the model's forward, on ``$WIOLA_CPU_ISA``'s variant.

    Raises ``ValueError`` for ``max_rows < 1``, ``max_len`` outside ``[1, max_seq_len]`` or an
    ``isa`` that is unknown or that this CPU lacks (also where the C++ step does not apply).
    """

    def __init__(self, model: Any, max_rows: int, max_len: int | None = None, *, isa: str | None = None) -> None:
        config = model.config
        max_rows = as_int("max_rows", max_rows, ValueError)
        if max_rows < 1:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        max_len = config.max_seq_len if max_len is None else as_int("max_len", max_len, ValueError)
        if not 1 <= max_len <= config.max_seq_len:
            raise ValueError(f"max_len must be an int in [1, max_seq_len={config.max_seq_len}], got {max_len!r}")
        if isa is not None:
            from wiola.fast.decode_step_cpu import select_isa

            select_isa(isa)
        self.model, self.max_rows, self.max_len, self.isa = model, max_rows, max_len, isa
        self._rows: list[_Row | None] = [None] * max_rows
        self._index: dict[int, int] = {}  # handle -> row index, for the live rows
        self._next_handle = 0
        self.cache: Cache | None = None
        self._noise: torch.Tensor | None = None  # the C++ sampler's Exp(1) draws and their logs, (2, max_rows, V)
        # The last step's rows (handles, in order), their Samplers and which of them sample: a
        # row's settings are fixed for its life and a handle is never reused, so while the same
        # rows go on the next step reuses them, and the C++ overwrites every output it reads.
        self._settings: tuple[tuple[int, ...], Any, list[int]] | None = None
        self._step = self._bind_cpp()
        self.backend = "C++" if self._step is not None else "PyTorch"

    @torch.inference_mode()
    def _bind_cpp(self) -> Any:
        """The C++ step bound to a fresh ``max_rows`` cache, or None where it does not apply."""
        from wiola.fast import ops

        if not hasattr(self.model, "kernels_enabled"):
            return None  # the reference model: no C++ step
        cache = self.model.new_cache(self.max_rows, self.max_len)
        if cache.device.type != "cpu" or ops.kernels_usable(cache.k) or not ops.cpu_step_applies(self.model, cache):
            return None
        from wiola.fast import decode_step_cpu

        if decode_step_cpu.load(self.isa) is None:  # the variant asked for, not $WIOLA_CPU_ISA's
            return None
        try:
            step = decode_step_cpu.DecodeStepCPU(self.model, cache, isa=self.isa)
        except decode_step_cpu.UnsupportedWeights:
            return None
        self.cache = cache
        return step

    # ------------------------------------------------------------------ the public API
    @property
    def live(self) -> list[int]:
        """The handles of the live rows, ascending (the order they joined in)."""
        return sorted(self._index)

    @property
    def free(self) -> int:
        """How many more rows may join now."""
        return self.max_rows - len(self._index)

    def join(self, request: RowRequest) -> int:
        """Prefill ``request``'s prompt into a free row and return its handle, an int that no
        other request of this ``Rows`` gets. Its first token is sampled here and returned by the
        next ``step``.

        Raises ``ValueError`` naming the problem: an empty prompt, an id that is not an int
        (numpy and torch integer scalars are taken) or is outside the vocabulary (the prompt's or
        ``eos_token_id``), ``max_new_tokens < 1``, prompt + new tokens past ``max_len``, sampling
        settings that are not numbers or mean nothing, a bad ``seed``/``logprobs``, or ``full``
        when every row is live (nothing is allocated before the checks)."""
        sampling, request = self._check(request)
        index = next((i for i, row in enumerate(self._rows) if row is None), None)
        if index is None:
            raise ValueError(f"full: all {self.max_rows} rows are live; wait for one to finish or leave")
        self._keep_backend()
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=_device(self.model)).manual_seed(request.seed)
        row = _Row(request, sampling, generator, self._next_handle, slot=len(request.prompt), cache=None)
        logits = self._prefill(row, index)
        row.pending = self._sample(row, logits)
        self._rows[index], self._index[row.handle] = row, index
        self._next_handle += 1
        return row.handle

    def leave(self, row: int) -> None:
        """Free ``row`` (a handle from ``join``) at once (a client that went away); its tokens not
        yet returned are dropped. ``row`` is an int (or a numpy/torch integer scalar). Raises
        ``ValueError`` when it is not a live row's handle (one that finished or left included; a
        bool or another type too)."""
        handle = as_int("row (a handle from join)", row, ValueError)
        if handle not in self._index:
            raise ValueError(f"row {handle} is not live (live rows: {self.live})")
        self._rows[self._index.pop(handle)] = None

    def step(self) -> list[RowToken]:
        """One new token for every live row, ascending by handle; rows that finish are freed. The
        model advances every row that goes on (one C++ call for all of them) before anything is
        returned or freed: a step that raises leaves every row as it was."""
        ending: list[tuple[RowToken, str | None]] = []
        going: list[int] = []
        for handle in self.live:
            row = self._rows[self._index[handle]]
            eos, token = row.request.eos_token_id, row.pending
            reason = None
            if eos is not None and token.token == eos:
                reason = "stop"
            elif row.produced + 1 == row.request.max_new_tokens:
                reason = "length"
            ending.append((token, reason))
            if reason is None:
                going.append(self._index[handle])
        if going:
            self._advance(going)
        for token, reason in ending:
            token.finish_reason = reason
            self._rows[self._index[token.row]].produced += 1
            if reason is not None:
                self._rows[self._index.pop(token.row)] = None
        return [token for token, _ in ending]

    # ------------------------------------------------------------------ internals
    def _check(self, request: RowRequest) -> tuple[Sampling, RowRequest]:
        """The request's sampling settings and a copy of it whose ids and counts are Python ints
        (every id checked: ``wiola.generation.token_id``; its ``TypeError``, and those of
        ``resolve_sampling``, raised as ``ValueError``, this method's one error type for a bad
        request)."""
        if not isinstance(request, RowRequest):
            raise TypeError(f"join takes a RowRequest, got {type(request).__name__}")
        V = self.model.config.vocab_size
        prompt = request.prompt
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        try:
            prompt = [token_id("prompt token id", t, V) for t in prompt]
            eos = None if request.eos_token_id is None else token_id("eos_token_id", request.eos_token_id, V)
            sampling = resolve_sampling(request.temperature, request.top_k, request.top_p, V)
        except TypeError as e:
            raise ValueError(str(e)) from None
        n = as_int("max_new_tokens", request.max_new_tokens, ValueError)
        if n < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
        if len(prompt) + n > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + {n} new tokens = {len(prompt) + n} is past max_len={self.max_len}"
            )
        seed = request.seed
        if seed is not None:
            seed = as_int("seed", seed, ValueError)
            if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**64) or None, got {seed!r}")
        k = as_int("logprobs", request.logprobs, ValueError)
        if not 0 <= k <= V:
            raise ValueError(f"logprobs must be an int in [0, vocab_size={V}], got {k!r}")
        request = dataclasses.replace(request, prompt=prompt, eos_token_id=eos, max_new_tokens=n, seed=seed, logprobs=k)
        return sampling, request

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
            _copy_row(cache, 0, self.cache, index, T)
        return logits

    @torch.inference_mode()
    def _keep_backend(self) -> None:
        """On the C++ backend: bind the step again after a weight was replaced or moved, or move
        every live row to the PyTorch backend where the step no longer applies (see the module).
        Leaves the rows as they were where it raises (a stale quantized model, a foreign cache). On
        the PyTorch backend: a row's cache follows the model to another dtype or device."""
        if self._step is None:
            w = _weight(self.model)
            for row in self._rows:
                if row is not None and (row.cache.dtype, row.cache.device) != (w.dtype, w.device):
                    row.cache = _moved(row.cache, self.model)
            return
        from wiola.fast import ops
        from wiola.fast.decode_step_cpu import DecodeStepCPU, UnsupportedWeights

        if ops.cpu_step_applies(self.model, self.cache):
            if self._step.is_current():
                return
            try:
                self._step = DecodeStepCPU(self.model, self.cache, isa=self.isa)
                return
            except UnsupportedWeights:
                pass
        for row in self._rows:
            if row is not None:
                row.cache = self.model.new_cache(1, len(row.request.prompt) + row.request.max_new_tokens)
                _copy_row(self.cache, self._index[row.handle], row.cache, 0, row.slot)
                row.cache.length = row.slot
        self._step, self.cache, self.backend = None, None, "PyTorch"

    @torch.inference_mode()
    def _advance(self, going: list[int]) -> None:
        """Feed each going row's pending token and sample its next one (the new pending). Where
        it raises, every row, cache and generator is as it was."""
        self._keep_backend()
        rows = [self._rows[i] for i in going]
        states = _generator_states(rows, _device(self.model))
        try:
            if self._step is None:
                pending = self._advance_pytorch(rows)
            else:
                pending = self._advance_cpp(rows)
        except BaseException:
            for generator, state in states:
                generator.set_state(state)
            raise
        for row, token in zip(rows, pending, strict=True):
            row.pending = token
            row.slot += 1

    def _advance_pytorch(self, rows: list[_Row]) -> list[RowToken]:
        """Each row's one-token forward on its own cache; a row's cache is put back where a
        later row raises."""
        pending: list[RowToken] = []
        saved: list[tuple[Cache, dict[str, Any]]] = []
        try:
            for row in rows:
                saved.append((row.cache, _cache_position(row.cache)))
                ids = torch.tensor([[row.pending.token]], dtype=torch.int64, device=row.cache.device)
                logits = self.model(ids, cache=row.cache, logits_to_keep=1).logits[:, -1]
                pending.append(self._sample(row, logits))
        except BaseException:
            for cache, position in saved:
                _restore_position(cache, position)
            raise
        return pending

    def _advance_cpp(self, rows: list[_Row]) -> list[RowToken]:
        """One C++ call for every row: it checks its arguments before it writes the cache."""
        samplers = self._samplers(rows)
        index = torch.tensor([self._index[row.handle] for row in rows], dtype=torch.int64)
        tokens = torch.tensor([row.pending.token for row in rows], dtype=torch.int64)
        slots = torch.tensor([row.slot for row in rows], dtype=torch.int64)
        self._step.step_rows(index, tokens, slots, samplers)
        pending: list[RowToken] = []
        chosen, logprobs = samplers.token.tolist(), samplers.logprob.tolist()
        for n, row in enumerate(rows):
            top: list[tuple[int, float]] = []
            if k := row.request.logprobs:
                top = list(zip(samplers.top_ids[n, :k].tolist(), samplers.top_values[n, :k].tolist(), strict=True))
            pending.append(RowToken(row.handle, chosen[n], logprobs[n], top))
        return pending

    def _samplers(self, rows: list[_Row]) -> Any:
        """The C++ sampler's settings for ``rows``, each sampled row's noise drawn from its own
        generator and its log taken exactly as ``wiola.generation.sample_next`` does."""
        from wiola.fast.decode_step_cpu import MODE, Samplers, exponential_rows

        V = self.model.config.vocab_size
        if self._noise is None:  # kept: fresh megabytes each step would fault their pages in again
            self._noise = torch.empty(2, self.max_rows, V)
        draws, log_noise = self._noise[0, : len(rows)], self._noise[1, : len(rows)]
        handles = tuple(row.handle for row in rows)
        if self._settings is not None and self._settings[0] == handles:
            samplers, sampled = self._settings[1], self._settings[2]
        else:
            modes, temperatures, top_ks, top_ps, ks = [], [], [], [], []  # made into tensors at once
            for row in rows:
                s = row.sampling
                modes.append(MODE["greedy" if s.greedy else "sample"])
                temperatures.append(1.0 if s.greedy else s.temperature)
                top_ks.append(0 if s.greedy else s.top_k or 0)
                top_ps.append(1.0 if s.greedy or s.top_p is None else s.top_p)
                ks.append(row.request.logprobs)
            samplers = Samplers(len(rows), V, max(ks), (modes, temperatures, top_ks, top_ps, ks), log_noise=log_noise)
            sampled = [n for n, mode in enumerate(modes) if mode == MODE["sample"]]
            self._settings = (handles, samplers, sampled)
        if sampled:  # greedy steps skip the draw's checks and library lookup
            exponential_rows([rows[n].generator for n in sampled], V, out=draws[: len(sampled)], isa=self.isa)
        for i, n in enumerate(sampled):  # the log on a (1, V) row, as sample_next takes it
            torch.log(draws[i : i + 1].clamp_min_(1e-30), out=log_noise[n : n + 1])
        return samplers

    def _sample(self, row: _Row, logits: torch.Tensor) -> RowToken:
        """The row's next token from ``(1, V)`` logits, drawn as ``wiola.generation`` draws it;
        the ``logprobs`` best as the C++ sampler orders them (ties: the lower id first)."""
        s, ops = row.sampling, CPU_SAMPLING if logits.device.type == "cpu" else SamplingOps()
        noise = ops.noise(logits, s, row.generator)
        token = sample_next(logits, s.temperature, s.top_k, s.top_p, row.generator, noise=noise, nucleus=ops.nucleus)
        token = int(token[0])
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        top: list[tuple[int, float]] = []
        if row.request.logprobs:
            order = torch.sort(logits[0].float(), descending=True, stable=True).indices[: row.request.logprobs]
            top = list(zip(order.tolist(), logp[order].tolist(), strict=True))
        return RowToken(row.handle, token, float(logp[token]), top)


def _weight(model: Any) -> torch.Tensor:
    return model.embed.weight


def _device(model: Any) -> torch.device:
    return _weight(model).device


def _moved(cache: Cache, model: Any) -> Cache:
    """A batch-1 ``cache`` copied into a new one in ``model``'s dtype and on its device."""
    new = model.new_cache(1, cache.max_len)
    _copy_row(cache, 0, new, 0, cache.length)
    new.length = cache.length
    return new


def _copy_row(src: Cache, i: int, dst: Cache, j: int, n: int) -> None:
    """Row ``i`` of ``src`` into row ``j`` of ``dst``: its first ``n`` slots and its gate state
    (``dst``'s slots past ``n`` left out of its key mask)."""
    dst.k[:, j, :, :n] = src.k[:, i, :, :n]
    dst.v[:, j, :, :n] = src.v[:, i, :, :n]
    dst.key_mask[j] = False
    dst.key_mask[j, :n] = src.key_mask[i, :n]
    dst.gate_sum[:, j] = src.gate_sum[:, i]
    dst.gate_count[:, j] = src.gate_count[:, i]
    dst.n_real[j] = src.n_real[i]


def _cache_position(cache: Cache) -> dict[str, Any]:
    """What a one-token forward changes in a batch-1 cache besides its next slot's K/V."""
    return {"length": cache.length, "gate_sum": cache.gate_sum.clone(), "gate_count": cache.gate_count.clone(),
            "n_real": cache.n_real.clone(), "key_mask": cache.key_mask.clone()}  # fmt: skip


def _restore_position(cache: Cache, position: dict[str, Any]) -> None:
    cache.length = position["length"]
    for name in ("gate_sum", "gate_count", "n_real", "key_mask"):
        getattr(cache, name).copy_(position[name])


def _generator_states(rows: list[_Row], device: torch.device) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The state of every generator ``rows`` draw from (a row without a seed: torch's default
    generator of the model's device, and the CPU's, which the C++ backend's noise comes from)."""
    generators: dict[int, torch.Generator] = {}
    for row in rows:
        if row.generator is not None:
            generators[id(row.generator)] = row.generator
        elif not row.sampling.greedy:
            defaults = [torch.default_generator]
            if device.type == "cuda":
                defaults.append(torch.cuda.default_generators[device.index or torch.cuda.current_device()])
            generators.update((id(g), g) for g in defaults)
    return [(g, g.get_state()) for g in generators.values()]
