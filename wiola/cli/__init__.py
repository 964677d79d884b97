"""The ``wiola`` command (``python -m wiola`` too, and under ``torchrun ... -m wiola train``).

Sub-commands: ``budget`` (``wiola.cli.budget``), ``generate`` (``wiola.cli.generate``), ``train``
(``wiola.cli.train``), ``eval`` and ``gates`` (``wiola.cli.evaluate``), ``demo`` (``wiola.cli.demo``),
``tokenizer train`` (``wiola.cli.tokenizer``), ``export`` (``wiola.cli.export``), ``ablate``
(``wiola.cli.ablate``).
Every handler takes the parsed arguments and returns an exit code (0 done, 2 bad input, 130
interrupted with a checkpoint saved). Bad input is one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import sys

from wiola.cli import ablate, budget, chat, demo, evaluate, export, finetune, generate, merge, tokenizer, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wiola", description="Wiola small language model")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (budget, generate, train, evaluate, demo, tokenizer, export, ablate, finetune, merge, chat):
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError, TypeError) as e:
        print(f"wiola {args.command}: error: {e}", file=sys.stderr)
        return 2
