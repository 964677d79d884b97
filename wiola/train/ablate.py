"""``wiola ablate SPEC``: a sweep of model variants × seeds, each an ordinary training run.

A spec is a small TOML or JSON file (docs/SPEC.md, Ablations)::

    name = "ffn"                 # optional; the report's title
    seeds = [0, 1, 2]
    baseline = "butterfly"       # the variant the others are compared with (default: the first)
    match_params = true          # d_ff of every variant matched to the base model's total (wiola.budget)
    gate_threshold = 0.1         # a head whose mean gate is under this counts as switched off
    position_bucket = 64         # validation loss by target position in buckets of this many tokens

    [base]                       # TrainConfig fields (a "recipe" name is read first), shared by every run
    preset = "tiny"
    data = "sample"
    steps = 200

    [grid]                       # every combination; or [[variants]] tables with an optional name
    ffn = ["butterfly", "swiglu", "gelu"]

Variants set the model fields ``ffn``, ``gate``, ``gate_pre_rope`` and ``helix_alpha``. Every
(variant, seed) is a run folder ``OUT/runs/<variant>/seed<k>/`` trained by ``wiola train
--config OUT/runs/<variant>/seed<k>.json`` in a subprocess (``--resume`` when a checkpoint is
there, ``--overwrite`` for a run stopped before its first checkpoint), so each resumes
bit-exactly and a killed sweep continues where it stopped when run again. A run folder whose
checkpoint holds other settings than the spec plans (the spec changed since) is refused before
anything is written, since its numbers are not the spec's; ``--overwrite`` deletes the planned
runs and the report and starts again. The seed sets both the initialisation and the data order
(``BatchStream``), so variants see the same batches for the same seed and differences can be
paired by seed. ``--jobs N`` runs N at a time (each with ``cores / N`` threads: a sweep's
numbers are reproducible for a fixed N); ``--print-commands`` writes the configs and prints one
command per run for a scheduler.
The report (``wiola.train.ablate_report``) is written once every run has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wiola.config import FFN_KINDS, WiolaConfig, check_field
from wiola.train.config import TrainConfig, recipe

VARIANT_KEYS = ("ffn", "gate", "gate_pre_rope", "helix_alpha")
SPEC_KEYS = {
    "name",
    "seeds",
    "baseline",
    "match_params",
    "gate_threshold",
    "position_bucket",
    "base",
    "grid",
    "variants",
}
SPEC_FORMATS = {".toml": "TOML", ".json": "JSON"}  # file extension (any case) -> parser
Log = Callable[[str], None]


@dataclass
class Variant:
    name: str
    model: dict[str, Any]  # a subset of VARIANT_KEYS


@dataclass
class AblationSpec:
    """A parsed sweep (see the module)."""

    base: dict[str, Any]  # TrainConfig fields shared by every run (recipe already merged)
    variants: list[Variant]
    seeds: list[int]
    baseline: str
    name: str = "ablation"
    match_params: bool = True
    gate_threshold: float = 0.1
    position_bucket: int = 64
    source: dict[str, Any] = field(default_factory=dict)  # the file's contents, for the record


@dataclass
class PlannedRun:
    variant: str
    seed: int
    config: TrainConfig  # out_dir is the run folder

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out_dir)

    @property
    def config_file(self) -> Path:
        return self.run_dir.with_suffix(".json")


# ----------------------------------------------------------------------------------- the spec
def load_spec(path: str | os.PathLike) -> AblationSpec:
    """Read and check a spec file (``.toml`` or ``.json``, in any case). Raises
    ``FileNotFoundError`` for a missing file and ``ValueError`` naming the problem for a folder,
    another file type or a malformed spec."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"spec {str(path)!r} is a folder, not a spec file (a .toml or .json file)")
    if not path.is_file():
        raise FileNotFoundError(f"spec file {str(path)!r} does not exist")
    kind = SPEC_FORMATS.get(path.suffix.lower())
    if kind is None:
        got = f"a {path.suffix} file" if path.suffix else "a file without an extension"
        raise ValueError(f"spec {str(path)!r} is {got}; a spec is a .toml or a .json file")
    try:
        text = path.read_text()
        if kind == "TOML":
            import tomllib

            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except OSError as e:
        raise ValueError(f"spec {path}: cannot be read: {e}") from e
    except ValueError as e:  # tomllib.TOMLDecodeError, json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"spec {path}: not valid {kind}: {e}") from e
    return parse_spec(raw, str(path))


