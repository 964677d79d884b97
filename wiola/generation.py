"""Autoregressive generation with the static cache: prefill once, then one token per step.

Greedy unless sampling is asked for: ``generate(model, ids, n)`` takes the argmax at every step
(reproducible, and the same tokens from ``wiola.WiolaModel`` and ``wiola.fast.WiolaModel``);
passing ``temperature > 0``, ``top_k`` or ``top_p`` samples. A sample is the winner of an
exponential race, ``argmax(log p_i − log E_i)`` with ``E_i ~ Exp(1)`` (Gumbel-max), which draws
from the filtered softmax exactly and needs no host sync, so the CUDA-graph loop of
``wiola.fast.generation`` runs the very same sampler (and the same bookkeeping and loop below).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from wiola.cache import Cache
from wiola.config import WiolaConfig


class Decoder(Protocol):
    """What generation needs of a model (``wiola.WiolaModel`` and ``wiola.fast.WiolaModel``)."""

    config: WiolaConfig

    def check_inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None
    ) -> None: ...

    def new_cache(self, batch_size: int, max_len: int | None = None) -> Cache: ...

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Sampling:
    """Resolved sampling settings: ``temperature == 0`` is greedy (then no filters)."""

    temperature: float
    top_k: int | None = None  # None: no top-k filter (also for top_k >= vocab size)
    top_p: float | None = None  # None: no nucleus filter (also for top_p == 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def resolve_sampling(temperature: float | None, top_k: int | None, top_p: float | None, vocab_size: int) -> Sampling:
    """Check the sampling arguments (``TypeError`` for a value that is not a number,
    ``ValueError`` for settings that mean nothing, each naming the argument) and resolve them:
    without ``temperature``, greedy unless ``top_k`` or ``top_p`` is given (then 1.0). Integer
    settings take numpy/torch integer scalars; real ones any real number but a bool."""
    if temperature is not None:
        temperature = _real("temperature", temperature)
        # Past float32's largest value the logits (fp32) divided by it are all 0: a uniform
        # draw past any top-k or top-p filter, as for inf.
        if not 0 <= temperature <= FLOAT32_MAX:
            raise ValueError(
                f"temperature must be >= 0 and finite in float32 (at most {FLOAT32_MAX:.4g}; 0 is greedy) or None, "
                f"got {temperature!r}"
            )
    if top_k is not None:
        try:
            k = as_int("top_k", top_k)
        except TypeError:
            k = 0
        if k < 1:
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        top_k = k
    if top_p is not None:
        top_p = _real("top_p", top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if temperature is None:
        temperature = 0.0 if top_k is None and top_p is None else 1.0
    if temperature == 0:
        return Sampling(0.0)
    return Sampling(
        temperature,
        None if top_k is None or top_k >= vocab_size else top_k,
        None if top_p is None or top_p >= 1.0 else top_p,
    )


FLOAT32_MAX = torch.finfo(torch.float32).max


def _real(name: str, value: Any) -> float:
    """``value`` as a Python float: a real number (numpy and 0-d torch floats included), not a
    bool, not a string; ``TypeError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and (value.numel() != 1 or value.dtype == torch.bool)
    ):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def nucleus_drop(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``(B, V)`` bool: the tokens outside the top-p nucleus of ``(B, V)`` logits. Sorted in
    descending order, a token is dropped when the tokens ranked above it already cover ``top_p`` of
    the softmax; the first is always kept (a tiny ``top_p`` would otherwise drop every token).

    The softmax and its running sum are float64 (``top_p`` compared as given, a float or a float64
    tensor): their rounding, about 1e-11 for 32,000 ids, then moves the nucleus' edge only where a
    sum lies that close to ``top_p``, so a CPU decides the same mask in C++ with its own rounding and
    a proven bound on both (``wiola.fast.decode_step_cpu.nucleus_rows``), asking this function only
    for such a near tie; in float32 that margin (about 1e-4 in the worst case of the sum's order)
    would be met on a good share of tokens."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.double(), dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter(-1, order, drop)


NucleusDrop = Callable[[torch.Tensor, float | torch.Tensor], torch.Tensor]


def filter_logits(
    logits: torch.Tensor, top_k: int | None, top_p: float | torch.Tensor | None, *, nucleus: NucleusDrop = nucleus_drop
) -> torch.Tensor:
    """Set to ``-inf`` every logit outside the top-k and outside the top-p nucleus. ``(B, V)``.

    ``top_p`` may be a 0-d tensor (read on the device: a CUDA graph replays with new values).
    ``nucleus``: the mask of the tokens outside the nucleus (``nucleus_drop``, or a function that
    gives the same mask: the fast model's CPU one decides it in C++)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and (isinstance(top_p, torch.Tensor) or top_p < 1.0):
        logits = logits.masked_fill(nucleus(logits, top_p), float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    noise: torch.Tensor | None = None,
    nucleus: NucleusDrop = nucleus_drop,
) -> torch.Tensor:
    """Next token per row from ``(B, V)`` logits: argmax when ``temperature == 0``, else a draw
    from ``softmax(filtered logits / temperature)`` (``filter_logits``, with ``nucleus``). Returns
    ``(B,)`` int64, no host sync.

    The draw is ``argmax(logits − log E)`` with ``E`` ``(B, V)`` ``Exp(1)`` noise: drawn here from
    ``generator``, or given as ``noise`` (a buffer refilled before each CUDA-graph replay).
    ``temperature`` and ``top_p`` may be 0-d device tensors (then never greedy). A temperature so
    small that a logit divided by it overflows float32 (``1e-40``: a positive logit to ``+inf``,
    or, where every logit is negative, every one to ``-inf``) gives the row's argmax, the limit of
    the distribution as the temperature goes to 0 (the noise is drawn all the same).
    """
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    overflow = (scaled == float("inf")).any(dim=-1) | (scaled == float("-inf")).all(dim=-1)
    scaled = filter_logits(scaled, top_k, top_p, nucleus=nucleus)
    if noise is None:
        noise = torch.empty_like(scaled).exponential_(generator=generator)
    drawn = (scaled - torch.log(noise.clamp_min(1e-30))).argmax(dim=-1)
    return torch.where(overflow, logits.argmax(dim=-1), drawn)


def next_tokens(
    logits: torch.Tensor,
    finished: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int | None,
    *,
    temperature: float | torch.Tensor,
    top_k: int | None = None,
    top_p: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    nucleus: NucleusDrop = nucleus_drop,
) -> torch.Tensor:
    """One step's ``(B,)`` tokens: ``sample_next`` of the ``(B, V)`` logits, ``pad_token_id`` for
    rows already finished; rows that emit ``eos_token_id`` are marked in ``finished`` (in place)."""
    token = sample_next(logits, temperature, top_k, top_p, generator, noise=noise, nucleus=nucleus)
    if eos_token_id is not None:
        token = token.masked_fill(finished, pad_token_id)
        finished |= token == eos_token_id
    return token


def check_generate_inputs(
    model: Decoder,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Sampling:
    """Every check of a ``generate`` call (the model's input checks, lengths, left padding,
    the sampling settings); returns the resolved ``Sampling``."""
    sampling = resolve_sampling(temperature, top_k, top_p, model.config.vocab_size)
    model.check_inputs(input_ids, attention_mask, None)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    total = input_ids.shape[1] + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"prompt of {input_ids.shape[1]} tokens + {max_new_tokens} new tokens = {total} is past "
            f"max_seq_len={model.config.max_seq_len}"
        )
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        if not bool(attention_mask[:, -1].all()):
            raise ValueError("generate needs left padding: the last column of attention_mask must be all ones")
    return sampling


@dataclass(frozen=True)
class GenerateArgs:
    """The arguments of a generation loop, checked (``GenerateArgs.check``): what
    ``eager_generate`` and the loops of ``wiola.fast.generation`` run on."""

    input_ids: torch.Tensor  # (B, T) the prompt
    max_new_tokens: int
    attention_mask: torch.Tensor | None  # (B, T), 0 on the left padding
    sampling: Sampling
    eos_token_id: int | None  # in [0, vocab_size) (``resolve_token_ids``)
    pad_token_id: int | None  # what finished rows hold, in [0, vocab_size) (``resolve_token_ids``)
    generator: torch.Generator | None
    streamer: Callable[[torch.Tensor], None] | None  # given each step's (B,) new tokens

    @classmethod
    def check(
        cls,
        model: Decoder,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        attention_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        streamer: Callable[[torch.Tensor], None] | None = None,
    ) -> GenerateArgs:
        """A loop's arguments checked (``check_generate_inputs``, ``resolve_token_ids``;
        ``ValueError``/``TypeError`` naming the problem, ``TypeError`` for an argument not listed),
        sampling, eos and the pad id resolved."""
        sampling = check_generate_inputs(model, input_ids, max_new_tokens, attention_mask, temperature, top_k, top_p)
        eos, pad = resolve_token_ids(model, eos_token_id, pad_token_id)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r}"
            )
        if streamer is not None and not callable(streamer):
            raise TypeError(f"streamer must be callable or None, got {type(streamer).__name__} {streamer!r}")
        return cls(input_ids, max_new_tokens, attention_mask, sampling, eos, pad, generator, streamer)


# The keyword arguments every generation loop takes (those of ``GenerateArgs.check``).
# torch.Generator.manual_seed takes a seed in this range (a negative one is taken modulo 2**64).
SEED_RANGE = (-(2**63), 2**64)

LOOP_KEYWORDS = frozenset(
    name for name, p in inspect.signature(GenerateArgs.check).parameters.items() if p.kind is p.KEYWORD_ONLY
)


class Steps(Protocol):
    """One generation's steps: ``prefill`` gives the first new tokens, ``step`` each next ones
    (``(B,)`` int64, eos-padded); ``finished`` ``(B,)`` bool marks rows that emitted eos."""

    finished: torch.Tensor

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor: ...

    def step(self) -> torch.Tensor: ...


def decode_loop(steps: Steps | None, args: GenerateArgs, eos_check_every: int = 1) -> torch.Tensor:
    """The loop every generator runs: ``(B, T + max_new_tokens)`` int64 (prompt, new tokens, and
    ``pad_token_id`` after every row has finished). Whether every row has finished is read on
    the host every ``eos_check_every`` steps (rows that finished emit the pad token meanwhile).
    ``steps`` may be None when ``max_new_tokens`` is 0."""
    input_ids, max_new_tokens = args.input_ids, args.max_new_tokens
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.int64, device=input_ids.device)
    out[:, :T] = input_ids
    for i in range(max_new_tokens):
        if i == 0:
            token = steps.prefill(input_ids, args.attention_mask)
        elif args.eos_token_id is not None and i % eos_check_every == 0 and bool(steps.finished.all()):
            out[:, T + i :] = args.pad_token_id
            break
        else:
            token = steps.step()
        out[:, T + i] = token
        if args.streamer is not None:
            args.streamer(token.clone())
    return out


NoiseDraw = Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]


@dataclass(frozen=True)
class SamplingOps:
    """How ``sample_next`` gets its Exp(1) noise and its top-p nucleus: torch's own ops (the
    reference), or functions that give the same values (the fast model's C++ ones on a CPU,
    ``wiola.fast.generation.CPU_SAMPLING``). ``draw_noise(logits, generator)``: the ``(B, V)``
    fp32 noise ``sample_next`` would draw (None: it draws it); ``nucleus``: as ``filter_logits``."""

    draw_noise: NoiseDraw | None = None
    nucleus: NucleusDrop = nucleus_drop

    def noise(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor | None:
        """The noise to hand ``sample_next`` for ``logits`` under ``sampling``: None where it draws
        none (greedy) or draws its own."""
        return None if sampling.greedy or self.draw_noise is None else self.draw_noise(logits, generator)


class _EagerSteps:
    """The model's forward on a fresh static cache, one token per row and step."""

    def __init__(self, model: Decoder, cache: Cache, args: GenerateArgs, ops: SamplingOps = SamplingOps()) -> None:
        self.model, self.cache, self.sampling, self.generator = model, cache, args.sampling, args.generator
        self.ops = ops
        self.eos, self.pad = args.eos_token_id, args.pad_token_id
        self.finished = torch.zeros(cache.batch_size, dtype=torch.bool, device=cache.device)
        self.token: torch.Tensor | None = None

    def _next(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids, attention_mask=attention_mask, cache=self.cache, logits_to_keep=1)
        s, logits = self.sampling, out.logits[:, -1]
        noise = self.ops.noise(logits, s, self.generator)
        self.token = next_tokens(
            logits, self.finished, self.eos, self.pad, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
            generator=self.generator, noise=noise, nucleus=self.ops.nucleus,
        )  # fmt: skip
        return self.token

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self._next(input_ids, attention_mask)

    def step(self) -> torch.Tensor:
        return self._next(self.token.unsqueeze(1), None)


