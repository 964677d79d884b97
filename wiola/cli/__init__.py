"""The ``wiola`` command (``python -m wiola`` too, and under ``torchrun ... -m wiola train``).

Sub-commands: ``budget`` (``wiola.cli.budget``), ``generate`` (``wiola.cli.generate``), ``train``
(``wiola.cli.train``), ``eval`` and ``gates`` (``wiola.cli.evaluate``), ``demo`` (``wiola.cli.demo``),
``tokenizer train`` (``wiola.cli.tokenizer``), ``export`` (``wiola.cli.export``), ``ablate``
(``wiola.cli.ablate``), ``finetune``, ``merge``, ``chat``, ``serve``, ``bench`` (each
``wiola.cli.<name>``).
``wiola --version`` prints the package version.
Every handler takes the parsed arguments and returns an exit code (0 done, 1 a training run
that diverged: a non-finite loss, gradient or weight, its earlier checkpoints kept; 2 bad input;
130 interrupted: Ctrl-C, with a checkpoint saved where training). Bad input is one line on stderr,
``wiola <command>: error: ...``, no traceback; so is an argument argparse rejects.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from wiola import __version__
from wiola.cli import (
    ablate,
    bench,
    budget,
    chat,
    demo,
    evaluate,
    export,
    finetune,
    generate,
    merge,
    serve,
    tokenizer,
    train,
)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: ``wiola <command>: error: ...`` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Add ``(default: X)`` to the help of each option of ``parser`` and its sub-commands that has
    a default its help does not already state (a flag's False and an unset None say nothing)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)
            continue
        default, text = action.default, action.help or ""
        if (
            not action.option_strings
            or text == argparse.SUPPRESS
            or default is None
            or isinstance(default, bool)
            or default == argparse.SUPPRESS
            or "default" in text.lower()
        ):
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="wiola", description="Wiola small language model")
    parser.add_argument("--version", action="version", version=f"wiola {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (budget, generate, train, evaluate, demo, tokenizer, export, ablate, finetune, merge, chat, serve, bench)
    for command in commands:
        command.register(sub)
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of stdout went away (`wiola bench --json | head -1`)
        # Point stdout at /dev/null so that the flush at exit does not fail again, and end as a
        # process that SIGPIPE ended would (128 + 13), without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError, RuntimeError, TypeError, ImportError) as e:
        # ImportError: an optional extra that the command needs is not installed (its message says
        # which one to install); OSError: a file or folder that is missing or cannot be written
        # (its message names it)
        print(f"wiola {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"wiola {args.command}: interrupted", file=sys.stderr)
        return 130
