"""The device check's plan, made on the CPU: what each stage compiles and whether it fits its budget.

    python -m bench.device_check plan [--budget 420] [--aot bench/aot_builds.json] [--factor 1.0]

For each stage of ``bench/device_check.sh`` (in the order it runs) the plan lists the Triton
kernels it would compile: every autotuned kernel × the autotune configs a launch tries (read from
the ``triton.autotune`` objects of ``kernels/`` and pruned by the autotuner's own
``early_config_prune`` for the launch's dtype and head width) × the distinct compiled variants
(dtype, specialisations, constexprs) its launches need, and the autotune keys each process
benchmarks. Compile seconds come from ahead-of-time builds measured on a CPU
(``bench/aot_builds.json``, written by ``python -m tests.aot_build --json``: kernel, arch, dtype,
config, seconds, cpu_seconds, ...) when that file is there, else from the fallback per-kernel
medians below, measured here and labelled as such. Binaries compiled by an earlier stage are not
counted again (the stages share one ``TRITON_CACHE_DIR``); autotune keys are, per process.

What is declared, not introspected: the launches of each stage (which kernels at which dtype,
head width, sequence length, mask, batch rows: written from the tests and benchmarks the stage
runs), the count of fixed-config (not autotuned) kernel builds, the autotuner's benchmarking
cost per config, and each stage's allowance for running its work besides compiling. Those are
estimates; the plan prints them as such.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Seconds per stage in the default 420 s run (the shell reads them through `budgets`); the
# compile-heavy stage gets what is left. parity_workers: pytest-xdist workers of the parity stage.
BUDGETS: dict[str, int] = {
    "setup": 30,
    "headline": 160,
    "parity": 110,
    "split": 60,
    "sanitizer": 60,
    "report": 20,
    "parity_workers": 8,
}


# Per-kernel medians of ahead-of-time builds (tests/aot_build.build, sm_90, triton 3.6) measured
# on this project's 2-core CPU machine (load average 3-5) on 2026-11-30: 7 D32 bf16 configs per
# attention kernel, 4/4/14 butterfly builds, and 11 builds of gate, rms_norm, cross_entropy and
# decode kernels for every other kernel ("*").
FALLBACK_SECONDS = {
    "attention_fwd": 1.34,
    "attention_bwd_dq": 1.17,
    "attention_bwd_dkdv": 1.27,
    "attention_bwd_preprocess": 0.86,
    "butterfly_up": 0.58,
    "butterfly_up_bwd": 0.80,
    "butterfly_down": 0.50,
    "*": 0.39,
}
FALLBACK_LABEL = "fallback: AOT build medians measured on the CPU machine (bench/plan.py FALLBACK_SECONDS)"
# Triton's autotuner times each config with do_bench (25 ms warm-up + 100 ms of repetitions, plus
# its first estimating calls and L2 flushes): an assumption per config and key, not a measurement.
BENCH_SECONDS_PER_CONFIG = 0.2
DEFAULT_AOT = Path(__file__).with_name("aot_builds.json")


# ------------------------------------------------------------------------------- launches
@dataclass(frozen=True)
class Launch:
    """One use of a kernel in a stage.

    ``kernel`` is the family name of the ahead-of-time builds (``attention_fwd``). ``key`` is what
    the autotuner tunes once per process (``None``: a fixed-config launch, one build, never
    tuned); ``binary`` is what a compiled variant depends on besides the config (dtype,
    specialisations of integer arguments, constexprs); ``D`` is the head width the autotuner
    prunes its configs by, with ``dtype`` (``None``: no head width), and ``rows`` the N bucket
    (butterfly: its few-row tiles; ``None``: not pruned by rows).
    """

    kernel: str
    dtype: str
    binary: tuple
    key: tuple | None = None
    D: int | None = None
    rows: int | None = None


def _spec(n: int) -> str:
    """Triton specialises integer arguments equal to 1 and multiples of 16."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "n"


