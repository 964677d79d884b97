"""CPU decoding (issue 2's benchmark): the 13m preset, fp32, batch 1 and 8, a 16-token prompt and
128 greedy new tokens, against the published ``wiola13m`` package's Hugging Face ``generate`` on
the same weights, identical tokens asserted. Goal: at least 4× wiola13m at batch 1.

Rows: ``wiola.WiolaModel.generate`` (the readable reference, PyTorch ops) and
``wiola.fast.WiolaModel.generate``, whose one-token steps run the C++ step of
``wiola/fast/decode_step_cpu`` (every layer and the head in one call), once in the variant chosen
for this CPU (``native``) and once forced to each of the ``avx2`` and ``portable`` variants
(``WIOLA_CPU_ISA``; skipped where this CPU lacks the ISA), each with its own ratio to wiola13m
measured in the same run. Quantized rows (issue 15): ``wiola.fast`` with int8 and bf16 weights
(``wiola.fast.quantize``; goals at batch 1: int8 >= 2,000 tok/s, bf16 >= 1,000), each beside the
fp32 ``wiola.fast`` and ``wiola13m`` (both timed again in the row), greedy tokens asserted equal
to the reference's and ``wiola13m``'s on the dequantized weights, and each with the % of its own
floor (its cost counts the packed weights' bytes: ``roofline.weight_bytes``). Every result
records the CPU's model name (with x86's family and model numbers) and flags, the variant and the
path that decoded (``cpu_model``, ``cpu_flags``, ``cpu_isa``, ``decode_path`` in ``extra_info``,
and in its notes).

int4 (group-wise scales, ``wiola.fast.quantize``) joins int8 and bf16 in the quantized rows, with
the int8 step timed beside it (goal at batch 1: int4 >= 1.6x int8 in the same run). Every
quantized row and the fp32 row also report the **read floor**: the time PyTorch takes to read
a matrix of a step's bytes once (its weights, and the keys and values its attention reads from
the cache, on average over the call: ``wiola.fast.speed.cache_bytes``; the faster of its
matrix-vector product and a plain sum over the matrix; ``wiola.fast.speed.READERS``), measured in the same run and read between
the timed calls (``wiola.fast.speed.read_floor``, as ``wiola bench`` does), beside the DRAM
copy floor of ``bench.frame``; ``pct_read_floor`` is that time x the steps over the measured
time. The tg rows also say which resource bounds the step (``bound_by``): the read floor or the
**compute floor** (``wiola.fast.speed.product_floor``: the products' multiply-adds at the rate the
step's own kernels reach on weights in each core's L1, measured between and after the timed calls
and kept at its best), whichever is longer; ``pct_roofline`` is that floor x the steps over the
measured time. Beside them, the variant's fp32 multiply-add peak (``wiola.fast.speed.fma_peak``:
chains of multiply-adds that read no memory) and the most of the read floor a step can reach with
its products' multiply-adds at that peak (``read_ceiling_pct``), beside the goal (80% at batch 1,
60% at batch 8: ``read_goal_pct``): every product multiplies each weight by x in fp32, so where
the ceiling is under the goal, the goal is out of reach on that CPU whatever the kernels. The prompt rows (``test_prefill_cpu``) are llama-bench's pp512: a 512-token
prompt at batch 1 through ``wiola.fast`` in each prompt mode
(``wiola.fast.prefill``: fp32 and bf16 products), fp32 also on the GEMM this CPU's table does not
pick (``WIOLA_CPU_GEMM``: ATen's or oneDNN's), and with bf16, int8 and int4 weights (whose
prompt runs in fp32 on their dequantized values), beside wiola13m's forward of the same prompt.
Each result records the CPU's model and flags, the ISA variant, the threads and the prompt mode
chosen (``tuning``); each tg row also the threads' parts of the step's rows as its timed calls
left them (``balance``: learned from each thread's rate, ``decode_step_cpu.balance``).

The tg rows (``test_tg128_cpu``) are llama-bench's tg128: the same 128 greedy tokens after the
same 16-token prompt, with the prompt's prefill left out of the time (it is done once, and each
timed call puts the cache back as the prefill left it), for fp32, bf16, int8 and int4 at batch 1
and 8, each with the % of the read floor, beside (in the same run) fp32, int8 for the int4 row,
and wiola13m's own decoding after the same prompt for the fp32 rows (its tokens asserted equal to
ours). The rows above (``test_decode_cpu*``) time whole ``generate`` calls, prompt included: what a
request costs end to end.

Under ``--benchmark-disable`` (the CI smoke run) only 8 tokens are generated and the prompt is
32 tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import wiola
from bench import roofline
from bench.hf_baseline import hf_greedy, wiola13m_like
from wiola.fast import decode_step_cpu
from wiola.fast.speed import (
    PRODUCT_BETWEEN,
    READS_BETWEEN,
    bound,
    cache_bytes,
    decoding_only,
    fma_peak,
    product_floor,
    prompt_run,
    read_ceiling,
    read_floor,
)

PROMPT, NEW_TOKENS, SMOKE_TOKENS = 16, 128, 8
READ_GOALS = {1: 0.8, 8: 0.6}  # issue 21's goals: the share of the read floor at batch 1 and at batch 8
PP, SMOKE_PP = 512, 32  # pp512: the prompt rows' length (the smoke run's)
BATCHES = [1, 8]
ISAS = ["native", "avx2", "portable"]  # native: the variant chosen for this CPU


@pytest.fixture(scope="module")
def model() -> wiola.WiolaModel:
    torch.manual_seed(0)
    return wiola.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()


@pytest.fixture(scope="module")
def hf_model(model: wiola.WiolaModel):
    """wiola13m on our weights, or the reason it is unavailable (a string)."""
    try:
        return wiola13m_like(model)
    except Exception as exc:  # ImportError without the package, or a transformers it cannot run on
        return f"wiola13m unavailable: {type(exc).__name__}: {exc}"


def _prompt(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + batch)
    return torch.randint(0, 32000, (batch, PROMPT), generator=gen)


def _cost(config: wiola.WiolaConfig, batch: int, new: int, scheme: str | None = None) -> roofline.Cost:
    # The prompt's forward gives the first new token (the PyTorch path, fp32 weights); each further
    # token costs one decoding step (reading the packed weights of a quantized model).
    cost = roofline.prefill(config, batch, PROMPT, torch.float32)
    if new > 1:
        weights = roofline.weight_bytes(config, scheme)
        cost = cost + roofline.decode(config, batch, PROMPT, new - 1, torch.float32, weights)
    return cost


def _wiola13m_baseline(hf_model, ids: torch.Tensor, new: int, ours: torch.Tensor):
    """wiola13m's greedy ``generate`` as a baseline, after asserting it gives our tokens (or the
    reason it is unavailable)."""
    if isinstance(hf_model, str):
        return hf_model
    mismatch = (hf_greedy(hf_model, ids, new) != ours).nonzero()
    assert mismatch.numel() == 0, f"greedy tokens differ from wiola13m's first at (row, slot) {mismatch[0].tolist()}"
    return lambda: hf_greedy(hf_model, ids, new)


def tuning(scheme: str | None = None) -> dict[str, Any]:
    """The choices the CPU paths made on this machine for ``scheme``'s weights (None or "fp32"): the
    step's own record where it has one (``decode_step_cpu.tuning()``), else its ISA variant and
    thread count; the prompt mode."""
    from wiola.fast import prefill

    record = getattr(decode_step_cpu, "tuning", None)
    out: dict[str, Any] = dict(record(scheme=None if scheme == "fp32" else scheme)) if callable(record) else {}
    out.setdefault("isa", decode_step_cpu.select_isa())
    out.setdefault("threads", torch.get_num_threads())
    out["prefill"] = prefill.describe()
    return out


def _cpu_notes(isa: str | None, path: str, scheme: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """The CPU this ran on (model name, flags), the ISA variant, the decoding path and the tuning
    choices for ``scheme``'s weights: as ``extra_info`` keys and as notes (which also reach
    ``WIOLA_BENCH_JSONL``)."""
    cpu = decode_step_cpu.cpu_info()
    tune = tuning(scheme)
    info = {"cpu_model": cpu["name"], "cpu_flags": cpu["flags"], "cpu_isa": isa, "decode_path": path, "tuning": tune}
    notes = [f"decode path: {path}", f"CPU: {cpu['name']} ({cpu['machine']})", f"CPU flags: {cpu['flags']}"]
    return info, [*notes, f"tuning: {tune}"]


def _read_bytes(config: wiola.WiolaConfig, scheme: str | None, batch: int, new: int) -> int:
    """The bytes a step of a ``new``-token call after the ``PROMPT``-token prompt reads: its weights
    (``roofline.weight_bytes``) and, on average over the call's steps, the cache's keys and values
    (``speed.cache_bytes``)."""
    return roofline.weight_bytes(config, scheme) + cache_bytes(config, batch, PROMPT, new)


def _floor_reads(config: wiola.WiolaConfig, scheme: str | None, batch: int, new: int, run: Any = None) -> Any:
    """Reads of a step's bytes (``_read_bytes``) for ``Bench.run``'s ``between``: ``READS_BETWEEN``
    after each timed call, so that the floor is read at the same moments of a shared machine as the
    step; with a tg call ``run`` (its ``step``), the compute floor's products too
    (``product_floor``, which keeps its best, as ``read_floor`` does)."""
    nbytes = _read_bytes(config, scheme, batch, new)
    step = getattr(run, "step", None)

    def between() -> None:
        read_floor(nbytes, READS_BETWEEN)
        if step is not None:
            product_floor(step, batch, PRODUCT_BETWEEN)
            fma_peak(step, PRODUCT_BETWEEN)

    return between


def _read_floor_pct(rec: dict, config: wiola.WiolaConfig, batch: int, new: int, scheme: str | None) -> None:
    """``rec['pct_read_floor']``: (new − 1) steps each reading a step's bytes (``_read_bytes``: the
    weights and the cache's keys and values) once at the measured read rate (the best of this
    process's reads of that size, those between the timed calls included), over the measured time
    (the prompt's cost left in the time: a lower bound)."""
    nbytes = _read_bytes(config, scheme, batch, new)
    read = read_floor(nbytes)
    t_read = read["s"]
    rec["read_floor_bytes"] = nbytes
    rec["read_floor_s_per_step"] = t_read
    rec["read_floor_gbs"] = nbytes / t_read / 1e9
    rec["read_floor_reader"] = read["reader"]
    rec["read_floor_readers_gbs"] = {k[: -len(" GB/s")]: v for k, v in read.items() if k.endswith(" GB/s")}
    seconds = rec.get("time_s")
    if seconds:
        rec["pct_read_floor"] = 100.0 * (new - 1) * t_read / seconds


def _bound(rec: dict, run: Any, batch: int, new: int) -> str:
    """Which resource bounds the tg call ``run``'s step (``decoding_only``), into ``rec``: its
    compute floor (``product_floor``: the products' multiply-adds at the in-cache rate of the step's
    own kernels, the best of this process's measurements) beside the read floor
    (``_read_floor_pct``, already in ``rec``); ``bound_by`` names the longer of the two,
    ``pct_roofline`` is (new − 1) steps at that floor over the measured time. Beside them the
    variant's fp32 multiply-add peak (``fma_peak``) and the most of the read floor a step can reach
    with its products at that peak (``read_ceiling``), beside the batch's goal (``READ_GOALS``):
    under the goal, no step that multiplies each weight by x in fp32 reaches it on this CPU. The
    clause for the printed line."""
    t_read, seconds = rec["read_floor_s_per_step"], rec["time_s"]
    compute = product_floor(run.step, batch)
    rec["compute_floor_s_per_step"] = compute["s"]
    rec["compute_floor_gmacs"] = compute["macs_per_s"] / 1e9
    rec.update(bound(t_read, compute["s"], new - 1, seconds))
    note = (
        f"; bound by {rec['bound_by']} (read floor {t_read * 1e6:.0f} us a step, compute floor "
        f"{compute['s'] * 1e6:.0f} us at {rec['compute_floor_gmacs']:.0f} G multiply-adds/s in cache): "
        f"{rec['pct_roofline']:.0f}% of the larger"
    )
    peak = fma_peak(run.step)
    if peak is None:
        return note
    rec["fma_peak_gmacs"] = peak["macs_per_s"] / 1e9
    rec["read_ceiling_pct"] = read_ceiling(run.step.config, batch, t_read, peak["macs_per_s"])
    rec["read_goal_pct"] = 100.0 * READ_GOALS[batch] if batch in READ_GOALS else None
    goal = "" if rec["read_goal_pct"] is None else f" (goal {rec['read_goal_pct']:.0f}%)"
    return (
        f"{note}; at this variant's fp32 multiply-add peak ({rec['fma_peak_gmacs']:.0f} G/s, {peak['chains']} "
        f"chains a thread) the products alone allow at most {rec['read_ceiling_pct']:.0f}% of the read floor{goal}"
    )


READ_KEYS = ("pct_read_floor", "read_floor_bytes", "read_floor_gbs", "read_floor_reader", "read_floor_readers_gbs")
BOUND_KEYS = (
    "compute_floor_s_per_step", "compute_floor_gmacs", "bound_by", "pct_roofline", "fma_peak_gmacs",
    "read_ceiling_pct", "read_goal_pct",
)  # fmt: skip


def _timed(
    cpu_bench, fn, config: wiola.WiolaConfig, batch: int, new: int, scheme: str | None, cpu: tuple[dict[str, Any], list[str]],
    **run: Any,
) -> dict:  # fmt: skip
    """``cpu_bench.run`` of a decoding call ``fn`` (``batch`` rows, ``new`` tokens after the
    ``PROMPT``-token prompt) with ``run``'s other arguments (``mode``, ``name``, ``cost``, ``tokens``,
    ``baselines``, ``notes``, ``between``), the CPU's facts (``cpu``, ``_cpu_notes``) recorded with it
    and after its notes, and, where it was timed, the share of the read floor (``_read_floor_pct``)."""
    notes = [*run.pop("notes"), *cpu[1]]
    shape = {"B": batch, "P": PROMPT, "N": new}
    rec = cpu_bench.run(fn, op="decode_cpu", shape=shape, dtype=torch.float32, notes=notes, **run)
    cpu_bench.benchmark.extra_info.update(cpu[0])
    rec.update(cpu[0])
    if not cpu_bench.quick and "tokens_per_s" in rec:
        _read_floor_pct(rec, config, batch, new, scheme)
        for key in READ_KEYS:
            cpu_bench.benchmark.extra_info[key] = rec.get(key)
    return rec


def _fast_copy(model: wiola.WiolaModel, scheme: str | None) -> Any:
    """A ``wiola.fast.WiolaModel`` with ``model``'s weights, gradients off, quantized to ``scheme``
    unless it is None or ``"fp32"``."""
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    fast = FastModel(model.config).eval().requires_grad_(False)
    fast.load_state_dict(model.state_dict())
    return fast if scheme in (None, "fp32") else quantize(fast, scheme)


def _cpp_step_path(monkeypatch) -> str:
    """``decode_step_cpu.describe()`` of the variant this CPU gets (``$WIOLA_CPU_ISA`` unset for
    the test); skips where the C++ step is not available."""
    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    path = decode_step_cpu.describe()
    if not path.startswith("C++"):
        pytest.skip(f"the C++ step is not available here: {path}")
    return path


def _beside(rec: dict, digits: int = 0) -> str:
    """The baselines' tokens/s of a record, ``name rate`` each, for a printed line."""
    return ", ".join(f"{k} {v['tokens_per_s']:.{digits}f}" for k, v in rec["baselines"].items() if "tokens_per_s" in v)


def _record(
    cpu_bench, fn, config: wiola.WiolaConfig, batch: int, new: int, name: str, baselines: dict, notes: list[str],
    cpu: tuple[dict[str, Any], list[str]], scheme: str | None = None,
) -> dict:  # fmt: skip
    """Time ``fn`` (greedy decoding of ``batch`` rows, ``new`` tokens) with its baselines, the CPU
    recorded with the result; prints the ratio to wiola13m."""
    rec = _timed(
        cpu_bench, fn, config, batch, new, scheme, cpu, mode="greedy", name=name,
        cost=_cost(config, batch, new, scheme), tokens=batch * new, baselines=baselines, notes=notes,
        between=_floor_reads(config, scheme, batch, new),
    )  # fmt: skip
    if not cpu_bench.quick:
        _summary(batch, name, rec)
        if scheme is not None:
            goal = {"int8": "2,000 tok/s", "bf16": "1,000 tok/s", "int4": "1.6x int8"}[scheme]
            pct, pct_l3, pct_read = rec.get("pct_floor"), rec.get("pct_floor_l3"), rec.get("pct_read_floor")
            reader = rec.get("read_floor_reader")
            beside = _beside(rec, 1)
            print(
                f"decode CPU B{batch}: {name} {rec['tokens_per_s']:.1f} tok/s (goal at B1: >= {goal}), "
                f"{'' if pct_read is None else f'{pct_read:.0f}% of the read floor ({reader}, same run), '}"
                f"{'' if pct is None else f'{pct:.0f}% of the DRAM copy floor, '}"
                f"{'' if pct_l3 is None else f'{pct_l3:.0f}% of its floor from L3, '}beside it (tok/s): {beside}"
            )
    return rec


def _summary(batch: int, name: str, rec: dict) -> None:
    hf = rec["baselines"]["wiola13m"]
    if "speedup" in hf:
        print(
            f"\ndecode CPU B{batch}: {name} {rec['tokens_per_s']:.1f} tok/s, wiola13m {hf['tokens_per_s']:.1f} tok/s, "
            f"ratio {hf['speedup']:.2f}x (goal at B1: >= 4x)"
        )


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu(cpu_bench, model, hf_model, batch: int) -> None:
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)

    def ours() -> torch.Tensor:
        return model.generate(ids, new, temperature=0)

    baselines = {}
    expected = ours()
    assert expected.shape == (batch, PROMPT + new), f"generate returned shape {tuple(expected.shape)}"
    baselines["wiola13m"] = _wiola13m_baseline(hf_model, ids, new, expected)
    notes = ["13m preset, random weights, same weights in every implementation; greedy tokens identical"]
    _record(
        cpu_bench,
        ours,
        model.config,
        batch,
        new,
        "reference",
        baselines,
        notes,
        _cpu_notes(None, "PyTorch ops (reference)"),
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu_fast(cpu_bench, model, hf_model, batch: int, isa: str, monkeypatch) -> None:
    fast = pytest.importorskip("wiola.fast", reason="wiola.fast does not exist yet")
    if not hasattr(fast, "WiolaModel"):
        pytest.skip("wiola.fast.WiolaModel does not exist yet")
    if isa == "native":
        monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    else:
        try:
            decode_step_cpu.select_isa(isa)
        except ValueError as exc:
            pytest.skip(f"the {isa} variant: {exc}")
        monkeypatch.setenv("WIOLA_CPU_ISA", isa)  # read by the step when it binds to a new cache
        if decode_step_cpu.load() is None:
            pytest.skip(f"the {isa} variant did not build: {decode_step_cpu.BUILD_ERROR}")
    path = decode_step_cpu.describe()  # the native row may be the PyTorch path (no compiler): recorded
    chosen = decode_step_cpu.select_isa() if path.startswith("C++") else None
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    fast_model = fast.WiolaModel(model.config).eval()
    fast_model.load_state_dict(model.state_dict())

    expected = model.generate(ids, new, temperature=0)
    got = fast_model.generate(ids, new, temperature=0)
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, (
        f"wiola.fast greedy tokens differ from the reference's first at {mismatch[0].tolist()}"
    )
    baselines = {"reference": lambda: model.generate(ids, new, temperature=0)}
    baselines["wiola13m"] = _wiola13m_baseline(hf_model, ids, new, got)
    name = "wiola.fast" if isa == "native" else f"wiola.fast[{isa}]"
    notes = ["13m preset, random weights; greedy tokens identical to the reference and to wiola13m"]
    if isa != "native":
        notes.append(f"variant forced with WIOLA_CPU_ISA={isa}")
    _record(
        cpu_bench,
        lambda: fast_model.generate(ids, new, temperature=0),
        model.config,
        batch,
        new,
        name,
        baselines,
        notes,
        _cpu_notes(chosen, path),
    )


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu_quantized(cpu_bench, model, batch: int, scheme: str, monkeypatch) -> None:
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    path = decode_step_cpu.describe()
    chosen = decode_step_cpu.select_isa() if path.startswith("C++") else None
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    fp32 = FastModel(model.config).eval()
    fp32.load_state_dict(model.state_dict())
    packed = FastModel(model.config).eval().requires_grad_(False)
    packed.load_state_dict(model.state_dict())
    quantize(packed, scheme)
    oracle = wiola.WiolaModel(model.config).eval()  # the reference on the dequantized weights
    oracle.load_state_dict(packed.state_dict())

    got = packed.generate(ids, new, temperature=0)
    mismatch = (got != oracle.generate(ids, new, temperature=0)).nonzero()
    assert mismatch.numel() == 0, (
        f"{scheme} greedy tokens differ from the dequantized reference's at {mismatch[0].tolist()}"
    )
    try:
        hf_model = wiola13m_like(oracle)
    except Exception as exc:
        hf_model = f"wiola13m unavailable: {type(exc).__name__}: {exc}"
    baselines = {"fp32": lambda: fp32.generate(ids, new, temperature=0)}
    if scheme == "int4":  # the goal is a ratio to int8, timed in the same run
        int8 = quantize(copy.deepcopy(fp32).requires_grad_(False), "int8")
        baselines["int8"] = lambda: int8.generate(ids, new, temperature=0)
    baselines["wiola13m"] = _wiola13m_baseline(hf_model, ids, new, got)
    notes = [
        f"13m preset, random weights, {scheme} weight-only quantization (wiola.fast.quantize); greedy tokens "
        "identical to the reference and to wiola13m on the dequantized weights; fp32 = wiola.fast unquantized",
        f"weights read per step: {roofline.weight_bytes(model.config, scheme) / 1e6:.1f} MB "
        f"(fp32: {roofline.weight_bytes(model.config) / 1e6:.1f} MB)",
    ]
    _record(
        cpu_bench,
        lambda: packed.generate(ids, new, temperature=0),
        model.config,
        batch,
        new,
        f"wiola.fast {scheme}",
        baselines,
        notes,
        _cpu_notes(chosen, f"{path}, {scheme} weights", scheme),
        scheme,
    )


TG_SCHEMES = ["fp32", "bf16", "int8", "int4"]


def hf_decoding_only(hf_model, ids: torch.Tensor, new: int):
    """wiola13m's greedy decoding of ``new`` tokens after the prompt, as its ``generate`` runs it
    (one forward of the last token per step over its ``DynamicCache``), the prompt's forward done
    here once and its cache copied for each call."""
    with torch.inference_mode():
        out = hf_model(ids, use_cache=True)
    past, last = out.past_key_values, out.logits[:, -1]

    def run() -> torch.Tensor:
        with torch.inference_mode():
            cache = copy.deepcopy(past)
            tok = last.argmax(-1, keepdim=True)
            toks = [tok]
            for _ in range(new - 1):
                step = hf_model(tok, past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                tok = step.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(tok)
            return torch.cat(toks, dim=1)

    return run


@pytest.mark.parametrize("scheme", TG_SCHEMES)
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_tg128_cpu(cpu_bench, model, hf_model, batch: int, scheme: str, monkeypatch) -> None:
    """tg128 as llama-bench reports it: the 128 greedy tokens after a 16-token prompt, the prompt's
    time left out (``decoding_only``), per weight type, with the % of the read floor (``new - 1``
    steps each reading the weights once at the read floor's rate, measured in the same run). Beside
    it, in the same run: fp32 (for a quantized row), int8 (for int4: the goal is 1.6x) and
    wiola13m's own decoding after the same prompt (``hf_decoding_only``: fp32 rows; its tokens
    asserted equal to ours). Tokens asserted equal to ``generate``'s."""
    path = _cpp_step_path(monkeypatch)
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    ours = _fast_copy(model, scheme)
    run = decoding_only(ours, ids, new)
    got = run().clone()
    want = ours.generate(ids, new, temperature=0)[:, PROMPT:]
    mismatch = (got != want).nonzero()
    assert mismatch.numel() == 0, (
        f"{scheme}: decoding-only tokens differ from generate's first at {mismatch[0].tolist()}"
    )
    baselines: dict[str, Any] = {}
    if scheme != "fp32":
        baselines["fp32"] = decoding_only(_fast_copy(model, "fp32"), ids, new)
    if scheme == "int4":
        baselines["int8"] = decoding_only(_fast_copy(model, "int8"), ids, new)
    if scheme == "fp32":
        if isinstance(hf_model, str):
            baselines["wiola13m"] = hf_model
        else:
            hf_run = hf_decoding_only(hf_model, ids, new)
            differ = (hf_run() != got).nonzero()
            assert differ.numel() == 0, f"wiola13m's decoded tokens differ from ours first at {differ[0].tolist()}"
            baselines["wiola13m"] = hf_run
    weights = roofline.weight_bytes(model.config, None if scheme == "fp32" else scheme)
    cpu = _cpu_notes(decode_step_cpu.select_isa(), f"{path}, {scheme} weights", scheme)
    quantized = None if scheme == "fp32" else scheme
    rec = _timed(
        cpu_bench,
        run,
        model.config,
        batch,
        new,
        quantized,
        cpu,
        mode="tg",
        name=f"tg{new} {scheme}",
        cost=roofline.decode(model.config, batch, PROMPT, new - 1, torch.float32, weights),
        tokens=batch * (new - 1),  # the timed steps' tokens: the first comes from the untimed prefill
        baselines=baselines,
        notes=[
            f"tg{new}: 13m preset, random weights, {scheme} weights ({weights / 1e6:.1f} MB read a step, and "
            f"{cache_bytes(model.config, batch, PROMPT, new) / 1e6:.1f} MB of the cache's keys and values on average), "
            f"after a {PROMPT}-token prompt whose prefill is not timed; tokens identical to generate's",
        ],
        between=_floor_reads(model.config, quantized, batch, new, run),
    )
    # the threads' parts of the rows as the timed calls left them (learned from their rates)
    balance = decode_step_cpu.balance()
    cpu_bench.benchmark.extra_info["balance"] = rec["balance"] = balance
    if not cpu_bench.quick and "tokens_per_s" in rec:
        bound_note = _bound(rec, run, batch, new)
        for key in BOUND_KEYS:
            cpu_bench.benchmark.extra_info[key] = rec.get(key)
        beside = _beside(rec)
        print(
            f"\ntg{new} CPU B{batch}: {scheme} {rec['tokens_per_s']:.0f} tok/s, "
            f"{rec.get('pct_read_floor', float('nan')):.0f}% of the read floor "
            f"({rec['read_floor_gbs']:.1f} GB/s, {rec['read_floor_reader']}, same run); beside it (tok/s): {beside}"
            f"{bound_note}; the threads' parts of the rows: {balance}"
        )


# Sampled decoding's settings: temperature alone, and with a nucleus (``wiola generate``'s default).
SAMPLINGS = {"t0.8": {"temperature": 0.8}, "t0.8-p0.95": {"temperature": 0.8, "top_p": 0.95}}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_sampled_cpu(cpu_bench, model, batch: int, sampling: str, monkeypatch) -> None:
    """Sampled decoding, bf16 weights: ``generate`` of 128 tokens after a 16-token prompt (its
    prefill included) from one seeded generator, at temperature 0.8 alone and with top-p 0.95,
    with the % of its steps' read floor (a lower bound: the prompt stays in the time). Beside it in
    the same run: greedy ``generate`` of the same model (what sampling adds: the Exp(1) noise, one
    stream that the step's threads share, and the C++ sampler) and ``wiola.generation.generate``'s
    loop on the same model (the one-token steps through the C++ step, the sampler in torch), whose
    tokens are asserted equal to ours."""
    from wiola import generation as reference_loop

    path = _cpp_step_path(monkeypatch)
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    ours = _fast_copy(model, "bf16")
    settings = SAMPLINGS[sampling]

    def sampled(loop: Any) -> Any:
        return lambda: loop(ids, new, generator=torch.Generator().manual_seed(0), **settings)

    run, python_loop = sampled(ours.generate), sampled(lambda *a, **k: reference_loop.generate(ours, *a, **k))
    differ = (run() != python_loop()).nonzero()
    assert differ.numel() == 0, f"{sampling}: tokens differ from wiola.generation's loop first at {differ[0].tolist()}"
    cpu = _cpu_notes(decode_step_cpu.select_isa(), f"{path}, bf16 weights", "bf16")
    rec = _timed(
        cpu_bench,
        run,
        model.config,
        batch,
        new,
        "bf16",
        cpu,
        mode="tg-sampled",
        name=f"generate {new} bf16 {sampling}",
        cost=_cost(model.config, batch, new, "bf16"),  # the prompt's prefill is in the timed call
        tokens=batch * new,
        baselines={"greedy": lambda: ours.generate(ids, new, temperature=0), "Python sampler loop": python_loop},
        notes=[
            f"sampled generate: 13m preset, random weights, bf16, {settings}, one generator seeded 0, after a "
            f"{PROMPT}-token prompt whose prefill is in the time; tokens identical to wiola.generation's loop",
        ],
        between=_floor_reads(model.config, "bf16", batch, new),
    )
    if not cpu_bench.quick and "tokens_per_s" in rec:
        print(
            f"\nsampled generate CPU B{batch} {sampling}: {rec['tokens_per_s']:.0f} tok/s, at least "
            f"{rec.get('pct_read_floor', float('nan')):.0f}% of the read floor; beside it (tok/s): {_beside(rec)}"
        )


ONNX_MODES = ["fp32", "int8", "int8-matmul", "int4", "int4-matmul"]


@pytest.fixture(scope="module")
def onnx_exports() -> dict:
    """Filled by ``_onnx_export``: mode -> (the wiola.fast model, its ONNX Runtime export folder),
    or the reason the export is unavailable; each mode exported once per module."""
    return {}


def _onnx_scheme(mode: str) -> str | None:
    """The weights' quantization scheme of an ONNX mode (``int8-matmul`` -> ``int8``; fp32: None)."""
    return None if mode == "fp32" else mode.removesuffix("-matmul")


def _onnx_export(cache: dict, model: wiola.WiolaModel, mode: str, folder) -> Any:
    if mode not in cache:
        try:
            from wiola.export.onnx import export_onnx

            fast = _fast_copy(model, _onnx_scheme(mode))
            export_onnx(fast, folder, int8_matmul=mode.endswith("-matmul"))
            cache[mode] = (fast, folder)
        except ImportError as exc:
            cache[mode] = f"export unavailable: {exc}"
    return cache[mode]


@pytest.mark.parametrize("mode", ONNX_MODES)
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu_onnx(cpu_bench, model, onnx_exports, tmp_path_factory, batch: int, mode: str) -> None:
    """The exported runtime (issue 15): ``wiola export --format onnx`` run by ONNX Runtime's Python
    API (``wiola.export.runner.OnnxModel``; the prompt fed one token a step), beside our C++ step
    on the same weights (``wiola.fast``, fp32, int8 or int4) and wiola13m. fp32, int8 and int4
    (stored packed, dequantized in the graph: exact): greedy tokens asserted identical to the
    oracle's. int8-matmul and int4-matmul (MatMulNBits with int8 activations): not the oracle's
    function; the tokens that agree with it are recorded."""
    pytest.importorskip("onnxruntime")
    got_export = _onnx_export(onnx_exports, model, mode, tmp_path_factory.mktemp(f"onnx-{mode}"))
    if isinstance(got_export, str):
        pytest.skip(got_export)
    fast, folder = got_export
    from wiola.export.runner import OnnxModel

    runtime = OnnxModel(folder, threads=torch.get_num_threads())
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    oracle = wiola.WiolaModel(model.config).eval()  # the reference on the (dequantized) weights
    oracle.load_state_dict(fast.state_dict())
    want = oracle.generate(ids, new, temperature=0)
    got = torch.from_numpy(runtime.generate(ids.numpy(), new, eos_token_id=None))
    agree = (got[:, PROMPT:] == want[:, PROMPT:]).cumprod(dim=1).sum(dim=1)  # tokens before the first difference
    if not mode.endswith("-matmul"):
        mismatch = (got != want).nonzero()
        assert mismatch.numel() == 0, f"ONNX {mode} greedy tokens differ from the oracle's at {mismatch[0].tolist()}"
    ids_np = ids.numpy()
    baselines: dict[str, Any] = {"wiola.fast": lambda: fast.generate(ids, new, temperature=0)}
    try:
        hf_model = wiola13m_like(oracle)
        baselines["wiola13m"] = lambda: hf_greedy(hf_model, ids, new)
    except Exception as exc:
        baselines["wiola13m"] = f"wiola13m unavailable: {type(exc).__name__}: {exc}"
    scheme = _onnx_scheme(mode)
    read = roofline.weight_bytes(model.config, scheme if mode.endswith("-matmul") else None)
    held = {
        "fp32": "fp32",
        "int8": "stored int8, dequantized at load (fp32 products)",
        "int8-matmul": "int8 in MatMulNBits, activations rounded to int8 per block",
        "int4": "stored int4 nibbles, unpacked in the graph (fp32 products)",
        "int4-matmul": "int4 in MatMulNBits, activations rounded to int8 per block",
    }[mode]
    notes = [
        f"13m preset, random weights; ONNX Runtime {runtime.session.get_providers()[0]}, "
        f"{torch.get_num_threads()} intra-op threads; the prompt fed one token a step",
        f"ONNX {mode}: weights {held}; wiola.fast = our C++ step on the {scheme or 'fp32'} weights",
        f"greedy tokens agreeing with the oracle before the first difference, per row: {agree.tolist()} of {new}",
    ]
    cost = roofline.decode(model.config, batch, 1, PROMPT + new - 1, torch.float32, read)
    rec = cpu_bench.run(
        lambda: runtime.generate(ids_np, new, eos_token_id=None),
        op="decode_cpu",
        mode="greedy",
        name=f"onnxruntime {mode}",
        cost=cost,
        shape={"B": batch, "P": PROMPT, "N": new},
        dtype=torch.float32,
        tokens=batch * new,
        baselines=baselines,
        notes=notes,
        info={"agree_tokens": agree.tolist(), "export_mb": (folder / "model.onnx").stat().st_size / 1e6},
    )
    cpu = _cpu_notes(None, f"onnxruntime {mode}")
    cpu_bench.benchmark.extra_info.update(cpu[0])
    if not cpu_bench.quick:
        ours = rec["baselines"]["wiola.fast"].get("tokens_per_s")
        hf = rec["baselines"].get("wiola13m", {}).get("tokens_per_s")
        pct = rec.get("pct_floor")
        print(
            f"\ndecode CPU B{batch}: onnxruntime {mode} {rec['tokens_per_s']:.1f} tok/s"
            f"{'' if pct is None else f' ({pct:.0f}% of its floor)'}, "
            f"our step {ours and f'{ours:.1f}'} tok/s, wiola13m {hf and f'{hf:.1f}'} tok/s; agreement {agree.tolist()}"
        )


# (prompt mode, weights, GEMM): "auto" is the fp32 GEMM this CPU's table picks, "other" the one it does not.
PP_ROWS = [
    ("fp32", "fp32", "auto"),
    ("fp32", "fp32", "other"),
    ("bf16", "fp32", "auto"),
    ("fp32", "bf16", "auto"),
    ("fp32", "int8", "auto"),
    ("fp32", "int4", "auto"),
]


@pytest.mark.parametrize(
    "prefill_mode,weights,gemm",
    PP_ROWS,
    ids=[f"{m}-products-{w}-weights" + ("-other-gemm" if g == "other" else "") for m, w, g in PP_ROWS],
)
def test_prefill_cpu(cpu_bench, model, hf_model, prefill_mode: str, weights: str, gemm: str, monkeypatch) -> None:
    """pp512: a 512-token prompt at batch 1 through ``wiola.fast`` (with a cache, the logits of the
    last position: what ``generate`` runs before its first step) in the prompt mode
    ``prefill_mode`` (``WIOLA_CPU_PREFILL``) with ``weights`` (fp32, or quantized by
    ``wiola.fast.quantize``: the prompt then runs in fp32 on the dequantized weights, the step's
    oracle), beside the reference's forward on the same weights, wiola13m's forward of the same
    prompt (on the fp32 weights) and, for quantized weights, the fp32 model's prompt. ``gemm``
    ``other``: the fp32 products on the GEMM that ``auto`` does not pick here (``WIOLA_CPU_GEMM``),
    so that one run compares the two on this CPU. fp32 products: the next token asserted equal to
    the reference's; bf16: the largest logit difference from fp32 is recorded (its loss cost:
    ``bench.quality``)."""
    from wiola.fast import prefill
    from wiola.ops.linear import onednn_available

    monkeypatch.setenv(prefill.ENV, prefill_mode)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(prefill.GEMM_ENV, raising=False)
    if gemm == "other":
        if not onednn_available():
            pytest.skip("this torch has no oneDNN: ATen is the only fp32 GEMM")
        monkeypatch.setenv(prefill.GEMM_ENV, "aten" if prefill.select_gemm() == "onednn" else "onednn")
    T = SMOKE_PP if cpu_bench.quick else PP
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(512))

    fast = _fast_copy(model, weights)
    oracle = model
    if weights != "fp32":  # the reference on the weights the quantized model stands for
        oracle = type(model)(model.config).eval().requires_grad_(False)
        oracle.load_state_dict(fast.state_dict())
    ours, reference = prompt_run(fast, ids), prompt_run(oracle, ids)
    got, want = ours(), reference()
    diff = float((got - want).abs().max())
    if prefill_mode == "fp32":
        assert int(got.argmax()) == int(want.argmax()), (
            f"the fp32 prompt's next token differs from the reference's ({weights} weights)"
        )
    baselines: dict[str, Any] = {"reference": reference}
    if weights != "fp32":
        baselines["fp32"] = prompt_run(_fast_copy(model, "fp32"), ids)
    if isinstance(hf_model, str):
        baselines["wiola13m"] = hf_model
    else:

        def hf_prompt() -> torch.Tensor:
            with torch.inference_mode():
                return hf_model(ids, attention_mask=torch.ones_like(ids), use_cache=True).logits[:, -1:]

        baselines["wiola13m"] = hf_prompt
    cpp = prefill_mode == "fp32" and decode_step_cpu.load() is not None  # bf16 products: autocast, ATen throughout
    gemm_name = "oneDNN" if prefill.select_gemm() == "onednn" else "ATen"
    path = f"{gemm_name} products, C++ attention, RMSNorms and SiLU gate" if cpp else "PyTorch prompt path"
    cpu = _cpu_notes(decode_step_cpu.select_isa(), f"{path}, {prefill.describe()}", weights)
    name = f"wiola.fast prefill {prefill_mode}" + ("" if weights == "fp32" else f", {weights} weights")
    if gemm == "other":
        name += f", {gemm_name} GEMM"
    rec = cpu_bench.run(
        ours,
        op="prefill_cpu",
        mode="prompt",
        name=name,
        cost=roofline.prefill(model.config, 1, T, torch.float32),
        shape={"B": 1, "P": T},
        dtype=torch.float32,
        tokens=T,
        baselines=baselines,
        notes=[
            f"pp{T}: 13m preset, random weights, batch 1, {weights} weights"
            f"{'' if weights == 'fp32' else ' (the prompt in fp32 on their dequantized values)'}; "
            f"max |logit - reference| {diff:.2e}",
            *cpu[1],
        ],
        info={"max_abs_logit_diff": diff, "weights": weights},
    )
    cpu_bench.benchmark.extra_info.update(cpu[0])
    if not cpu_bench.quick:
        print(f"\nprefill CPU pp{T}: {name} {rec['tokens_per_s']:.0f} tok/s; beside it: {_beside(rec)}")
