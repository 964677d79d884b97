"""The instructions of each packed_block instantiation (the int4 and bf16 products' blocks) built
from the checkout's source and from a copy that pins every part of x (python stack_moves.py
PINNED.cpp, from the checkout root), as the avx512 and avx2 variants are built (g++ -O3 and
VARIANTS' flags) under each -mtune of TUNES: per instantiation, its vector accesses to the stack in
each build and whether the two builds' instructions are the same (addresses and constants' offsets
aside)."""

import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

TUNES = ("icelake-server", "sapphirerapids", "skylake-avx512", "znver3", "generic")
VARIANTS = {
    "avx512": ("-DWIOLA_ISA_AVX512", "-mavx512f", "-mavx2", "-mfma"),
    "avx2": ("-DWIOLA_ISA_AVX2", "-mavx2", "-mfma"),
}
SOURCE = Path("wiola/fast/decode_step_cpu.cpp")


def blocks(source: Path, variant: str, tune: str, out: Path) -> dict[str, list[str]]:
    """packed_block instantiation (its template arguments) -> its instructions, normalised."""
    lib = out / f"{source.stem}-{variant}-{tune}.so"
    flags = ["-O3", "-fopenmp", "-std=c++17", "-fPIC", "-shared", *VARIANTS[variant], f"-mtune={tune}"]
    subprocess.run(["g++", *flags, "-o", str(lib), str(source)], check=True)
    dis = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", str(lib)], check=True, capture_output=True, text=True
    )
    found: dict[str, list[str]] = defaultdict(list)
    name = None
    for line in dis.stdout.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            m = re.search(r"packed_block<(.*?)>\(", head.group(1))
            name = m.group(1).replace("(anonymous namespace)::", "") if m else None
        elif name and "\t" in line:
            ins = line.split("\t", 1)[1]
            ins = re.sub(r"[0-9a-f]+ <[^>]*>", "", ins)
            found[name].append(re.sub(r"-?0x[0-9a-f]+\(%rip\)", "X(%rip)", ins))
    return found


def stack(ins: list[str]) -> int:
    return sum(1 for i in ins if "mm" in i and "%rsp" in i)


pinned = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    for variant in VARIANTS:
        for tune in TUNES:
            a, b = blocks(SOURCE, variant, tune, Path(tmp)), blocks(pinned, variant, tune, Path(tmp))
            print(
                f"== {variant}, -mtune={tune}: packed_block<type, rows, batch rows>: vector stack accesses pinned -> checkout"
            )
            for name in sorted(set(a) | set(b)):
                same = "the same instructions" if a.get(name) == b.get(name) else "different instructions"
                print(
                    f"  {name}: {stack(b.get(name, []))} -> {stack(a.get(name, []))}, {same} ({len(a.get(name, []))})"
                )
