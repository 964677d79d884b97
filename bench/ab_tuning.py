"""The C++ step's tuning knobs A/B'd on this CPU, interleaved in one process (issue 21: tune per CPU
family, choose by measurement).

    python -m bench.ab_tuning --knob prefetch_rows --values 8 32 --scheme int8 --batch 1 [--out DIR]

One model (the 13m preset, random weights, seed 0; quantized by ``wiola.fast.quantize`` unless
``--scheme fp32``) and one ``DecodeStepCPU`` binding; the knob's value is written into the
binding's dimensions (``wiola.fast.step_layout.DIMS``) between timed blocks of ``--steps`` steps,
the values' order reversed every round, so that each value sees the same machine: on a shared VM
whose speed drifts by tens of percent between processes, alternating whole processes needs many
more runs to tell a few percent apart. The cache advances one slot a step, so every value sees
the same range of context lengths.

Before timing, every value decodes the same step from copies of the same cache, and the logits
are asserted bitwise equal: a knob chooses only where loads are served from and how many threads
run (``docs/SPEC.md``, "Tuning per CPU"), never a result.

Prints each value's median and fastest step time and its speed relative to the first value, with
the CPU's model name, the ISA variant and the binding's tuning; with ``--out``, writes
``ab_tuning.json`` and ``ab_tuning.png`` (the step times per value) there. A knob that is not
one of ``KNOBS``, or a value it does not take, exits with status 2 and a message naming it; where
the C++ step cannot be built, it exits 1 saying why.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from wiola.config import WiolaConfig

KNOBS = {"stream_head": (0, 1), "prefetch_rows": (0, 4096), "bytes_per_thread": (1, 1 << 40)}  # allowed ranges


def _model(config: WiolaConfig, scheme: str) -> torch.nn.Module:
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's generator left as it was
        torch.manual_seed(0)
        model = FastModel(config).eval().requires_grad_(False)
    return model if scheme == "fp32" else quantize(model, scheme)


def check(knob: str, values: list[int], scheme: str, batch: int, rounds: int, steps: int) -> None:
    """Raise ``ValueError`` naming the problem with the arguments, before anything is built."""
    if knob not in KNOBS:
        raise ValueError(f"--knob {knob!r} is not one of {', '.join(KNOBS)}")
    low, high = KNOBS[knob]
    if len(values) < 2 or len(set(values)) != len(values):
        raise ValueError(f"--values needs at least two distinct values, got {values}")
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise ValueError(f"--values {bad} out of range for {knob} ([{low}, {high}])")
    if scheme not in ("fp32", "bf16", "int8", "int4"):
        raise ValueError(f"--scheme {scheme!r} is not one of fp32, bf16, int8, int4")
    for name, v in (("--batch", batch), ("--rounds", rounds), ("--steps", steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def run(
    knob: str,
    values: list[int],
    scheme: str = "fp32",
    batch: int = 1,
    rounds: int = 12,
    steps: int = 5,
    prompt: int = 16,
    config: WiolaConfig | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Time the step under each of ``values`` of ``knob`` (see the module's text); the record.
    Leaves torch's global state (gradient mode, generator) as it found it."""
    check(knob, values, scheme, batch, rounds, steps)
    with torch.no_grad():
        return _run(knob, values, scheme, batch, rounds, steps, prompt, config, progress)