def parse_spec(raw: dict[str, Any], where: str = "spec") -> AblationSpec:
    """An ``AblationSpec`` from the parsed file; ``ValueError`` names a bad key or value.

    Every value is checked for its kind here (TOML and JSON hand over strings, numbers and
    tables as written), so ``match_params = "false"`` or ``gate = "no"`` is refused by name
    rather than coerced into the opposite setting."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table of settings, got {raw!r}")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(SPEC_KEYS)}")
    base = raw.get("base", {})
    if not isinstance(base, dict):
        raise ValueError(f"{where}: base must be a table of TrainConfig fields, got {base!r}")
    base = dict(base)
    if "recipe" in base:
        base = {**recipe(base.pop("recipe")), **base}
    for key in ("seed", "out_dir"):
        if key in base:
            raise ValueError(f"{where}: base.{key} is set by the sweep (seeds, --out)")
    if base.get("init") is not None:  # --init takes the checkpoint's model, which the variants would change
        raise ValueError(f"{where}: base.init is not for a sweep: each variant trains its own model from its seed")
    if not isinstance(base.get("model", {}), dict):
        raise ValueError(f"{where}: base.model must be a table of model fields, got {base['model']!r}")
    if set(base.get("model", {})) & set(VARIANT_KEYS):
        raise ValueError(f"{where}: base.model may not set {VARIANT_KEYS}: vary them in grid or variants")
    variants = _variants(raw, where)
    seeds = raw.get("seeds", [0])
    # The range of TrainConfig.seed (torch.manual_seed's; numpy refuses a negative seed).
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(type(s) is int and 0 <= s < 2**64 for s in seeds)
        or len(set(seeds)) < len(seeds)
    ):
        raise ValueError(f"{where}: seeds must be a non-empty list of distinct ints in [0, 2**64), got {seeds!r}")
    name = raw.get("name", "ablation")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name (the report's title) must be a non-empty string, got {name!r}")
    baseline = raw.get("baseline", variants[0].name)
    if baseline not in [v.name for v in variants]:
        raise ValueError(f"{where}: baseline {baseline!r} is not one of the variants {[v.name for v in variants]}")
    match = raw.get("match_params", True)
    if not isinstance(match, bool):
        raise ValueError(f"{where}: match_params must be true or false, got {match!r}")
    threshold = raw.get("gate_threshold", 0.1)
    # A gate is a sigmoid, in (0, 1): a threshold outside [0, 1] counts every head or none.
    if not _is_number(threshold) or not 0 <= threshold <= 1:
        raise ValueError(f"{where}: gate_threshold must be a number in [0, 1] (a mean gate), got {threshold!r}")
    bucket = raw.get("position_bucket", 64)
    if type(bucket) is not int or bucket < 1:
        raise ValueError(f"{where}: position_bucket must be an int >= 1 (tokens per bucket), got {bucket!r}")
    spec = AblationSpec(base, variants, seeds, baseline, name, match, float(threshold), bucket, raw)
    try:
        plan(spec, Path("."))  # every run's TrainConfig is checked now
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return spec


def _is_number(value: Any) -> bool:
    """A finite int or float; a bool is not a number here (``True`` would read as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _variants(raw: dict[str, Any], where: str) -> list[Variant]:
    if ("grid" in raw) == ("variants" in raw):
        raise ValueError(f"{where}: give exactly one of grid (a table of lists) or variants (a list of tables)")
    if "grid" in raw:
        grid = raw["grid"]
        if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError(f"{where}: grid must map variant keys to non-empty lists")
        items = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    else:
        tables = raw["variants"]
        if not isinstance(tables, list) or not tables:
            raise ValueError(f"{where}: variants must be a non-empty list of tables, got {tables!r}")
        for i, table in enumerate(tables):
            if not isinstance(table, dict):
                raise ValueError(f"{where}: variants[{i}] must be a table (name and model keys), got {table!r}")
        items = [dict(v) for v in tables]
    out = []
    for item in items:
        name = item.pop("name", "")
        if not isinstance(name, str):
            raise ValueError(f"{where}: a variant's name must be a string, got {name!r}")
        name = name or _auto_name(item)
        bad = sorted(set(item) - set(VARIANT_KEYS))
        if bad:
            raise ValueError(f"{where}: variant {name!r}: unknown keys {bad}; a variant sets {list(VARIANT_KEYS)}")
        for key, value in item.items():
            try:
                check_field(WiolaConfig, key, value)  # gate = "false" is not a bool
            except ValueError as e:
                raise ValueError(f"{where}: variant {name!r}: {e}") from None
        if "ffn" in item and item["ffn"] not in FFN_KINDS:
            raise ValueError(f"{where}: variant {name!r}: ffn must be one of {FFN_KINDS}, got {item['ffn']!r}")
        if not name.replace("=", "").replace(",", "").replace("-", "").replace(".", "").replace("_", "").isalnum():
            raise ValueError(f"{where}: variant name {name!r} must be letters, digits and - _ . = , only")
        out.append(Variant(name, item))
    names = [v.name for v in out]
    if len(set(names)) < len(names):
        raise ValueError(f"{where}: variant names repeat: {names}")
    for i, a in enumerate(out):  # the same runs twice under two names: a comparison of nothing
        for b in out[i + 1 :]:
            if a.model == b.model:
                raise ValueError(f"{where}: variants {a.name!r} and {b.name!r} have the same settings {a.model}")
    return out


def _auto_name(item: dict[str, Any]) -> str:
    """``swiglu`` for a lone string value, else ``ffn=swiglu,gate=false``; ``base`` for no keys."""
    if len(item) == 1 and isinstance(next(iter(item.values())), str):
        return next(iter(item.values()))
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in item.items()) or "base"