def as_int(name: str, value: Any, error: type[Exception] = TypeError) -> int:
    """``value`` as a Python ``int``: an int, or a numpy/torch integer scalar (``operator.index``).
    A bool (Python's or a torch bool) or anything else raises ``error`` naming ``name`` and the value."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise error(f"{name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def token_id(name: str, value: Any, vocab_size: int) -> int:
    """``value`` as one token id: a Python ``int`` in ``[0, vocab_size)``. Integer scalars of numpy
    or torch (``np.int64(5)``, ``torch.tensor(5)``) are taken through ``operator.index``; a bool, a
    float, a list of ids or anything else raises ``TypeError``, an id outside the vocabulary
    ``ValueError``, each naming ``name`` and the value. The ids reach the embedding (and the C++
    step, which does not check them) unchanged, so they are checked here first."""
    if isinstance(value, list | tuple | set | frozenset) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        raise TypeError(f"{name} must be a single int (a list of ids is not supported), got {value!r}")
    index = as_int(name, value)
    if not 0 <= index < vocab_size:
        raise ValueError(f"{name} {index} is outside [0, vocab_size={vocab_size})")
    return index


def resolve_token_ids(model: Decoder, eos_token_id: Any, pad_token_id: Any) -> tuple[int | None, int | None]:
    """``(eos, pad)`` for a generation: each given id checked (``token_id``: an int in
    ``[0, vocab_size)``, one eos id, not a list); the pad id, what finished rows hold, is
    ``pad_token_id``, else the checkpoint's (``model.config``), else eos."""
    V = model.config.vocab_size
    eos = None if eos_token_id is None else token_id("eos_token_id", eos_token_id, V)
    if pad_token_id is not None:
        return eos, token_id("pad_token_id", pad_token_id, V)
    config_pad = getattr(model.config, "pad_token_id", None)  # WiolaConfig checks its own range
    return eos, eos if config_pad is None else config_pad


