"""Ahead-of-time compilation of every kernel, launch/autotune config and dtype for sm_90 and sm_80.

Needs no GPU: ``triton.compile`` builds PTX and a cubin for the target, then ``cuobjdump``
(shipped in Triton's wheel) reports registers, stack/local memory (spills) and shared memory.
The interpreter accepts code that the real compiler rejects; this test catches it. The builds
run in worker processes (``tests/aot_build.py``) with ``TRITON_INTERPRET=0``, one per target,
each spec built once per target for the whole session.

By default it builds a representative subset, ``ci_subset``; ``WIOLA_AOT_SUBSET=full`` (or
``WIOLA_AOT_FULL=1``) builds every registered spec (the matrix ``bench/aot_builds.json`` records);
``WIOLA_AOT_SUBSET=paths`` builds each code path once, ``code_paths`` (CI's leg on the newest
Triton, where spills are expected failures, proves that every path still compiles; the leg on
the tuned Triton builds ``ci_subset`` with spills as failures).

Spills are failures under the Triton the configs were tuned for (``TUNED_TRITON``, what the
lent GPU image compiles with; ``WIOLA_AOT_STRICT_SPILLS=1`` makes them failures under any
version). Other releases allocate registers differently (triton 3.9 spills 8-32 bytes of stack
in about 5% of these builds): there a spilling build is an expected failure that names itself
in the summary, while it still has to compile and fit in shared memory. Autotuning on such a
GPU times the spilling configs beside the others, so they cost tuning time, not correctness.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import triton
from aot_build import build_in_workers

from wiola_kernels.aot import AOT_OPS, AotSpec, aot_specs

ARCHS = ["sm_80", "sm_90"]
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
FULL = os.environ.get("WIOLA_AOT_FULL", "0") not in ("", "0")

ALL_SPECS = [spec for op in AOT_OPS for spec in aot_specs(op)]


def ci_subset(specs: list[AotSpec]) -> list[AotSpec]:
    """The specs CI builds: every fp32 and bf16 one. fp16 compiles the bf16 code with another
    16-bit type: in bench/aot_builds.json its builds use 33 fewer to 11 more registers than their
    bf16 twins, and none spills. The lighter variants (unmasked, no residual store) stay in: an
    unmasked fp32 build spilled where its masked twin did not."""
    return [s for s in specs if s.dtype != "fp16"]


def code_paths(specs: list[AotSpec]) -> list[AotSpec]:
    """One spec per kernel, dtype and value of every compile-time argument but the tile sizes
    (``BLOCK_*``): each code path the compiler sees (masks, residuals, head widths, rotation),
    built at its first tile config; 138 of ``ci_subset``'s 333."""
    seen: dict[tuple, AotSpec] = {}
    for s in ci_subset(specs):
        path = tuple(sorted((k, repr(v)) for k, v in s.constexprs.items() if not k.startswith("BLOCK")))
        seen.setdefault((s.kernel, s.dtype, path), s)
    return list(seen.values())


SUBSET = "full" if FULL else os.environ.get("WIOLA_AOT_SUBSET", "ci")
SUBSETS = {"full": list, "ci": ci_subset, "paths": code_paths}
if SUBSET not in SUBSETS:
    raise ValueError(f"WIOLA_AOT_SUBSET={SUBSET!r}: one of {', '.join(SUBSETS)}")
SPECS = SUBSETS[SUBSET](ALL_SPECS)
TUNED_TRITON = "3.6"
STRICT_SPILLS = triton.__version__.startswith(TUNED_TRITON + ".") or os.environ.get(
    "WIOLA_AOT_STRICT_SPILLS", ""
) not in ("", "0")


@pytest.fixture(scope="module")
def builds(request) -> dict[str, dict]:
    """``{arch: {spec name: report}}``, every spec this session selected built once per target."""
    names = list(
        dict.fromkeys(
            item.callspec.params["spec"].name
            for item in request.session.items
            if hasattr(item, "callspec") and "spec" in item.callspec.params
        )
    )
    out = build_in_workers(names, ARCHS)
    yield out
    print(f"\n{'kernel':<64}{'arch':>7}{'regs':>6}{'local':>7}{'stack':>7}{'shared':>9}{'cpu s':>7}")
    for arch in ARCHS:
        for name, r in out[arch].items():
            if "error" not in r:
                print(
                    f"{name:<64}{arch:>7}{r['regs']:>6}{r['local']:>7}{r['stack']:>7}{r['shared']:>9}"
                    f"{r['cpu_seconds']:>7.2f}"
                )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles(builds, spec, arch):
    r = builds[arch].get(spec.name)
    assert r is not None, f"{spec.name}: not built"
    assert "error" not in r, f"{spec.name} does not compile for {arch}: {r.get('error')}"
    assert r["shared"] <= SHARED_LIMIT[arch], f"{spec.name} on {arch} needs {r['shared']} B of shared memory"
    if spec.expect_wgmma and arch == "sm_90":
        assert r["wgmma"], f"{spec.name}: sm_90 PTX has no wgmma instruction"
    spills = f"{spec.name} on {arch} spills: LOCAL={r['local']} STACK={r['stack']}"
    if not STRICT_SPILLS and (r["local"] or r["stack"]):
        pytest.xfail(f"{spills} under triton {triton.__version__} (tuned spill-free for {TUNED_TRITON})")
    assert r["local"] == 0 and r["stack"] == 0, spills


def test_spec_names_are_unique_and_name_their_dtype():
    names = [s.name for s in ALL_SPECS]
    assert len(names) == len(set(names)), "two AOT specs share a name"
    assert all(s.dtype in ("fp32", "bf16", "fp16") for s in ALL_SPECS)  # raises for a name without one


@pytest.mark.parametrize("op", AOT_OPS)
def test_every_op_builds_every_dtype(op):
    """Each op's specs cover every dtype the model runs in, for each of its kernels."""
    by_kernel: dict[str, set[str]] = {}
    for spec in aot_specs(op):
        by_kernel.setdefault(spec.kernel, set()).add(spec.dtype)
    assert by_kernel, f"{op}: no ahead-of-time specs"
    for kernel, dtypes in by_kernel.items():
        assert dtypes == {"fp32", "bf16", "fp16"}, f"{kernel}: AOT specs for {sorted(dtypes)} only"
