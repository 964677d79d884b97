"""How ``wiola.fast.WiolaModel`` runs the prompt path on a CPU: fp32, or bf16 matrix products, and
which fp32 GEMM its gradient-free CPU forwards use.

The prompt path (a forward of ``B × T`` positions, ``T > 1``, with a cache: the prefill before
decoding) is a few large matrix products, which a CPU's matrix units run faster in bf16 than in
fp32: oneDNN, under PyTorch's CPU autocast, runs ``torch.nn.functional.linear`` with bf16 inputs
and fp32 accumulation on AVX-512 BF16 (``vdpbf16ps``) or AMX tiles (``amx_bf16``) where the CPU has
them. The modes (``MODES``):

- ``fp32``: the reference's arithmetic (exact up to fp32 summation order; every exactness test);
- ``bf16``: the projections, the feed-forward products and the head under
  ``torch.autocast("cpu", torch.bfloat16)`` (weights cast once per weight version and kept, see
  ``wiola.model.DerivedWeights``); norms, the gate, softmax and the cache stay fp32. Not the
  reference's function: its quality is measured (``tests/test_prefill.py`` bounds the loss change
  on validation windows; ``bench.quality``'s table).

``select()`` reads ``$WIOLA_CPU_PREFILL`` (``auto``, ``fp32`` or ``bf16``; unset: ``auto``).
The quality rule of a prompt mode is a validation loss within 0.001 nats of fp32's; bf16
products (inputs rounded to 8 significant bits) measured +0.0023 nats on the test model
(``tests/test_prefill.py``), so ``auto`` resolves to ``fp32`` on every CPU, whatever bf16 units
its flags show (``AUTO``: flag -> mode, empty), and ``bf16`` is for a caller who accepts that
cost. ``describe()`` says which mode was chosen, why, and the CPU's bf16 units, for benchmark
records.

It applies only where the C++ decode step would (a plain CPU, no gradients, no autocast already
on, an fp32 unquantized model; ``applies``): a quantized model keeps the fp32 path on its
dequantized weights, its oracle.

**The fp32 GEMM.** Outside bf16, the fast model's gradient-free CPU forwards (a prompt, or a
scoring pass) run their products of more than 64 rows on one of ``wiola.ops.linear.CPU_GEMMS``:
``aten`` (``F.linear``: MKL's sgemm in PyTorch's x86 builds) or ``onednn`` (oneDNN's fp32
matmul). Both are fp32 arithmetic, within the same error bound of the products; they differ in
summation order, so in the last bits. ``select_gemm()`` reads ``$WIOLA_CPU_GEMM`` (``auto``,
``measure``, ``aten`` or ``onednn``; unset: ``auto``). ``auto`` looks the CPU's vendor and family up in
``GEMM_AUTO``, which holds the families where the two were measured against each other in whole
prompts. On any other CPU it times the two on a prompt's products (``measure_gemms``) the first
time it is asked, and takes oneDNN only where it ran them at least ``GEMM_MARGIN`` times as fast:
where the two are close, MKL's stays, as on every CPU before. The measurement is kept per CPU,
torch version and thread count in ``gemm.json`` in the build cache (``decode_step_cpu``'s
folder), so that every process on a machine makes the same choice without timing again; delete
the file to measure again. A measurement is written there only where the machine was quiet while
it ran (``others_busy``: other processes used under ``GEMM_QUIET`` of the CPUs' time): on a busy
machine the two libraries' threads lose the cores differently, and such a ratio would be kept for
good. It still decides for that process. ``measure`` takes the timed choice on any CPU, a listed
family's too.
``gemm_applies`` says where the choice is used (quantized models included: their products are
fp32 on the dequantized weights). In a forward with a cache the products and the gate also run a
sequence at a time (``context``), so that a row's prompt is the same alone and in a batch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

MODES = ("fp32", "bf16")
ENV = "WIOLA_CPU_PREFILL"
AUTO: dict[str, str] = {}  # CPU flag -> the mode ``auto`` picks where it is present (none meets the rule yet)

GEMM_ENV = "WIOLA_CPU_GEMM"
# (vendor, family) -> the fp32 GEMM ``auto`` picks there. AMD family 26 (Zen 5): oneDNN ran a
# 512-token prompt of the 13m preset 1.6x faster than MKL's sgemm (its products about 2x: MKL ran
# them at the rate of 256-bit code, and Zen 5 runs 512-bit FMAs at full width):
# bench/results/2026-12-04_cpu_prompt-gemm-amd-zen5/. Other CPUs were not measured against each other
# in whole prompts: ``auto`` times the two there (``measured_gemm``).
GEMM_AUTO: dict[tuple[str, str], str] = {("AuthenticAMD", "26"): "onednn"}
# Elsewhere ``auto`` times the two (``measure_gemms``) on these products, (rows, in, out): the fused
# q/k/v of a 512-token prompt in the 13m preset (d_model 256) and in a 100M-class model (768).
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((512, 256, 768), (512, 768, 2304))
GEMM_ROUNDS = 7
# oneDNN is taken on a CPU outside the table only where it ran those products at least this many
# times as fast as ATen: a difference within a shared machine's noise keeps ATen, whose choice would
# otherwise flip between machines of one kind.
GEMM_MARGIN = 1.1
GEMM_CACHE = "gemm.json"
# A measurement is kept in the cache file only where other processes (and, in a virtual machine, the
# host's other guests: steal time) used less than this share of the time of the CPUs this process
# may run on while it ran.
# On the 2-core Ice Lake-SP Xeon, timed beside a test suite's other worker, oneDNN ran the products
# 1.33x as fast as ATen; on the idle machine 0.87-1.03x.
GEMM_QUIET = 0.1
_MEASURED: dict[int, dict[str, Any]] = {}  # torch threads -> the measurement auto uses in this process
_MEASURING = threading.Lock()


@functools.cache
def _cpu() -> dict[str, str]:
    """``decode_step_cpu.cpu_info()``, read once a process: every forward's choice reads it, and
    parsing ``/proc/cpuinfo`` grows with the core count."""
    from wiola.fast.decode_step_cpu import cpu_info

    return cpu_info()


def _flags() -> set[str]:
    return set(_cpu()["flags"].split())


def check_names() -> None:
    """Raise ``ValueError`` when ``$WIOLA_CPU_PREFILL`` or ``$WIOLA_CPU_GEMM`` holds a value
    neither takes (whether oneDNN is there is checked where the GEMM is chosen)."""
    from wiola.ops.linear import CPU_GEMMS

    for env, allowed in ((ENV, ("auto", *MODES)), (GEMM_ENV, ("auto", "measure", *CPU_GEMMS))):
        value = os.environ.get(env, "").strip().lower()
        if value not in ("", *allowed):
            raise ValueError(f"{env}={value!r} is not one of {', '.join(allowed)}")


def select(mode: str | None = None) -> str:
    """The prompt-path mode: ``mode`` if given, else ``$WIOLA_CPU_PREFILL``; ``auto`` (or unset)
    resolves from the CPU's flags (see the module). Raises ``ValueError`` naming a bad value."""
    source = "mode" if mode is not None else ENV
    requested = (mode if mode is not None else os.environ.get(ENV, "")).strip().lower()
    if requested in ("", "auto"):
        flags = _flags()
        return next((mode for flag, mode in AUTO.items() if flag in flags), "fp32")
    if requested not in MODES:
        raise ValueError(f"{source}={requested!r} is not one of auto, {', '.join(MODES)}")
    return requested