class TokenStreamer(Protocol):
    """``transformers``' streamer protocol (``TextStreamer``, ``TextIteratorStreamer``): ``put``
    receives the ``(B, T)`` prompt first, then each step's ``(B,)`` new tokens (CPU tensors);
    ``end`` is called once after the last."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class TextDecoder(Protocol):
    """What stop strings need of a tokenizer (ours or a ``transformers`` one): ``decode(ids)``."""

    def decode(self, ids: list[int]) -> str: ...


def resolve_do_sample(
    do_sample: bool | None, temperature: float | None, top_k: int | None, top_p: float | None
) -> tuple[float | None, int | None, float | None]:
    """``transformers``' ``do_sample`` folded into ``(temperature, top_k, top_p)``: ``False`` is
    greedy whatever the other settings, ``True`` samples (at temperature 1.0 unless given), None
    keeps them. ``ValueError`` for ``do_sample=True`` with ``temperature=0``."""
    if do_sample is None:
        return temperature, top_k, top_p
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool or None, got {do_sample!r}")
    if not do_sample:
        return 0.0, None, None
    if temperature is not None and not isinstance(temperature, bool) and temperature == 0:
        raise ValueError("do_sample=True needs temperature > 0 (temperature=0 is greedy: pass do_sample=False)")
    return 1.0 if temperature is None else temperature, top_k, top_p


def find_stop(text: str, stop_strings: list[str]) -> int | None:
    """Index in ``text`` of the earliest occurrence of any stop string, or None."""
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def check_stop_strings(stop_strings: str | list[str] | None) -> list[str]:
    """``stop_strings`` as a list of non-empty strings (``ValueError``/``TypeError`` otherwise)."""
    if stop_strings is None:
        return []
    stops = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop_strings must be a string or a list of strings, got {stop_strings!r}")
    if not all(stops):
        raise ValueError("stop_strings must not contain an empty string")
    return list(stops)


class _AllStopped(Exception):
    """Raised from the per-step callback once every row has stopped (ends the loop early)."""


class _Front:
    """The per-step callback of ``hf_generate``: collects the new tokens, feeds the caller's streamer
    (a callable or a ``TokenStreamer``), tracks stop strings and eos per row. A row stopped by a
    stop string streams the pad id from the next step on, as the result holds it (a row that met
    eos streams the loop's pad already)."""

    def __init__(
        self, prompt: torch.Tensor, streamer, stops: list[str], tokenizer, eos: int | None, pad: int | None
    ) -> None:
        self.streamer, self.stops, self.tokenizer, self.eos, self.pad = streamer, stops, tokenizer, eos, pad
        B = prompt.shape[0]
        self.prompt: torch.Tensor | None = prompt  # put to a TokenStreamer with the first tokens
        self.tokens: list[torch.Tensor] = []
        self.new: list[list[int]] = [[] for _ in range(B)]
        self.stopped_at = [-1] * B  # step at which a row's text first contained a stop string
        self.ended = torch.zeros(B, dtype=torch.bool)  # stopped or emitted eos

    def __call__(self, token: torch.Tensor) -> None:
        step = len(self.tokens)
        self.tokens.append(token)
        if self.streamer is not None:
            stopped = [row for row, at in enumerate(self.stopped_at) if at >= 0]  # at an earlier step
            shown = token.index_fill(0, torch.tensor(stopped, device=token.device), self.pad) if stopped else token
            if hasattr(self.streamer, "put"):
                self.open()
                self.streamer.put(shown.cpu())
            else:
                self.streamer(shown)
        if not self.stops and self.eos is None:
            return
        host = token.tolist()
        for row, t in enumerate(host):
            if self.ended[row]:
                continue
            if self.eos is not None and t == self.eos:
                self.ended[row] = True
            elif self.stops:
                self.new[row].append(t)
                if find_stop(self.tokenizer.decode(self.new[row]), self.stops) is not None:
                    self.stopped_at[row] = step
                    self.ended[row] = True
        if self.stops and bool(self.ended.all()):
            raise _AllStopped

    def open(self) -> None:
        """Give a ``TokenStreamer`` the prompt, once: with the first tokens, so that a call its
        loop refuses streams nothing."""
        if self.prompt is not None:
            self.streamer.put(self.prompt.cpu())
            self.prompt = None


# ``eos_token_id`` not passed to ``generate``: the model config's, as ``transformers`` takes its
# generation config's (an explicit None: no eos).
FROM_CONFIG: Any = type("FromConfig", (), {"__repr__": lambda self: "the model config's eos_token_id"})()


@torch.inference_mode()
def hf_generate(
    loop: Callable[..., torch.Tensor],
    model: Decoder,
    input_ids: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    *,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: Any = FROM_CONFIG,
    pad_token_id: int | None = None,
    streamer: Callable[[torch.Tensor], None] | TokenStreamer | None = None,
    stop_strings: str | list[str] | None = None,
    tokenizer: TextDecoder | None = None,
    inputs: torch.Tensor | None = None,
    max_length: int | None = None,
    token_type_ids: torch.Tensor | None = None,
    num_beams: int = 1,
    **options: Any,
) -> torch.Tensor:
    """``loop(model, input_ids, max_new_tokens, ...)`` (a generation loop with a per-step callback
    ``streamer``) called as ``transformers`` callers write it: the prompt as ``input_ids`` or
    ``inputs``; ``max_new_tokens`` or ``max_length`` (prompt + new tokens); ``eos_token_id``
    by default the model config's (None: no eos); ``token_type_ids`` of zeros (a tokenizer's,
    ignored); ``do_sample``, streamer objects, and ``stop_strings`` (decoded with ``tokenizer``): a
    row whose new text contains one stops there, its later slots hold the pad id, and generation
    ends once every row has stopped or hit eos. The result keeps the ``(B, T + max_new_tokens)``
    shape. A streamer's ``end`` is called whatever happens, also for a refused call (a reader
    waiting on it finishes). ``num_beams=1`` and ``top_k=0`` are ``transformers``' no-ops (no beam
    search, no top-k filter) and are taken as such; another ``num_beams`` is refused."""
    if streamer is not None and not (callable(streamer) or hasattr(streamer, "put")):
        raise TypeError(
            f"streamer must be a callable or a transformers streamer (put/end), got {type(streamer).__name__} {streamer!r}"
        )
    try:
        unknown = sorted(set(options) - LOOP_KEYWORDS)
        if unknown:  # transformers' num_beams, repetition_penalty, ...: refused, never ignored
            raise TypeError(
                f"generate() got an unexpected keyword argument {', '.join(map(repr, unknown))}: Wiola's generate "
                "has greedy decoding and sampling (temperature, top_k, top_p), eos, pad, stop strings and streamers, "
                "not this"
            )
        if as_int("num_beams", num_beams) != 1:
            raise ValueError(f"num_beams={num_beams!r}: Wiola's generate has no beam search (num_beams=1 only)")
        with contextlib.suppress(TypeError):  # anything else: resolve_sampling names it
            if top_k is not None and as_int("top_k", top_k) == 0:
                top_k = None  # transformers' "no top-k filter"
        input_ids, max_new_tokens = resolve_lengths(input_ids, inputs, max_new_tokens, max_length)
        check_token_type_ids(token_type_ids, input_ids)
        if eos_token_id is FROM_CONFIG:
            eos_token_id = getattr(model.config, "eos_token_id", None)
        temperature, top_k, top_p = resolve_do_sample(do_sample, temperature, top_k, top_p)
        stops = check_stop_strings(stop_strings)
        eos_token_id, pad = resolve_token_ids(model, eos_token_id, pad_token_id)
        if stops and tokenizer is None:
            raise ValueError("stop_strings need tokenizer= (anything with decode(ids)) to read the text")
        if stops and pad is None:
            raise ValueError("stop_strings need pad_token_id or eos_token_id for the slots after a stop")
        front = (
            None if streamer is None and not stops else _Front(input_ids, streamer, stops, tokenizer, eos_token_id, pad)
        )
        kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id)
        try:
            out = loop(model, input_ids, max_new_tokens, pad_token_id=pad, streamer=front, **kwargs, **options)
            if hasattr(streamer, "put"):
                front.open()  # no new tokens (max_new_tokens 0): the prompt alone
        except _AllStopped:
            out = torch.full((input_ids.shape[0], input_ids.shape[1] + max_new_tokens), pad, dtype=torch.int64)
            out = out.to(input_ids.device)
            out[:, : input_ids.shape[1]] = input_ids
            new = torch.stack(front.tokens, dim=1)
            out[:, input_ids.shape[1] : input_ids.shape[1] + new.shape[1]] = new
    finally:
        if hasattr(streamer, "end"):
            streamer.end()
    if front is not None:
        for row, step in enumerate(front.stopped_at):
            if step >= 0:
                out[row, input_ids.shape[1] + step + 1 :] = pad
    return out