def _run(
    knob: str,
    values: list[int],
    scheme: str,
    batch: int,
    rounds: int,
    steps: int,
    prompt: int,
    config: WiolaConfig | None,
    progress: bool,
) -> dict[str, Any]:
    import wiola
    from wiola.fast import decode_step_cpu, step_layout

    if decode_step_cpu.load() is None:
        raise RuntimeError(f"the C++ step is not available here: {decode_step_cpu.BUILD_ERROR}")
    config = config or wiola.WiolaConfig.preset("13m")
    slots = prompt + 1 + rounds * len(values) * steps
    if slots > config.max_seq_len:
        raise ValueError(
            f"{slots} cache slots needed (prompt {prompt} + rounds x values x steps) > {config.max_seq_len}"
        )
    model = _model(config, scheme)
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(batch, slots)
    model(ids, cache=cache)
    index = step_layout.DIMS.index(knob)
    tok = ids[:, -1].contiguous()

    logits = {}
    for v in values:  # the same step from copies of the same cache: bitwise the same logits
        twin = decode_step_cpu.DecodeStepCPU(model, copy.deepcopy(cache))
        twin.dims[index] = v
        logits[v] = twin(tok, prompt)
    step = decode_step_cpu.DecodeStepCPU(model, cache)
    differ = [v for v in values[1:] if not torch.equal(logits[v], logits[values[0]])]
    assert not differ, (
        f"{knob}={differ} changed the logits against {knob}={values[0]} ({_cpu(step.tuning)}, {step.isa})"
    )
    chosen = int(step.dims[index])
    times: dict[int, list[float]] = {v: [] for v in values}
    slot = prompt
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=rounds, unit="round", file=sys.stderr, leave=False)
    for r in range(rounds):
        for v in values if r % 2 == 0 else values[::-1]:
            step.dims[index] = v
            start = time.perf_counter()
            for _ in range(steps):
                step(tok, slot)
                slot += 1
            times[v].append((time.perf_counter() - start) / steps)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    first = statistics.median(times[values[0]])
    return {
        "cpu": _cpu(step.tuning),
        "isa": step.isa,
        "tuning": dict(step.tuning),
        "knob": knob,
        "chosen": chosen,
        "scheme": scheme,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "steps_per_block": steps,
        "bitwise_equal": True,
        "values": {
            str(v): {
                "median_us": statistics.median(t) * 1e6,
                "min_us": min(t) * 1e6,
                "speed_vs_first": first / statistics.median(t),
                "times_us": [x * 1e6 for x in t],
            }
            for v, t in times.items()
        },
    }


def _cpu(tuning: dict[str, Any]) -> str:
    """The CPU's model name with its vendor family and model numbers (a VM's name can be bare), from
    the binding's tuning record."""
    return f"{tuning['cpu']} (family {tuning['family']}, model {tuning['model']})"


def summary(rec: dict[str, Any]) -> str:
    """The record as a few lines of text: the CPU, then one line per value."""
    head = (
        f"{rec['knob']} on {rec['cpu']} ({rec['isa']}, {rec['threads']} threads), {rec['scheme']} weights, "
        f"batch {rec['batch']}: {rec['rounds']} rounds of {rec['steps_per_block']} steps a value, interleaved; "
        f"logits bitwise equal across values; this CPU's choice: {rec['chosen']}"
    )
    lines = [head]
    for v, r in rec["values"].items():
        lines.append(
            f"  {rec['knob']}={v}: median {r['median_us']:.0f} us a step, fastest {r['min_us']:.0f} us, "
            f"{r['speed_vs_first']:.3f}x the first value"
        )
    return "\n".join(lines)


def plot(rec: dict[str, Any], path: Path) -> None:
    """Each value's step times (every timed block) as points, the median as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, r in enumerate(rec["values"].values()):
        ax.bar(i, r["median_us"], color="#9ecae1", width=0.6)
        ax.plot([i] * len(r["times_us"]), r["times_us"], "k.", alpha=0.5)
    ax.set_xticks(range(len(rec["values"])), [f"{rec['knob']}={v}" for v in rec["values"]])
    ax.set_ylabel("µs a step")
    ax.set_title(f"{rec['cpu']}: {rec['scheme']} B{rec['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_tuning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--knob", required=True, help=f"one of {', '.join(KNOBS)}")
    parser.add_argument("--values", type=int, nargs="+", required=True)
    parser.add_argument("--scheme", default="fp32", help="fp32, bf16, int8 or int4 weights")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps a timed block")
    parser.add_argument("--out", type=Path, help="folder for ab_tuning.json and ab_tuning.png")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"bench.ab_tuning: error: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        rec = run(
            args.knob, args.values, args.scheme, args.batch, args.rounds, args.steps, progress=sys.stderr.isatty()
        )
    except ValueError as exc:
        print(f"bench.ab_tuning: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # no C++ step on this machine (no compiler, a build error)
        print(f"bench.ab_tuning: {exc}", file=sys.stderr)
        return 1
    print(summary(rec))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab_tuning.json").write_text(json.dumps(rec, indent=1) + "\n")
        plot(rec, args.out / "ab_tuning.png")
        print(f"wrote {args.out / 'ab_tuning.json'} and {args.out / 'ab_tuning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
