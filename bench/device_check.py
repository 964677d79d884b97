"""Helpers of ``bench/device_check.sh`` (see bench/README.md): metadata, tables, the plan.

python -m bench.device_check env OUT/env.json            # date, GPU, driver, versions, commit
python -m bench.device_check plan [--budget S] [--aot F]  # CPU: what each stage compiles, does it fit
python -m bench.device_check headline OUT                # the headline table from OUT/bench.jsonl
python -m bench.device_check sanitize-target             # the work compute-sanitizer watches (CUDA)
python -m bench.device_check summary OUT                 # every stage's outcome, the tables; exit code
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.plan import BUDGETS

# The minimal parity selection on CUDA: the kernel, fast-model and generation tests (the CPU-only
# tests — torchrun DDP, the demo, the C++ decode step, data, tokenizer — stay in CI), without the
# torch.compile tests (inductor compiles; they run in the last stage).
PARITY_TESTS = [
    "tests/test_attention.py",
    "tests/test_butterfly.py",
    "tests/test_gate.py",
    "tests/test_rms_norm.py",
    "tests/test_cross_entropy.py",
    "tests/test_decode.py",
    "tests/test_fast.py",
]
# Without CUDA (CI's dry run) a small selection under the Triton interpreter.
PARITY_TESTS_CPU = ["tests/test_decode.py"]  # the flash-decoding kernel: about 20 s interpreted
# The GPU benchmark files in the order of their value (the headline's first); the CPU-only
# test_decode_cpu.py stays out (GPU minutes are for GPU work).
BENCH_FILES = [
    "bench/test_train_step.py",
    "bench/test_decode.py",
    "bench/test_attention.py",
    "bench/test_butterfly.py",
    "bench/test_gate.py",
    "bench/test_rms_norm.py",
    "bench/test_cross_entropy.py",
]
HEADLINE_FILES = BENCH_FILES[:3]
SANITIZER_ERRORS = 86  # compute-sanitizer --error-exitcode in device_check.sh


def write_env(path: str | Path) -> dict:
    """Write the date, GPU name, driver, CUDA, torch and triton versions (and the commit) as JSON."""
    from bench.frame import environment

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
    from importlib import metadata

    # The baselines' packages: which transformers the wiola13m baseline ran under (or why not).
    for name in ("pytest-benchmark", "transformers", "wiola13m"):
        try:
            info[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name.replace("-", "_")] = None
    Path(path).write_text(json.dumps(info, indent=2) + "\n")
    return info


def last_summary_line(log: Path) -> str:
    """pytest's final ``N passed, M failed ...`` line of a log, or a note that there is none."""
    if not log.is_file():
        return f"{log.name}: missing"
    lines = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", line) and " in " in line:
            return line
    return "no pytest summary line (killed by its time limit?)"


def read_stages(out: Path) -> list[dict[str, Any]]:
    """``stages.tsv`` lines: name, exit code, seconds used, budget, note (the shell appends one per stage)."""
    path = out / "stages.tsv"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        rc = None if parts[1] in ("", "-") else int(parts[1])
        rows.append(
            {"name": parts[0], "rc": rc, "seconds": int(parts[2]), "budget": int(parts[3]),
             "note": parts[4] if len(parts) > 4 else ""}
        )  # fmt: skip
    return rows


def _verdict(rc: int | None, note: str) -> str:
    if rc is None:
        return f"skipped: {note}" if note else "skipped"
    if rc == 0:
        return "ok" + (f" ({note})" if note else "")
    if rc == 5:
        return "nothing selected" + (f" ({note})" if note else "")
    if rc == 124:
        return "time limit reached (what finished is recorded)"
    return f"FAILED (exit {rc})" + (f": {note}" if note else "")