def resolve_lengths(input_ids: Any, inputs: Any, max_new_tokens: Any, max_length: Any) -> tuple[torch.Tensor, int]:
    """The prompt (``input_ids``, or ``transformers``' ``inputs``) and how many tokens to add
    (``max_new_tokens``, or ``max_length`` minus the prompt's length); ``TypeError``/``ValueError``
    naming the argument for one missing, both of a pair given, or a ``max_length`` shorter than
    the prompt. Integer scalars of numpy or torch are the ints they hold."""
    if inputs is not None:
        if input_ids is not None:
            raise TypeError("give the prompt as input_ids or as inputs, not both")
        input_ids = inputs
    if input_ids is None:
        raise TypeError("generate needs the prompt: input_ids (or inputs), a (B, T) tensor of token ids")
    if max_length is not None:
        if max_new_tokens is not None:
            raise ValueError("give max_new_tokens (tokens to add) or max_length (prompt + new tokens), not both")
        total = as_int("max_length", max_length, ValueError)
        T = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else None
        if T is not None and total < T:
            raise ValueError(f"max_length={total} is shorter than the prompt ({T} tokens); it counts the prompt too")
        max_new_tokens = total - (T or 0)
    if max_new_tokens is None:
        raise TypeError("generate needs max_new_tokens (tokens to add) or max_length (prompt + new tokens)")
    with contextlib.suppress(TypeError):  # not an integer (a bool too): check_generate_inputs names it
        max_new_tokens = as_int("max_new_tokens", max_new_tokens)
    return input_ids, max_new_tokens


