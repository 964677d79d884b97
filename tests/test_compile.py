"""Ahead-of-time compilation of every kernel and autotune config for sm_90 and sm_80.

Needs no GPU: ``triton.compile`` builds PTX and a cubin for the target, then ``cuobjdump``
(shipped in Triton's wheel) reports registers, stack/local memory (spills) and shared memory.
The interpreter accepts code that the real compiler rejects; this test catches it. The builds
run in a subprocess (``tests/aot_build.py``) with ``TRITON_INTERPRET=0``, one per target.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# Each kernel module registers its builds into kernels._utils.AOT_SPECS when imported.
KERNEL_MODULES = ["attention", "gate", "butterfly", "rms_norm", "cross_entropy", "decode"]
ROOT = Path(__file__).resolve().parents[1]
PRESENT = [m for m in KERNEL_MODULES if (ROOT / "kernels" / f"{m}.py").exists()]
ARCHS = ["sm_80", "sm_90"]
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}


def _load_specs():
    from kernels._utils import AOT_SPECS

    for name in PRESENT:
        importlib.import_module(f"kernels.{name}")
    return {spec.name: op for op in sorted(AOT_SPECS) for spec in AOT_SPECS[op]}, [
        spec for op in sorted(AOT_SPECS) for spec in AOT_SPECS[op]
    ]


OP_OF, SPECS = _load_specs()


@pytest.fixture(scope="module")
def builds(request) -> dict[str, dict]:
    """``{arch: {spec name: report}}``, built once per target in a clean subprocess (only the
    ops whose specs this session selected)."""
    selected = {
        OP_OF[item.callspec.params["spec"].name]
        for item in request.session.items
        if hasattr(item, "callspec") and "spec" in item.callspec.params
    }
    ops = [op for op in PRESENT if op in selected]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    procs = {  # the two targets build side by side (one core each)
        arch: subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "aot_build.py"), arch, *ops],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for arch in ARCHS
    }
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate()
        assert proc.returncode == 0, f"aot_build.py {arch} failed:\n{stderr[-4000:]}"
        out[arch] = json.loads(stdout)
    yield out
    print(f"\n{'kernel':<64}{'arch':>7}{'regs':>6}{'local':>7}{'stack':>7}{'shared':>9}")
    for arch in ARCHS:
        for name, r in out[arch].items():
            if "error" not in r:
                print(f"{name:<64}{arch:>7}{r['regs']:>6}{r['local']:>7}{r['stack']:>7}{r['shared']:>9}")


@pytest.mark.skipif(not SPECS, reason="no kernel has registered an ahead-of-time spec yet")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles(builds, spec, arch):
    r = builds[arch].get(spec.name)
    assert r is not None, f"{spec.name}: not built (duplicate name?)"
    assert "error" not in r, f"{spec.name} does not compile for {arch}: {r.get('error')}"
    assert r["local"] == 0 and r["stack"] == 0, f"{spec.name} on {arch} spills: LOCAL={r['local']} STACK={r['stack']}"
    assert r["shared"] <= SHARED_LIMIT[arch], f"{spec.name} on {arch} needs {r['shared']} B of shared memory"
    if spec.expect_wgmma and arch == "sm_90":
        assert r["wgmma"], f"{spec.name}: sm_90 PTX has no wgmma instruction"


def test_spec_names_are_unique():
    names = [s.name for s in SPECS]
    assert len(names) == len(set(names)), "two AOT specs share a name"
