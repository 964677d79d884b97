"""``wiola budget``: exact parameter counts and FLOPs per token of a preset."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import PRESETS

    p = sub.add_parser("budget", help="exact parameter counts and FLOPs per token of a preset")
    p.add_argument("--preset", default="13m", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=512, help="sequence length for attention FLOPs")
    p.set_defaults(func=_budget)


def _budget(args: argparse.Namespace) -> int:
    from wiola import WiolaConfig, budget

    config = WiolaConfig.preset(args.preset)
    print(budget(config, args.seq_len).table())
    return 0