def plan(spec: AblationSpec, out: Path) -> list[PlannedRun]:
    """Every (variant, seed) run of ``spec`` under ``out``, variants outer, seeds inner.
    ``ValueError`` names ``base`` or the variant whose settings ``TrainConfig`` refuses."""
    from wiola.budget import match_params

    try:
        base_cfg = TrainConfig.from_dict({**spec.base, "out_dir": str(out)})
        base_model = base_cfg.model_config()
    except (ValueError, TypeError) as e:  # TypeError: a value of the wrong kind met a comparison
        raise ValueError(f"base: {e}") from e
    runs = []
    for variant in spec.variants:
        model = {**spec.base.get("model", {}), **variant.model}
        try:
            config = TrainConfig.from_dict({**spec.base, "model": model, "out_dir": str(out)}).model_config()
            if spec.match_params:
                model["d_ff"] = match_params(config, base_model).d_ff
            for seed in spec.seeds:
                settings = {"progress": False, **spec.base, "model": model, "seed": seed}
                settings["out_dir"] = str(out / "runs" / variant.name / f"seed{seed}")
                runs.append(PlannedRun(variant.name, seed, TrainConfig.from_dict(settings)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"variant {variant.name!r}: {e}") from e
    return runs


# ------------------------------------------------------------------------- the sweep folder
# Settings that change no number of the report (where files go, what is kept or printed): a run
# may differ from the plan in these and still be continued or reported.
NO_RESULT_SETTINGS = {"out_dir", "cache_dir", "progress", "num_threads", "peak_flops", "plots"}
NO_RESULT_SETTINGS |= {"save_every", "keep_checkpoints"}


def settings_differences(run: PlannedRun) -> list[str]:
    """How the run folder's latest checkpoint differs from the planned run, one
    ``"lr 0.003 → 0.0001"`` (old → new) per setting: the variant's model keys first, then the
    rest of the model, then the training settings (``NO_RESULT_SETTINGS`` left out), and a
    checkpoint past ``steps``. Empty when the checkpoint is the plan's, or when there is none: a
    run without a checkpoint starts from scratch with the planned settings (``train_arguments``)."""
    from wiola.train.run_folder import find_checkpoint, read_trainer_state

    step = run_step(run)
    if step is None:
        return []
    saved = read_trainer_state(find_checkpoint(run.run_dir))
    # A key a checkpoint lacks (an older version wrote it) reads as the default it was loaded with.
    old_model = {**dataclasses.asdict(WiolaConfig()), **(saved.get("model_config") or {})}
    new_model = run.config.model_config().to_dict()
    keys = [*VARIANT_KEYS, *(k for k in new_model if k not in VARIANT_KEYS)]
    diffs = [
        f"model.{k} {_show(old_model.get(k))} → {_show(new_model[k])}" for k in keys if old_model.get(k) != new_model[k]
    ]
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    saved_train = saved.get("train_config") or {}
    # A path an older version saved as typed (train.txt) names the same file as the plan's absolute one.
    old_train, new_train = {**defaults, **saved_train}, run.config.with_saved_paths(saved_train).to_dict()
    skip = NO_RESULT_SETTINGS | {"preset", "model"}  # the model is compared above, field by field
    diffs += [
        f"{k} {_show(old_train.get(k))} → {_show(v)}"
        for k, v in new_train.items()
        if k not in skip and old_train.get(k) != v
    ]
    if step > run.config.steps:
        diffs.append(f"its checkpoint is at step {step}, past steps = {run.config.steps}")
    return diffs


def _show(value: Any) -> str:
    return json.dumps(value)  # as a spec writes it: true, null, "gelu"


def check_runs_match(runs: list[PlannedRun], out: Path) -> None:
    """``ValueError`` naming the first planned run whose folder under ``out`` holds a checkpoint
    trained with other settings (``settings_differences``) and the first difference: continuing
    it, or reporting it as finished, would put another spec's numbers in this spec's report."""
    for run in runs:
        diffs = settings_differences(run)
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ValueError(
                f"--out {str(out)!r} already holds run {run.variant} seed {run.seed} ({run.run_dir}) "
                f"trained with other settings: {diffs[0]}{more}. Its numbers are not this spec's: choose "
                "another --out, or pass --overwrite to delete the sweep's runs and start again"
            )


def clear_runs(runs: list[PlannedRun], out: Path) -> int:
    """Delete each planned run's folder, config and log, and the report of ``out`` (for
    ``--overwrite``); returns the number of run folders deleted. Runs of variants or seeds the spec
    no longer plans, and anything else in ``out``, stay."""
    from wiola.train.ablate_report import REPORT_FILES
    from wiola.train.run_folder import remove_path as remove

    deleted = 0
    for run in runs:
        deleted += remove(run.run_dir)
        remove(run.config_file)
        remove(run.run_dir.parent / f"seed{run.seed}.log")
        with contextlib.suppress(OSError):  # the variant's folder, when nothing else is left in it
            run.run_dir.parent.rmdir()
    for name in ("spec.json", *REPORT_FILES):
        remove(out / name)
    return deleted


def prepare_sweep(spec: AblationSpec, out: Path, *, overwrite: bool = False, log: Log = print) -> list[PlannedRun]:
    """The planned runs of ``spec`` under ``out``, with their configs written, after the checks
    that come before writing anything: ``out`` can be a folder, and no run folder there holds a
    checkpoint of other settings (``check_runs_match``). With ``overwrite`` the planned runs and
    the report are deleted instead (``clear_runs``). ``ValueError`` names the problem."""
    from wiola.train.run_folder import check_output_folder, ensure_writable

    check_output_folder(out, "--out")
    runs = plan(spec, out)
    if not overwrite:
        check_runs_match(runs, out)
    try:
        ensure_writable(out)
    except ValueError as e:  # its own message names no flag: give the OSError behind it
        raise ValueError(f"--out {str(out)!r} cannot be created or written: {e.__cause__ or e}") from e
    try:
        if overwrite:
            n = clear_runs(runs, out)
            if n:
                log(f"--overwrite: deleted {n} run folder{'s' * (n != 1)} of the sweep in {out}")
        write_configs(runs)
    except OSError as e:  # a file where a variant's folder goes, a read-only run folder
        raise ValueError(f"--out {str(out)!r}: cannot write the sweep's run folders: {e}") from e
    return runs


# ------------------------------------------------------------------------------ running the runs
def write_configs(runs: list[PlannedRun]) -> None:
    """Write each run's ``TrainConfig`` as ``<run folder>.json`` (what ``wiola train --config`` reads)."""
    for run in runs:
        run.config_file.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(run.config.to_dict(), indent=2) + "\n"
        if not run.config_file.is_file() or run.config_file.read_text() != text:
            tmp = run.config_file.with_name(f".{run.config_file.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, run.config_file)


def run_step(run: PlannedRun) -> int | None:
    """The step of the run folder's latest checkpoint, None when it has none."""
    from wiola.train.run_folder import find_checkpoint, read_trainer_state

    if not (run.run_dir / "checkpoints").is_dir():
        return None
    try:
        return int(read_trainer_state(find_checkpoint(run.run_dir))["step"])
    except (FileNotFoundError, ValueError):
        return None


def train_arguments(run: PlannedRun) -> list[str]:
    """The ``wiola train`` arguments that start the run, or continue it from its checkpoint. A run
    stopped before its first checkpoint has nothing to continue from: it starts again with
    ``--overwrite`` (its folder holds only that attempt's metrics)."""
    args = ["train", "--config", str(run.config_file)]
    if run_step(run) is not None:
        return [*args, "--resume", str(run.run_dir)]
    # No folder: nothing to replace. Damaged checkpoints: never deleted here (train refuses, naming them).
    plain = not run.run_dir.is_dir() or (run.run_dir / "checkpoints").exists()
    return args if plain else [*args, "--overwrite"]


def commands(runs: list[PlannedRun], torchrun: int | None = None) -> list[str]:
    """One shell command per run not yet finished: ``wiola train ...`` or, with ``torchrun``
    processes per node, ``torchrun --nproc_per_node N -m wiola train ...``."""
    import shlex

    lead = ["torchrun", f"--nproc_per_node={torchrun}", "-m", "wiola"] if torchrun else ["wiola"]
    return [shlex.join(lead + train_arguments(r)) for r in runs if (run_step(r) or 0) < r.config.steps]


def prepare_all(runs: list[PlannedRun], log: Log) -> None:
    """Tokenise each distinct data source once, here, before runs start (concurrent runs then only read the cache)."""
    from wiola.train.data import prepare_data, resolve_source, tokenizer_for

    seen = set()
    for run in runs:
        c = run.config
        key = (c.data, c.val_data, c.val_fraction, c.tokenizer, c.cache_dir, c.model_config().vocab_size)
        if key not in seen:
            seen.add(key)
            source = resolve_source(c.data, c.val_data, c.val_fraction)
            prepare_data(source, tokenizer_for(c.model_config(), c.tokenizer), c.cache_dir, progress=False, log=log)


def execute(runs: list[PlannedRun], jobs: int = 1, log: Log = print, progress: bool = False) -> bool:
    """Train every unfinished run, ``jobs`` at a time, each in a ``wiola train`` subprocess
    (output in ``<run folder>.log``). SIGINT/SIGTERM are passed to the live runs, which
    stop after their step with a checkpoint. Returns False when interrupted, True when every run
    is finished. Raises ``RuntimeError`` naming a run that failed (and its log)."""
    from tqdm.auto import tqdm

    from wiola.train.env import draws_bars

    todo = [r for r in runs if (run_step(r) or 0) < r.config.steps]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))} if jobs > 1 else None
    live: dict[subprocess.Popen, PlannedRun] = {}
    stop = {"requested": False}

    def handle(signum: int, frame: Any) -> None:
        stop["requested"] = True
        for proc in live:
            proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), unit="run", disable=not draws_bars(progress))
    try:
        while (todo and not stop["requested"]) or live:
            while todo and len(live) < jobs and not stop["requested"]:
                run = todo.pop(0)
                with tqdm.external_write_mode(file=sys.stderr):  # above a drawn bar, not over it
                    log(f"{'continuing' if run_step(run) else 'starting'} {run.variant} seed {run.seed}")
                with (run.run_dir.parent / f"seed{run.seed}.log").open("a") as out:
                    cmd = [sys.executable, "-m", "wiola", *train_arguments(run)]
                    live[subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)] = run
            time.sleep(0.2)
            for proc in [p for p in live if p.poll() is not None]:
                run = live.pop(proc)
                if proc.returncode != 0 and not stop["requested"]:  # a stopped run exits 130 (or dies starting)
                    handle(signal.SIGTERM, None)
                    for p in live:
                        p.wait()
                    log_file = run.run_dir.parent / f"seed{run.seed}.log"
                    raise RuntimeError(
                        f"run {run.variant} seed {run.seed} failed (exit {proc.returncode}); see {log_file}"
                    )
                bar.update(1 if proc.returncode == 0 else 0)
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    return not stop["requested"]


