"""Build the kernels' ahead-of-time specs for GPU targets without a GPU; report registers, spills,
shared memory and compile time.

Two uses:

* ``python -m tests.aot_build --json bench/aot_builds.json [--ops attention ...] [--arch sm_90 ...]``
  builds every registered spec (``wiola_kernels.aot.aot_specs``) for each target — one worker process
  per target, side by side, each with a fresh Triton cache so the seconds are real compiles — and
  writes one record per (spec, target): the measured compile data ``bench/`` plans GPU runs with.
* ``tests/test_compile.py`` starts ``python tests/aot_build.py --worker sm_90 --names FILE`` (a JSON
  list of the spec names it selected) and reads ``{name: report}`` from stdout.

Builds run in worker processes with ``TRITON_INTERPRET=0``: under the interpreter ``@triton.jit``
yields functions that cannot be compiled, and the test session runs the kernels interpreted.
Importing this module imports no kernel (the workers do, after setting the variable).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from wiola_kernels.aot import AOT_OPS, AotSpec, aot_specs

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}


def resources(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of a cubin, as ``cuobjdump`` (in Triton's wheel) prints them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}


def build(spec: AotSpec, arch: str) -> dict:
    """Compile ``spec`` for ``arch``; its resource use, whether sm_90 used wgmma, and the seconds it took."""
    attrs = {(spec.fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    k = triton.compile(src, target=TARGETS[arch], options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    usage = resources(k.asm["cubin"])
    return {
        "regs": usage.get("REG", -1),
        "local": usage.get("LOCAL", 0),
        "stack": usage.get("STACK", 0),
        "shared": k.metadata.shared,
        "wgmma": "wgmma" in k.asm["ptx"],
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
    }


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): a compile's cost without the
    waiting that other load on the machine adds to its wall time."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def all_specs(ops: list[str]) -> dict[str, AotSpec]:
    """``{name: spec}`` over ``ops``; a name registered twice is an error (its builds would be confused)."""
    specs: dict[str, AotSpec] = {}
    for op in ops:
        for spec in aot_specs(op):
            if spec.name in specs:
                raise ValueError(f"two AOT specs are named {spec.name!r}")
            specs[spec.name] = spec
    return specs


def worker(arch: str, names: list[str]) -> dict[str, dict]:
    """Build the named specs for ``arch``; a spec that fails to compile reports its error instead."""
    specs = all_specs(list(AOT_OPS))
    unknown = [name for name in names if name not in specs]
    if unknown:
        raise ValueError(f"unknown AOT spec names: {unknown[:5]}")
    report = {}
    for name in names:
        try:
            report[name] = build(specs[name], arch)
        except Exception as e:  # reported per spec by the caller
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return report


def build_in_workers(
    names: list[str] | dict[str, list[str]], archs: list[str], cache_dir: str | None = None
) -> dict[str, dict[str, dict]]:
    """``{arch: {name: report}}``: one ``--worker`` process per target, side by side (one core each),
    building ``names`` (or ``names[arch]`` when a dict gives each target its own list).
    ``cache_dir`` replaces Triton's cache for the workers (a fresh one makes every build a real compile)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = cache_dir
    lists = {arch: names[arch] if isinstance(names, dict) else names for arch in archs}
    files = {}
    try:
        for arch, selected in lists.items():
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(selected, f)
            files[arch] = f.name
        procs = {
            arch: subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", arch, "--names", files[arch]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )
            for arch in archs
        }
        out = {}
        for arch, proc in procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"aot_build.py --worker {arch} failed:\n{stderr[-4000:]}")
            out[arch] = json.loads(stdout)
    finally:
        for name in files.values():
            os.unlink(name)
    return out


