"""The kernel imports of ``wiola.fast.ops`` are loud: with triton importable every kernel
imports, a broken kernel module raises, and only a missing triton falls back (with the reason in
``MISSING``). (The import layering is ``tests/test_layers.py``.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ kernel imports
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_kernel_imports_where_triton_does():
    from wiola.fast import ops

    expected = {"rms_norm", "gate", "attention", "decode_attention", "write_cache", "butterfly", "linear_cross_entropy"}
    assert set(ops.KERNELS) == expected, f"kernels missing: {sorted(expected - set(ops.KERNELS))}, {ops.MISSING}"
    assert not expected & set(ops.MISSING), f"MISSING lists importable kernels: {ops.MISSING}"


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_without_triton_the_reason_is_recorded_and_the_model_runs():
    run = _run(
        """
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        from wiola import WiolaConfig, WiolaModel
        from wiola.fast import WiolaModel as Fast, ops
        assert not ops.KERNELS, ops.KERNELS
        assert all("triton is not installed" in why for why in ops.MISSING.values()), ops.MISSING
        assert len(ops.MISSING) == 7, ops.MISSING
        torch.manual_seed(0)
        ref = WiolaModel(WiolaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=32))
        fast = Fast(ref.config)
        fast.load_state_dict(ref.state_dict())
        ids = torch.randint(0, 100, (2, 7))
        with torch.no_grad():
            print(float((ref(ids).logits - fast(ids).logits).abs().max()))
        """
    )
    assert run.returncode == 0, f"subprocess failed:\n{run.stderr[-3000:]}"
    err = float(run.stdout.strip().splitlines()[-1])
    assert err <= 1e-5, f"logits without triton differ by {err:.2e}"


@pytest.mark.parametrize(
    "broken, error",
    [
        ("None", "ModuleNotFoundError"),  # the module fails to import
        ("types.ModuleType('wiola_kernels.gate')", "AttributeError"),  # a module without its kernel
    ],
    ids=["import-error", "no-kernel-function"],
)
def test_a_broken_kernel_module_raises(broken, error):
    run = _run(
        f"""
        import sys, types
        sys.modules["wiola_kernels.gate"] = {broken}
        import wiola.fast
        """
    )
    assert run.returncode != 0, "wiola.fast imported although a kernel module is broken"
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(error) and "wiola_kernels.gate" in last, run.stderr[-2000:]