def attention(dtype: str, D: int, T: int, mask: bool, backward: bool) -> list[Launch]:
    """The launches of one ``wiola_kernels.attention`` call (forward, and the backward's three kernels).

    Keys as the autotuners form them: (T_BUCKET, D, HAS_MASK), the forward's STORE_RESIDUAL (set
    for a bf16/fp16 call that needs gradients), and the dtypes (``dtype`` stands for them)."""
    from wiola_kernels.attention import _t_bucket

    residual = backward and dtype != "fp32"
    key = (_t_bucket(T), D, mask)
    out = [Launch("attention_fwd", dtype, (D, mask, _spec(T), residual), (*key, residual, dtype), D)]
    if backward:
        out += [
            Launch("attention_bwd_preprocess", dtype, (D, _spec(T))),
            Launch("attention_bwd_dq", dtype, (D, mask, _spec(T)), (*key, dtype), D),
            Launch("attention_bwd_dkdv", dtype, (D, mask, _spec(T)), (*key, dtype), D),
        ]
    return out


def butterfly(dtype: str, D: int, F: int, N: int, residual: str | None, backward: bool) -> list[Launch]:
    """The launches of one ``wiola_kernels.butterfly`` call on N rows: autotuned for bf16/fp16 (keys
    (N_BUCKET, D, F), down's HAS_RESIDUAL, and the dtypes, the residual's included), one small
    fixed tile for fp32. ``residual``: the residual's dtype, or ``None``."""
    from wiola_kernels.butterfly import _n_bucket

    if dtype == "fp32":
        out = [Launch("butterfly_up", dtype, (_spec(N),)), Launch("butterfly_down", dtype, (_spec(N), residual))]
        return out + ([Launch("butterfly_up_bwd", dtype, (_spec(N),))] if backward else [])
    key = (_n_bucket(N), D, F)
    out = [
        Launch("butterfly_up", dtype, (_spec(N),), (*key, dtype), rows=key[0]),
        Launch(
            "butterfly_down", dtype, (_spec(N), residual), (*key, residual is not None, dtype, residual), rows=key[0]
        ),
    ]
    return out + ([Launch("butterfly_up_bwd", dtype, (_spec(N),), (*key, dtype))] if backward else [])


def fixed(kernel: str, dtype: str, count: int, where: str) -> list[Launch]:
    """``count`` distinct builds of fixed-config kernels (gate, rms_norm, cross_entropy, decode)
    made by the work ``where`` (builds of different works are counted as different)."""
    return [Launch(kernel, dtype, (where, i)) for i in range(count)]


def forced(kernel: str, dtype: str, binary: tuple) -> list[Launch]:
    """Every autotune config of ``kernel`` (of every dtype's list) built once in ``dtype`` with an
    explicit config (no tuning): the marker ``("forced",)`` in the key makes ``plan_stage`` count
    all configs, unpruned, untimed."""
    return [Launch(kernel, dtype, binary, ("forced",))]


# --------------------------------------------------------------------------------- stages
@dataclass
class Stage:
    """One stage of the device check: its launches, its budget and its non-compile allowance."""

    name: str
    what: str
    budget_s: float
    launches: list[Launch]
    allowance_s: float  # running the work itself (tests, timing loops, model builds): declared
    allowance_note: str
    processes: int = 1  # pytest-xdist workers sharing the compiles and the tuning
    one_config: bool = False  # bench.parity_plugin: each autotuner tries one config per key
    autotune_cache: bool = False  # TRITON_CACHE_AUTOTUNING=1: keys tuned by an earlier such stage are not re-timed
    extra_compile_s: float = 0.0  # compiles outside Triton's autotuned kernels (torch.compile): declared
    extra_note: str = ""
    optional: bool = False  # runs only in the time left; not required to fit


@dataclass
class StagePlan:
    stage: Stage
    rows: list[dict[str, Any]] = field(default_factory=list)  # per kernel: configs, binaries, keys, seconds
    compile_s: float = 0.0  # CPU seconds of new builds
    tune_s: float = 0.0  # seconds the autotuners spend timing configs
    cached_builds: int = 0  # builds an earlier stage already made
    cached_keys: int = 0  # autotune results an earlier stage left on disk
    wall_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.wall_s <= self.stage.budget_s


# tuner(dtype, D, rows): the configs a launch of that dtype, head width and N bucket tries (rows
# None: a launch not pruned by rows); tuner(None, None, None): every config
Tuner = Callable[[str | None, int | None, int | None], list[dict[str, Any]]]
Tuners = Mapping[str, Tuner]
Seconds = Callable[[str, str, dict[str, Any]], tuple[float, str]]


