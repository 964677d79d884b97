"""Generation for ``wiola.fast.WiolaModel`` on CUDA: the one-token step as a CUDA graph.

Per model and batch size, a ``GraphCache`` (the static cache plus the next slot as a device
tensor) and a captured graph of the whole step: every layer (the decode kernel reads the slot
from device memory, so one graph serves every position), the tied head for the last position,
sampling, the ``eos`` bookkeeping, and the copy of the new token into the next step's input.
The host only replays the graph, copies the token into the output (a device copy) and, for
sampling, refills a noise buffer from the caller's generator. The prefill runs eagerly on the
training kernels.

Sampling needs no host sync: temperature and top-p live in device tensors, top-k is a shape;
the token is the winner of an exponential race, ``argmax(log p_i − log E_i)`` with
``E_i ~ Exp(1)`` (Gumbel-max), which draws from the filtered softmax exactly. Greedy
(``temperature == 0``) is ``argmax``, identical to the reference. Whether every row has hit
``eos_token_id`` is read on the host only every ``EOS_CHECK_EVERY`` steps; rows that finished
emit the pad token meanwhile, so the result is the same as the reference loop's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from wiola.cache import Cache
from wiola.config import WiolaConfig
from wiola.fast import ops
from wiola.generation import check_generate_inputs, check_sampling

if TYPE_CHECKING:
    from wiola.fast import WiolaModel

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

    def reset(self) -> None:
        super().reset()
        self.slot.zero_()


@dataclass(frozen=True)
class _Mode:
    capture: bool  # False: the step runs eagerly in graph mode (tests on machines without CUDA)
    batch: int
    greedy: bool
    top_k: int | None
    top_p: bool
    eos: int | None
    pad: int | None


@dataclass
class _Step:
    cache: GraphCache
    ids: torch.Tensor  # (B, 1) int64: the step's input, written by the step itself
    token: torch.Tensor  # (B,) int64: the step's output
    finished: torch.Tensor  # (B,) bool
    noise: torch.Tensor | None  # (B, V) float32 Exp(1) draws, refilled before each replay
    temperature: torch.Tensor  # () float32
    top_p: torch.Tensor  # () float32
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class _State:
    stamp: tuple
    caches: dict[int, GraphCache]
    steps: dict[_Mode, _Step]


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphs_usable(model: WiolaModel, input_ids: torch.Tensor) -> bool:
    """CUDA graphs need CUDA tensors and the decode kernel (not the PyTorch path)."""
    return (
        input_ids.is_cuda
        and ops._enabled
        and "decode_attention" in ops.KERNELS
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


def _stamp(model: WiolaModel) -> tuple:
    """What a captured graph depends on: parameter storage and dtype, autocast, kernel switch."""
    params = tuple((p.data_ptr(), p.dtype) for p in model.parameters())
    return (params, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), ops._enabled)


def sample_tokens(
    logits: torch.Tensor,
    mode: _Mode,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor | None,
) -> torch.Tensor:
    """``(B,)`` next tokens from ``(B, V)`` logits on the device, no host sync."""
    if mode.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if mode.top_k is not None:
        kth = torch.topk(logits, mode.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if mode.top_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p.
    return (logits - torch.log(noise.clamp_min(1e-30))).argmax(dim=-1)


def _advance(step: _Step, logits: torch.Tensor, mode: _Mode) -> torch.Tensor:
    token = sample_tokens(logits, mode, step.temperature, step.top_p, step.noise)
    if mode.eos is not None:
        token = token.masked_fill(step.finished, mode.pad)
        step.finished |= token == mode.eos
    step.token.copy_(token)
    step.ids.copy_(token.unsqueeze(1))
    return token


def _run_step(model: WiolaModel, step: _Step, mode: _Mode) -> None:
    logits = model(step.ids, cache=step.cache, logits_to_keep=1).logits[:, -1]
    _advance(step, logits, mode)


def _capture(model: WiolaModel, step: _Step, mode: _Mode) -> None:
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
    finally:
        cache.device_slot = False
        cache.reset()
        step.finished.zero_()


def _get_step(model: WiolaModel, mode: _Mode) -> _Step:
    state = _STATES.get(model)
    stamp = _stamp(model)
    if state is None or state.stamp != stamp:
        state = _STATES[model] = _State(stamp, {}, {})  # weights moved: recapture
    step = state.steps.get(mode)
    if step is None:
        device = model.embed.weight.device
        cache = state.caches.get(mode.batch)
        if cache is None:
            w = model.embed.weight
            cache = GraphCache(model.config, mode.batch, model.config.max_seq_len, device=device, dtype=w.dtype)
            state.caches[mode.batch] = cache
        B, V = mode.batch, model.config.vocab_size
        step = _Step(
            cache=cache,
            ids=torch.zeros(B, 1, dtype=torch.int64, device=device),
            token=torch.zeros(B, dtype=torch.int64, device=device),
            finished=torch.zeros(B, dtype=torch.bool, device=device),
            noise=None if mode.greedy else torch.ones(B, V, dtype=torch.float32, device=device),
            temperature=torch.ones((), dtype=torch.float32, device=device),
            top_p=torch.ones((), dtype=torch.float32, device=device),
        )
        if mode.capture:
            _capture(model, step, mode)
        state.steps[mode] = step
    return step


def graph_generate(model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """``wiola.generation.generate`` with the one-token step replayed as a CUDA graph.

    Same arguments and result, ``(B, T + max_new_tokens)`` int64. Greedy tokens are identical
    to the reference loop's; sampled tokens follow the same distribution but use the generator
    differently (one ``Exp(1)`` draw per vocabulary entry and step), so they are not the same
    draws. ``generator`` must be a generator on the model's device when sampling. ``streamer``
    receives each step's ``(B,)`` tokens as a device tensor.
    """
    return step_generate(model, input_ids, max_new_tokens, capture=True, **kwargs)


@torch.inference_mode()
def step_generate(
    model: WiolaModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    streamer: Callable[[torch.Tensor], None] | None = None,
    capture: bool = True,
) -> torch.Tensor:
    """The graph-mode generation loop: with ``capture`` (CUDA) each step is a graph replay;
    without, the very same step runs eagerly with the cache slot on the device (how tests
    check the step on a machine without CUDA). See ``graph_generate``."""
    check_sampling(temperature, top_k, top_p)
    model._check_inputs(input_ids, attention_mask, None)
    check_generate_inputs(model, input_ids, max_new_tokens, attention_mask)
    B, T = input_ids.shape
    V = model.config.vocab_size
    out = torch.empty(B, T + max_new_tokens, dtype=torch.int64, device=input_ids.device)
    out[:, :T] = input_ids
    if max_new_tokens == 0:
        return out
    greedy = temperature == 0
    mode = _Mode(
        capture=capture,
        batch=B,
        greedy=greedy,
        top_k=None if greedy or top_k is None or top_k >= V else top_k,
        top_p=not greedy and top_p is not None and top_p < 1.0,
        eos=eos_token_id,
        pad=None if eos_token_id is None else (eos_token_id if pad_token_id is None else pad_token_id),
    )
    step = _get_step(model, mode)
    step.temperature.fill_(temperature if not greedy else 1.0)
    step.top_p.fill_(top_p if mode.top_p else 1.0)
    cache = step.cache
    cache.reset()
    step.finished.zero_()

    def fill_noise() -> None:
        if step.noise is not None:
            step.noise.exponential_(generator=generator)

    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    fill_noise()
    token = _advance(step, logits, mode)
    out[:, T] = token
    if streamer is not None:
        streamer(token.clone())
    done = 1
    while done < max_new_tokens:
        if mode.eos is not None and done % EOS_CHECK_EVERY == 0 and bool(step.finished.all()):
            out[:, T + done :] = mode.pad
            break
        fill_noise()
        if step.graph is not None:
            step.graph.replay()
        else:
            step.cache.device_slot = True
            try:
                _run_step(model, step, mode)
            finally:
                step.cache.device_slot = False
        out[:, T + done].copy_(step.token)
        if streamer is not None:
            streamer(step.token.clone())
        done += 1
    cache.length = T + done - 1  # host bookkeeping: slots filled (the last token is not fed back)
    return out