def headline_lines(results: Path) -> list[str]:
    """The headline table: stage "headline" records of a JSON-lines results file."""
    from bench import report

    if not results.is_file() or results.stat().st_size == 0:
        return ["headline: no results recorded"]
    run = report.load_run(results)
    recs = [r for r in run.records if r.get("stage") == "headline"]
    if not recs:
        return ["headline: no results recorded"]
    lines = [
        f"{'headline':<22} {'shape':<18} {'impl':<11} {'time':>10} {'tokens/s':>11} {'MFU':>6}  vs baselines (ours N×)"
    ]
    for r in recs:
        timed = "time_s" in r and not r.get("quick")
        lines.append(
            f"{report.group_key(r)[:22]:<22} {r.get('shape_id', '')[:18]:<18} {r.get('impl', '')[:11]:<11} "
            f"{report.fmt_time(r['time_s']) if timed else 'not timed':>10} "
            f"{report.fmt_rate(r['tokens_per_s']) if 'tokens_per_s' in r else '—':>11} "
            f"{report.fmt_pct(r['mfu_pct']) if 'mfu_pct' in r else '—':>6}  " + ", ".join(report.speedup_cells(r))
        )
        host = r.get("host")
        if timed and host and "host_median_s" in host:
            warm = ", ".join(report.fmt_time(w) for w in host.get("warmup_s", []))
            slept = host.get("gpu_slept_median_s")
            lines.append(
                f"{'':<22} host: {report.fmt_time(host['host_median_s'])} a timed call (GPU {report.fmt_time(r['time_s'])}"
                + (f", spun {report.fmt_time(slept)} ahead" if slept else "")
                + (", spin rate recalibrated" if host.get("sleep_recalibrated") else "")
                + f"), warm-up calls {warm or '—'}"
            )
        loop = report.loop_line(r)
        if loop:
            lines.append(f"{'':<22} {loop}")
        agree = (r.get("info") or {}).get("greedy_vs_reference")
        if agree:
            first = agree.get("first_divergence")
            where = "none" if first is None else f"new token {first['step']} (row {first['row']})"
            gap = agree.get("reference_top2_gap_at_divergence")
            lines.append(
                f"{'':<22} greedy vs reference ({r.get('dtype')}): rows identical {agree['rows_identical']:.0%}, "
                f"equal prefix {agree['prefix_agreement']:.0%}, first divergence {where}"
                + (f", reference top-2 gap there {gap:.3g}" if gap is not None else "")
            )
    ceil = next((r["ceilings"] for r in recs if "ceilings" in r), None)
    if ceil:
        lines.append(
            f"ceilings: matmul {ceil['matmul']} {report.fmt_num(ceil['matmul_tflops'])} TFLOP/s, "
            f"copy {report.fmt_num(ceil['copy_gbs'])} GB/s"
        )
    return lines


def summary(out_dir: str | Path) -> int:
    """Print every stage's outcome, the headline table and the results table; return the exit code:
    see ``exit_code``."""
    from bench import report

    out = Path(out_dir)
    print("\n========== wiola device check ==========")
    env = out / "env.json"
    if env.is_file():
        e = json.loads(env.read_text())
        gpu = e.get("gpu") or "no CUDA device"
        print(
            f"{gpu} | driver {e.get('driver', '—')} | torch {e.get('torch')} | triton {e.get('triton')} | commit {e.get('commit')}"
        )
    stages = read_stages(out)
    for s in stages:
        log = out / f"{s['name']}.log"
        tail = f" | {last_summary_line(log)}" if log.is_file() and s["name"] in ("headline", "parity", "extra") else ""
        print(f"{s['name']:<10} {s['seconds']:>4}s of {s['budget']:>4}s  {_verdict(s['rc'], s['note'])}{tail}")
    print()
    print("\n".join(headline_lines(out / "bench.jsonl")))
    print("\n".join(split_lines(out / "split.jsonl")))
    results = out / "bench.jsonl"
    if results.is_file() and results.stat().st_size > 0:
        try:
            others = [r for r in report.load_run(results).records if r.get("stage") != "headline"]
            if others:
                run = report.load_run(results)
                run.records = others
                print("\nother benchmarks:")
                print("\n".join(report.summary_lines([run])))
        except Exception as exc:
            print(f"could not read {results.name}: {exc}")
    return exit_code(stages)


