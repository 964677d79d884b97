"""Helpers of ``bench/device_check.sh``: the run's metadata and the closing summary.

python -m bench.device_check env OUT/env.json
python -m bench.device_check summary OUT PARITY_RC BENCH_RC
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.frame import environment


def write_env(path: str | Path) -> dict:
    """Write the date, GPU name, driver, CUDA, torch and triton versions (and the commit) as JSON."""
    info = environment()
    commit = os.environ.get("WIOLA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except Exception:
            commit = None
    info["commit"] = commit or "unknown (no .git on this machine; pass WIOLA_COMMIT)"
    try:
        import pytest_benchmark

        info["pytest_benchmark"] = pytest_benchmark.__version__
    except ImportError:
        info["pytest_benchmark"] = None
    Path(path).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _last_summary_line(log: Path) -> str:
    """pytest's final ``N passed, M failed ...`` line of a log, or a note that there is none."""
    if not log.is_file():
        return f"{log.name}: missing"
    lines = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", line) and " in " in line:
            return line
    return "no pytest summary line (killed by its time limit?)"


def summary(out_dir: str | Path, parity_rc: int, bench_rc: int) -> int:
    """Print the parity and benchmark outcome, then the short results table; return the exit code."""
    from bench import report

    out = Path(out_dir)
    print("\n========== wiola device check ==========")
    env = out / "env.json"
    if env.is_file():
        e = json.loads(env.read_text())
        print(f"{e.get('gpu')} | driver {e.get('driver')} | torch {e.get('torch')} | triton {e.get('triton')}")
    verdict = "OK" if parity_rc == 0 else f"FAILED (exit {parity_rc}{', time limit' if parity_rc == 124 else ''})"
    print(f"parity tests: {verdict}: {_last_summary_line(out / 'parity.log')}")
    print(f"benchmarks (exit {bench_rc}): {_last_summary_line(out / 'bench.log')}")
    results = out / "bench.json"
    if not results.is_file() or results.stat().st_size == 0:  # pytest-benchmark writes nothing when killed
        results = out / "bench.jsonl"
    if results.is_file() and results.stat().st_size > 0:
        try:
            run = report.load_run(results)
            ceil = next((r["ceilings"] for r in run.records if "ceilings" in r), None)
            if ceil:
                print(
                    f"ceilings: matmul {ceil['matmul']} {report.fmt_num(ceil['matmul_tflops'])} TFLOP/s, copy {report.fmt_num(ceil['copy_gbs'])} GB/s"
                )
            print("\n".join(report.summary_lines([run])))
        except Exception as exc:
            print(f"could not read {results.name}: {exc}")
    else:
        print("no benchmark results")
    if parity_rc != 0:
        return 1
    return 0 if bench_rc in (0, 5) else 2


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "env":
        write_env(argv[1])
        return 0
    if len(argv) == 4 and argv[0] == "summary":
        return summary(argv[1], int(argv[2]), int(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
