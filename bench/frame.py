"""The benchmark frame: timing, ceilings and the ``extra_info`` record every benchmark writes.

Benchmarks use it through the ``cuda_bench`` and ``cpu_bench`` fixtures of ``bench/conftest.py``
(see ``bench/README.md``); nothing here needs pytest except the optional pytest-benchmark stats.

Timing rules (CUDA): every implementation is called three times before timing (compile,
autotune, allocator warm-up), then timed repetition by repetition with CUDA events, cycling
through enough freshly generated input sets that one cycle does not fit in L2; a short GPU spin
before each repetition lets the host queue the whole call first, so the events time the device
and not the launch rate; the median of the repetitions is the result; no host clock is read as
a measurement on CUDA (the host clock only sizes the spin).
CPU: ``time.perf_counter`` around each call, median of the repetitions.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from bench.roofline import Cost

# Inputs cycled per repetition touch at least this many times the L2 size.
L2_MULTIPLE = 3
MAX_INPUT_SETS = 32
MAX_ROTATION_BYTES = 4 << 30


@dataclass(frozen=True)
class Ceilings:
    """Measured ceilings of one device: a large matrix product and a large copy."""

    device: str  # "cuda" or "cpu"
    device_name: str
    matmul_flops: float  # FLOP/s of the matrix product
    copy_bytes_per_s: float  # bytes read + written per second by the copy
    matmul: str  # what was measured, e.g. "bf16 8192x8192x8192"
    copy: str  # e.g. "2.0 GiB device-to-device"
    # CPU only: a copy whose two buffers fit in the last-level cache (the floor of a model that
    # fits there, e.g. the int8 13m in a 32 MiB L3), and that cache's size.
    cache_copy_bytes_per_s: float | None = None
    cache_copy: str = ""
    cache_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["matmul_tflops"] = self.matmul_flops / 1e12
        out["copy_gbs"] = self.copy_bytes_per_s / 1e9
        if self.cache_copy_bytes_per_s:
            out["cache_copy_gbs"] = self.cache_copy_bytes_per_s / 1e9
        return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _iqr(xs: Sequence[float]) -> float:
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return float(q[2] - q[0])


# ------------------------------------------------------------------------------ timing
def _reps(estimate: float, target_s: float, min_reps: int, max_reps: int, max_total_s: float = 5.0) -> int:
    """Repetitions for a call of ``estimate`` seconds: about ``target_s`` in all, at least
    ``min_reps`` unless that would pass ``max_total_s`` (slow calls: at least 3)."""
    reps = min(max_reps, max(min_reps, int(target_s / max(estimate, 1e-7))))
    if reps * estimate > max_total_s:
        reps = max(3, int(max_total_s / max(estimate, 1e-7)))
    return reps


_SLEEP_CYCLES_PER_S: list[float] = []
# The longest spin ahead of a call: long enough for a host that needs tens of ms to queue one
# call (an eager 13m training step at B 64 needs ~43 ms on the H200 machine's host), short
# enough that the timed loop of a slow call stays within seconds.
MAX_AHEAD_S = 0.25


def _gpu_sleep(seconds: float) -> None:
    """Keep the GPU busy for about ``seconds`` (``torch.cuda._sleep``), so the host can queue the
    next repetition before the GPU reaches it: the events then time the device, not the launches."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None or seconds <= 0:
        return
    if not _SLEEP_CYCLES_PER_S:  # calibrate once: cycles per second of the spin kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(1000)  # warm-up
        start.record()
        sleep(2_000_000)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_CYCLES_PER_S.append(2_000_000 / max(start.elapsed_time(end) / 1e3, 1e-9))
    sleep(int(min(seconds, MAX_AHEAD_S) * _SLEEP_CYCLES_PER_S[0]))