def select_gemm(name: str | None = None) -> str:
    """The fp32 GEMM: ``name`` if given, else ``$WIOLA_CPU_GEMM``; ``auto`` (or unset) looks up
    ``GEMM_AUTO`` by the CPU's vendor and family, and where the family is absent takes
    ``measured_gemm()``'s choice; ``measure`` takes that choice on any CPU (to check a listed
    family's part); both ``aten`` where this torch has no oneDNN. Raises ``ValueError`` naming a
    bad value, or ``onednn`` forced without oneDNN."""
    from wiola.ops.linear import CPU_GEMMS, onednn_available

    source = "name" if name is not None else GEMM_ENV
    requested = (name if name is not None else os.environ.get(GEMM_ENV, "")).strip().lower()
    if requested in ("", "auto", "measure"):
        if not onednn_available():
            return "aten"
        cpu = _cpu()
        listed = GEMM_AUTO.get((cpu["vendor"], cpu["family"])) if requested != "measure" else None
        return listed if listed is not None else measured_gemm()["chosen"]
    if requested not in CPU_GEMMS:
        raise ValueError(f"{source}={requested!r} is not one of auto, measure, {', '.join(CPU_GEMMS)}")
    if requested == "onednn" and not onednn_available():
        raise ValueError(f"{source}=onednn, but this torch has no oneDNN (torch.backends.mkldnn)")
    return requested


