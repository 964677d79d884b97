"""Measuring decoding on a CPU as llama.cpp's ``llama-bench`` reports it, for ``wiola bench`` and
``bench/test_decode_cpu.py``.

- **pp<P>**: a P-token prompt through the model with a new cache, the logits of its last position
  (what ``generate`` runs before its first step): ``prompt_run``.
- **tg<N>**: ``generate``'s greedy decoding of N tokens after a prompt whose prefill is not timed
  (done once; each call puts the cache back as the prefill left it and runs ``generate``'s C++
  loop: N samples, N - 1 steps): ``decoding_only``.
- **The compute floor**: the time the step's products take when reading the weights costs
  nothing: its multiply-adds (the matrices' weights times the batch) at the rate its own kernels
  reach on a part of the head small enough to stay in each core's cache, on the step's threads
  (``product_floor``). A step cannot beat it either; whichever of the two floors is longer is the
  resource that bounds the step (``bound_by``).
- **The read floor**: the time to read the C++ step's bytes once (``step_bytes``: its matrices as
  stored, their scales, the norms and the gate; and ``cache_bytes``: the keys and values its
  attention reads from the decoding cache, on average over the call's steps), measured in the same
  process as the best of plain reads of an fp32 matrix of that many bytes (``read_floor``). A step
  cannot take less time than reading those bytes once, so (N - 1) read times over a tg call's time
  is the share of that floor it reaches. Both ``wiola bench`` and the benchmark suite read it
  between the timed calls (``READS_BETWEEN`` reads after each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from wiola.fast.decode_step_cpu import step_threads

READ_REPEATS = 31  # the best of this many: a shared host's noise can slow a few reads in a row
# Reads of the floor (each reader) after each timed tg call, so that the floor and the step see the
# same moments of a shared machine (a floor read only before or after the runs can meet a quieter or
# a busier cache than the runs did).
READS_BETWEEN = 7
READERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    # PyTorch's matrix-vector product over the matrix (MKL's sgemv on x86): the step's own operation.
    "torch.mv": lambda A, x: torch.mv(A, x),
    # A plain reduction over the same bytes (ATen's vectorized, threaded sum): on CPUs where the
    # BLAS's gemv is not tuned (MKL on AMD EPYC reads a 13 MB matrix at a ninth of this rate), the
    # faster of the two is the honest floor.
    "torch.sum": lambda A, x: A.sum(),
}
_READS: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, float]]] = {}  # size -> (matrix, x, best s)


def read_floor(nbytes: int, repeats: int = READ_REPEATS) -> dict[str, Any]:
    """Seconds to read ``nbytes`` once, measured now and kept at its best: for each reader of
    ``READERS``, the best of ``repeats`` reads of an fp32 matrix of that many bytes (256 columns,
    like the model's rows; made once per size) on torch's threads, the readers interleaved, and the
    best of that and every earlier measurement of the size in this process (on a shared host a read
    can be slowed for seconds at a time by other tenants of the cache: a floor measured then would
    flatter every row after it). ``{"s": the fastest, "reader": its name, "<reader> GB/s": each
    one's best rate}``. ``ValueError`` for a size under one row (1 KiB) or ``repeats`` under 1."""
    cols = 256
    if nbytes < 4 * cols or repeats < 1:
        raise ValueError(f"read_floor: nbytes={nbytes} must be at least {4 * cols} and repeats={repeats} at least 1")
    if nbytes not in _READS:
        A = torch.randn(nbytes // 4 // cols, cols)
        _READS[nbytes] = (A, torch.randn(cols), dict.fromkeys(READERS, float("inf")))
        for read in READERS.values():
            read(A, _READS[nbytes][1])
    A, x, best = _READS[nbytes]
    with torch.inference_mode():
        for _ in range(repeats):
            for name, read in READERS.items():
                t0 = time.perf_counter()
                read(A, x)
                best[name] = min(best[name], time.perf_counter() - t0)
    reader = min(best, key=best.__getitem__)
    return {"s": best[reader], "reader": reader} | {f"{name} GB/s": A.numel() * 4 / t / 1e9 for name, t in best.items()}


PRODUCT_BYTES = 16 << 10  # the head's rows product_floor reads: with x, within every core's L1 (32 KiB and up)
PRODUCT_MACS = 1 << 24  # multiply-adds a timed call, each thread (about 0.1-0.5 ms)
PRODUCT_REPEATS = 7
PRODUCT_BETWEEN = 3  # product_floor's calls after each timed tg call (as READS_BETWEEN)


def step_macs(config: Any, batch: int) -> int:
    """The multiply-adds of one step's products (``B`` rows): every matrix weight the step's
    products read (the tied head once, the layers' seven projections) times ``batch``. The gate's
    small products and the attention are left out: a lower bound."""
    d, L, f, V = config.d_model, config.n_layers, config.d_ff, config.vocab_size
    return batch * (V * d + L * (4 * d * d + 4 * d * f))


_PRODUCTS: dict[tuple, float] = {}  # (library, dims, N, K, batch, threads, reps) -> best seconds a call


def product_floor(step: Any, batch: int, repeats: int = PRODUCT_REPEATS) -> dict[str, Any]:
    """The compute floor of one step of ``step`` (a ``decode_step_cpu.DecodeStepCPU``) at
    ``batch`` rows: ``step_macs`` at the rate of the step's own product kernels over the head's
    first rows (``PRODUCT_BYTES`` of them, as stored), which each of the step's own threads
    (``decode_step_cpu.step_threads``: one for a small model) reads at once, again and again, so
    that they come from its core's cache: the best of ``repeats``
    calls now and of every earlier call for the same step and batch in this process (as
    ``read_floor`` keeps its best: a call slowed by the host's other tenants would put the floor
    too high, and every row's share of it with it). ``{"s": seconds a step, "macs_per_s": the
    rate, "threads": n}``. ``ValueError`` for a batch or ``repeats`` under 1."""
    if batch < 1 or repeats < 1:
        raise ValueError(f"product_floor: batch={batch} and repeats={repeats} must be at least 1")
    config = step.config
    head, scale = step.step_tensors[0], step.scales[0]
    K = config.d_model
    row_bytes = head.numel() * head.element_size() // config.vocab_size
    N = max(4, min(config.vocab_size, PRODUCT_BYTES // row_bytes) // 4 * 4)
    nth = step_threads(step.tuning)
    reps = max(1, PRODUCT_MACS // (N * K * batch))
    key = (step.lib._name, tuple(step.dims), N, K, batch, nth, reps)
    x = torch.randn(batch, K, generator=torch.Generator().manual_seed(0))
    y = torch.empty(nth, batch, N)
    best = _PRODUCTS.get(key, float("inf"))
    for i in range(repeats + 1):  # the first call warms the caches and the threads, untimed
        t0 = time.perf_counter()
        rc = step.lib.wiola_product_reps(
            step.dims, head.data_ptr(), None if scale is None else scale.data_ptr(), N, K, x.data_ptr(), batch,
            y.data_ptr(), reps, nth,
        )  # fmt: skip
        t = time.perf_counter() - t0
        if rc != 0:  # pragma: no cover - the binding passes only its own weight type and group
            raise RuntimeError(f"wiola_product_reps returned {rc}")
        if i > 0:
            best = min(best, t)
    _PRODUCTS[key] = best
    rate = nth * reps * N * K * batch / best
    return {"s": step_macs(config, batch) / rate, "macs_per_s": rate, "threads": nth}


FMA_CHAINS = (8, 12, 16, 24)  # fma_peak's chain counts: latency x pipes is 8 on the x86 cores measured
_PEAKS: dict[tuple, float] = {}  # (library, chains, threads, reps) -> best seconds a call


def fma_peak(step: Any, repeats: int = PRODUCT_REPEATS) -> dict[str, Any]:
    """The fp32 multiply-add peak of the C++ step's variant on the step's threads (``step_threads``): ``PRODUCT_MACS``
    multiply-adds a thread in independent chains that read no memory (``wiola_fma_peak``), for each
    chain count of ``FMA_CHAINS``, the best of ``repeats`` calls now and of every earlier call in this
    process (as ``product_floor`` keeps its best), and the fastest chain count. Every product of the
    step multiplies each weight by x with one such multiply-add, so no step can do its products
    (``step_macs``) faster than this rate, however its weights are stored (``read_ceiling``).
    ``{"macs_per_s", "chains", "threads"}``; None for a build without ``wiola_fma_peak``.
    ``ValueError`` for ``repeats`` under 1."""
    if repeats < 1:
        raise ValueError(f"fma_peak: repeats={repeats} must be at least 1")
    peak = getattr(step.lib, "wiola_fma_peak", None)
    if peak is None:
        return None
    nth = step_threads(step.tuning)
    out = torch.empty(nth)
    rates = {}
    for chains in FMA_CHAINS:
        lanes = peak(chains, 1, nth, out.data_ptr())  # untimed: starts the threads
        if lanes <= 0:  # pragma: no cover - the build has every count of FMA_CHAINS
            raise RuntimeError(f"wiola_fma_peak has no {chains}-chain form")
        reps = max(1, PRODUCT_MACS // (chains * lanes))
        key = (step.lib._name, chains, nth, reps)
        best = _PEAKS.get(key, float("inf"))
        for _ in range(repeats):
            t0 = time.perf_counter()
            peak(chains, reps, nth, out.data_ptr())
            best = min(best, time.perf_counter() - t0)
        _PEAKS[key] = best
        rates[chains] = nth * reps * chains * lanes / best
    chains = max(rates, key=rates.__getitem__)
    return {"macs_per_s": rates[chains], "chains": chains, "threads": nth}


def read_ceiling(config: Any, batch: int, read_s: float, macs_per_s: float) -> float:
    """The most of its read floor ``read_s`` (%) that a step of ``batch`` rows can reach when its
    products' multiply-adds (``step_macs``, a lower bound of its work) run at ``macs_per_s``: at
    ``fma_peak``'s rate, a ceiling for every step that multiplies each weight by x in fp32, however
    its weights are stored (above 100: the products alone could keep up with reading).
    ``ValueError`` for a time or rate not above 0."""
    if not read_s > 0.0 or not macs_per_s > 0.0:
        raise ValueError(f"read_ceiling: read_s={read_s} and macs_per_s={macs_per_s} must be above 0")
    return 100.0 * read_s * macs_per_s / step_macs(config, batch)


# What bounds a step (``bound``). The read floor counts the cache's keys and values too (records with
# ``read_floor_bytes``); the name stays as recorded since the first results, so that they compare.
BOUND_READ, BOUND_COMPUTE = "reading the weights", "the multiply-adds"
_BOUND_LABELS = {BOUND_READ: "read", BOUND_COMPUTE: "compute"}


def bound_label(bound_by: str) -> str:
    """A ``bound_by`` as a table cell names it: ``"read"`` or ``"compute"``; ``ValueError`` for any
    other value."""
    if bound_by not in _BOUND_LABELS:
        raise ValueError(f"bound_by={bound_by!r} is neither {BOUND_READ!r} nor {BOUND_COMPUTE!r}")
    return _BOUND_LABELS[bound_by]


def bound(read_s: float, compute_s: float, steps: int, seconds: float) -> dict[str, Any]:
    """Which floor bounds ``steps`` steps that took ``seconds``: ``bound_by`` (``BOUND_READ`` when the
    read floor ``read_s`` a step is at least the compute floor ``compute_s``, else
    ``BOUND_COMPUTE``) and ``pct_roofline``, the steps at the longer floor over ``seconds``."""
    return {
        "bound_by": BOUND_READ if read_s >= compute_s else BOUND_COMPUTE,
        "pct_roofline": 100.0 * steps * max(read_s, compute_s) / seconds,
    }


def step_bytes(step: Any) -> int:
    """The bytes one step of a ``decode_step_cpu.DecodeStepCPU`` binding reads from its weights,
    whatever the batch: every tensor it is bound to (the matrices as stored: fp32, bf16, int8 or
    packed int4; the tied embedding once, as the head) and their scales."""
    tensors = [*step.step_tensors, *(s for s in step.scales if s is not None)]
    return sum(t.numel() * t.element_size() for t in tensors)


def cache_bytes(config: Any, batch: int, prompt_len: int, new: int) -> int:
    """The bytes one step of a tg call (``decoding_only``: ``new`` tokens after a ``prompt_len``-token
    prompt, ``new - 1`` steps) reads from the decoding cache, on average over its steps (rounded
    down): step j, which writes each row's slot ``prompt_len + j``, attends over that row's slots
    0 … ``prompt_len + j`` in every layer, reading each slot's key and value (``d_model`` numbers
    each: H heads of D) at the cache's width (``step_layout.STATE``: fp32). At batch 8 of the 13m
    preset after a 16-token prompt that is 7.9 MB a step against int8's 13.1 MB of weights. The
    key mask (one byte a slot) and the new slot's writes are left out; 0 where there is no step.
    ``ValueError`` for a batch under 1 or a negative length."""
    from wiola.fast.step_layout import STATE

    if batch < 1 or prompt_len < 0 or new < 0:
        raise ValueError(
            f"cache_bytes: batch={batch} must be at least 1, prompt_len={prompt_len} and new={new} at least 0"
        )
    steps = new - 1
    if steps < 1:
        return 0
    slots = steps * (prompt_len + 1) + steps * (steps - 1) // 2  # the slots the steps read, each row
    width = {name: dtype.itemsize for name, dtype, _ in STATE}
    return batch * config.n_layers * config.d_model * (width["k"] + width["v"]) * slots // steps


class DecodingOnly:
    """A tg call (``decoding_only``): ``run()`` decodes and returns the tokens ``(B, new)``; ``step``
    is the C++ step's binding (``step_bytes(run.step)``)."""

    def __init__(self, step: Any, prompt_len: int, new: int, first: torch.Tensor) -> None:
        self.step, self.prompt_len, self.new, self.first = step, prompt_len, new, first
        self.saved = [(t, t.clone()) for t in step.state]
        self.out = torch.empty(first.shape[0], new, dtype=torch.int64)
        self.finished = torch.zeros(first.shape[0], dtype=torch.uint8)

    def __call__(self) -> torch.Tensor:
        with torch.inference_mode():  # the cache's buffers are inference tensors
            for t, copy_ in self.saved:
                t.copy_(copy_)
            self.finished.zero_()
            self.step.generate_loop(
                self.prompt_len, (0, self.new), self.out, self.first, self.finished,
                temperature=0.0, top_k=None, top_p=None, log_noise=None, eos=None, pad=None,
            )  # fmt: skip
        return self.out


def decoding_only(fast_model: torch.nn.Module, ids: torch.Tensor, new: int) -> DecodingOnly | None:
    """llama-bench's tg: ``generate``'s greedy decoding of ``new`` tokens after the prompt ``ids``
    (B, T), without the prompt. The prompt is prefilled here, once; each call puts the cache back
    as the prefill left it (a copy of its buffers) and runs ``generate``'s C++ loop
    (``generate_loop``: ``new`` samples, ``new - 1`` steps), returning the tokens ``(B, new)`` (the
    same tensor each call). None where the C++ step does not apply (no compiler, not a CPU model)."""
    from wiola.fast import ops

    B, T = ids.shape
    with torch.inference_mode():
        cache = fast_model.new_cache(B, T + new)
        step = ops.cpu_decode_step(fast_model, ids[:, -1:], cache)
        if step is None:
            return None
        first = fast_model(ids, cache=cache, logits_to_keep=1).logits[:, -1].contiguous()
    return DecodingOnly(step, T, new, first)


def prompt_run(fast_model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """llama-bench's pp: the prompt ``ids`` (B, T) through the model with a new cache of T slots,
    returning the logits of its last position (B, V), as ``generate`` prefills before its first step."""

    def run() -> torch.Tensor:
        with torch.inference_mode():
            cache = fast_model.new_cache(ids.shape[0], ids.shape[1])
            return fast_model(ids, cache=cache, logits_to_keep=1).logits[:, -1]

    return run


def interleaved(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Each of ``runs`` called once a round for ``rounds`` rounds, the order reversed every other
    round (so neither side always runs first after the other, and both see the same moments of a
    shared machine); the median seconds of each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