def check_token_type_ids(token_type_ids: torch.Tensor | None, input_ids: Any) -> None:
    """``token_type_ids`` (what a ``transformers`` tokenizer returns beside the ids) must be
    None or zeros of the ids' shape: Wiola has no token types, and a tokenizer gives zeros for a
    single sequence. ``ValueError`` naming it otherwise (a pair of segments would be read as
    one text)."""
    if token_type_ids is None:
        return
    if not isinstance(token_type_ids, torch.Tensor) or token_type_ids.shape != getattr(input_ids, "shape", None):
        shape = (
            tuple(token_type_ids.shape) if isinstance(token_type_ids, torch.Tensor) else type(token_type_ids).__name__
        )
        raise ValueError(
            f"token_type_ids {shape} must be a tensor of input_ids' shape {tuple(getattr(input_ids, 'shape', ()))}, "
            "or None"
        )
    if bool(token_type_ids.any()):
        raise ValueError(
            "token_type_ids must be all 0 (Wiola has no token types, so a second segment would be read as the same "
            "text): encode one sequence, or leave token_type_ids out"
        )


@torch.inference_mode()
def eager_generate(
    model: Decoder,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    sampling_ops: SamplingOps = SamplingOps(),
    **kwargs: Any,
) -> torch.Tensor:
    """The reference loop of ``generate`` (a model's forward on a fresh static cache), without the
    ``transformers``-style arguments: the keyword arguments of ``GenerateArgs.check``, where
    ``streamer`` is a per-step callback. ``sampling_ops``: see ``SamplingOps``."""
    args = GenerateArgs.check(model, input_ids, max_new_tokens, **kwargs)
    steps = None
    if max_new_tokens > 0:
        B, T = input_ids.shape
        steps = _EagerSteps(model, model.new_cache(B, T + max_new_tokens), args, sampling_ops)
    return decode_loop(steps, args)