def measure_gemms(
    shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES, rounds: int = GEMM_ROUNDS
) -> dict[str, float]:
    """Seconds of one pass over ``shapes`` ((rows, in, out) products of random fp32 operands) on
    each GEMM of ``CPU_GEMMS``, on torch's threads: the medians of ``rounds`` interleaved rounds
    (``speed.interleaved``), after one untimed pass each (oneDNN makes its kernels for a shape on
    first use). ``ValueError`` for no shapes, a dimension or ``rounds`` under 1."""
    from wiola.fast.speed import interleaved
    from wiola.ops.linear import onednn_linear

    if not shapes or rounds < 1 or any(d < 1 for shape in shapes for d in shape):
        raise ValueError(f"measure_gemms: shapes={shapes!r} need positive dimensions and rounds={rounds} at least 1")
    gen = torch.Generator().manual_seed(0)
    operands = [(torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)) for m, k, n in shapes]

    def passes(product: Any) -> Any:
        return lambda: [product(x, w) for x, w in operands]

    runs = {"aten": passes(F.linear), "onednn": passes(onednn_linear)}
    with torch.inference_mode():
        for run in runs.values():
            run()
        return interleaved(runs, rounds)


def _cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity), or None where the system does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _cpu_jiffies(cpus: set[int] | None, stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, all) clock ticks since boot of ``cpus`` (every CPU where None), from ``/proc/stat``'s
    ``cpuN`` lines (busy: everything but idle and iowait, steal included), or None where there is
    no such file or it names none of them."""
    busy = total = 0
    found = False
    try:
        with open(stat) as f:
            for line in f:
                fields = line.split()
                if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
                    continue
                if not fields[0][3:].isdigit() or (cpus is not None and int(fields[0][3:]) not in cpus):
                    continue
                ticks = [int(t) for t in fields[1:9]]  # user nice system idle iowait irq softirq steal
                if len(ticks) < 8:
                    return None
                busy += sum(ticks) - ticks[3] - ticks[4]
                total += sum(ticks)
                found = True
    except (OSError, ValueError):
        return None
    return (busy, total) if found else None


def others_busy(work: Callable[[], Any]) -> tuple[Any, float | None]:
    """``work()``'s result and the share of the time of the CPUs this process may run on that
    anything but this process used while it ran (0: they were otherwise idle; 1: others kept
    every one of them busy throughout), from ``/proc/stat``'s ticks less this process's own CPU
    time; None where ``/proc/stat`` cannot be read or too little time passed to tell (two ticks a
    CPU). CPUs outside the process's affinity do not count: work there does not slow it."""
    cpus = _cpus()
    before, own_before = _cpu_jiffies(cpus), time.process_time()
    result = work()
    after, own_after = _cpu_jiffies(cpus), time.process_time()
    if before is None or after is None or after[1] - before[1] < 2 * (len(cpus) if cpus else os.cpu_count() or 1):
        return result, None
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    others = (after[0] - before[0]) * tick - (own_after - own_before)
    return result, min(1.0, max(0.0, others / ((after[1] - before[1]) * tick)))


def _gemm_key(threads: int) -> str:
    """The cache file's key of a measurement: this CPU (model name and flags), torch's version, the
    thread count and the shapes timed."""
    from wiola.fast.decode_step_cpu import _cpu_signature

    what = f"{_cpu_signature()}\n{torch.__version__}\n{threads}\n{GEMM_SHAPES}"
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def _cache_file() -> Path | None:
    """``gemm.json`` in the build cache, or None where that folder is unusable (the choice is then
    measured once a process)."""
    from wiola.fast.decode_step_cpu import _cache_dir

    try:
        return _cache_dir() / GEMM_CACHE
    except OSError:
        return None