def time_cuda(
    fn: Callable[..., Any],
    input_sets: Sequence[tuple],
    *,
    target_s: float = 0.25,
    min_reps: int = 10,
    max_reps: int = 1000,
) -> list[float]:
    """Per-repetition GPU times in seconds of ``fn(*input_sets[i % n])``, measured with CUDA events.

    Three warm-up calls and three probe calls come first. The number of repetitions is chosen so
    that the timed loop lasts about ``target_s`` (at least ``min_reps``, at most ``max_reps``;
    calls slower than 0.5 s get fewer, at least 3). Before each repetition the GPU spins for
    about 1.5 times as long as the host takes to queue one call (at most ``MAX_AHEAD_S``; a host
    slower than that gets no spin), so every kernel of the call is queued before the start
    event fires: the time is the device's execution time, not the launch rate (a call that
    waits on the host inside, like ``generate`` with a sync per token, still includes those
    waits).
    """
    n = len(input_sets)
    warm = []
    for i in range(3):  # warm-up: compile, autotune, the allocator's caches
        w = time.perf_counter()
        fn(*input_sets[i % n])
        torch.cuda.synchronize()
        warm.append(time.perf_counter() - w)
    probe = 3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for i in range(probe):
        fn(*input_sets[i % n])
    end.record()
    host = (time.perf_counter() - host) / probe  # host time to queue one call (no sync inside)
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 1e3 / probe
    reps = _reps(estimate, target_s, min_reps, max_reps)
    ahead = 1.5 * host if host < MAX_AHEAD_S else 0.0
    times, slept, queued = _timed_reps(fn, input_sets, reps, ahead)
    wanted = min(ahead, MAX_AHEAD_S)
    recalibrated = False
    if wanted > 0 and _median(slept) < 0.8 * wanted and _SLEEP_CYCLES_PER_S:
        # The spin ran short: its rate was calibrated while the GPU's clock was lower (a cold
        # GPU ramps up over the first work), so the host may not have queued a call before its
        # start event fired. Scale the rate by what the spin did and time the loop again.
        _SLEEP_CYCLES_PER_S[0] *= wanted / max(_median(slept), 1e-6)
        times, slept, queued = _timed_reps(fn, input_sets, reps, ahead)
        recalibrated = True
    # What the host did, for reading a result that is slower than its kernels: the warm-up calls'
    # wall times (compilation, autotuning), the host's time to return from each timed call and
    # how long the GPU spun ahead of it. A median host time near the GPU time, longer than the
    # spin, means the call waited on the host (a sync inside, or launches slower than the
    # kernels), not on the device.
    LAST_CUDA_HOST.clear()
    LAST_CUDA_HOST.update(
        warmup_s=[round(w, 6) for w in warm],
        host_median_s=_median(queued),
        gpu_sleep_s=ahead,
        gpu_slept_median_s=_median(slept),
        sleep_recalibrated=recalibrated,
    )
    return times


def _timed_reps(
    fn: Callable[..., Any], input_sets: Sequence[tuple], reps: int, ahead: float
) -> tuple[list[float], list[float], list[float]]:
    """``reps`` calls, each after a GPU spin of about ``ahead`` seconds: per call the GPU time
    (events around the call), the spin's own GPU time and the host's time to return."""
    n = len(input_sets)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(reps)]
    queued = []
    for i in range(reps):
        args = input_sets[i % n]
        before, start, end = events[i]
        before.record()
        _gpu_sleep(ahead)
        start.record()
        q = time.perf_counter()
        fn(*args)
        queued.append(time.perf_counter() - q)
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) / 1e3 for _, start, end in events]
    slept = [before.elapsed_time(start) / 1e3 for before, start, _ in events]
    return times, slept, queued


LAST_CUDA_HOST: dict[str, Any] = {}  # time_cuda's host-side times of its last measurement


def loop_time(fn: Callable[..., Any], args: tuple, *, steps: int = 10, rounds: int = 3) -> float:
    """Seconds a call of ``fn(*args)`` takes in a loop, as a training loop runs it: ``steps`` calls
    back to back and one synchronisation at the end (on CUDA), wall clock, the median of
    ``rounds`` loops after two warm-up calls.

    Unlike ``time_cuda``'s repetitions nothing runs ahead of the host, so where the host issues a
    call more slowly than the device runs it, this is the host's pace: the rate a loop of these
    calls gets, beside the device time of one."""
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):
        fn(*args)
    sync()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            fn(*args)
        sync()
        per_call.append((time.perf_counter() - start) / steps)
    return _median(per_call)


