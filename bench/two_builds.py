"""Another build of the C++ step beside the checkout's, for the A/B scripts under ``bench/results``
(``ab_two_builds.py``, ``ab_tg_two_builds.py``, ``step_rate.py``): the library built from a copy
of ``wiola/fast/decode_step_cpu.cpp`` (``build``), a binding rebound to it (``rebind``), and the
13m preset those scripts time (``model_13m``), with ``wiola.fast.speed.interleaved``, their timing
loop. The scripts put the checkout root on ``sys.path`` to import it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

import wiola
from wiola.fast import WiolaModel as FastModel
from wiola.fast import decode_step_cpu as dsc
from wiola.fast.quantize import quantize
from wiola.fast.speed import interleaved

__all__ = ["build", "interleaved", "model_13m", "rebind"]


def build(source: Path | str, isa: str | None = None) -> ctypes.CDLL:
    """The step's library built from ``source`` (in the build cache, keyed by its text like the
    checkout's), for ``select_isa(isa)``; the checkout's own library is built first, and
    ``decode_step_cpu.SOURCE`` is the checkout's again afterwards."""
    dsc.load(isa)
    saved = dsc.SOURCE
    try:
        dsc.SOURCE = Path(source)
        return dsc._build(dsc._compiler(), dsc.select_isa(isa))
    finally:
        dsc.SOURCE = saved


def rebind(step: dsc.DecodeStepCPU, lib: ctypes.CDLL) -> dsc.DecodeStepCPU:
    """``step`` calling ``lib`` from now on, its workspace sized by ``lib`` (a patched source may
    need more of it than the checkout's)."""
    step.lib = lib
    step.work = torch.empty(lib.wiola_workspace_floats(step.dims), dtype=torch.float32)
    return step


def model_13m(scheme: str) -> FastModel:
    """The 13m preset with random weights (``torch.manual_seed(0)``), in eval mode, quantized to
    ``scheme`` unless it is ``"fp32"``."""
    torch.manual_seed(0)
    model = FastModel(wiola.WiolaConfig.preset("13m")).eval().requires_grad_(False)
    return model if scheme == "fp32" else quantize(model, scheme)