def plan_stage(
    stage: Stage,
    tuners: Tuners,
    seconds: Seconds,
    built: set[tuple] | None = None,
    factor: float = 1.0,
    tuned_on_disk: set[tuple] | None = None,
) -> StagePlan:
    """Count the builds and tunings of ``stage`` and estimate its wall time.

    ``tuners[kernel](dtype, D, rows)`` gives the configs the autotuner of ``kernel`` tries for a
    launch of that dtype, head width and N bucket (``Launch.rows``; dicts of ``BLOCK_*``, ``num_warps``, ``num_stages``); a launch
    without a key, or of a kernel not in ``tuners``, is one fixed-config build (config ``{}``).
    ``seconds(kernel, dtype, config)`` gives one build's seconds and where the number comes
    from. ``built`` holds the builds of earlier stages (updated in place); a
    build made earlier is counted as cached, one repeated within the stage once. ``tuned_on_disk``
    holds the keys tuned by earlier stages with ``autotune_cache`` (updated in place when this
    stage has it too): such a stage does not time them again.

    Per autotuned launch whose key is new to the process: every config is built for its binary
    variant (once per stage and variant) and timed, ``BENCH_SECONDS_PER_CONFIG`` each. A launch
    whose key is already tuned (earlier in the stage, or on disk) builds only the winner, for
    its variant: one build at the mean seconds of the configs, none where every config of that
    variant is already built. With ``stage.one_config`` a key builds and times one config (which
    one depends on the key, so one build per key and variant is counted, at the mean seconds of
    the configs). Compile seconds are multiplied by ``factor``. Wall = (compile + tuning) /
    processes + extra compiles + allowance.
    """
    built = set() if built is None else built
    earlier = set(built)
    out = StagePlan(stage)
    rows: dict[str, dict[str, Any]] = {}
    keys_seen: set[tuple] = set()
    for ln in stage.launches:
        is_forced = ln.key == ("forced",)
        if ln.key is None or ln.kernel not in tuners:
            configs: list[dict[str, Any]] = [{}]
        else:
            configs = tuners[ln.kernel](None, None, None) if is_forced else tuners[ln.kernel](ln.dtype, ln.D, ln.rows)
            if not configs:
                raise ValueError(f"{stage.name}: no autotune config of {ln.kernel} for {ln.dtype} D={ln.D}")
        tuned = ln.key is not None and not is_forced and len(configs) > 1
        k = (ln.kernel, ln.dtype, ln.key)
        on_disk = stage.autotune_cache and tuned_on_disk is not None and tuned and k in tuned_on_disk
        row = rows.setdefault(
            ln.kernel,
            {"kernel": ln.kernel, "configs": set(), "builds": 0, "keys": 0, "compile_s": 0.0, "tune_s": 0.0,
             "sources": set()},
        )  # fmt: skip
        row["configs"].update(json.dumps(c, sort_keys=True) for c in configs)
        timed = [seconds(ln.kernel, ln.dtype, c) for c in configs]
        every = [((ln.kernel, ln.dtype, ln.binary, json.dumps(c, sort_keys=True)), s, source)
                 for c, (s, source) in zip(configs, timed)]  # fmt: skip
        builds = every
        if tuned and (stage.one_config or on_disk or k in keys_seen):  # one config of the key for this variant
            if all(b in built for b, _, _ in every):
                builds = every[:1]  # already built: cached or repeated
            else:
                which = "one config" if stage.one_config else "winner"
                builds = [((ln.kernel, ln.dtype, ln.binary, (which, ln.key)), statistics.fmean(t for t, _ in timed),
                           timed[0][1])]  # fmt: skip
        for build, s, source in builds:
            if build in earlier:
                out.cached_builds += 1
            elif build not in built:
                built.add(build)
                row["builds"] += 1
                row["compile_s"] += s * factor
                row["sources"].add(source)
        if tuned and k not in keys_seen:
            keys_seen.add(k)
            if on_disk:
                out.cached_keys += 1
            else:
                row["keys"] += 1
                row["tune_s"] += (1 if stage.one_config else len(configs)) * BENCH_SECONDS_PER_CONFIG
            if stage.autotune_cache and tuned_on_disk is not None:
                tuned_on_disk.add(k)
    for row in rows.values():
        row["configs"] = len(row["configs"])
        row["sources"] = sorted(row["sources"])
        out.rows.append(row)
        out.compile_s += row["compile_s"]
        out.tune_s += row["tune_s"]
    procs = max(1, stage.processes)
    out.wall_s = (out.compile_s + out.tune_s) / procs + stage.extra_compile_s + stage.allowance_s
    return out


