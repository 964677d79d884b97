"""Flags that several ``wiola`` sub-commands take with the same meaning, declared once."""

from __future__ import annotations

import argparse


def add_checkpoint_arguments(p: argparse.ArgumentParser, *, help: str, required: bool = False) -> None:
    """``--checkpoint`` (a model folder, a run folder or a Hub id, described by ``help``) and
    ``--revision`` (a Hub id's branch, tag or commit); ``wiola.checkpoint.resolve_checkpoint``
    reads the pair."""
    p.add_argument("--checkpoint", type=non_empty, required=required, help=help)
    p.add_argument("--revision", type=non_empty, help="with a Hub id: a branch, tag or commit")


def non_empty(value: str) -> str:
    """An argparse ``type`` for a path or name that must not be empty (``--checkpoint ''`` would
    otherwise read as the current folder, or as no checkpoint at all)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty: give a path or a Hub id")
    return value


def non_empty_path(value: str) -> str:
    """An argparse ``type`` for a file or folder (or a named data source) that must not be empty:
    an empty path names the current folder, which a command would read or write unasked."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty: give a path (an empty one would name the current folder)")
    return value


def seed(value: str) -> int:
    """An argparse ``type`` for ``--seed``: an int in the range ``torch.Generator.manual_seed``
    takes (``wiola.generation.SEED_RANGE``), named as given when it is outside."""
    from wiola.generation import SEED_RANGE

    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not SEED_RANGE[0] <= number < SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{number} is outside [-2**63, 2**64), the seeds torch's generators take")
    return number


def top_k(value: str) -> int | None:
    """``--top-k``: an int, 0 meaning no top-k filter (None), as ``generate``'s ``top_k=0`` and the
    server's; a negative one is left to ``check_sampling_flags`` to name."""
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    return None if k == 0 else k


def add_length_arguments(p: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float) -> None:
    """``--steps``, ``--batch-size`` and ``--lr`` of a training run, with these defaults."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    """``--no-progress``: sets ``progress`` False. Without it a progress bar is drawn where stderr
    is a terminal (``wiola.train.env.Progress``); with it, or off a terminal, plain lines instead."""
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (plain lines instead)")


def check_sampling_flags(
    temperature: float | None, top_k: int | None, top_p: float | None, stop: list[str] | None = None
) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--stop`` checked by the rules generation
    itself applies (``wiola.generation.resolve_sampling``, ``check_stop_strings``), one flag at a
    time so that the ``ValueError`` names it. Commands call it before loading a model or writing
    anything."""
    from wiola.generation import check_stop_strings, resolve_sampling

    unset = {"temperature": None, "top_k": None, "top_p": None}
    for flag, key, value in (("--temperature", "temperature", temperature), ("--top-k", "top_k", top_k),
                             ("--top-p", "top_p", top_p)):  # fmt: skip
        if value is None:
            continue
        try:
            resolve_sampling(**{**unset, key: value}, vocab_size=1 << 62)  # any vocabulary: only the value is checked
        except ValueError as e:
            raise ValueError(f"{flag} {value}: {e}") from None
    try:
        check_stop_strings(stop)
    except ValueError:
        raise ValueError("--stop: a stop text must not be empty") from None
