"""Build registered kernel specs ahead of time for one GPU target; print a JSON report.

Run as ``python tests/aot_build.py sm_90 attention gate ...``. It must run with
``TRITON_INTERPRET=0`` (a separate process): under the interpreter ``@triton.jit`` yields
functions that cannot be compiled, and the test session runs the kernels interpreted.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}


def resources(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}


def build(spec, arch: str) -> dict:
    attrs = {(spec.fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    k = triton.compile(src, target=TARGETS[arch], options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    usage = resources(k.asm["cubin"])
    return {
        "regs": usage.get("REG", -1),
        "local": usage.get("LOCAL", 0),
        "stack": usage.get("STACK", 0),
        "shared": k.metadata.shared,
        "wgmma": "wgmma" in k.asm["ptx"],
    }


def main() -> None:
    arch, ops = sys.argv[1], sys.argv[2:]
    from kernels._utils import AOT_SPECS

    for op in ops:
        importlib.import_module(f"kernels.{op}")
    report = {}
    for op in ops:
        for spec in AOT_SPECS.get(op, []):
            try:
                report[spec.name] = build(spec, arch)
            except Exception as e:  # reported per spec by the test
                report[spec.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