def time_cpu(
    fn: Callable[..., Any],
    input_sets: Sequence[tuple],
    *,
    target_s: float = 3.0,
    min_reps: int = 3,
    max_reps: int = 200,
    between: Callable[[], Any] | None = None,
) -> list[float]:
    """Per-repetition wall times in seconds of ``fn(*input_sets[i % n])`` on the CPU (one warm-up
    call); ``between()``, untimed, after each timed call (a floor read at the same moments)."""
    n = len(input_sets)
    t0 = time.perf_counter()
    fn(*input_sets[0])
    estimate = time.perf_counter() - t0
    reps = _reps(estimate, target_s, min_reps, max_reps)
    times = []
    for i in range(reps):
        args = input_sets[i % n]
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        if between is not None:
            between()
    return times


# ---------------------------------------------------------------------------- ceilings
def _time_matmul_cuda(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    return _median(time_cuda(lambda: torch.mm(a, b, out=c), [()], target_s=0.15, min_reps=10, max_reps=50))


def _time_copy_cuda(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return _median(time_cuda(lambda: dst.copy_(src), [()], target_s=0.15, min_reps=10, max_reps=50))


def measure_cuda_ceilings(device: int | None = None) -> Ceilings:
    """The bf16 matmul rate (8192³ on random data) and the device-to-device copy rate (2 GiB)."""
    n, nbytes = 8192, 2 << 30
    t_mm = _time_matmul_cuda(n)
    t_cp = _time_copy_cuda(nbytes)
    torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device)
    return Ceilings("cuda", name, 2 * n**3 / t_mm, 2 * nbytes / t_cp, f"bf16 {n}x{n}x{n}", "2.0 GiB device-to-device")


def measure_cpu_ceilings() -> Ceilings:
    """The fp32 matmul rate (1024³: the faster of ATen's ``torch.mm`` and oneDNN's fp32 matmul,
    which ``wiola.ops.linear`` may run; on an AMD EPYC Zen 5 oneDNN's was about twice MKL's) and a
    256 MiB memory copy rate on this CPU."""
    from wiola.fast.decode_step_cpu import last_level_cache_bytes
    from wiola.ops.linear import onednn_available, onednn_linear

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    gemms = {"ATen": lambda: torch.mm(a, b, out=c)}
    if onednn_available():
        gemms["oneDNN"] = lambda: onednn_linear(a, b)
    times = {k: min(time_cpu(f, [()], target_s=0.3, min_reps=5, max_reps=30)) for k, f in gemms.items()}
    gemm = min(times, key=times.get)
    t_mm = times[gemm]
    nbytes = 256 << 20
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    t_cp = min(time_cpu(lambda: dst.copy_(src), [()], target_s=0.3, min_reps=5, max_reps=30))
    name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    llc = last_level_cache_bytes()  # the C++ step's reading of sysfs: one rule for both
    cache_rate, cache_what = None, ""
    if llc:  # both buffers in half the cache, each past the L2 of a core (2 MiB here)
        small = max(llc // 4, 4 << 20) if llc >= (16 << 20) else llc // 4
        src_c = torch.rand(small // 4)
        dst_c = torch.empty_like(src_c)
        t_c = min(time_cpu(lambda: dst_c.copy_(src_c), [()], target_s=0.3, min_reps=20, max_reps=2000))
        cache_rate, cache_what = 2 * small / t_c, f"{small / 2**20:.0f} MiB copy in a {llc / 2**20:.0f} MiB L3"
    return Ceilings(
        "cpu", name, 2 * n**3 / t_mm, 2 * nbytes / t_cp, f"fp32 {n}x{n}x{n} ({gemm}, best of reps)", "256 MiB copy",
        cache_rate, cache_what, llc,
    )  # fmt: skip


# ------------------------------------------------------------------------------ helpers
def fwd_bwd(f: Callable[..., Any], *, seed: int = 0) -> Callable[..., Any]:
    """Wrap ``f`` into forward + backward: ``f(*args)``, then the gradients of every input that
    requires grad, against a fixed random upstream gradient (made once per output shape).

    Gradients are returned with ``torch.autograd.grad``, so nothing accumulates into ``.grad``
    between repetitions. A tuple output uses its first tensor; a scalar output uses gradient 1.
    """
    grads: dict[tuple, torch.Tensor] = {}

    def run(*args: Any) -> Any:
        out = f(*args)
        if isinstance(out, (tuple, list)):
            out = out[0]
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        key = (tuple(out.shape), out.dtype, out.device)
        if key not in grads:
            gen = torch.Generator(device=out.device).manual_seed(seed)
            grads[key] = (
                torch.ones_like(out) if out.dim() == 0 else torch.randn(out.shape, generator=gen, device=out.device)
            ).to(out.dtype)
        return torch.autograd.grad(out, wrt, grads[key])

    return run


def forward_only(f: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``f`` to run without autograd (the forward-only twin of ``fwd_bwd``)."""

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return f(*args)

    return run


def wrapper_for(mode: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper a kernel benchmark times its callables with: ``fwd_bwd`` for the mode
    ``"fwd_bwd"``, ``forward_only`` for any other."""
    return fwd_bwd if mode == "fwd_bwd" else forward_only


def reference_baselines(reference: Callable[..., Any], wrap: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """The two baselines every kernel benchmark times: the op's reference eager (``"reference"``)
    and under ``torch.compile`` (``"torch.compile"``, compiled on its first call), each wrapped by
    ``wrap`` (``fwd_bwd`` or ``forward_only``)."""
    return {"reference": wrap(reference), "torch.compile": wrap(torch.compile(reference))}


COMPILED_ENV = "WIOLA_BENCH_COMPILED"


def compiled_baselines_enabled() -> bool:
    """Whether the compile-heavy baselines (``torch.compile``, FlexAttention) run: yes unless
    ``WIOLA_BENCH_COMPILED=0`` (the device check's headline stage sets it, so its minutes go to
    our measurements; its last stage runs them)."""
    return os.environ.get(COMPILED_ENV, "1") != "0"


def compile_heavy(factories: Mapping[str, Callable[[], Any]]) -> tuple[dict[str, Any], list[str]]:
    """Build the compile-heavy baselines from their factories, or none when they are switched off.

    Returns ``(baselines, notes)``: the built baselines, or ``{}`` and a note naming the ones left
    out (so a table without them says why). Factories keep the work of building them (a second
    model on the GPU, a ``torch.compile`` wrapper) out of runs that do not use them.
    """
    if compiled_baselines_enabled():
        return {name: make() for name, make in factories.items()}, []
    names = ", ".join(factories)
    return {}, [f"{names}: not run here (compile-heavy baselines, {COMPILED_ENV}=0)"]


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max|ref − got| / max|ref| in float64 (ref all zero: divided by 1e-30): the check a benchmark
    makes once before timing, and the error the tests bound (tests/numerics.py)."""
    ref, got = ref.detach().double(), got.detach().double()
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))


def greedy_agreement(expected: torch.Tensor, got: torch.Tensor, start: int) -> dict[str, Any]:
    """How far two greedy continuations ``(B, start + N)`` agree after the first ``start`` tokens.

    Returns ``rows_identical`` (fraction of rows with all N new tokens equal), ``prefix_agreement``
    (mean over rows of the length of the equal prefix / N: tokens after a row's first difference
    follow a different context and are not compared) and ``first_divergence``: ``{"row", "step"}``
    of the earliest differing new token (smallest step, then row), or ``None`` when all agree.
    """
    if expected.shape != got.shape or expected.dim() != 2:
        raise ValueError(
            f"expected and got must be the same (B, T) shape, got {tuple(expected.shape)} and {tuple(got.shape)}"
        )
    if not 0 <= start < expected.shape[1]:
        raise ValueError(f"start {start} must leave at least one new token of {expected.shape[1]}")
    diff = (expected[:, start:] != got[:, start:]).cpu()
    B, N = diff.shape
    steps = torch.where(diff.any(1), diff.int().argmax(1), torch.full((B,), N))  # first differing step per row
    first = None
    if bool(diff.any()):
        step = int(steps.min())
        first = {"row": int((steps == step).nonzero()[0, 0]), "step": step}
    return {
        "rows_identical": float((steps == N).float().mean()),
        "prefix_agreement": float(steps.float().mean() / N),
        "first_divergence": first,
    }


def shape_id(shape: Mapping[str, Any]) -> str:
    """``{"B": 32, "T": 512}`` -> ``"B32-T512"`` (the test-id style of the project); a value that
    is not a number stands alone (``{"preset": "13m", "B": 32}`` -> ``"13m-B32"``)."""
    return "-".join(f"{k}{v}" if isinstance(v, (int, float)) else str(v) for k, v in shape.items())


def _nbytes(args: Any) -> int:
    if isinstance(args, torch.Tensor):
        return args.numel() * args.element_size()
    if isinstance(args, (tuple, list)):
        return sum(_nbytes(a) for a in args)
    if isinstance(args, dict):
        return sum(_nbytes(a) for a in args.values())
    return 0


def make_input_sets(make_inputs: Callable[[], Any] | None, l2_bytes: int) -> list[tuple]:
    """Fresh input sets: enough that cycling through them touches ``L2_MULTIPLE × l2_bytes``."""
    if make_inputs is None:
        return [()]
    first = make_inputs()
    first = first if isinstance(first, tuple) else (first,)
    size = _nbytes(first)
    n = 1
    if l2_bytes and 0 < size < L2_MULTIPLE * l2_bytes:
        n = min(MAX_INPUT_SETS, math.ceil(L2_MULTIPLE * l2_bytes / size), max(1, MAX_ROTATION_BYTES // size))
    sets = [first]
    for _ in range(n - 1):
        s = make_inputs()
        sets.append(s if isinstance(s, tuple) else (s,))
    return sets


def _reason(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


# ---------------------------------------------------------------------- session metadata
def environment() -> dict[str, Any]:
    """Date, host, torch/triton versions and, on CUDA, the GPU name and driver version."""
    info: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):  # a shared CPU's numbers depend on what else runs
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # triton absent (e.g. macOS)
        info["triton"] = f"unavailable ({_reason(exc)})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_sms"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
        info["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            )  # fmt: skip
            info["driver"] = out.stdout.strip().splitlines()[0]
        except Exception as exc:
            info["driver"] = f"unknown ({_reason(exc)})"
    else:
        info["gpu"] = None
    return info


# --------------------------------------------------------------------------- the bench
class Bench:
    """Times one implementation and its baselines on the same inputs and fills ``extra_info``.

    Created by the ``cuda_bench`` / ``cpu_bench`` fixtures; use ``run``.
    """

    def __init__(self, benchmark: Any, device: str, ceilings: Ceilings | None, jsonl: str | None = None) -> None:
        self.benchmark = benchmark
        self.device = device
        self.ceilings = ceilings
        self.jsonl = jsonl
        self.record: dict[str, Any] | None = None

    @property
    def quick(self) -> bool:
        """True under ``--benchmark-disable``: a smoke run, where benchmarks may shrink their work."""
        return bool(getattr(self.benchmark, "disabled", False))

    def _time(
        self, fn: Callable[..., Any], sets: Sequence[tuple], between: Callable[[], Any] | None = None
    ) -> list[float]:
        if self.device == "cuda":
            return time_cuda(fn, sets)
        return time_cpu(fn, sets, between=between)

    def _peak_mem(self, fn: Callable[..., Any], args: tuple) -> int | None:
        if self.device != "cuda":
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*args)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)

    def _metrics(self, t: float, cost: Cost, tokens: int | None) -> dict[str, Any]:
        m: dict[str, Any] = {
            "time_s": t,
            "tflops": cost.flops / t / 1e12,
            "gbs": cost.bytes / t / 1e9,
        }
        if self.ceilings is not None:
            floor = cost.floor_s(self.ceilings.matmul_flops, self.ceilings.copy_bytes_per_s)
            m["floor_s"] = floor
            m["pct_floor"] = 100.0 * floor / t
            m["mfu_pct"] = 100.0 * cost.flops / t / self.ceilings.matmul_flops
            if self.ceilings.cache_copy_bytes_per_s:  # as if every byte came from the L3
                floor_l3 = cost.floor_s(self.ceilings.matmul_flops, self.ceilings.cache_copy_bytes_per_s)
                m["pct_floor_l3"] = 100.0 * floor_l3 / t
        if tokens:
            m["tokens_per_s"] = tokens / t
        return m

    def run(
        self,
        fn: Callable[..., Any],
        *,
        op: str,
        cost: Cost,
        shape: Mapping[str, Any],
        dtype: torch.dtype | str,
        inputs: Callable[[], Any] | None = None,
        baselines: Mapping[str, Callable[..., Any] | str | BaseException] | None = None,
        mode: str = "fwd",
        name: str = "ours",
        tokens: int | None = None,
        notes: Sequence[str] = (),
        info: Mapping[str, Any] | None = None,
        between: Callable[[], Any] | None = None,
    ) -> dict[str, Any]:
        """Time ``fn`` and every baseline on the same fresh inputs; fill ``benchmark.extra_info``.

        Args:
            fn: the implementation measured, called as ``fn(*inputs())``.
            op: the op's name (groups the results, e.g. ``"attention"``).
            cost: FLOPs and bytes of one call, from ``bench.roofline``.
            shape: the sizes, e.g. ``{"B": 32, "T": 512, "H": 8, "D": 32}``.
            dtype: the data type measured.
            inputs: makes one fresh random input set (a tuple of arguments, or one argument);
                called several times when a set would fit in L2, and the sets are cycled.
                ``None``: ``fn`` takes no arguments.
            baselines: name -> callable with ``fn``'s signature. A baseline that raises (in its
                first call) is recorded as unavailable with the reason, not a failure; a string
                or an exception instead of a callable records it as unavailable upfront.
            mode: ``"fwd"``, ``"fwd_bwd"``, ``"decode"``, ... (part of the group name).
            name: the name of ``fn`` in the tables (``"ours"`` by default).
            tokens: tokens processed per call, to report tokens/s.
            notes: free-text remarks stored with the result.
            info: further facts stored with the result under ``"info"`` (JSON-serialisable), e.g.
                how far two implementations' greedy tokens agree.
            between: on the CPU, called untimed after each timed call of ``fn`` (not of the
                baselines): a floor measured at the same moments of a shared machine as ``fn``.

        Our result is appended to ``WIOLA_BENCH_JSONL`` as soon as it is measured, before any
        baseline runs, and again after each baseline (same ``record_id``; ``baselines_pending``
        lists those still to come). Returns the record (also in ``benchmark.extra_info``). Errors
        in ``fn`` itself propagate; so does an interruption of a baseline (pytest-timeout), after
        it is recorded as unavailable.
        """
        bm = self.benchmark
        dtype_name = str(dtype).removeprefix("torch.")
        l2 = torch.cuda.get_device_properties(0).L2_cache_size if self.device == "cuda" else 0
        if self.device == "cuda":
            torch.cuda.empty_cache()
        sets = make_input_sets(inputs, l2)
        rec: dict[str, Any] = {
            "op": op,
            "mode": mode,
            "impl": name,
            "shape": dict(shape),
            "shape_id": shape_id(shape),
            "dtype": dtype_name,
            "device": self.device,
            "flops": cost.flops,
            "bytes": cost.bytes,
            "input_sets": len(sets),
            "notes": list(notes),
        }
        if info:
            rec["info"] = dict(info)
        if tokens:
            rec["tokens"] = tokens
        if self.device == "cpu":
            rec["threads"] = torch.get_num_threads()
        if self.ceilings is not None:
            rec["ceilings"] = self.ceilings.as_dict()
        if hasattr(bm, "group"):
            bm.group = f"{op} {mode}"

        if self.quick:  # smoke run: every implementation once, no timing
            fn(*sets[0])
            rec["baselines"] = {}
            for bname, bfn in (baselines or {}).items():
                rec["baselines"][bname] = self._smoke_baseline(bfn, sets[0])
            rec["quick"] = True
            if hasattr(bm, "_mode") and not bm._mode:
                bm._mode = f"{self.device}_bench.run (disabled)"
            bm.extra_info.update(rec)
            self.record = rec
            return rec

        times = self._time(fn, sets, between)
        t = _median(times)
        rec.update(self._metrics(t, cost, tokens))
        rec["time_iqr_s"] = _iqr(times)
        rec["reps"] = len(times)
        if self.device == "cuda":
            rec["host"] = dict(LAST_CUDA_HOST)
        mem = self._peak_mem(fn, sets[0])
        if mem is not None:
            rec["peak_mem_bytes"] = mem
        if self.device == "cpu" and hasattr(os, "getloadavg"):
            rec["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other work on a shared CPU skews the times
        # Our result is recorded before any baseline runs: a baseline that hangs, runs out of
        # memory or trips the per-test timeout cannot take our measurement with it. The same
        # record (same ``record_id``) is appended again after each baseline; readers keep the last.
        rec["record_id"] = uuid.uuid4().hex[:12]
        pending = list(baselines or {})
        rec["baselines"] = {}
        rec["baselines_pending"] = pending
        _feed_stats(bm, times, f"{self.device}_bench.run")
        bm.extra_info.update(rec)
        self.record = rec
        self._append_jsonl(rec, times)
        for bname, bfn in (baselines or {}).items():
            try:
                rec["baselines"][bname] = self._run_baseline(bfn, sets, cost, tokens, t)
            except BaseException as exc:  # pytest-timeout's Failed, KeyboardInterrupt: record, then re-raise
                rec["baselines"][bname] = {"unavailable": f"interrupted: {_reason(exc)}"}
                raise
            finally:
                pending.remove(bname)
                bm.extra_info.update(rec)
                self._append_jsonl(rec, times)
        del rec["baselines_pending"]
        bm.extra_info.pop("baselines_pending", None)
        return rec

    def _smoke_baseline(self, bfn: Any, args: tuple) -> dict[str, Any]:
        if not callable(bfn):
            return {"unavailable": bfn if isinstance(bfn, str) else _reason(bfn)}
        try:
            bfn(*args)
        except Exception as exc:
            return {"unavailable": _reason(exc)}
        return {"ran": True}

    def _run_baseline(
        self, bfn: Any, sets: Sequence[tuple], cost: Cost, tokens: int | None, t_ours: float
    ) -> dict[str, Any]:
        if not callable(bfn):
            return {"unavailable": bfn if isinstance(bfn, str) else _reason(bfn)}
        try:
            bfn(*sets[0])
        except Exception as exc:  # e.g. FlexAttention missing, compile failure, out of memory
            if self.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            return {"unavailable": _reason(exc), "traceback": traceback.format_exc(limit=3)[-1500:]}
        times = self._time(bfn, sets)
        tb = _median(times)
        out = self._metrics(tb, cost, tokens)
        out["time_iqr_s"] = _iqr(times)
        out["reps"] = len(times)
        out["speedup"] = tb / t_ours  # > 1: ours is faster
        mem = self._peak_mem(bfn, sets[0])
        if mem is not None:
            out["peak_mem_bytes"] = mem
        return out

    def _append_jsonl(self, rec: dict[str, Any], times: list[float]) -> None:
        """Append the result to ``$WIOLA_BENCH_JSONL`` as soon as it exists (survives a killed run);
        called again as each baseline finishes (the reader keeps the last line of a ``record_id``)."""
        if not self.jsonl:
            return
        rec = json.loads(json.dumps(rec))  # a snapshot: the record keeps changing as baselines finish
        if os.environ.get("WIOLA_BENCH_STAGE"):
            rec["stage"] = os.environ["WIOLA_BENCH_STAGE"]
        entry = {
            "name": getattr(self.benchmark, "name", None),
            "fullname": getattr(self.benchmark, "fullname", None),
            "group": getattr(self.benchmark, "group", None),
            "extra_info": rec,
            "stats": {
                "median": _median(times),
                "min": min(times),
                "max": max(times),
                "iqr": _iqr(times),
                "mean": statistics.fmean(times),
                "rounds": len(times),
            },
        }
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _feed_stats(benchmark: Any, times: list[float], mode: str) -> None:
    """Give pytest-benchmark the measured per-repetition times as its own statistics, so that
    its table and ``--benchmark-json`` show the event-timed (GPU) times, not host times."""
    make_stats = getattr(benchmark, "_make_stats", None)
    if make_stats is None:  # no pytest-benchmark (stub fixture) or an API we do not know
        return
    if getattr(benchmark, "_mode", None):
        raise RuntimeError("the benchmark fixture was already used in this test; call run() once per test")
    benchmark._mode = mode
    stats = make_stats(1)
    for t in times:
        stats.update(t)
