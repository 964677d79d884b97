"""Ahead-of-time compilation of every kernel and autotune config for sm_90 and sm_80.

Needs no GPU: ``triton.compile`` builds PTX and a cubin for the target, then ``cuobjdump``
(shipped in Triton's wheel) reports registers, stack/local memory (spills) and shared memory.
The interpreter accepts code that the real compiler rejects; this test catches it.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Each kernel module registers its builds into kernels._utils.AOT_SPECS when imported.
KERNEL_MODULES = ["attention", "gate", "butterfly", "rms_norm", "cross_entropy", "decode"]
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
RESULTS: list[tuple[str, str, int, int, int, int]] = []


def _load_specs():
    from kernels._utils import AOT_SPECS

    for name in KERNEL_MODULES:
        if (Path(__file__).parent.parent / "kernels" / f"{name}.py").exists():
            importlib.import_module(f"kernels.{name}")
    return [spec for op in sorted(AOT_SPECS) for spec in AOT_SPECS[op]]


SPECS = _load_specs()


def _cuobjdump() -> str | None:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else shutil.which("cuobjdump")


def _resources(cubin: bytes) -> dict[str, int]:
    tool = _cuobjdump()
    assert tool, "cuobjdump not found (Triton's wheel ships one in backends/nvidia/bin)"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    usage = {key: int(val) for key, val in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    assert "REG" in usage, f"could not read resource usage from cuobjdump:\n{out}"
    return usage


@pytest.mark.skipif(not SPECS, reason="no kernel has registered an ahead-of-time spec yet")
@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles(spec, arch):
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
    k = triton.compile(src, target=TARGETS[arch], options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    usage = _resources(k.asm["cubin"])
    shared = k.metadata.shared
    RESULTS.append((spec.name, arch, usage["REG"], usage.get("LOCAL", 0), usage.get("STACK", 0), shared))
    assert usage.get("LOCAL", 0) == 0 and usage.get("STACK", 0) == 0, (
        f"{spec.name} on {arch} spills: LOCAL={usage.get('LOCAL')} STACK={usage.get('STACK')}"
    )
    assert shared <= SHARED_LIMIT[arch], f"{spec.name} on {arch} needs {shared} B of shared memory"
    if spec.expect_wgmma and arch == "sm_90":
        assert "wgmma" in k.asm["ptx"], f"{spec.name}: sm_90 PTX has no wgmma instruction"


def teardown_module(module):
    if RESULTS:
        print(f"\n{'kernel':<56}{'arch':>7}{'regs':>6}{'local':>7}{'stack':>7}{'shared':>9}")
        for name, arch, reg, local, stack, shared in RESULTS:
            print(f"{name:<56}{arch:>7}{reg:>6}{local:>7}{stack:>7}{shared:>9}")
