"""``wiola budget``: exact parameter counts and FLOPs per token of a preset."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import FFN_KINDS, PRESETS

    p = sub.add_parser("budget", help="exact parameter counts and FLOPs per token of a preset")
    p.add_argument("--preset", default="13m", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=512, help="sequence length for attention FLOPs")
    p.add_argument("--ffn", default="butterfly", choices=FFN_KINDS, help="feed-forward block")
    p.add_argument("--no-gate", dest="gate", action="store_false", help="without the attention gate")
    p.add_argument(
        "--match-params", action="store_true", help="pick d_ff so the total is nearest the preset's (within 0.5%%)"
    )
    p.set_defaults(func=_budget)


def _budget(args: argparse.Namespace) -> int:
    from wiola import WiolaConfig, budget
    from wiola.budget import match_params

    config = WiolaConfig.preset(args.preset, ffn=args.ffn, gate=args.gate)
    if args.match_params:
        config = match_params(config, WiolaConfig.preset(args.preset))
    print(budget(config, args.seq_len).table())
    return 0