def records(specs: dict[str, AotSpec], builds: dict[str, dict[str, dict]]) -> list[dict]:
    """One flat record per (spec, target) for ``bench/aot_builds.json``."""
    rows = []
    for arch, reports in builds.items():
        for name, r in reports.items():
            spec = specs[name]
            row = {
                "kernel": spec.kernel,
                "arch": int(arch.removeprefix("sm_")),
                "dtype": spec.dtype,
                "config": spec.config,
                "num_warps": spec.num_warps,
                "num_stages": spec.num_stages,
            }
            if "error" in r:
                row["error"] = r["error"]
            else:
                row |= {
                    "seconds": r["seconds"],
                    "cpu_seconds": r["cpu_seconds"],
                    "registers": r["regs"],
                    "spills": r["stack"] > 0 or r["local"] > 0,
                    "stack_bytes": r["stack"],
                    "local_bytes": r["local"],
                    "shared_bytes": r["shared"],
                    "wgmma": r["wgmma"],
                }
            rows.append(row)
    return records_sorted(rows)


def records_sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda row: (row["kernel"], row["config"], row["arch"]))


def dumps(doc: dict) -> str:
    """``doc`` as JSON with one build record a line (readable, and a rebuild diffs line by line)."""
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != "builds")
    rows = ",\n".join(f"  {json.dumps(row)}" for row in doc["builds"])
    return f'{{\n{head},\n "builds": [\n{rows}\n ]\n}}\n'


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # before any kernel module is imported (aot_specs imports them)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="ARCH", choices=sorted(TARGETS), help="build the specs named in --names")
    parser.add_argument("--names", metavar="FILE", help="a JSON list of spec names (with --worker)")
    parser.add_argument("--json", metavar="PATH", help="write the records of every build here")
    parser.add_argument("--ops", nargs="+", default=list(AOT_OPS), choices=AOT_OPS)
    parser.add_argument("--arch", nargs="+", default=["sm_90", "sm_80"], choices=sorted(TARGETS))
    parser.add_argument("--first", type=int, metavar="N", help="build only the first N specs of each kernel and dtype")
    parser.add_argument(
        "--merge", action="store_true", help="keep the --json file's records of the kernels not rebuilt this time"
    )
    args = parser.parse_args()
    if args.worker:
        json.dump(worker(args.worker, json.loads(Path(args.names).read_text())), sys.stdout)
        return
    if not args.json:
        parser.error("give --json PATH (or --worker ARCH)")
    specs = all_specs(args.ops)
    if args.first:
        seen: dict[tuple[str, str], int] = {}
        for name, spec in list(specs.items()):
            group = (spec.kernel, spec.dtype)
            seen[group] = seen.get(group, 0) + 1
            if seen[group] > args.first:
                del specs[name]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aot_cache_") as cache:
        builds = build_in_workers(list(specs), args.arch, cache_dir=cache)
    rows = records(specs, builds)
    if args.merge and Path(args.json).exists():
        rebuilt = {(row["kernel"], row["arch"]) for row in rows}
        current = all_specs(list(AOT_OPS))  # a record of a spec that no longer exists is dropped
        old = json.loads(Path(args.json).read_text())["builds"]
        kept = [
            r for r in old if (r["kernel"], r["arch"]) not in rebuilt and f"{r['kernel']}[{r['config']}]" in current
        ]
        rows = records_sorted(kept + rows)
    doc = {
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": (
            f"{os.cpu_count()} CPUs, one worker process per arch, a fresh Triton cache; seconds is wall time "
            "(it includes waiting for other load on the machine), cpu_seconds the compile's own CPU time"
        ),
        "builds": rows,
    }
    Path(args.json).write_text(dumps(doc))
    bad = [f"{r['kernel']}[{r['config']}] sm_{r['arch']}" for r in rows if r.get("error") or r.get("spills")]
    wall = time.perf_counter() - started
    built = sum(map(len, builds.values()))
    print(f"{built} builds in {wall:.0f} s; {len(rows)} records -> {args.json}; failing or spilling: {len(bad)}")
    for line in bad:
        print("  ", line)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
