"""``wiola ablate SPEC``: a sweep of model variants × seeds with statistics and figures
(``wiola.train.ablate``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from wiola.cli.arguments import add_progress_flag, non_empty_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ablate", help="train variants × seeds from a TOML/JSON spec; report with CIs and plots")
    p.add_argument("spec", type=non_empty_path, help="the sweep: a .toml or .json file (docs/SPEC.md, Ablations)")
    p.add_argument("--out", type=non_empty_path, help="sweep folder (default: runs/ablate-<spec file name>)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="delete the sweep's runs and report in --out and start again (without it, a run folder "
        "trained with other settings than the spec's is refused)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, metavar="N", help="runs trained at once, each with cores/N threads (default 1)")
    p.add_argument(
        "--print-commands", action="store_true", help="write the run configs, print one command per unfinished run"
    )
    p.add_argument("--torchrun", type=int, metavar="N", help="with --print-commands: torchrun with N processes")
    add_progress_flag(p)
    p.set_defaults(func=run_ablate)


def check_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming a flag that is out of range or does not go with the others; before
    the spec is read or anything is written."""
    if args.torchrun is not None and not args.print_commands:
        raise ValueError("--torchrun goes with --print-commands (a local sweep runs `wiola train` itself)")
    if args.torchrun is not None and args.torchrun < 1:
        raise ValueError(f"--torchrun must be >= 1 (processes per node), got {args.torchrun}")
    if args.jobs is not None and args.print_commands:
        raise ValueError("--jobs goes with a local sweep; with --print-commands the scheduler runs the commands")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")


def run_ablate(args: argparse.Namespace) -> int:
    from wiola.train.ablate import commands, load_spec, prepare_sweep, run_sweep
    from wiola.train.ablate_report import check_report_packages

    check_flags(args)
    spec = load_spec(args.spec)
    out = Path(args.out or Path("runs") / f"ablate-{Path(args.spec).stem}")
    log = lambda m: print(m, file=sys.stderr)  # progress on stderr, the report on stdout
    if args.print_commands:
        runs = prepare_sweep(spec, out, overwrite=args.overwrite, log=log)
        for line in commands(runs, args.torchrun):
            print(line)
        then = shlex.join(["wiola", "ablate", args.spec, "--out", str(out)])
        print(f"# then: {then}   (writes the report once every run has finished)")
        return 0
    check_report_packages()  # before any run: the report is written once they have all finished
    jobs = 1 if args.jobs is None else args.jobs
    report = run_sweep(spec, out, jobs=jobs, log=log, progress=args.progress, overwrite=args.overwrite)
    if report is None:
        return 130
    print(report.read_text())
    print(f"report: {report}\nresults: {report.parent / 'results.json'}")
    return 0