def ensure_positions(run: PlannedRun, bucket: int) -> dict[str, Any]:
    """``<run folder>/positions.json``: the finished model's validation loss by target position
    (``wiola.train.evaluate.position_losses``, the run's eval windows), computed once."""
    from wiola.checkpoint import load_pretrained
    from wiola.model import WiolaModel
    from wiola.train.data import prepare_data, resolve_source, tokenizer_for
    from wiola.train.env import resolve_device
    from wiola.train.evaluate import position_losses
    from wiola.train.run_folder import find_checkpoint

    path = run.run_dir / "positions.json"
    step = run_step(run)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("bucket") == bucket and saved.get("step") == step:
            return saved
    c = run.config
    model = load_pretrained(WiolaModel, find_checkpoint(run.run_dir), device=resolve_device(c.device, 0))
    source = resolve_source(c.data, c.val_data, c.val_fraction)
    data = prepare_data(
        source, tokenizer_for(c.model_config(), c.tokenizer), c.cache_dir, progress=False, log=lambda m: None
    )
    batch = c.eval_batch_size or c.micro_batch or c.batch_size
    buckets = position_losses(model, data.val, c.seq_len, bucket, batch_size=batch, max_windows=c.eval_windows)
    saved = {"bucket": bucket, "step": step, "buckets": buckets}
    tmp = path.with_name(".positions.json.tmp")
    tmp.write_text(json.dumps(saved) + "\n")
    os.replace(tmp, path)
    return saved


def run_sweep(
    spec: AblationSpec,
    out: str | os.PathLike,
    *,
    jobs: int = 1,
    log: Log = print,
    progress: bool = False,
    overwrite: bool = False,
) -> Path | None:
    """Run (or continue) every run of ``spec`` under ``out`` and write the report; returns the
    ``report.md`` path, or None when the sweep was interrupted (run it again to continue).
    ``ValueError`` before anything is written for a bad ``out`` or a run folder there trained with
    other settings (``prepare_sweep``); ``overwrite`` deletes the planned runs and starts again."""
    from wiola.train.ablate_report import collect, write_report

    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out = Path(out)
    runs = prepare_sweep(spec, out, overwrite=overwrite, log=log)
    (out / "spec.json").write_text(json.dumps(spec.source, indent=2, sort_keys=True) + "\n")
    prepare_all(runs, log)
    if not execute(runs, jobs, log, progress):
        log(f"interrupted: the runs stopped with checkpoints; run the same command again to continue ({out})")
        return None
    positions = {(r.variant, r.seed): ensure_positions(r, spec.position_bucket) for r in runs}
    return write_report(spec, collect(spec, runs, positions), out)