def split_lines(path: str | Path) -> list[str]:
    """One line per batch size of ``bench.decode_split``'s output (``split.jsonl``): the call, its
    prefill (GPU and host), the replayed steps, and the time the GPU had nothing to run. Lines
    that are not complete records are skipped; no file, no lines."""
    path = Path(path)
    if not path.is_file():
        return []
    keys = ("batch", "new", "generate_s", "prefill_s", "prefill_host_s", "replay_s_per_step", "generate_kernel_busy_s")
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(text)
        except json.JSONDecodeError:
            continue
        if not isinstance(r, dict) or any(k not in r for k in keys):
            continue
        steps = r["new"] * r["replay_s_per_step"]
        idle = r["generate_s"] - r["generate_kernel_busy_s"]
        lines.append(
            f"decode split B{r['batch']}: generate {r['generate_s'] * 1e3:.1f} ms = prefill {r['prefill_s'] * 1e3:.2f} ms "
            f"(host {r['prefill_host_s'] * 1e3:.2f} ms to issue it) + {r['new']} steps × "
            f"{r['replay_s_per_step'] * 1e6:.0f} µs replayed ({steps * 1e3:.1f} ms) + the rest "
            f"{(r['generate_s'] - r['prefill_s'] - steps) * 1e3:.1f} ms; GPU idle {idle * 1e3:.1f} ms of the call"
        )
    return lines


def exit_code(stages: list[dict[str, Any]]) -> int:
    """1: a parity test failed, or the parity stage did not finish (or never ran); 2: a headline
    benchmark failed; 3: memcheck found errors; 4: another benchmark (or the decode split) failed;
    else 0. A stage skipped (no CUDA, switched off, no time) or an optional one cut by its time
    limit is no failure."""
    rc = {s["name"]: s["rc"] for s in stages}
    if "parity" not in rc or rc["parity"] != 0 or rc.get("parity-compile") not in (0, 5, 124, None):
        return 1
    if rc.get("headline") not in (0, 5, None):
        return 2
    if rc.get("sanitizer") == SANITIZER_ERRORS:
        return 3
    if rc.get("extra") not in (0, 5, 124, None) or rc.get("split") not in (0, 124, None):
        return 4
    return 0


# ------------------------------------------------------------------------------ sanitizer
def sanitize_target() -> None:
    """The work ``compute-sanitizer --tool memcheck`` watches: one 13m training step of wiola.fast
    (bf16 autocast, B 1 × T 512) and a batch-1 greedy generate of 8 tokens after a 512-token
    prompt (bf16 model) — the headline's shapes, so its kernels and autotune results are cached."""
    import torch

    import wiola
    from wiola.fast import WiolaModel as Fast
    from wiola.fast.generation import step_generate

    if not torch.cuda.is_available():
        raise SystemExit("sanitize-target needs a CUDA device")
    cfg = wiola.WiolaConfig.preset("13m")
    torch.manual_seed(0)
    model = Fast(cfg).to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    model = model.to(torch.bfloat16).eval()
    # The graph-mode step's kernels, run eagerly: under memcheck PyTorch's caching allocator is
    # off, and a capturing stream refuses the plain cudaMalloc calls that leaves.
    out = step_generate(model, ids, 8, temperature=0, capture=False)
    torch.cuda.synchronize()
    print(f"sanitize-target: train step loss {loss.item():.4f}, generated {tuple(out.shape)}")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "env":
        write_env(argv[1])
        return 0
    if argv[:1] == ["plan"]:
        from bench import plan

        return plan.main(argv[1:])
    if argv == ["budgets"]:  # for the shell: NAME=SECONDS lines
        print("\n".join(f"{k}={v}" for k, v in BUDGETS.items()))
        return 0
    if argv[:1] == ["tests"] and len(argv) == 2:  # for the shell: a space-separated selection
        print(" ".join({"parity": PARITY_TESTS, "parity-cpu": PARITY_TESTS_CPU, "bench": BENCH_FILES,
                        "headline": HEADLINE_FILES}[argv[1]]))  # fmt: skip
        return 0
    if len(argv) == 2 and argv[0] == "headline":
        print("\n".join(headline_lines(Path(argv[1]) / "bench.jsonl")))
        return 0
    if argv == ["sanitize-target"]:
        sanitize_target()
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        return summary(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
