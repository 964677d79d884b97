"""``wiola serve``: an OpenAI-compatible HTTP server for a checkpoint (``wiola.serve``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible, continuous batching)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    raise ValueError("not built yet")