# ------------------------------------------------------------------------ introspection
def _config_dict(cfg: Any) -> dict[str, Any]:
    return {**dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def kernel_tuners() -> dict[str, Tuner]:
    """The autotuners of ``kernels/``, by the family name of their ahead-of-time builds.

    Found as the ``triton.autotune`` objects among the attributes of the modules that
    ``wiola_kernels.aot.AOT_OPS`` names; each is named after the specs of ``aot_specs(op)`` built
    from the same ``@triton.jit`` function. The returned ``tuner(dtype, D, rows=None)`` gives the
    configs after the autotuner's own ``early_config_prune``, called as Triton calls it at launch:
    the positional arguments (here ``Q``: an empty tensor of the launch's dtype, and ``N_BUCKET``
    when rows are given) and the constexpr keywords (here ``D``). ``tuner(None, None)``: every
    config.
    """
    import importlib

    import torch
    from triton.runtime.autotuner import Autotuner

    from wiola_kernels._utils import TRITON_DTYPE
    from wiola_kernels.aot import AOT_OPS, aot_specs

    torch_dtype = {name: dt for dt, name in TRITON_DTYPE.items()}
    tuners: dict[str, Tuner] = {}
    for op in AOT_OPS:
        mod, specs = importlib.import_module(f"wiola_kernels.{op}"), aot_specs(op)
        for attr, obj in vars(mod).items():
            if not isinstance(obj, Autotuner):
                continue
            names = {s.kernel for s in specs if s.fn is obj.fn}
            if len(names) != 1:
                raise RuntimeError(
                    f"wiola_kernels.{op}.{attr}: no single AOT family for its @triton.jit function: {names}"
                )

            def configs(
                dtype: str | None, D: int | None, rows: int | None = None, tuner: Autotuner = obj
            ) -> list[dict[str, Any]]:
                cfgs = list(tuner.configs)
                if dtype is not None and tuner.early_config_prune is not None:
                    if dtype not in torch_dtype:
                        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(torch_dtype)}")
                    named = {"Q": torch.empty(0, dtype=torch_dtype[dtype])}
                    if rows is not None:
                        named["N_BUCKET"] = rows
                    cfgs = tuner.early_config_prune(cfgs, named, D=D)
                return [_config_dict(c) for c in cfgs]

            tuners[names.pop()] = configs
    return tuners


# ----------------------------------------------------------------------- build seconds
_FIELDS = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "num_warps": "w", "num_stages": "s"}


def _config_tag(cfg: Mapping[str, Any] | str) -> dict[str, int]:
    """``{"BM": 128, "BN": 64, "w": 4, "s": 3}`` from a config dict or a spec-style string
    (``"BM128,BN64,w4,s3"``, ``"BM64,BN64,BK64,w4s3"``)."""
    if isinstance(cfg, Mapping):
        return {_FIELDS[k]: int(v) for k, v in cfg.items() if k in _FIELDS}
    return {k: int(v) for k, v in re.findall(r"(?<![A-Za-z])(BM|BN|BK|w|s)(\d+)", cfg)}