def _read_records(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _write_records(path: Path, records: dict[str, Any]) -> None:
    """``records`` into ``path`` at once (a temporary file renamed over it: a process reading it
    meanwhile sees the old file or the new one); nothing where the folder cannot be written."""
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".gemm-", suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(records, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _quiet(busy: float | None) -> bool:
    """Whether a measurement may be kept: others used under ``GEMM_QUIET`` of the CPUs' time
    while it ran, or that could not be read (None)."""
    return busy is None or busy < GEMM_QUIET


def _quiet_record(stored: dict[str, Any]) -> bool:
    """Whether a ``gemm.json`` record holds two positive times measured on a quiet machine: its
    ``busy`` share under ``GEMM_QUIET``, or None where it could not be read. A record without
    ``busy`` proves nothing of the machine's load and is measured again."""
    times = all(isinstance(stored.get(k), float) and stored[k] > 0.0 for k in ("aten_s", "onednn_s"))
    busy = stored.get("busy", GEMM_QUIET)
    return times and (busy is None or isinstance(busy, float)) and _quiet(busy)


def measured_gemm() -> dict[str, Any]:
    """The GEMM ``auto`` takes on a CPU outside ``GEMM_AUTO``, at torch's current thread count:
    ``{"chosen", "ratio" (ATen's time over oneDNN's), "aten_s", "onednn_s", "threads", "source"
    ("measured": timed now; else the cache file it was read from), "busy" (timed now: the share of
    the CPUs' time others used meanwhile, ``others_busy``)}``, oneDNN chosen where the ratio is at
    least ``GEMM_MARGIN``; ``{"chosen": "aten", "threads", "source": "oneDNN failed: why"}``
    where oneDNN's product raised. The times are read from the cache file where it holds them for
    this CPU, torch, thread count and ``GEMM_SHAPES``, timed on a quiet machine (``_quiet_record``);
    else measured (``measure_gemms``) and written there with the CPU's name and torch's version
    where the machine was quiet meanwhile (others used under ``GEMM_QUIET`` of the CPUs' time, or
    that could not be read); a busy machine's measurement decides for this process only. A file
    that cannot be read or written is measured past, never an error. Once a process and thread
    count."""
    threads = torch.get_num_threads()
    known = _MEASURED.get(threads)
    if known is not None:  # every forward asks: no lock once measured
        return known
    with _MEASURING:
        if threads in _MEASURED:
            return _MEASURED[threads]
        key, path = _gemm_key(threads), _cache_file()
        records = _read_records(path)
        stored = records.get(key)
        busy = None
        if isinstance(stored, dict) and _quiet_record(stored):
            aten_s, onednn_s, source = stored["aten_s"], stored["onednn_s"], str(path)
        else:
            try:
                times, busy = others_busy(measure_gemms)
            except RuntimeError as e:  # a oneDNN that fails here is never taken (and not written down)
                reason = " ".join(str(e).split())[:200]
                _MEASURED[threads] = {"chosen": "aten", "threads": threads, "source": f"oneDNN failed: {reason}"}
                return _MEASURED[threads]
            aten_s, onednn_s, source = times["aten"], times["onednn"], "measured"
            if path is not None and _quiet(busy):
                _write_records(path, records | {key: {
                    "aten_s": aten_s, "onednn_s": onednn_s, "cpu": _cpu()["name"], "torch": torch.__version__,
                    "threads": threads, "shapes": [list(shape) for shape in GEMM_SHAPES], "busy": busy,
                }})  # fmt: skip
        ratio = aten_s / onednn_s
        _MEASURED[threads] = {
            "chosen": "onednn" if ratio >= GEMM_MARGIN else "aten",
            "ratio": ratio,
            "aten_s": aten_s,
            "onednn_s": onednn_s,
            "threads": threads,
            "source": source,
        }
        if source == "measured":
            _MEASURED[threads]["busy"] = busy
        return _MEASURED[threads]


def _describe_gemm() -> str:
    from wiola.ops.linear import onednn_available

    chosen = select_gemm()
    asked = os.environ.get(GEMM_ENV, "").strip().lower() or "auto"
    if asked not in ("auto", "measure"):
        return f"fp32 GEMM {chosen} (forced: {GEMM_ENV}={asked})"
    cpu = _cpu()
    family = f"{cpu['vendor'] or cpu['machine']} family {cpu['family'] or '?'}"
    if asked == "auto" and (cpu["vendor"], cpu["family"]) in GEMM_AUTO:
        return f"fp32 GEMM {chosen} (auto: {family} measured)"
    if not onednn_available():
        return f"fp32 GEMM {chosen} ({asked}: this torch has no oneDNN)"
    why = f"{family} not in the table; " if asked == "auto" else f"{GEMM_ENV}=measure; "
    m = measured_gemm()
    if "ratio" not in m:
        return f"fp32 GEMM {chosen} ({asked}: {why}{m['source']})"
    if m["source"] != "measured":
        where = f"timed before, {m['source']}"
    elif not _quiet(m.get("busy")):
        where = f"timed now, not kept: others used {m['busy']:.0%} of the CPUs' time meanwhile"
    else:
        where = "timed now"
    return (
        f"fp32 GEMM {chosen} ({asked}: {why}oneDNN ran a prompt's products {m['ratio']:.2f}x as fast as "
        f"ATen on {m['threads']} thread{'s' if m['threads'] != 1 else ''}, taken from {GEMM_MARGIN}x; {where})"
    )


def describe(mode: str | None = None) -> str:
    """One line: the chosen mode and why (forced, or the flag ``auto`` read), then the fp32 GEMM
    and why."""
    chosen = select(mode)
    gemm = _describe_gemm()
    forced = mode if mode is not None else os.environ.get(ENV, "").strip().lower()
    if forced and forced != "auto":
        return f"prefill {chosen} (forced: {ENV if mode is None else 'mode'}={forced}); {gemm}"
    flags = _flags()
    bf16_units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    why = f"CPU has {', '.join(bf16_units)}" if bf16_units else "CPU has no bf16 matrix units"
    return f"prefill {chosen} (auto: {why}; bf16 products miss the 0.001-nat quality rule); {gemm}"


def gemm_applies(model: Any, input_ids: Any) -> bool:
    """Whether this forward's products follow ``select_gemm()``: on a plain CPU, gradients and
    autocast off, an fp32 model (quantized or not), with or without a cache."""
    from wiola.fast.ops import kernels_usable

    return (
        isinstance(input_ids, torch.Tensor)
        and input_ids.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not kernels_usable(input_ids)
        and model.embed.weight.dtype == torch.float32
    )


def applies(model: Any, input_ids: Any, cache: Any) -> bool:
    """Whether the bf16 mode may run this forward: where ``gemm_applies``, for a prompt (``T > 1``)
    with a cache, of a model that is not quantized."""
    return (
        cache is not None
        and gemm_applies(model, input_ids)
        and input_ids.dim() == 2
        and input_ids.shape[1] > 1
        and getattr(model, "quantization", None) is None
    )


def context(model: Any, input_ids: Any, cache: Any) -> contextlib.AbstractContextManager:
    """The context to run this forward in: CPU bf16 autocast where ``select()`` says bf16 and
    ``applies``; else, where ``gemm_applies``, ``select_gemm()``'s fp32 GEMM, and for a forward
    with a cache (a prompt, or a step outside the C++ step) its products and gate a sequence at a
    time (``wiola.ops.linear.cpu_gemm``'s ``rows``: the C++ step's product, where the library
    builds), so that a row's numbers are the same alone and in a batch of rows of its length
    (``docs/SPEC.md``, "A row alone and in a batch"); else a no-op. A scoring pass (no cache) keeps
    one product over the batch's rows, the faster."""
    if applies(model, input_ids, cache) and select() == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if torch.compiler.is_compiling():  # linear keeps F.linear while traced; nothing to choose or time
        return contextlib.nullcontext()
    if gemm_applies(model, input_ids):
        from wiola.fast import decode_step_cpu
        from wiola.ops.linear import cpu_gemm

        rows = decode_step_cpu.product if cache is not None and decode_step_cpu.load() is not None else None
        return cpu_gemm(select_gemm(), rows=rows)
    return contextlib.nullcontext()
