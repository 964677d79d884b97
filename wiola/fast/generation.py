"""Generation for ``wiola.fast.WiolaModel`` on CUDA: the one-token step as a CUDA graph.

Per model and batch size, a ``GraphCache`` (the static cache plus the next slot as a device
tensor) and a captured graph of the whole step: every layer (the decode kernel reads the slot
from device memory, so one graph serves every position), the tied head for the last position,
sampling, the ``eos`` bookkeeping, and the copy of the new token into the next step's input.
The host only replays the graph, copies the token into the output (a device copy) and, for
sampling, refills a noise buffer from the caller's generator. The prefill runs eagerly on the
training kernels. The graphs live on the model (``model.cuda_graphs``, a ``GraphSteps``).

Sampling, the ``eos`` bookkeeping and the loop are those of ``wiola.generation``
(``next_tokens``, ``decode_loop``): temperature and top-p live in device tensors, top-k is a
shape, and the noise of the exponential race is drawn on the host side from the generator, so
that with the same generator the sampled tokens are the reference loop's. Whether every row has
hit ``eos_token_id`` is read on the host only every ``EOS_CHECK_EVERY`` steps; rows that
finished emit the pad token meanwhile, so the result is the same as the reference loop's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wiola.cache import Cache
from wiola.config import WiolaConfig
from wiola.fast import ops
from wiola.generation import (
    LOOP_KEYWORDS,
    GenerateArgs,
    SamplingOps,
    decode_loop,
    next_tokens,
    nucleus_drop,
)
from wiola.ops.rope import rope_tables

if TYPE_CHECKING:
    from wiola.model import WiolaModel  # a wiola.fast.WiolaModel (its kernels_enabled, cuda_graphs)

EOS_CHECK_EVERY = 16  # steps between host reads of "has every row finished?"


class GraphCache(Cache):
    """A ``Cache`` whose next slot is also kept on the device (``slot``, 0-d int64).

    With ``device_slot = True`` the fast model reads the slot from there (graph capture);
    otherwise it uses ``length`` as usual and keeps ``slot`` equal to it.
    """

    def __init__(self, config: WiolaConfig, batch_size: int, max_len: int, **kwargs) -> None:
        super().__init__(config, batch_size, max_len, **kwargs)
        self.slot = torch.zeros((), dtype=torch.int64, device=self.device)
        self.device_slot = False
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope_table(self, freqs: torch.Tensor) -> torch.Tensor:
        """``(2, max_len, D/2)`` float32: ``rope_tables``' cos and sin at every position a row of
        this cache can reach (its real tokens never outnumber its slots), built once per
        ``freqs`` tensor (the model's, on its device)."""
        if self._rope_table is None or self._rope_table[0] is not freqs:
            positions = torch.arange(self.max_len, device=self.device).unsqueeze(0)
            cos, sin = rope_tables(positions, freqs)  # (1, max_len, D/2) each
            self._rope_table = (freqs, torch.cat((cos, sin)))
        return self._rope_table[1]

    def reset(self) -> None:
        super().reset()
        self.slot.zero_()


@dataclass(frozen=True)
class _Mode:
    capture: bool  # False: the step runs eagerly in graph mode (tests on machines without CUDA)
    batch: int
    greedy: bool
    top_k: int | None
    top_p: bool  # a nucleus filter (its value lives in a device tensor, as the temperature's)
    eos: int | None
    pad: int | None


@dataclass
class _Captured:
    cache: GraphCache
    token: torch.Tensor  # (B,) int64: the step's output
    ids: torch.Tensor  # (B, 1) int64 view of ``token``: the next step's input
    finished: torch.Tensor  # (B,) bool
    noise: torch.Tensor | None  # (B, V) float32 Exp(1) draws, refilled before each replay
    temperature: torch.Tensor  # () float32
    top_p: torch.Tensor  # () float64: nucleus_drop compares in float64, with the Python float's value
    graph: torch.cuda.CUDAGraph | None = None
    derived: tuple = ()  # the model's derived tensors the graph reads: kept alive with it


class GraphSteps:
    """One model's captured decoding steps: a ``GraphCache`` per batch size and a step (with its
    CUDA graph) per mode. Not in the state dict; copies and pickles of the model start empty;
    everything is recaptured when the weights move, their dtype or autocast changes."""

    def __init__(self) -> None:
        self.stamp: tuple | None = None
        self.caches: dict[int, GraphCache] = {}
        self.steps: dict[_Mode, _Captured] = {}

    def clear(self) -> None:
        self.stamp, self.caches, self.steps = None, {}, {}

    def __deepcopy__(self, memo: dict) -> GraphSteps:
        return type(self)()

    def __reduce__(self) -> tuple:
        return (type(self), ())


def graphs_usable(model: WiolaModel, input_ids: torch.Tensor) -> bool:
    """CUDA graphs need CUDA tensors, the decode kernel (not the PyTorch path) and PyTorch's
    caching allocator (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, as under compute-sanitizer, makes
    every allocation a ``cudaMalloc``, which a capturing stream refuses): else the eager loop."""
    return (
        os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1"
        and isinstance(input_ids, torch.Tensor)
        and input_ids.is_cuda
        and model.kernels_enabled
        and "decode_attention" in ops.KERNELS
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


def _stamp(model: WiolaModel) -> tuple:
    """What a captured graph depends on: parameter storage, version and dtype, autocast, kernel
    switch. The version: a graph reads the derived weights (fused QKV, casts) built from the
    parameters' values at capture, so an in-place update (an optimizer step) recaptures; so does
    a training forward (``DerivedWeights.epoch``: writes through ``p.data`` move no version)."""
    # Inference tensors (a model made under inference_mode) have no version: nothing is derived
    # from them (DerivedWeights builds per call), so the graph reads them live.
    params = tuple((p.data_ptr(), 0 if p.is_inference() else p._version, p.dtype) for p in model.parameters())
    derived = model.derived_weights.epoch
    return (params, derived, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), model.kernels_enabled)


def _advance(step: _Captured, logits: torch.Tensor, mode: _Mode) -> torch.Tensor:
    token = next_tokens(
        logits, step.finished, mode.eos, mode.pad,
        temperature=0.0 if mode.greedy else step.temperature, top_k=mode.top_k,
        top_p=step.top_p if mode.top_p else None, noise=step.noise,
    )  # fmt: skip
    step.token.copy_(token)  # also the next step's input: ``ids`` is a view of ``token``
    return token


def _run_step(model: WiolaModel, step: _Captured, mode: _Mode) -> None:
    logits = model(step.ids, cache=step.cache, logits_to_keep=1).logits[:, -1]
    _advance(step, logits, mode)


def _capture(model: WiolaModel, step: _Captured, mode: _Mode) -> None:
    """Warm up (kernel compilation, autotuning) on a side stream, then capture one step."""
    cache = step.cache
    if step.noise is not None:
        step.noise.fill_(1.0)
    cache.device_slot = True
    try:
        side = torch.cuda.Stream(device=cache.device)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                _run_step(model, step, mode)
        torch.cuda.current_stream(cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _run_step(model, step, mode)
        step.graph = graph
        step.derived = model.derived_weights.values()
    finally:
        cache.device_slot = False
        cache.reset()
        step.finished.zero_()


def _get_step(model: WiolaModel, mode: _Mode) -> _Captured:
    store: GraphSteps = model.cuda_graphs
    stamp = _stamp(model)
    if store.stamp != stamp:
        store.clear()  # weights moved: recapture
        store.stamp = stamp
    step = store.steps.get(mode)
    if step is None:
        w = model.embed.weight
        cache = store.caches.get(mode.batch)
        if cache is None:
            cache = GraphCache(model.config, mode.batch, model.config.max_seq_len, device=w.device, dtype=w.dtype)
            store.caches[mode.batch] = cache
        B, V = mode.batch, model.config.vocab_size
        token = torch.zeros(B, dtype=torch.int64, device=w.device)
        step = _Captured(
            cache=cache,
            token=token,
            ids=token.unsqueeze(1),
            finished=torch.zeros(B, dtype=torch.bool, device=w.device),
            noise=None if mode.greedy else torch.ones(B, V, dtype=torch.float32, device=w.device),
            temperature=torch.ones((), dtype=torch.float32, device=w.device),
            top_p=torch.ones((), dtype=torch.float64, device=w.device),
        )
        if mode.capture:
            _capture(model, step, mode)
        store.steps[mode] = step
    return step


class _GraphRun:
    """``wiola.generation.Steps`` for one call: the prefill eagerly, then graph replays (or the
    same step run eagerly with the slot on the device, without ``capture``)."""

    def __init__(self, model: WiolaModel, step: _Captured, mode: _Mode, generator: torch.Generator | None) -> None:
        self.model, self.captured, self.mode, self.generator = model, step, mode, generator
        self.finished = step.finished

    def _fill_noise(self) -> None:
        if self.captured.noise is not None:
            self.captured.noise.exponential_(generator=self.generator)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids, attention_mask=attention_mask, cache=self.captured.cache, logits_to_keep=1)
        self._fill_noise()
        return _advance(self.captured, out.logits[:, -1], self.mode)

    def step(self) -> torch.Tensor:
        step = self.captured
        self._fill_noise()
        if step.graph is not None:
            step.graph.replay()
        else:
            step.cache.device_slot = True
            try:
                _run_step(self.model, step, self.mode)
            finally:
                step.cache.device_slot = False
        return step.token


def graph_generate(model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """``wiola.generation.generate`` with the one-token step replayed as a CUDA graph.

    Same arguments and result, ``(B, T + max_new_tokens)`` int64: greedy tokens are identical to
    the reference loop's, and so are sampled ones for the same generator state wherever the
    logits agree. ``generator`` must be a generator on the model's device when sampling.
    ``streamer`` receives each step's ``(B,)`` tokens as a device tensor.
    """
    return step_generate(model, input_ids, max_new_tokens, capture=True, **kwargs)


@torch.inference_mode()
def step_generate(
    model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, *, capture: bool = True, **kwargs: Any
) -> torch.Tensor:
    """The graph-mode generation loop: with ``capture`` (CUDA) each step is a graph replay;
    without, the very same step runs eagerly with the cache slot on the device (how tests
    check the step on a machine without CUDA). The keyword arguments of
    ``wiola.generation.GenerateArgs.check``; see ``graph_generate``."""
    args = GenerateArgs.check(model, input_ids, max_new_tokens, **kwargs)
    if max_new_tokens == 0:
        return decode_loop(None, args)
    sampling = args.sampling
    mode = _Mode(
        capture=capture,
        batch=input_ids.shape[0],
        greedy=sampling.greedy,
        top_k=sampling.top_k,
        top_p=sampling.top_p is not None,
        eos=args.eos_token_id,
        pad=args.pad_token_id,
    )
    step = _get_step(model, mode)
    step.temperature.fill_(1.0 if sampling.greedy else sampling.temperature)
    step.top_p.fill_(1.0 if sampling.top_p is None else sampling.top_p)
    step.cache.reset()
    step.finished.zero_()
    return decode_loop(_GraphRun(model, step, mode, args.generator), args, EOS_CHECK_EVERY)


NOISE_FLOATS = 1 << 22  # Exp(1) draws held at once by the CPU loop (16 MiB): steps per C++ call when sampling


def cpu_noise(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The ``(B, V)`` fp32 Exp(1) noise ``sample_next`` draws for ``(B, V)`` CPU ``logits`` from
    ``generator`` (``torch.empty_like(logits.float()).exponential_(generator=generator)``), drawn by
    ``decode_step_cpu.exponential_rows``: the same values, the generator left in the same state."""
    from wiola.fast.decode_step_cpu import exponential_rows

    B, V = logits.shape
    return exponential_rows([generator], B * V).view(B, V)


def cpu_nucleus(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``wiola.generation.nucleus_drop`` decided in C++ (``decode_step_cpu.nucleus_rows``: a proven
    bound on the reference's float64 sums, the reference itself asked where it does not decide): the
    same mask. Where the C++ does not apply (no library, a tensor ``top_p``), ``nucleus_drop``."""
    from wiola.fast.decode_step_cpu import nucleus_rows

    usable = logits.device.type == "cpu" and not isinstance(top_p, torch.Tensor) and top_p < 1.0
    decided = nucleus_rows(logits, top_p) if usable else None
    return nucleus_drop(logits, top_p) if decided is None else decided[0]


CPU_SAMPLING = SamplingOps(draw_noise=cpu_noise, nucleus=cpu_nucleus)  # the reference sampler's values, in C++


def cpu_loop_usable(model: WiolaModel, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """``generate`` runs its whole loop in C++ (``cpu_generate``) for CPU ids of a fast model whose
    one-token steps take the C++ step. The arguments are not read here: ``cpu_generate`` checks them
    first (the reference's named errors)."""
    return (
        set(kwargs) <= LOOP_KEYWORDS  # what cpu_generate takes; other arguments keep the reference loop
        and isinstance(input_ids, torch.Tensor)
        and input_ids.device.type == "cpu"
        and model.kernels_enabled
        and not torch.compiler.is_compiling()
    )


@torch.inference_mode()
def cpu_generate(model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor | None:
    """``wiola.generation.generate`` with the decoding loop in C++: the prefill on the PyTorch
    path as there, then one call of the C++ loop (``DecodeStepCPU.generate_loop``) for every step,
    sampling (the top-p nucleus included: ``nucleus_rows``' C++, which calls back into the
    reference only where its bound does not decide), the eos bookkeeping and the stop included.
    Greedy: one call per request. Sampling: each step's Exp(1) noise is drawn here from
    ``generator`` exactly as ``sample_next`` draws it, ``NOISE_FLOATS`` at a time (one call per
    chunk of steps; the generator is left where the reference loop leaves it, also when every row
    stops early). With a ``streamer``, one call per step, the streamer called after each. Same
    arguments and result as ``generate``, identical tokens; returns None (before touching anything)
    where the C++ step does not apply.
    """
    from wiola.fast.decode_step_cpu import exponential_rows

    args = GenerateArgs.check(model, input_ids, max_new_tokens, **kwargs)
    sampling, eos_token_id, pad, streamer = args.sampling, args.eos_token_id, args.pad_token_id, args.streamer
    if max_new_tokens == 0:
        return None
    B, T = input_ids.shape
    cache = model.new_cache(B, T + max_new_tokens)
    step = ops.cpu_decode_step(model, input_ids[:, -1:], cache)
    if step is None:
        return None
    first = model(input_ids, attention_mask=args.attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    first = first.contiguous()
    N, V = max_new_tokens, model.config.vocab_size
    new = torch.empty(B, N, dtype=torch.int64)
    finished = torch.zeros(B, dtype=torch.uint8)
    chunk = 1 if streamer is not None else N if sampling.greedy else max(1, NOISE_FLOATS // (B * V))
    gen = args.generator if args.generator is not None else torch.default_generator
    i = 0
    while i < N:
        i1 = min(N, i + chunk)
        log_noise, state = None, None
        if not sampling.greedy:
            state = gen.get_state()
            log_noise = exponential_rows([gen], (i1 - i) * B * V).view(i1 - i, B, V)  # one stream: the steps in turn
            for j in range(i1 - i):  # as sample_next: one (B, V) draw per step, its log taken on that shape
                torch.log(log_noise[j].clamp_min_(1e-30), out=log_noise[j])
        stopped = step.generate_loop(
            T, (i, i1), new, first, finished, sampling.temperature, sampling.top_k, sampling.top_p, log_noise,
            eos_token_id, pad,
        )  # fmt: skip
        if streamer is not None:
            for j in range(i, stopped):
                streamer(new[:, j].clone())
        if stopped < i1:  # every row finished: pad the rest; the generator as if only `stopped - i` draws
            new[:, stopped:] = pad
            if state is not None:
                gen.set_state(state)
                exponential_rows([gen], (stopped - i) * B * V)
            break
        i = i1
    return torch.cat([input_ids.to(torch.int64), new], dim=1)