def load_aot_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of ``bench/aot_builds.json`` (``python -m tests.aot_build --json``: ``{"builds":
    [...], ...}``), or a plain list of them, or ``{"records": [...]}``. ``arch`` as ``"sm_90"`` or
    ``90``; ``cpu_seconds`` (the build's own CPU time) preferred over ``seconds`` (wall time,
    inflated by other load on the machine) when present.

    Each needs ``kernel`` (family, or a spec name ``family[...]``) and ``seconds``; ``arch``,
    ``dtype`` and ``config`` (dict or spec-style string) are used when present.
    """
    data = json.loads(Path(path).read_text())
    records = data.get("builds", data.get("records")) if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a list of build records or {{'builds'|'records': [...]}}")
    if not records:
        raise ValueError(f"{path}: no build records")
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict) or "kernel" not in r or "seconds" not in r:
            raise ValueError(f"{path}: record {i} needs 'kernel' and 'seconds': {r!r:.200}")
        name = str(r["kernel"])
        config = r.get("config", name[name.find("[") :] if "[" in name else "")
        dtype = r.get("dtype") or (re.search(r"\b(bf16|fp16|fp32)\b", name) or [None, None])[1]
        arch = r.get("arch")
        if isinstance(arch, int) or (isinstance(arch, str) and arch.isdigit()):
            arch = f"sm_{arch}"  # tests/aot_build.py writes 90 / 80
        # A build's own CPU time where recorded: the wall time here includes waiting for other load.
        seconds = float(r.get("cpu_seconds", r["seconds"]))
        out.append(
            {"kernel": name.split("[")[0], "arch": arch, "dtype": dtype, "tag": _config_tag(config),
             "seconds": seconds}
        )  # fmt: skip
    return out


def build_seconds(records: Sequence[dict[str, Any]], arch: str = "sm_90") -> Seconds:
    """``seconds(kernel, dtype, config)``: the median of the measured builds for ``arch`` (over
    variants such as head widths and masks) of, in this order: that kernel, dtype and config; that
    kernel and config in another dtype (an fp32 build of a half-precision config); that kernel
    and dtype (a fixed-config build: config ``{}``); that kernel. A name with no builds of its
    own stands for its op's kernels (``gate``: ``gate_fwd``, ``gate_bwd``, ...). Else
    ``FALLBACK_SECONDS``. The second value names which."""
    recs = [r for r in records if r["arch"] in (None, arch)]
    names = {r["kernel"] for r in recs}

    def seconds(kernel: str, dtype: str, config: dict[str, Any]) -> tuple[float, str]:
        tag = _config_tag(config)
        own = kernel in names
        family = [r for r in recs if r["kernel"] == kernel or (not own and r["kernel"].startswith(f"{kernel}_"))]
        what = "this kernel" if own else f"the {kernel}_* kernels"
        for label, pick in (
            (f"{what}, dtype and config", lambda r: bool(tag) and r["tag"] == tag and r["dtype"] == dtype),
            (f"{what} and config, another dtype", lambda r: bool(tag) and r["tag"] == tag),
            (f"{what} and dtype, median", lambda r: r["dtype"] == dtype),
            (f"{what}, median", lambda r: True),
        ):
            found = [r["seconds"] for r in family if pick(r)]
            if found:
                return statistics.median(found), f"aot_builds.json: {label}"
        return FALLBACK_SECONDS.get(kernel, FALLBACK_SECONDS["*"]), FALLBACK_LABEL

    return seconds


# ------------------------------------------------------------------------ the workloads
DTYPES = ("fp32", "bf16", "fp16")  # the kernel tests' dtypes on CUDA (tests/conftest.py KERNEL_DTYPES)
TESTS = Path(__file__).resolve().parents[1] / "tests"


def read_test_constant(test_file: str, name: str) -> Any:
    """The value of the module-level constant ``name`` of ``tests/<test_file>``, read from its source
    (a literal, or ``dict(key=literal, ...)``) without importing the test module.

    Raises ``ValueError`` when the file has no such constant or it is not a literal."""
    import ast

    tree = ast.parse((TESTS / test_file).read_text(), test_file)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
                return {kw.arg: ast.literal_eval(kw.value) for kw in value.keywords}
            return ast.literal_eval(value)
    raise ValueError(f"tests/{test_file} has no module-level constant {name}")


def attention_test_cases() -> list[tuple[int, int, bool]]:
    """``(T, D, masked)`` of every case of tests/test_attention.py (``CASES``)."""
    cases = read_test_constant("test_attention.py", "CASES")
    return list(dict.fromkeys((T, D, pad != "none") for _, T, _, D, _, pad in cases))


def butterfly_test_shapes() -> list[tuple[int, int, int]]:
    """``(rows, d, d_ff)`` of every shape of tests/test_butterfly.py (``SHAPES``)."""
    shapes = read_test_constant("test_butterfly.py", "SHAPES")
    return [(math.prod(lead), d, d_ff) for lead, d, d_ff in shapes]


def parity_launches() -> list[Launch]:
    """The minimal parity selection on CUDA (``bench.device_check.PARITY_TESTS``)."""
    out: list[Launch] = []
    for dtype in DTYPES:  # tests/test_attention.py: every case forward + backward in every dtype
        for T, D, mask in attention_test_cases():
            out += attention(dtype, D, T, mask, backward=True)
    out += attention("bf16", 32, 256, True, True)  # CUDA graph capture
    out += attention("fp32", 32, 33, False, True) + attention("fp32", 16, 50, True, True)  # layouts, determinism
    for k in ("attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv"):  # every block shape, forced
        out += forced(k, "fp32", (32, True, "n", False) if k == "attention_fwd" else (32, True, "n"))
    fast = read_test_constant("test_fast.py", "CONFIG")  # tests/test_fast.py's model
    d, head, d_ff = fast["d_model"], fast["d_model"] // fast["n_heads"], fast["d_ff"]
    for dtype in ("fp32", "bf16"):
        for T in (1, 17, 130):
            out += attention(dtype, head, T, False, True) + attention(dtype, head, T, True, True)
            out += butterfly(dtype, d, d_ff, 3 * T, "fp32" if dtype == "bf16" else None, True)
    for dtype in ("bf16", "fp16"):  # tests/test_butterfly.py: shapes x residual none / same / fp32
        for N, D, F in butterfly_test_shapes():
            for res in (None, dtype, "fp32"):
                out += butterfly(dtype, D, F, N, res, True)
    # gate (7 kernels), rms_norm (2), cross_entropy (2), decode (4) and the fast model's decode
    # step across the tests' dtypes, widths and flags: a declared count, about 115 builds.
    for dtype in DTYPES:
        out += fixed("gate", dtype, 14, "parity") + fixed("rms_norm", dtype, 6, "parity")
        out += fixed("cross_entropy", dtype, 6, "parity") + fixed("decode", dtype, 12, "parity")
    return out


def headline_launches() -> list[Launch]:
    """``-m headline``: the 13m train step (B 32/64 × T 512, bf16 autocast: fp32 residual stream;
    the captured B 32 step runs the same kernels),
    decoding at batch 1 and 8 (bf16 model, 512-token prompt), attention B32 T512 H8 D32 fwd+bwd."""
    out: list[Launch] = []
    for B in (32, 64):  # train step
        out += attention("bf16", 32, 512, False, True) + butterfly("bf16", 256, 512, B * 512, "fp32", True)
    for B in (1, 8):  # decode: prefill of the prompt (forward only), then one row per sequence a step
        out += attention("bf16", 32, 512, False, False) + butterfly("bf16", 256, 512, B * 512, "bf16", False)
        out += butterfly("bf16", 256, 512, B, "bf16", False)
    out += attention("bf16", 32, 512, False, True)  # attention benchmark: the train step's kernels
    out += fixed("gate", "bf16", 6, "13m") + fixed("rms_norm", "bf16", 4, "13m")
    out += fixed("cross_entropy", "bf16", 2, "13m") + fixed("decode", "bf16", 4, "13m")
    return out


def extra_launches() -> list[Launch]:
    """Everything else in ``bench/`` (compile-heavy baselines switched on): other attention shapes,
    fp32 and batch-64 decoding, prefill at T 2048, the per-op benchmarks."""
    out: list[Launch] = []
    out += attention("bf16", 32, 512, False, False)  # the paper shape, forward only
    out += attention("bf16", 32, 2048, False, True) + attention("bf16", 32, 2048, False, False)
    out += attention("bf16", 64, 4096, False, True) + attention("bf16", 64, 4096, False, False)
    out += attention("bf16", 32, 2048, False, False)  # prefill T 2048
    for B in (1, 8):  # fp32 decoding
        out += attention("fp32", 32, 512, False, False) + butterfly("fp32", 256, 512, B * 512, "fp32", False)
        out += butterfly("fp32", 256, 512, B, "fp32", False)
    out += butterfly("bf16", 256, 512, 64, "bf16", False)  # decode batch 64
    for N in (16384, 32768):  # per-op butterfly benchmark shapes
        out += butterfly("bf16", 256, 512, N, "bf16", True)
    out += fixed("gate", "bf16", 4, "per-op") + fixed("rms_norm", "bf16", 4, "per-op")
    out += fixed("cross_entropy", "bf16", 4, "per-op") + fixed("decode", "fp32", 4, "13m fp32")
    return out


def sanitizer_launches() -> list[Launch]:
    """``compute-sanitizer --tool memcheck``: one 13m train step at B 1 × T 512 and a batch-1
    generate after a 512-token prompt: the headline's keys and builds (cached)."""
    return attention("bf16", 32, 512, False, True) + butterfly("bf16", 256, 512, 512, "fp32", True)


