"""Where wiola keeps files between runs: the C++ step's builds (``wiola.fast.decode_step_cpu``)
and training's token shards (``wiola.train.token_cache``), in one folder a user can move."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VARIABLE = "WIOLA_CACHE_DIR"


def standard_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/wiola``, or ``~/.cache/wiola`` (a relative ``XDG_CACHE_HOME`` is invalid
    and ignored, as the XDG base directory spec says). Not created."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "wiola"


def user_cache_dir() -> Path:
    """``$WIOLA_CACHE_DIR`` (``~`` expanded) when set, else ``standard_cache_dir()``. Not created."""
    explicit = os.environ.get(CACHE_DIR_VARIABLE)
    return Path(explicit).expanduser() if explicit else standard_cache_dir()
