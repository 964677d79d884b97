"""``wiola ablate SPEC``: a sweep of model variants × seeds with statistics and figures
(``wiola.train.ablate``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wiola.cli.arguments import add_progress_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ablate", help="train variants × seeds from a TOML/JSON spec; report with CIs and plots")
    p.add_argument("spec", help="the sweep: a .toml or .json file (docs/SPEC.md, Ablations)")
    p.add_argument("--out", help="sweep folder (default: runs/ablate-<spec file name>)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once (each with cores/N threads)")
    p.add_argument(
        "--print-commands", action="store_true", help="write the run configs, print one command per unfinished run"
    )
    p.add_argument("--torchrun", type=int, metavar="N", help="with --print-commands: torchrun with N processes")
    add_progress_flag(p)
    p.set_defaults(func=run_ablate)


def run_ablate(args: argparse.Namespace) -> int:
    from wiola.train.ablate import commands, load_spec, plan, run_sweep, write_configs

    spec = load_spec(args.spec)
    out = Path(args.out or Path("runs") / f"ablate-{Path(args.spec).stem}")
    if args.torchrun is not None and not args.print_commands:
        raise ValueError("--torchrun goes with --print-commands (a local sweep runs `wiola train` itself)")
    if args.print_commands:
        runs = plan(spec, out)
        write_configs(runs)
        for line in commands(runs, args.torchrun):
            print(line)
        print(f"# then: wiola ablate {args.spec} --out {out}   (writes the report once every run has finished)")
        return 0
    report = run_sweep(spec, out, jobs=args.jobs, log=lambda m: print(m, file=sys.stderr), progress=args.progress)
    if report is None:
        return 130
    print(report.read_text())
    print(f"report: {report}\nresults: {report.parent / 'results.json'}")
    return 0