def generate(
    model: Decoder, input_ids: torch.Tensor | None = None, max_new_tokens: int | None = None, **kwargs: Any
) -> torch.Tensor:
    """The prompt followed by up to ``max_new_tokens`` new tokens: ``(B, T + max_new_tokens)`` int64.

    Keyword arguments (as ``transformers``' ``generate`` takes them):
        inputs: the prompt, in place of ``input_ids``.
        max_length: prompt + new tokens, in place of ``max_new_tokens``.
        token_type_ids: zeros of the prompt's shape (a tokenizer's; ignored), or None.
        attention_mask: ``(B, T)``, 0 on the left padding; every row then decodes exactly as
            it would alone.
        do_sample: ``False`` is greedy whatever the other settings; ``True`` samples (temperature
            1.0 unless given); None (the default) decides by ``temperature``/``top_k``/``top_p``.
        temperature: None (the default) or 0 is greedy, unless ``top_k``/``top_p`` is given
            (then sampling at 1.0); a positive value samples from ``softmax(logits / temperature)``.
        top_k, top_p: sample only from the ``top_k`` most likely tokens / the smallest nucleus
            of probability ``top_p`` (ignored when greedy).
        eos_token_id: a row that produces it stops; its later slots hold ``pad_token_id``
            (default: the model config's ``pad_token_id``, else ``eos_token_id``). Not given: the
            model config's ``eos_token_id`` (a checkpoint's, as ``transformers`` reads its
            generation config; None in the presets); None: no eos. Generation ends
            early once every row has stopped, and the result is still ``T + max_new_tokens`` wide.
            One id (an int, or a numpy/torch integer scalar), not a list; both ids in
            ``[0, vocab_size)``.
        stop_strings: a string or list; a row whose new text (decoded by ``tokenizer=``) contains
            one stops after the token that completed it (later slots: the pad id).
        generator: a ``torch.Generator`` (on the model's device) for reproducible sampling.
        streamer: a callable given each step's ``(B,)`` new tokens as soon as they exist, or a
            ``transformers`` streamer (``put`` gets the prompt, then each step's tokens; ``end``).

    Raises ``ValueError``/``TypeError`` naming the problem for bad ids (the prompt's, eos and pad),
    masks, lengths past ``max_seq_len``, sampling settings that mean nothing and unknown arguments,
    before any work.
    """
    return hf_generate(eager_generate, model, input_ids, max_new_tokens, **kwargs)