def default_stages(budget: float = 420.0) -> list[Stage]:
    """The stages of ``bench/device_check.sh`` in the order they run, with the budgets it gives them
    in a run of ``budget`` seconds where each stage takes all of its own: the headline at most what
    leaves the parity stage and the report theirs, the parity stage at most what leaves the report
    its own (so a short run shrinks them, and the plan says they do not fit), the compile-heavy
    extra stage what is left after every other."""
    b = BUDGETS
    extra = max(0.0, budget - sum(b[k] for k in ("setup", "headline", "parity", "split", "sanitizer", "report")))
    headline = max(0.0, min(b["headline"], budget - b["setup"] - b["parity"] - b["report"]))
    parity = max(0.0, min(b["parity"], budget - b["setup"] - headline - b["report"]))
    return [
        Stage("setup", "editable install, env.json", b["setup"], [], 15, "pip install -e ., one python start"),
        Stage(
            "headline", "train step (eager, and a CUDA graph at B 32), decode B1/B8, attention vs SDPA (-m headline)",
            headline, headline_launches(), 85,
            "ceilings ~5 s; 3 train steps ~10 s each (one captured as a CUDA graph), 2 decodes ~20 s each "
            "(reference generate is the slow baseline), attention ~5 s; model builds",
            autotune_cache=True,
        ),
        Stage(
            "parity", "kernel, fast-model tests on CUDA (bench.device_check.PARITY_TESTS)", parity,
            parity_launches(), 40, "test bodies, f64 oracles, python starts", processes=b["parity_workers"],
            one_config=True,
        ),
        Stage(
            "split", "where a CUDA-graph generate call's time goes (python -m bench.decode_split)", b["split"], [],
            30, "a model build, 3 generate calls and 2 profiles per batch size; kernels built by the headline",
            optional=True,
        ),
        Stage(
            "extra", "compile-heavy baselines and the rest of bench/", extra, extra_launches(), 120,
            "about 25 more benchmarks at ~5 s each", extra_compile_s=200,
            extra_note="torch.compile / FlexAttention: ~10 compiled functions, ~20 s each (assumption)",
            optional=True, autotune_cache=True,
        ),
        Stage(
            "sanitizer", "compute-sanitizer memcheck: one train step, a short generate", b["sanitizer"],
            sanitizer_launches(), 40, "memcheck slows kernels 10-100x (assumption)", optional=True,
            autotune_cache=True,
        ),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ the plan
def make_plan(stages: Iterable[Stage], tuners: Tuners, seconds: Seconds, factor: float = 1.0) -> list[StagePlan]:
    """Plan the stages in order; builds of earlier stages count as cached in later ones."""
    built: set[tuple] = set()
    tuned: set[tuple] = set()
    return [plan_stage(s, tuners, seconds, built, factor, tuned) for s in stages]


def format_plan(plans: Sequence[StagePlan], budget: float, source: str) -> str:
    lines = [f"device check plan (budget {budget:.0f} s; build seconds: {source})", ""]
    required = estimate = 0.0
    for p in plans:
        st = p.stage
        verdict = "fits" if p.fits else "runs in part (the rest skipped)" if st.optional else "DOES NOT FIT"
        tag = " (optional: runs in the time left)" if st.optional else ""
        lines.append(f"== {st.name}{tag}: {st.what}")
        how = f"{st.processes} processes" if st.processes > 1 else "1 process"
        if st.one_config:
            how += ", one autotune config per key (bench.parity_plugin)"
        lines.append(
            f"   estimate {p.wall_s:.0f} s of {st.budget_s:.0f} s budget: {verdict}  "
            f"[(compile {p.compile_s:.0f} CPU-s + autotune timing {p.tune_s:.0f} s) / {how}, "
            f"allowance {st.allowance_s:.0f} s ({st.allowance_note})"
            + (f", other compiles {st.extra_compile_s:.0f} s ({st.extra_note})" if st.extra_compile_s else "")
            + "]"
        )
        if p.cached_builds:
            lines.append(f"   {p.cached_builds} builds already made by an earlier stage (shared TRITON_CACHE_DIR)")
        if p.cached_keys:
            lines.append(
                f"   {p.cached_keys} autotune keys already tuned by an earlier stage (TRITON_CACHE_AUTOTUNING=1)"
            )
        for r in sorted(p.rows, key=lambda r: -r["compile_s"]):
            lines.append(
                f"   {r['kernel']:<26} {r['configs']:>3} configs  {r['builds']:>4} new builds  {r['keys']:>3} tuned keys  "
                f"{r['compile_s']:6.1f} s compile  {r['tune_s']:5.1f} s tuning"
            )
        lines.append("")
        if not st.optional:
            required += st.budget_s
            estimate += p.wall_s
    ok = all(p.fits for p in plans if not p.stage.optional)
    lines.append(
        f"required stages (setup, headline, parity): estimate {estimate:.0f} s, budgets {required:.0f} s "
        f"of the run's {budget:.0f} s: " + ("each fits its budget" if ok else "a required stage does NOT fit")
    )
    lines.append("optional stages run in the time left; what would start too late is skipped and listed as such")
    lines.append(
        "declared, not measured: the launches of each stage, fixed-kernel build counts, "
        f"{BENCH_SECONDS_PER_CONFIG} s of autotune timing per config and key, the allowances."
    )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.device_check plan", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=420.0, help="whole-run seconds (WIOLA_CHECK_SECONDS)")
    parser.add_argument("--aot", default=str(DEFAULT_AOT), help="AOT build records (default bench/aot_builds.json)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--factor", type=float, default=1.0, help="multiply build seconds (a slower CPU, JIT loading)")
    args = parser.parse_args(argv)
    for flag, value in (("--budget", args.budget), ("--factor", args.factor)):
        if not (value > 0 and math.isfinite(value)):
            parser.error(
                f"{flag} must be a positive number of {'seconds' if flag == '--budget' else 'times'}, got {value}"
            )
    if not re.fullmatch(r"sm_\d+", args.arch):
        parser.error(f"--arch must be a CUDA architecture such as sm_90, got {args.arch!r}")
    if Path(args.aot).is_file():
        try:
            records = load_aot_records(args.aot)
        except (ValueError, json.JSONDecodeError) as e:  # JSONDecodeError is a ValueError; said as one line
            parser.error(f"--aot {args.aot}: {e}")
        mine = sum(r["arch"] in (None, args.arch) for r in records)
        if not mine:
            held = ", ".join(sorted({str(r["arch"]) for r in records}))
            parser.error(f"--arch {args.arch}: {args.aot} holds no build for it (its builds: {held})")
        source = (
            f"{args.aot} ({mine} of its {len(records)} records for {args.arch}), fallback where a kernel is missing"
        )
    elif args.aot != str(DEFAULT_AOT):  # a file asked for by name: not silently replaced by fallbacks
        parser.error(f"--aot {args.aot} does not exist")
    else:
        records, source = [], f"{args.aot} not found: {FALLBACK_LABEL}"
    if args.factor != 1.0:
        source += f", × {args.factor}"
    tuners, seconds = kernel_tuners(), build_seconds(records, args.arch)
    plans = make_plan(default_stages(args.budget), tuners, seconds, args.factor)
    print(format_plan(plans, args.budget, source))
    slower = make_plan(default_stages(args.budget), tuners, seconds, 2 * args.factor)
    print(
        "if builds take twice as long (JIT loading, a slower CPU): "
        + ", ".join(
            f"{p.stage.name} {p.wall_s:.0f} s of {p.stage.budget_s:.0f} s" for p in slower if not p.stage.optional
        )
    )
    return 0 if all(p.fits for p in plans if not p.stage.optional) else 1
