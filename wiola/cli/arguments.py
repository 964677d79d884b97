"""Flags that several ``wiola`` sub-commands take with the same meaning, declared once."""

from __future__ import annotations

import argparse


def add_checkpoint_arguments(p: argparse.ArgumentParser, *, help: str, required: bool = False) -> None:
    """``--checkpoint`` (a model folder, a run folder or a Hub id, described by ``help``) and
    ``--revision`` (a Hub id's branch, tag or commit); ``wiola.checkpoint.resolve_checkpoint``
    reads the pair."""
    p.add_argument("--checkpoint", required=required, help=help)
    p.add_argument("--revision", help="with a Hub id: a branch, tag or commit")


def add_length_arguments(p: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float) -> None:
    """``--steps``, ``--batch-size`` and ``--lr`` of a training run, with these defaults."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--no-progress``: sets ``progress`` False (progress bars are shown unless it is given)."""
    p.add_argument("--no-progress", dest="progress", action="store_false")
