"""pytest plugin of the device check's parity stage: one autotune config per key, not all of them.

    pytest -p bench.parity_plugin tests/...        (active when WIOLA_PARITY_ONE_CONFIG=1)

The parity tests check numbers, not speed; autotuning every key compiles and times every config
its dtype and head width keep (2-4 builds a key for attention, 3-4 for butterfly) in every xdist
worker, which does not fit a GPU check's minutes. With this plugin each autotuner of ``kernels/``
tries a single config per key: one of the configs its own ``early_config_prune`` keeps for the
launch (attention: the list of q's dtype class, fp32 or bf16/fp16, at that head width, so the
spill-free limits hold), chosen by a checksum of the key, so different keys exercise different
configs across the run. Which config each key got is printed with ``TRITON_PRINT_AUTOTUNING=1``.
``tests/test_attention.py`` still forces every attention config explicitly
(``test_every_autotune_block_shape``)."""

from __future__ import annotations

import importlib
import os
import zlib
from collections.abc import Callable
from typing import Any


def choose(candidates: list[Any], key: tuple) -> Any:
    """The config of ``candidates`` for ``key``: index crc32(repr(key)) mod the count."""
    if not candidates:
        raise ValueError("no autotune config left to choose from")
    return candidates[zlib.crc32(repr(key).encode()) % len(candidates)]


def _key(tuner: Any, kwargs: dict[str, Any]) -> tuple:
    """The autotune key as Triton forms it: the key arguments' values, then every tensor's dtype."""
    args = {**(tuner.nargs or {}), **kwargs}
    key = [args[k] for k in tuner.keys if k in args]
    key += [str(v.dtype) for k, v in args.items() if k in tuner.arg_names and hasattr(v, "dtype")]
    return tuple(key)


def one_config(tuner: Any) -> None:
    """Make ``tuner`` (a ``triton.runtime.autotuner.Autotuner``) try one config per key: Triton
    calls ``prune_configs`` once per new key, with the launch's positional arguments in
    ``tuner.nargs`` and its keywords; the choice is made among what the original returns."""
    pruned: Callable[[dict[str, Any]], list[Any]] = tuner.prune_configs

    def prune_to_one(kwargs: dict[str, Any]) -> list[Any]:
        return [choose(list(pruned(kwargs)), _key(tuner, kwargs))]

    tuner.prune_configs = prune_to_one


PATCHED: list[str] = []  # "module.attribute" of every autotuner changed in this process


def pytest_configure(config: Any) -> None:
    import torch

    # Without CUDA the kernels run interpreted with fixed configs; importing them here, before
    # tests/conftest.py sets TRITON_INTERPRET, would break that.
    if os.environ.get("WIOLA_PARITY_ONE_CONFIG") != "1" or not torch.cuda.is_available():
        return
    from triton.runtime.autotuner import Autotuner

    from wiola_kernels.aot import AOT_OPS  # every kernels/<op>.py

    for name in AOT_OPS:
        mod = importlib.import_module(f"wiola_kernels.{name}")
        for attr, obj in vars(mod).items():
            if isinstance(obj, Autotuner) and f"{name}.{attr}" not in PATCHED:
                one_config(obj)
                PATCHED.append(f"{name}.{attr}")


def pytest_report_header(config: Any) -> str | None:
    if not PATCHED:
        return None
    return f"parity: one autotune config per key (WIOLA_PARITY_ONE_CONFIG=1) for {', '.join(PATCHED)}"
