"""Count what one call launches: Triton kernels and the ATen ops that would be device kernels.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python -m bench.launches          # 13m preset, batch 1
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python -m bench.launches --autocast
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python -m bench.launches --dtype bfloat16

``LaunchCounter`` is a context manager: inside it every Triton launch (``JITFunction.run``, or
the interpreter's ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``) is counted by kernel
name, and every ATen op by a ``TorchDispatchMode``, except the ops that launch nothing on a GPU
(views, ``empty``) and the ops the interpreter itself runs inside a Triton launch. The casts
autocast inserts into ``linear`` are seen (as ``to``). What is left
is what a captured CUDA graph would replay, one kernel per count (a few ATen ops launch more than
one; none in the decode step). ``_local_scalar_dense`` (``.item()``, ``int(t)``) is a host sync:
it is reported as ``syncs``. Custom ops (``wiola::…``) are not counted themselves: their Python bodies run under the
counter, so their Triton launches and the ATen ops they run (a ``.float()`` or ``.contiguous()``
copy) are.

The command counts one decoding step of ``wiola.fast.generation.step_generate`` (the step the
CUDA graph captures, run eagerly with ``capture=False``) on the CPU under the Triton interpreter:
the 13m preset with random weights, batch 1, after a 16-token prompt, fp32 (or with
``--autocast``, the fp32 model under bf16 CPU autocast, as on GPU under CUDA autocast). It runs
the step as on CUDA: the value checks a CUDA model skips are off, the CPU-only re-laid-out
weights of ``wiola.ops.linear`` are not used, and bf16 takes every kernel it takes on a GPU (the
interpreter computes two of them wrongly in bf16, ``wiola.fast.ops.INTERPRETER_BF16_WRONG``: the
values do not matter here).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or alias and launch no kernel.
_NO_LAUNCH = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
    "promote_types",
}
_SYNCS = {"_local_scalar_dense", "item"}  # a host read (under inference mode `item` arrives whole)


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counter: LaunchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        body = _custom_op_body(func) if not self.counter.in_triton else None
        if body is not None:
            # A custom op (``wiola::…``): the ATen ops of its Python body launch kernels too, and
            # this mode is off while its handler runs, so the body runs under a fresh one.
            with _AtenCounter(self.counter):
                return body(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if not self.counter.in_triton:
            name = func.overloadpacket.__name__
            if name in _SYNCS:
                self.counter.syncs += 1
            elif func.namespace == "aten" and name not in _NO_LAUNCH and not (func.is_view and _aliases(out, args)):
                self.counter.aten[name] += 1
        return out


def _custom_op_body(func: Any) -> Any:
    """The Python function behind a ``torch.library.custom_op`` (None for any other op)."""
    if func.namespace == "aten":
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
    return None if opdef is None else opdef._init_fn


def _aliases(out: Any, args: tuple) -> bool:
    """Whether a maybe-view op (``to``, ``contiguous``, ``reshape``) returned a view of its input
    rather than a copy."""
    if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return True
    return out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()


class LaunchCounter:
    """``with LaunchCounter() as c: ...`` then ``c.triton`` / ``c.aten`` (``Counter`` by name),
    ``c.syncs`` and ``c.total`` (Triton launches plus launching ATen ops)."""

    def __init__(self) -> None:
        self.triton: collections.Counter[str] = collections.Counter()
        self.aten: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self.in_triton = False

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        import triton.runtime.jit as jit

        classes = [jit.JITFunction]
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        originals = {cls: cls.run for cls in classes}

        def wrap(original: Any) -> Any:
            def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
                if self.in_triton:
                    return original(fn, *args, **kwargs)
                self.triton[getattr(fn, "__name__", None) or fn.fn.__name__] += 1
                self.in_triton = True
                try:
                    return original(fn, *args, **kwargs)
                finally:
                    self.in_triton = False

            return run

        for cls, original in originals.items():
            cls.run = wrap(original)
        try:
            yield
        finally:
            for cls, original in originals.items():
                cls.run = original

    def __enter__(self) -> LaunchCounter:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._patched())
        self._stack.enter_context(_AtenCounter(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def report(self) -> str:
        lines = [f"total launches: {self.total} (Triton {sum(self.triton.values())}, ATen {sum(self.aten.values())})"]
        lines += [f"  triton {name}: {n}" for name, n in sorted(self.triton.items())]
        lines += [f"  aten {name}: {n}" for name, n in sorted(self.aten.items())]
        lines.append(f"host syncs: {self.syncs}")
        return "\n".join(lines)


def count_decode_step(model: Any, batch: int = 1, prompt: int = 16, autocast: bool = False) -> LaunchCounter:
    """One graph-mode decoding step of ``model`` (a ``wiola.fast.WiolaModel``) after a prefill of
    ``prompt`` tokens, counted; the step runs twice first (warm-up: autotuning, derived weights)."""
    import wiola.model
    from wiola.fast import ops as fast_ops
    from wiola.fast.generation import _get_step, _Mode, _run_step

    mode = _Mode(capture=False, batch=batch, greedy=True, top_k=None, top_p=False, eos=None, pad=None)
    device = model.embed.weight.device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    # As on CUDA: no value checks (token-id range: min, max and two host reads), no CPU decode layouts.
    model._sync_checks = lambda t: False
    gpu_like = mock.patch.object(wiola.model, "uses_decode_layout", lambda x: False)
    # Every kernel bf16 takes on a GPU, including the two whose bf16 products the interpreter
    # computes wrongly (their values do not matter here, only what launches).
    every_kernel = mock.patch.object(fast_ops, "INTERPRETER_BF16_WRONG", frozenset())
    with torch.inference_mode(), ctx, gpu_like, every_kernel:
        step = _get_step(model, mode)
        step.cache.reset()
        model(ids.to(device), cache=step.cache, logits_to_keep=1)
        step.cache.device_slot = True
        try:
            for _ in range(2):
                _run_step(model, step, mode)
            with LaunchCounter() as counter:
                _run_step(model, step, mode)
        finally:
            step.cache.device_slot = False
            del model._sync_checks
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="13m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--autocast", action="store_true", help="fp32 model under bf16 autocast")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    args = parser.parse_args()
    from wiola.config import WiolaConfig
    from wiola.fast import WiolaModel

    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset(args.preset)).to(getattr(torch, args.dtype)).eval()
    counter = count_decode_step(model, args.batch, autocast=args.autocast)
    print(f"one decode step, preset {args.preset}, batch {args.batch}, {args.dtype}, autocast={args.autocast}")
    print(counter.report())


if __name__ == "__main__":
    main()
