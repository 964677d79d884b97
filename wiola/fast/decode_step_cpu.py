"""One decoding step of the whole model on a CPU, in C++ (``decode_step_cpu.cpp``).

``wiola.fast.WiolaModel`` runs it for every one-token step with a cache on a plain CPU (fp32,
gradients off): every layer and the tied head in one call, the static cache written in place.
It computes what ``wiola.WiolaModel.forward(ids, cache=cache)`` computes for ``ids`` of shape
``(B, 1)``, in fp32 with its own summation order (``tests/test_decode_step_cpu.py``). For a
model quantized by ``wiola.fast.quantize`` (int8 with per-row scales, int4 with per-group scales,
or bf16) it streams the packed matrices, widened to fp32 in registers, and computes what the PyTorch path computes on
the dequantized weights (``tests/test_quantize.py``); the C++ has one body of the products for
fp32 and int8 (the weight type a template parameter) and one for int4 and bf16, whose rows it
reads as 32-bit lanes of several weights each (``docs/SPEC.md``, "Products by weight type").
The same library runs three parts of a prompt (``T > 1``, or a token the one-token step does not
take, as for a model with adapters) on a plain CPU: its attention over the cache
(``decode_attention``), its RMSNorms (``rms_norm``) and the butterfly's middle (``silu_gate``);
with a cache its products run a sequence at a time on ``product`` or the chosen GEMM
(``wiola.ops.linear.cpu_gemm``).

One source, four instruction-set variants (``ISAS``), chosen at build time:

- ``amx``: ``avx512`` with the bf16 products on the AMX tile unit (``-mamx-tile -mamx-bf16
  -mavx512bf16``), where the CPU has AMX-BF16 (Intel Sapphire Rapids and later) and Linux grants
  the process its tile registers (``amx_permitted``); bf16 matrices are bound tiled
  (``tile_matrix``), fp32, int8 and int4 run as on ``avx512``;
- ``avx512``: 16 fp32 lanes (``-mavx512f -mavx2 -mfma``), where the CPU has AVX-512F;
- ``avx2``: 8 lanes (``-mavx2 -mfma``), where it has AVX2 and FMA;
- ``portable``: 4 lanes of the compiler's generic vectors, no x86 flags or assembly (any
  x86-64, aarch64 or other target the compiler builds for; NEON on aarch64, where
  ``tests/test_decode_step_arm.py`` runs it under qemu-user against the oracle).

``select_isa()`` takes the best one this CPU has, read from the compiler's predefined macros
under ``-march=native`` (``/proc/cpuinfo``'s flags where that fails); ``WIOLA_CPU_ISA=amx|avx512|
avx2|portable`` forces one (``auto`` or unset: the best), and an ISA the CPU lacks is refused
with a ``ValueError`` naming the missing flags. The x86 variants add ``-mtune=native``.

The source is compiled on first use with the system C++ compiler (``$CXX``, else ``g++``;
``-O3 -fopenmp`` and the variant's flags) into ``$WIOLA_CACHE_DIR`` (default ``~/.cache/wiola``,
or ``$TMPDIR/wiola-<uid>`` when home is read-only), keyed by the source, the variant, its flags,
the compiler and the CPU, and loaded with ``ctypes``. That folder is created private (0700), and
one owned by another user or writable by the group or others is refused (``private_dir``): the
key is computable by anyone, so such a folder could hold someone else's library under the
expected name. A refused folder is a build failure like the others (below). Its OpenMP parallel region runs on the ``libgomp`` that torch has already loaded
(the same thread pool as torch's own ops, sized by ``torch.set_num_threads``). Where no compiler
works, ``load()`` returns None, ``BUILD_ERROR`` says why, and a ``RuntimeWarning`` naming the
compiler error is issued once (per variant); the model then keeps its PyTorch path.
``describe()`` says in one line which path decodes on this machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wiola.fast import quantize
from wiola.fast import step_layout as layout
from wiola.ops.decode import check_queries
from wiola.user_cache import CACHE_DIR_VARIABLE, standard_cache_dir, user_cache_dir

if TYPE_CHECKING:
    from wiola.cache import Cache
    from wiola.config import WiolaConfig
    from wiola.model import WiolaModel

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")
ISAS = ("amx", "avx512", "avx2", "portable")  # best first
ISA_FLAGS = {
    "amx": (
        "-DWIOLA_ISA_AVX512",
        "-DWIOLA_ISA_AMX",
        "-mavx512f",
        "-mavx2",
        "-mfma",
        "-mamx-tile",
        "-mamx-bf16",
        "-mavx512bf16",
        "-mtune=native",
    ),
    "avx512": ("-DWIOLA_ISA_AVX512", "-mavx512f", "-mavx2", "-mfma", "-mtune=native"),
    "avx2": ("-DWIOLA_ISA_AVX2", "-mavx2", "-mfma", "-mtune=native"),
    "portable": (),
}
ISA_NEEDS = {
    "amx": ("avx512f", "avx2", "fma", "avx512_bf16", "amx_tile", "amx_bf16"),
    "avx512": ("avx512f", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "portable": (),
}
ISA_ENV = "WIOLA_CPU_ISA"
MAX_HEAD = 1024  # the C++ keeps a head's gate vectors on the stack

BUILD_ERROR: str | None = None  # why the library could not be built or loaded (the latest failure)
_BUILDS: dict[tuple[str, str], ctypes.CDLL | str] = {}  # (compiler, isa) -> the library or the error
_FEATURES: dict[str, tuple[frozenset[str], str]] = {}  # compiler -> (CPU features, where read)
# (isa asked, $WIOLA_CPU_ISA, compiler) -> (library, the features entry and ISA it was chosen by):
# ``load``'s answer without choosing again, while _FEATURES and _BUILDS still hold those entries.
_LOADED: dict[tuple[str | None, str, str], tuple[ctypes.CDLL, tuple[frozenset[str], str] | None, str]] = {}
_MACROS = {
    "__AVX512F__": "avx512f", "__AVX2__": "avx2", "__FMA__": "fma", "__AVX512BF16__": "avx512_bf16",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
}  # the compiler's macro -> the feature (as /proc/cpuinfo spells it)  # fmt: skip
_AMX_FEATURES = frozenset({"amx_tile", "amx_bf16"})


def _cache_dir() -> Path:
    """``$WIOLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/wiola`` or ``~/.cache/wiola``; a per-user
    folder under the temporary directory when that cannot be written (a read-only home). The
    folder is created private and checked (``private_dir``)."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return private_dir(user_cache_dir(), f"or choose another {CACHE_DIR_VARIABLE}")
    root = standard_cache_dir()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        usable = os.access(root, os.W_OK)
    except OSError:
        usable = False
    if usable:
        return private_dir(root)
    return private_dir(Path(tempfile.gettempdir()) / f"wiola-{os.getuid() if hasattr(os, 'getuid') else 'user'}")


def private_dir(path: Path, remedy: str = "or set WIOLA_CACHE_DIR") -> Path:
    """``path``, created with mode 0700 if missing, once it is a folder owned by this user that
    neither the group nor others can write. Raises ``PermissionError`` naming the owner or the
    mode otherwise (``remedy`` ends the message): a library in a folder another user can write
    (``/tmp/wiola-<uid>`` created first by someone else, say) could be theirs, and loading it
    would run their code."""
    if path.exists() and not path.is_dir():
        raise PermissionError(f"the build cache {path} is not a folder; {remedy.removeprefix('or ')}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()  # follows a link: the folder it leads to is what we would load from
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(
            f"refusing the build cache {path}: it is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.getuid()}), who could not trust a library in it; remove it {remedy}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"refusing the build cache {path}: its mode {stat.S_IMODE(st.st_mode):#o} lets other users write "
            f"into it; make it private (chmod 700 {path}) {remedy}"
        )
    return path


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """``/proc/cpuinfo``'s lines, read once a process (every binding of the step reads them)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpu_info() -> dict[str, str]:
    """The CPU as the OS reports it, for the tuning, benchmark records and failure messages:
    ``machine``, ``vendor`` (x86's vendor_id), ``model`` (the model name in ``/proc/cpuinfo``, else
    the platform's processor string), ``family`` and ``model_number`` (x86's "cpu family" and
    "model"; "" where not reported), ``name`` (the model name with those numbers: a VM may name
    both a Zen 3 and a Zen 4 EPYC just "AMD EPYC", family 25 with model 1 or 17) and ``flags``."""
    info = {"machine": platform.machine(), "vendor": "", "model": "", "family": "", "model_number": "", "flags": ""}
    fields = {
        "vendor_id": "vendor",
        "model name": "model",
        "cpu family": "family",
        "model": "model_number",
        "flags": "flags",
        "Features": "flags",
    }
    for line in _cpuinfo_lines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in fields and not info[fields[key]]:
            info[fields[key]] = value
    info["model"] = info["model"] or platform.processor() or platform.machine()
    numbers = [f"{what} {n}" for what, n in (("family", info["family"]), ("model", info["model_number"])) if n]
    info["name"] = f"{info['model']} ({', '.join(numbers)})" if numbers else info["model"]
    return info


def _cpu_signature() -> str:
    """What ``-mtune=native`` and the variant choice depend on: the CPU's model name and flags."""
    keep = [line for line in _cpuinfo_lines() if line.startswith(("model name", "flags", "Features"))]
    if not keep:
        return platform.machine() + platform.processor()
    return platform.machine() + "\n".join(sorted(set(keep)))


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


def compiler_command(compiler: str) -> list[str]:
    """``compiler`` (``$CXX``: a program, or a launcher and its program such as ``ccache g++``)
    as a command: its first word resolved on PATH. Raises ``RuntimeError`` when it is not there."""
    words = shlex.split(compiler)
    path = shutil.which(words[0]) if words else None
    if path is None:
        raise RuntimeError(f"no C++ compiler: `{compiler}` is not on PATH (set CXX)")
    return [path, *words[1:]]


def amx_permitted() -> bool:
    """Whether this process may use the AMX tile registers: Linux (5.16 and later) hands them to a
    process only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and a tile
    instruction without that permission kills it with SIGILL. Asks once (granting is for the whole
    process and cannot be undone); False where the request fails or this is not Linux on x86-64."""
    global _AMX_PERMITTED
    if _AMX_PERMITTED is None:
        _AMX_PERMITTED = False
        if platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
                _AMX_PERMITTED = libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
            except (OSError, AttributeError):
                pass
    return _AMX_PERMITTED


_AMX_PERMITTED: bool | None = None


def cpu_features(compiler: str | None = None) -> tuple[frozenset[str], str]:
    """The features of this CPU that the variants need (of ``avx512f``, ``avx2``, ``fma``,
    ``avx512_bf16``, ``amx_tile``, ``amx_bf16``) and where they were read: the compiler's macros
    under ``-march=native`` (what it can target here, the OS's support included), else the flags
    in ``/proc/cpuinfo``; the AMX ones only where Linux grants the tiles (``amx_permitted``)."""
    compiler = compiler or _compiler()
    if compiler not in _FEATURES:
        found: tuple[frozenset[str], str] | None = None
        try:
            command: list[str] | None = compiler_command(compiler)
        except (RuntimeError, ValueError):  # not on PATH, or unbalanced quotes
            command = None
        if command is not None and platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
            try:
                proc = subprocess.run(
                    [*command, "-march=native", "-dM", "-E", "-x", "c++", "-"],
                    input="", capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                if proc.returncode == 0:
                    macros = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
                    found = (frozenset(f for m, f in _MACROS.items() if m in macros), f"{compiler} -march=native")
            except (OSError, subprocess.SubprocessError):
                pass
        if found is None:
            flags = set(cpu_info()["flags"].split())
            found = (frozenset(f for f in _MACROS.values() if f in flags), "/proc/cpuinfo")
        if found[0] & _AMX_FEATURES and not amx_permitted():
            found = (found[0] - _AMX_FEATURES, f"{found[1]}, less AMX: Linux refused the tile registers")
        _FEATURES[compiler] = found
    return _FEATURES[compiler]


def check_isa_name() -> None:
    """Raise ``ValueError`` when ``$WIOLA_CPU_ISA`` names no variant (not whether this CPU runs it)."""
    requested = os.environ.get(ISA_ENV, "").strip().lower()
    if requested not in ("", "auto", *ISAS):
        raise ValueError(f"{ISA_ENV}={requested!r} is not one of auto, {', '.join(ISAS)}")


def select_isa(isa: str | None = None, compiler: str | None = None) -> str:
    """The variant to build: ``isa`` if given, else ``$WIOLA_CPU_ISA``, else (or for ``auto``)
    the best in ``ISAS`` that this CPU runs. Raises ``ValueError`` for an unknown name or an ISA
    this CPU lacks (running it would die on an illegal instruction)."""
    source = "isa" if isa is not None else ISA_ENV
    requested = (isa if isa is not None else os.environ.get(ISA_ENV, "")).strip().lower()
    features, where = cpu_features(compiler)
    if requested in ("", "auto"):
        return next(name for name in ISAS if set(ISA_NEEDS[name]) <= features)
    if requested not in ISAS:
        raise ValueError(f"{source}={requested!r} is not one of auto, {', '.join(ISAS)}")
    missing = [f for f in ISA_NEEDS[requested] if f not in features]
    if missing:
        have = ", ".join(sorted(features)) or "none of avx512f, avx2, fma"
        raise ValueError(
            f"{source}={requested}: this CPU lacks {', '.join(missing)} (it has {have}, read from {where}); "
            f"use one of {', '.join(n for n in ISAS if set(ISA_NEEDS[n]) <= features)}"
        )
    return requested


def compile_variant(isa: str, target: Path, compiler: str | None = None) -> None:
    """Compile the ``isa`` variant into ``target`` (whatever CPU this is: the x86 variants build
    on any x86 compiler). Raises ``RuntimeError`` with the compiler's error."""
    if isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not one of {', '.join(ISAS)}")
    command = compiler_command(compiler or _compiler())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        # libstdc++ named, so that a C compiler driver (CXX=gcc) links what the step's new[] needs
        cmd = [*command, *FLAGS, *ISA_FLAGS[isa], str(SOURCE), "-o", str(out), "-lstdc++"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            error = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit status {proc.returncode}):\n{error}")
        data = out.read_bytes()
        with open(out, "rb+") as f:  # on disk before the rename: a crash leaves no renamed, short file
            os.fsync(f.fileno())
        digest = _digest_path(target)
        digest_tmp = Path(tmp) / digest.name
        digest_tmp.write_text(hashlib.sha256(data).hexdigest())
        os.replace(digest_tmp, digest)
        os.replace(out, target)  # atomic: a concurrent build never sees half a file


def _digest_path(target: Path) -> Path:
    """Where the SHA-256 of the library ``target`` is kept, written by the build that made it."""
    return target.with_name(target.name + ".sha256")


def _intact(target: Path) -> bool:
    """Whether the cached library ``target`` is whole: its bytes hash to the digest its build
    wrote. Loading a cut-off library can kill the process (SIGBUS inside ``dlopen``), so a file
    that fails this is built again, never loaded."""
    try:
        want = _digest_path(target).read_text().strip()
        return hashlib.sha256(target.read_bytes()).hexdigest() == want
    except OSError:
        return False


def library_path(compiler: str, isa: str) -> Path:
    """Where the build of ``isa`` by ``compiler`` is cached: named by a hash of everything the
    binary depends on (the source, the variant and its flags, the compiler's ``--version``, and
    the CPU's model name and flags, which ``-mtune=native`` and the variant's choice read), so
    that a change to any of them builds again instead of loading a library made for another."""
    command = compiler_command(compiler)
    version = subprocess.run([*command, "--version"], capture_output=True, text=True).stdout
    flags = " ".join((*FLAGS, *ISA_FLAGS[isa], "-lstdc++"))
    key = hashlib.sha256("\0".join((SOURCE.read_text(), isa, flags, version, _cpu_signature())).encode())
    return _cache_dir() / f"decode_step_cpu-{isa}-{key.hexdigest()[:20]}.so"


def cached_build(isa: str, compiler: str | None = None) -> Path:
    """The build cache's library of the ``isa`` variant (``library_path``), compiled first where
    it is missing or damaged since its build (``_intact``); a variant this CPU cannot run builds
    all the same. Raises ``RuntimeError`` with the compiler's error."""
    compiler = compiler or _compiler()
    target = library_path(compiler, isa)
    if not _intact(target):
        compile_variant(isa, target, compiler)
    return target


def _build(compiler: str, isa: str) -> ctypes.CDLL:
    target = cached_build(isa, compiler)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:  # built, but not loadable (a missing symbol): not kept for the next process
        target.unlink(missing_ok=True)
        _digest_path(target).unlink(missing_ok=True)
        raise
    lib.wiola_workspace_floats.argtypes = [ctypes.c_void_p]
    lib.wiola_workspace_floats.restype = ctypes.c_int64
    lib.wiola_decode_step.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_float] + [ctypes.c_void_p] * 2
    lib.wiola_decode_step.restype = ctypes.c_int
    lib.wiola_decode_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3
    lib.wiola_decode_rows.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.wiola_decode_rows.restype = ctypes.c_int
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.wiola_sample_scratch_floats.argtypes = [I]
    lib.wiola_sample_scratch_floats.restype = I
    C, D = NUCLEUS_CALLER, ctypes.c_double
    lib.wiola_sample_rows.argtypes = [P, I, I, P, P, P, P, P, P, I, C, P, P, P, P, P, P]
    lib.wiola_sample_rows.restype = I
    lib.wiola_step_rows.argtypes = [P, P, P, P, I, P, P, P, F, P, P, P, P, P, P, P, P, I, C, P, P, P, P, P, P]
    lib.wiola_step_rows.restype = ctypes.c_int
    lib.wiola_generate.argtypes = [P, P, P, P, F, P, I, I, I, I, P, P, I, F, I, D, C, P, I, I, P, P, P]
    lib.wiola_generate.restype = I
    lib.wiola_nucleus.argtypes = [P, I, I, P, C, P, P]
    lib.wiola_nucleus.restype = I
    lib.wiola_exp_error.argtypes = [D, I]
    lib.wiola_exp_error.restype = D
    lib.wiola_exponential.argtypes = [P, I, I, P, I, I, P]
    lib.wiola_exponential.restype = I
    lib.wiola_product_reps.argtypes = [P, P, P, I, I, P, I, P, I, I]
    lib.wiola_product_reps.restype = ctypes.c_int
    if hasattr(lib, "wiola_fma_peak"):  # absent from a copy of an older source (bench/two_builds.py)
        lib.wiola_fma_peak.argtypes = [I, I, I, P]
        lib.wiola_fma_peak.restype = I
    if hasattr(lib, "wiola_divide"):  # likewise
        lib.wiola_divide.argtypes = [P, I, F, I, P]
        lib.wiola_divide.restype = ctypes.c_int
    lib.wiola_layout_counts.argtypes = [ctypes.c_void_p]
    lib.wiola_layout_counts.restype = None
    reported = (ctypes.c_int64 * 4)()
    lib.wiola_layout_counts(reported)
    layout.check_counts(tuple(reported), str(target))
    lib.wiola_q4_group.argtypes = []
    lib.wiola_q4_group.restype = ctypes.c_int64
    lib.wiola_decode_attention_floats.argtypes = [I, I, I, I]
    lib.wiola_decode_attention_floats.restype = I
    lib.wiola_decode_attention.argtypes = [P] * 12
    lib.wiola_decode_attention.restype = None
    lib.wiola_rms_norm_rows.argtypes = [P, P, P, F, P, P, I, I]
    lib.wiola_rms_norm_rows.restype = None
    lib.wiola_silu_gate_rows.argtypes = [P, P, P, I, I]
    lib.wiola_silu_gate_rows.restype = None
    lib.wiola_product_rows.argtypes = [P, I, I, P, I, P, I]
    lib.wiola_product_rows.restype = None
    lib.wiola_gate_rows.argtypes = [P] * 11
    lib.wiola_gate_rows.restype = None
    if hasattr(lib, "wiola_balance_parts"):  # absent from a copy of an older source (bench/two_builds.py)
        lib.wiola_balance_parts.argtypes = [I, I, P, I]
        lib.wiola_balance_parts.restype = ctypes.c_int
        lib.wiola_balance_next.argtypes = [I, P, P, P, P]
        lib.wiola_balance_next.restype = ctypes.c_int
    return lib


def _follow_torch_threads() -> None:
    """Give this thread torch's thread count as its OpenMP count, which the C++ functions read
    (``omp_get_max_threads``): torch sets it lazily per thread, so a thread that has run no
    parallel torch op would otherwise use OpenMP's default, every core, whatever
    ``torch.set_num_threads`` said."""
    torch.get_num_threads()


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library of ``select_isa(isa)`` (built on first call), or None with
    ``BUILD_ERROR`` set and, the first time, a ``RuntimeWarning`` naming the error. Raises
    ``ValueError`` when the ISA asked for (``isa`` or ``$WIOLA_CPU_ISA``) is unknown or not this
    CPU's."""
    global BUILD_ERROR
    _follow_torch_threads()
    compiler = _compiler()
    key = (isa, os.environ.get(ISA_ENV, ""), compiler)
    known = _LOADED.get(key)  # every product and row function asks: once chosen, two lookups
    if known is not None and _FEATURES.get(compiler) is known[1] and _BUILDS.get((compiler, known[2])) is known[0]:
        return known[0]
    asked, isa = isa, select_isa(isa, compiler)
    built = _BUILDS.get((compiler, isa))
    if built is None:
        try:
            built = _build(compiler, isa)
        except Exception as exc:  # no compiler, a compile error, an unloadable library
            built = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"wiola: the C++ CPU decode step ({isa}) could not be built, so one-token decoding on this "
                f"CPU takes the slower PyTorch path. {built}",
                RuntimeWarning,
                stacklevel=2,
            )
        _BUILDS[(compiler, isa)] = built
    if isinstance(built, str):
        BUILD_ERROR = built
        return None
    _LOADED[(asked, key[1], compiler)] = (built, _FEATURES.get(compiler), isa)
    return built


def _one_line(error: str) -> str:
    """The line of a build error that names the problem: the compiler's first ``error`` line
    (else its last line) under the failed command, or the error itself when it is one line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or ["unknown error"]
    detail = lines[1:] or lines
    text = next((line for line in detail if "error" in line.lower()), detail[-1])
    return text if len(text) <= 300 else text[:297] + "..."


def describe(isa: str | None = None, config: WiolaConfig | None = None, scheme: str | None = None) -> str:
    """One line saying how one-token steps decode on this CPU, building the step if needed:
    ``"C++ step, avx2, 2 threads"`` or ``"PyTorch path: <why the step did not build>"``. (It
    applies to fp32, gradient-free steps of ``wiola.fast.WiolaModel`` outside
    ``TRITON_INTERPRET=1``.) The threads are torch's, or with ``config`` (and ``scheme``, its
    weights) those that model's step runs on (``step_threads``: one for a small model). Raises
    ``ValueError`` like ``select_isa`` for a forced ISA that this CPU lacks."""
    if load(isa) is None:
        return f"PyTorch path: the C++ step did not build ({_one_line(BUILD_ERROR or '')})"
    n = torch.get_num_threads() if config is None else step_threads(choose_tuning(config, scheme))
    return f"C++ step, {select_isa(isa)}, {n} thread{'s' if n != 1 else ''}"


PREFETCH_ROWS = 8  # rows ahead of the product's block that are prefetched
# (vendor, family, models) that prefetch at least PREFETCH_BYTES ahead: rows of fewer bytes go
# further. AMD Zen 5 (EPYC 9005 "Turin", family 26, models 0-31; measured on model 2): the 13m bf16
# step (512-byte rows) at batch 1 ran 1.10-1.11x faster 16 rows ahead than 8 in four interleaved
# A/Bs of five (the fifth level), 1.06x at batch 8; fp32 (1 KB rows: 8 rows are 8 KB) and int8
# and int4 at 32 rows were level with 8, so every type there reads about 8 KB ahead.
PREFETCH_BYTES_CPUS = (("AuthenticAMD", 26, range(0, 32)),)  # Zen 5 EPYC
PREFETCH_BYTES = 8 << 10
# (vendor, family, models) that prefetch no rows ahead: before each block of rows, that block's own
# lines, every line of it requested at once before its first load. AMD Zen 4 (EPYC 9004 "Genoa",
# family 25, models 16-31; measured on model 17), against 8 rows ahead, in interleaved A/Bs of the
# 13m step (bench/results/2026-12-05_cpu_tuning-ab-amd-zen4/): fp32 1.01-1.09x faster at batch 1,
# 1.02-1.09x at batches 2 and 4 and 1.31-1.49x at batch 8; bf16 0.96-1.01x at batch 1, 1.04-1.34x
# at batches 2 to 8; int8 and int4 level (0.96-1.06x). One product of the 33 MB fp32 head alone at
# 16 rows: 1.6-1.8x.
PREFETCH_NEAR_CPUS = (("AuthenticAMD", 25, range(16, 32)),)  # Zen 4 EPYC
# Whether the step prefetches the tied head non-temporally (``stream_head``), so that where the
# matrices outgrow the last-level cache the head would not evict the layers' weights: on no CPU
# measured was that faster than reading it through the caches with the step's current prefetch
# distances, and on four it was slower, so every CPU reads it through the caches. Cached over
# streamed, the 13m step in interleaved A/Bs: Intel Ice Lake-SP Xeon (family 6 model 106, 48 MiB
# L3) fp32 (52 MB of matrices, past all of it) 1.69-1.72x at batch 1 and 1.51-1.55x at batch 8,
# bf16 (26 MB, past half of it) 1.51-1.73x and 1.17-1.24x
# (bench/results/2026-12-07_cpu_tuning-ab-intel-icelake/); Intel Xeon with AMX (model 167, 480 MiB
# L3) fp32 2.5x (bench/results/2026-12-06_cpu_tuning-ab-intel-xeon/); Intel Xeon of model 207 (260
# MiB L3) fp32 1.45x and int8 1.7x at batch 1 (one thread, a loaded machine); AMD Zen 3 EPYC (family 25
# model 1, 32 MiB L3), whose non-temporal prefetch streams DRAM more slowly than a plain one (a 200
# MB fp32 product on 2 threads: 15.3 GB/s against 18.4), fp32 1.07-1.10x; AMD Zen 4 EPYC (family 25
# model 17, 32 MiB L3) level with no rows prefetched ahead, its distance (streamed 0.98-1.04x as
# fast in fp32 and bf16 at batches 1 and 8; with 8 rows ahead bf16 at batch 1 had run 1.01-1.14x
# faster streamed and fp32 0.91-0.93x, bench/results/2026-12-05_cpu_tuning-ab-amd-zen4/); AMD Zen 5
# EPYC (family 26 model 2, 32 MiB L3) level in fp32 and bf16 (0.99-1.02x,
# bench/results/2026-12-03_cpu_tuning-ab-amd-zen5/).
# The knob stays for ``bench.ab_tuning``, to measure it on a new CPU.
STREAM_HEAD = 0
BYTES_PER_THREAD = 1 << 21  # a parallel region takes one thread per this many bytes streamed


CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.cache
def last_level_cache_bytes(root: Path = CACHE_SYSFS) -> int | None:
    """The size of this CPU's largest data or unified cache (``root``'s ``index*/size``, in bytes
    or with a K, M or G suffix), or None; read once a process."""
    best = None
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            kind = (index / "type").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not text:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        size = int(text.rstrip("KMG")) * scale
        best = size if best is None or size > best else best
    return best


def _listed(cpu: dict[str, str], table: tuple[tuple[str, int, range], ...]) -> bool:
    """Whether ``cpu`` (``cpu_info``) is one of ``table``'s (vendor, family, models)."""
    family, model = cpu["family"], cpu["model_number"]
    if not (family.isdigit() and model.isdigit()):
        return False
    return any(cpu["vendor"] == v and int(family) == f and int(model) in models for v, f, models in table)


def prefetch_rows(row_bytes: int) -> int:
    """Rows of ``row_bytes`` bytes a product prefetches ahead on this CPU: ``PREFETCH_ROWS``; on
    the CPUs of ``PREFETCH_BYTES_CPUS`` at least ``PREFETCH_BYTES`` of them; on those of
    ``PREFETCH_NEAR_CPUS`` none (each block's own rows, just before it)."""
    cpu = cpu_info()
    if _listed(cpu, PREFETCH_NEAR_CPUS):
        return 0
    if _listed(cpu, PREFETCH_BYTES_CPUS):
        return max(PREFETCH_ROWS, PREFETCH_BYTES // max(row_bytes, 1))
    return PREFETCH_ROWS


def choose_tuning(config: WiolaConfig, scheme: str | None = None) -> dict[str, int | str | None]:
    """The step's tuning for this CPU and a model of ``config`` whose matrices are stored as
    ``scheme`` (None: fp32; ``quantize.matrix_bytes`` counts them, scales included):

    - ``stream_head``: ``STREAM_HEAD`` (0: the tied head is read through the caches on every CPU;
      1, measured with ``bench.ab_tuning``, prefetches it non-temporally);
    - ``prefetch_rows``: rows of each product prefetched ahead (``PREFETCH_ROWS``; on the CPUs of
      ``PREFETCH_BYTES_CPUS`` (Zen 5) at least ``PREFETCH_BYTES`` of ``d_model``-weight rows: 16
      for bf16, 32 for int8 and int4, 8 for fp32 (int4's rows counted at a byte a weight, as
      int8's: the distance measured for both); on those of ``PREFETCH_NEAR_CPUS`` (Zen 4) 0:
      each block's own rows, just before it);
    - ``bytes_per_thread``: one thread per this many bytes streamed (``BYTES_PER_THREAD``), of
      the ``matrix_bytes`` the step streams (the C++ takes both).

    Also records what it was chosen from: the CPU's vendor, family, model and cache size, and
    the thread count. No choice changes a result, only the time."""
    cpu = cpu_info()
    llc = last_level_cache_bytes()
    matrices = quantize.matrix_bytes(config, scheme)
    vendor, family, model = cpu["vendor"], cpu["family"], cpu["model_number"]
    ahead = prefetch_rows(WEIGHT_TYPES[scheme][1].itemsize * config.d_model)
    return {
        "vendor": vendor or platform.machine(), "family": family or None, "model": model or None, "cpu": cpu["model"],
        "last_level_cache_bytes": llc, "matrix_bytes": matrices, "threads": torch.get_num_threads(),
        "stream_head": STREAM_HEAD, "prefetch_rows": ahead, "bytes_per_thread": BYTES_PER_THREAD,
    }  # fmt: skip


def step_threads(chosen: dict[str, Any]) -> int:
    """The threads a step's parallel region takes with ``chosen`` (``choose_tuning``'s record): one
    per ``bytes_per_thread`` of its matrices, at least one, at most torch's count (``threads_for``
    in the source); a model under twice that many bytes runs on one thread."""
    return max(1, min(torch.get_num_threads(), int(chosen["matrix_bytes"]) // int(chosen["bytes_per_thread"])))


def tuning(config: WiolaConfig | None = None, scheme: str | None = None) -> dict[str, int | str | None]:
    """What the step chooses on this CPU for ``scheme``'s weights (``choose_tuning``; for the 13m
    preset unless ``config`` is given), with the ISA variant, for benchmark records."""
    from wiola.config import WiolaConfig as Config

    out = choose_tuning(config or Config.preset("13m"), scheme)
    out["isa"] = select_isa()
    return out


BALANCE_KINDS = ("layers", "head")  # the step's kinds of product, each with its own parts


def balance(
    threads: int | None = None, isa: str | None = None, parts: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """How the step splits each product's rows between ``threads`` threads (torch's count unless
    given) in this process, per kind of product (``BALANCE_KINDS``): each thread's part, learned
    from its measured rate over the steps run so far (``Balance`` in the source; even, ``[]``,
    before any step of that many threads, for one thread, and above 8 threads). With ``parts``,
    those are set first (a kind's list of ``threads`` positive numbers, taken as fractions of their
    sum; ``[]`` forgets it): no result depends on them, only the time. Each ISA variant (``isa``)
    keeps its own.
    ``ValueError`` for parts of another length, or not positive and finite."""
    lib = load(isa)
    if lib is None:
        raise RuntimeError(f"the CPU decode step is not available: {BUILD_ERROR}")
    n = torch.get_num_threads() if threads is None else int(threads)
    setting = {kind: list(values) for kind, values in (parts or {}).items()}
    for kind, values in setting.items():
        if kind not in BALANCE_KINDS:
            raise ValueError(f"balance: kind {kind!r} is not one of {BALANCE_KINDS}")
        if values and (len(values) != n or not all(math.isfinite(v) and v > 0 for v in values)):
            raise ValueError(
                f"balance: {kind} parts {values} must be {n} positive finite numbers (or [] to forget them)"
            )
    if setting and not 2 <= n <= 8:
        raise ValueError(f"balance: {n} threads' parts are not kept (2 to 8 are)")
    for kind, values in setting.items():
        buf = (ctypes.c_float * n)(*(values or [0.0] * n))
        lib.wiola_balance_parts(BALANCE_KINDS.index(kind), n, buf, 1)
    out: dict[str, list[float]] = {}
    for k, kind in enumerate(BALANCE_KINDS):
        buf = (ctypes.c_float * max(n, 1))()
        kept = lib.wiola_balance_parts(k, n, buf, 0) == 0
        values = [float(v) for v in buf[:n]] if kept else []
        out[kind] = values if any(values) else []
    return out


def step_parameters(model: WiolaModel) -> list[torch.Tensor | None]:
    """The tensors the step reads, in the C++'s order (``wiola.fast.step_layout.slots``): the
    embedding, final γ, helical frequencies, then per layer attn γ, W_q, W_k, W_v, W_o, gate W_1,
    W_2, b_2 (None without a gate), ffn γ, W_up, W_bp, W_down."""
    gate = model.config.gate
    return [
        None if s.gate and not gate else layout.tensor_at(model, path)
        for path, s in layout.slots(model.config.n_layers)
    ]


def matrix_slots(n_layers: int) -> list[int]:
    """The positions in ``step_parameters`` of the matrices a quantized model packs (see
    ``wiola.fast.step_layout.matrix_slots``)."""
    return layout.matrix_slots(n_layers)


def _packed(model: WiolaModel) -> tuple[str | None, list[torch.Tensor], list[torch.Tensor | None]]:
    """A quantized model's scheme, packed matrices and scales in ``matrix_slots`` order (None and
    empty lists for an fp32 model)."""
    scheme = getattr(model, "quantization", None)
    if scheme is None:
        return None, [], []
    pairs = [model.quantized[name] for name in layout.matrix_names(model.config.n_layers)]
    return scheme, [q for q, _ in pairs], [s for _, s in pairs]


WEIGHT_TYPES = layout.WEIGHT_TYPES
TILED = ("bf16",)  # the weight types the amx variant multiplies on its tile unit, bound tiled


def tile_matrix(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``(N, K)`` in the amx variant's tiled order (``tile_rows`` in the source), as a
    ``(N' / 16, K' / 32, 512)`` tensor of its dtype: blocks of 16 rows by 32 columns, the blocks of
    each 16-row band in order of K; inside a block, element ``(n, k)`` at ``(k // 2)·32 + 2n + k % 2``
    (the pairs the tile unit multiplies). N is padded with zero rows to ``N'``, a multiple of 32
    (the C++ computes two blocks of rows at once), K with zero columns to ``K'``, a multiple of 32."""
    N, K = q.shape
    n, k = -(-N // 32) * 32, -(-K // 32) * 32
    padded = q.new_zeros(n, k)
    padded[:N, :K] = q
    return padded.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 512)


def _tiled(model: WiolaModel, name: str, q: torch.Tensor) -> torch.Tensor:
    """``tile_matrix(q)`` for the packed matrix ``name`` of ``model``, made once and kept on the
    model while ``q`` is the packed matrix (``quantize`` makes new ones; nothing writes them in
    place). A second copy of the quantized matrices: the row-major ones stay for everything else
    that reads them (checkpoints, the export, the PyTorch path)."""
    kept = model.__dict__.setdefault("_step_tiles", {})
    if name not in kept or kept[name][0] is not q:
        kept[name] = (q, tile_matrix(q))
    return kept[name][1]


class _Registrations:
    """How many parameters, buffers and submodules any module of this process has had set
    (``module.weight = ...``, ``load_state_dict(assign=True)``, ``layers[i] = ...``, an adapter
    wrapping a projection: torch's global registration hooks see them all). While the count is
    the one a binding saw when it last walked its model, no module attribute was set since, so
    the tensors it found are still the model's (``DecodeStepCPU.is_current``). A lost increment of
    two threads at once still changes the count."""

    count = 0

    @classmethod
    def seen(cls, *_: object) -> None:
        cls.count += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_Registrations.seen)
torch.nn.modules.module.register_module_buffer_registration_hook(_Registrations.seen)
torch.nn.modules.module.register_module_module_registration_hook(_Registrations.seen)


class UnsupportedWeights(ValueError):
    """The model's fp32 weights are not in a form the C++ step reads (one that is not a contiguous
    fp32 CPU tensor of the layout's shape, heads wider than ``MAX_HEAD``): the PyTorch path computes
    that model (``wiola.fast.ops.cpu_decode_step`` answers None). Every other refusal of a binding
    (a cache of another model, a stale quantized model) is an error of the caller's."""


class DecodeStepCPU:
    """The C++ step bound to one model's weights and one cache (pointers taken once), in the
    variant ``select_isa(isa)`` (``$WIOLA_CPU_ISA`` is read here, once per binding). For a model
    quantized by ``wiola.fast.quantize`` the step reads the packed matrices (int8 with per-row
    scales, int4 with per-group scales, or bf16) instead of the fp32 ones.

    Two calls: ``step(tokens, slot)`` (also ``__call__``) steps every row of the cache at one
    shared slot (a left-padded batch that started together, as ``generate`` runs it);
    ``rows(rows, tokens, slots)`` steps some of the cache's rows, each at its own slot (rows that
    joined at different times, ``wiola.fast.rows``). A row's logits are bitwise the same either
    way, alone or beside any other rows, whichever cache row it occupies.

    Raises ``UnsupportedWeights`` (a ``ValueError``) naming the weight when one is not a contiguous
    fp32 CPU tensor of the expected shape; ``ValueError`` naming the buffer when a cache buffer is
    not a contiguous CPU tensor of the expected dtype and shape (a cache made for another model,
    say), or when a quantized model's matrices changed after ``quantize``
    (``wiola.fast.quantize.require_current``: the packed ones no longer stand for them).
    """

    def __init__(self, model: WiolaModel, cache: Cache, isa: str | None = None) -> None:
        lib = load(isa)
        if lib is None:
            raise RuntimeError(f"the CPU decode step is not available: {BUILD_ERROR}")
        self.isa = select_isa(isa)
        cfg = model.config
        cfg.require_butterfly("the C++ CPU decode step")
        if cfg.head_dim > MAX_HEAD or cfg.n_heads > MAX_HEAD:
            raise UnsupportedWeights(f"the CPU decode step needs head_dim and n_heads <= {MAX_HEAD}")
        self.lib, self.config = lib, cfg
        self.registrations = _Registrations.count  # before the walk: a registration during it walks again
        self.tensors = step_parameters(model)  # references keep the storage alive
        B, S = cache.batch_size, cache.max_len
        size = layout.sizes(cfg, B, S)
        shapes = [layout.shape(s.shape, size) for _, s in layout.slots(cfg.n_layers)]
        for i, (t, shp) in enumerate(zip(self.tensors, shapes, strict=True)):
            if t is not None:
                _check(t, f"weight #{i}", torch.float32, shp, UnsupportedWeights)
        quantize.require_current(model, "CPU decode step")
        self.quantization, packed, scales = _packed(model)
        slots = self.matrix_slots = matrix_slots(cfg.n_layers)
        wtype, wdtype = WEIGHT_TYPES[self.quantization]
        self.scales: list[torch.Tensor | None] = [None] * len(self.tensors)
        self.packed = packed + [s for s in scales if s is not None]  # references keep the storage alive
        step_tensors = list(self.tensors)
        group = quant_group(lib)
        for i, q, s in zip(slots, packed, scales, strict=True) if packed else ():
            N, K = shapes[i]
            _check(q, f"weight #{i} ({self.quantization})", wdtype, (N, K // 2) if wtype == 3 else (N, K))
            if self.quantization in ("int8", "int4"):
                _check(s, f"weight #{i} scales", torch.float32, (N, K // group) if wtype == 3 else (N,))
            step_tensors[i], self.scales[i] = q, s
        if self.isa == "amx" and self.quantization in TILED:
            names = layout.matrix_names(cfg.n_layers)
            for i, name, q in zip(slots, names, packed, strict=True):
                step_tensors[i] = _tiled(model, name, q)
        self.step_tensors = step_tensors  # what the C++ reads, in its order (tests/test_decode_step_arm.py)
        self.state = tuple(getattr(cache, name) for name, _, _ in layout.STATE)
        for (name, dtype, symbols), t in zip(layout.STATE, self.state, strict=True):
            _check(t, f"cache.{name}", dtype, layout.shape(symbols, size))
        self.tuning = choose_tuning(cfg, self.quantization)
        values = {**size, "gate": int(cfg.gate), "gate_pre_rope": int(cfg.gate_pre_rope), "weight_type": wtype}
        values["group"] = group
        values.update({k: int(v) for k, v in self.tuning.items() if k in layout.DIMS})
        self.batch_size, self.max_len = B, S
        self.dims = (ctypes.c_int64 * len(layout.DIMS))(*(values[name] for name in layout.DIMS))
        self.weights = (ctypes.c_void_p * len(step_tensors))(*_pointers(step_tensors))
        self.scale_ptrs = (ctypes.c_void_p * len(self.scales))(*_pointers(self.scales))
        self.state_ptrs = (ctypes.c_void_p * len(self.state))(*(t.data_ptr() for t in self.state))
        self.work = torch.empty(lib.wiola_workspace_floats(self.dims), dtype=torch.float32)
        self.eps = float(cfg.norm_eps)
        self.model = weakref.ref(model)
        self.pointers = _pointers(self.tensors) + _pointers(self.packed)

    def is_current(self) -> bool:
        """Whether the bound weights are still the model's, where they were: False after any
        parameter was replaced (``load_state_dict(assign=True)``, ``module.weight = ...``) or
        moved (``.to()``, ``.half()``). In-place updates of an fp32 model need no rebinding; a
        quantized model's matrices changed in place make it False too, so that binding again
        checks them (``wiola.fast.quantize.require_current``).

        Compares the model's current tensors' addresses with the bound ones; the binding keeps
        the bound tensors alive, so a replacement can never reuse their address. The model's
        tensors are found again by their paths only after some module attribute was set somewhere
        (``_Registrations``); otherwise they are the tensors found last, whose addresses a move
        changes in place. Finding them by path takes about 0.3 ms for the 13m preset, a step
        about 0.15-0.5 ms: the check runs before every step."""
        model = self.model()
        if model is None or getattr(model, "quantization", None) != self.quantization:
            return False
        _, packed, scales = _packed(model)
        count = _Registrations.count
        weights = self.tensors if count == self.registrations else step_parameters(model)
        if self.pointers != _pointers(weights + packed + [s for s in scales if s is not None]):
            return False
        if self.quantization is not None and not quantize.is_stamped(model, [weights[i] for i in self.matrix_slots]):
            return False
        self.tensors, self.registrations = weights, count  # the same addresses: these tensors from now on
        return True

    # The C++ indexes the embedding, the cache and the outputs with these numbers unchecked: every
    # call checks them first (ValueError naming the argument), a few microseconds a step.
    def _check_ids(self, t: torch.Tensor, name: str, n: int, high: int) -> list[int]:
        """``t``'s values, once it is an ``(n,)`` contiguous int64 CPU tensor of values in ``[0, high)``."""
        _check(t, name, torch.int64, (n,))
        values = t.tolist()
        bad = [v for v in values if not 0 <= v < high]
        if bad:
            raise ValueError(f"CPU decode step: {name} holds {bad[0]}, outside [0, {high})")
        return values

    def _check_rows(self, rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> int:
        n = int(rows.numel())
        if len(set(self._check_ids(rows, "rows", n, self.batch_size))) != n:
            raise ValueError(f"CPU decode step: rows must be distinct, got {rows.tolist()}")
        self._check_ids(tokens, "tokens", n, self.config.vocab_size)
        self._check_ids(slots, "slots", n, self.max_len)
        return n

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """``(B, V)`` fp32 logits of ``tokens`` ``(B,)`` (int64, contiguous, each in ``[0, V)``) placed
        at cache slot ``slot`` (in ``[0, max_len)``) of every row; writes the cache (k, v, key mask,
        gate sums and counts, ``n_real``). The caller advances ``cache.length``. Raises
        ``ValueError`` for ids, a slot or a tensor the C++ cannot take."""
        self._check_ids(tokens, "tokens", self.batch_size, self.config.vocab_size)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_len:
            raise ValueError(f"CPU decode step: slot must be an int in [0, max_len={self.max_len}), got {slot!r}")
        logits = torch.empty(self.batch_size, self.config.vocab_size, dtype=torch.float32)
        _follow_torch_threads()
        rc = self.lib.wiola_decode_step(
            self.dims, self.weights, self.scale_ptrs, self.state_ptrs, tokens.data_ptr(), slot, self.eps,
            logits.data_ptr(), self.work.data_ptr(),
        )  # fmt: skip
        if rc != 0:  # pragma: no cover - an unknown weight type or int4 group, which the binding never passes
            raise RuntimeError(f"wiola_decode_step returned {rc}")
        return logits

    def rows(self, rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``(n, V)`` fp32 logits of ``tokens`` ``(n,)`` for the cache rows ``rows`` ``(n,)``, each at
        its own slot ``slots`` ``(n,)`` (all int64, contiguous); writes those rows of the cache and
        leaves the others untouched. Raises ``ValueError`` unless the rows are distinct and in
        range, the ids in ``[0, V)`` and each slot below ``max_len``."""
        n = self._check_rows(rows, tokens, slots)
        logits = torch.empty(n, self.config.vocab_size, dtype=torch.float32)
        _follow_torch_threads()
        rc = self.lib.wiola_decode_rows(
            self.dims, self.weights, self.scale_ptrs, self.state_ptrs, n, rows.data_ptr(), tokens.data_ptr(),
            slots.data_ptr(), self.eps, logits.data_ptr(), self.work.data_ptr(),
        )  # fmt: skip
        if rc != 0:  # pragma: no cover - only an unknown weight type fails, and the binding never passes one
            raise RuntimeError(f"wiola_decode_rows returned {rc}")
        return logits

    def _scratch(self) -> torch.Tensor:
        n = self.lib.wiola_sample_scratch_floats(self.config.vocab_size)
        if getattr(self, "scratch", None) is None or self.scratch.numel() < n:  # the thread count may grow
            self.scratch = torch.empty(n, dtype=torch.float32)
        return self.scratch

    def step_rows(
        self, rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, samplers: Samplers
    ) -> torch.Tensor:
        """``rows`` (one step of some rows, each at its own slot) and their tokens sampled in the same
        C++ call (``Samplers``: greedy, temperature, top-k, top-p). Returns the ``(n, V)`` logits;
        the tokens and log-probabilities land in ``samplers``. Raises ``ValueError`` as ``rows``
        does, or for ``samplers`` made for another ``n`` or ``V``."""
        n = self._check_rows(rows, tokens, slots)
        t = samplers
        if t.log_noise.shape != (n, self.config.vocab_size) or t.top_ids.shape != (n, t.max_k):
            raise ValueError(f"CPU decode step: samplers made for {tuple(t.log_noise.shape)} rows and ids, not {n}")
        if n and not 0 <= int(t.n_logprobs.min()) <= int(t.n_logprobs.max()) <= t.max_k:
            raise ValueError(f"CPU decode step: samplers.n_logprobs must be in [0, max_k={t.max_k}]")
        logits = torch.empty(n, self.config.vocab_size, dtype=torch.float32)
        _follow_torch_threads()
        rc = self.lib.wiola_step_rows(
            self.dims, self.weights, self.scale_ptrs, self.state_ptrs, n, rows.data_ptr(), tokens.data_ptr(),
            slots.data_ptr(), self.eps, logits.data_ptr(), self.work.data_ptr(), t.mode.data_ptr(),
            t.temperature.data_ptr(), t.top_k.data_ptr(), t.top_p.data_ptr(), t.log_noise.data_ptr(),
            t.n_logprobs.data_ptr(), t.max_k, _NUCLEUS_CALLBACK, t.token.data_ptr(), t.logprob.data_ptr(),
            t.top_ids.data_ptr(), t.top_values.data_ptr(), t.path.data_ptr(), self._scratch().data_ptr(),
        )  # fmt: skip
        _raise_caller_error(rc == -3)
        if rc != 0:  # pragma: no cover - only an unknown weight type fails, and the binding never passes one
            raise RuntimeError(f"wiola_step_rows returned {rc}")
        return logits

    def generate_loop(
        self, start: int, steps: tuple[int, int], out: torch.Tensor, first: torch.Tensor, finished: torch.Tensor,
        temperature: float, top_k: int | None, top_p: float | None, log_noise: torch.Tensor | None, eos: int | None,
        pad: int | None,
    ) -> int:  # fmt: skip
        """``generate``'s loop over steps ``[i0, i1)`` for every row of the cache, in one C++ call:
        step 0 samples from the prefill's ``first`` ``(B, V)`` logits, step ``i`` from a step of
        the previous tokens at slot ``start + i - 1``; tokens into ``out`` ``(B, N)`` int64;
        ``finished`` ``(B,)`` uint8 carries the eos bookkeeping across calls. ``temperature`` 0 is
        greedy; else ``log_noise`` ``(i1 - i0, B, V)``: the log of each step's Exp(1) draws, with
        ``top_k`` and ``top_p`` (None: none). Returns the step it stopped before (``i1``, or earlier
        once every row has finished). Raises ``ValueError`` for ``eos``/``pad`` outside ``[0, V)``,
        steps past ``out`` or the cache, or a tensor of another shape."""
        i0, i1 = steps
        B, V = self.batch_size, self.config.vocab_size
        for name, value in (("eos", eos), ("pad", pad)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < V):
                raise ValueError(
                    f"CPU decode step: {name} must be None or an int in [0, vocab_size={V}), got {value!r}"
                )
        _check(out, "out", torch.int64, (B, out.shape[-1]))
        if not (0 <= i0 <= i1 <= out.shape[1] and 0 <= start and start + i1 - 1 <= self.max_len):
            raise ValueError(
                f"CPU decode step: steps [{i0}, {i1}) from slot {start} are past out's {out.shape[1]} columns or the "
                f"cache's max_len={self.max_len}"
            )
        if i0 > 0:  # the C++ feeds column i0 - 1 back as the next tokens
            self._check_ids(out[:, i0 - 1].contiguous(), f"out[:, {i0 - 1}]", B, V)
        _check(first, "first", torch.float32, (B, V))
        _check(finished, "finished", torch.uint8, (B,))
        if temperature != 0:
            if log_noise is None:
                raise ValueError("CPU decode step: sampling (temperature > 0) needs log_noise")
            _check(log_noise, "log_noise", torch.float32, (i1 - i0, B, V))
        logits = torch.empty(self.batch_size, self.config.vocab_size, dtype=torch.float32)
        _follow_torch_threads()
        stopped = self.lib.wiola_generate(
            self.dims, self.weights, self.scale_ptrs, self.state_ptrs, self.eps, self.work.data_ptr(), start, i0,
            i1, out.shape[1], first.data_ptr(), logits.data_ptr(), int(temperature == 0), float(temperature),
            top_k or 0, 1.0 if top_p is None else float(top_p), _NUCLEUS_CALLBACK,
            0 if log_noise is None else log_noise.data_ptr(), -1 if eos is None else eos, 0 if pad is None else pad,
            finished.data_ptr(), out.data_ptr(), self._scratch().data_ptr(),
        )  # fmt: skip
        _raise_caller_error(stopped == -2)
        if stopped < 0:  # pragma: no cover - only an unknown weight type fails, and the binding never passes one
            raise RuntimeError("wiola_generate: unknown weight type")
        return stopped


MODE = {"greedy": 0, "sample": 1}  # the C++'s SampleMode
NUCLEUS_PATHS = ("none", "bound", "caller")  # the C++'s NucleusPath: what decided a row's nucleus

# The C++ nucleus' fallback (nucleus_row): where its bounds do not decide a token, or the nucleus ends
# inside a run of equal logits, it asks this for the reference's own mask. Kept for the process: the
# library holds its address.
NUCLEUS_CALLER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p)
_caller_errors = threading.local()


def _reference_nucleus(x: int, n: int, top_p: float, drop: int) -> int:
    """``drop`` (``n`` uint8) = ``wiola.generation.nucleus_drop`` of the ``n`` fp32 logits at ``x``
    (scaled, top-k filtered). Returns 0, or 1 with the exception kept for the binding to raise (an
    exception cannot cross the C++)."""
    try:
        from wiola.generation import nucleus_drop

        logits = torch.frombuffer((ctypes.c_float * n).from_address(x), dtype=torch.float32).view(1, n)
        mask = torch.frombuffer((ctypes.c_uint8 * n).from_address(drop), dtype=torch.uint8)
        mask.copy_(nucleus_drop(logits, top_p)[0])
        return 0
    except BaseException as error:  # re-raised by _raise_caller_error on this thread
        _caller_errors.error = error
        return 1


_NUCLEUS_CALLBACK = NUCLEUS_CALLER(_reference_nucleus)


def _raise_caller_error(failed: bool) -> None:
    """Raise what the nucleus fallback raised on this thread, where the C++ reports it failed."""
    error = getattr(_caller_errors, "error", None)
    _caller_errors.error = None
    if failed:
        raise error if error is not None else RuntimeError("the C++ nucleus fallback failed")


class Samplers:
    """The per-row sampler settings and outputs of one C++ sampling call, for ``n`` rows:
    ``mode`` (``MODE``), ``temperature``, ``top_k`` (0: none), ``top_p`` (float64; 1: none),
    ``log_noise`` ``(n, V)`` (the log of each sampled row's Exp(1) draws, taken by torch as
    ``wiola.generation.sample_next`` takes it), ``n_logprobs`` (how many best log-probabilities per
    row, at most ``max_k``); out: ``token``, ``logprob`` (the token's log-softmax),
    ``top_ids``/``top_values`` ``(n, max_k)``, ``path`` (what decided each row's nucleus, an index
    into ``NUCLEUS_PATHS``)."""

    def __init__(
        self,
        n: int,
        vocab_size: int,
        max_k: int,
        settings: tuple[list[int], list[float], list[int], list[float], list[int]] | None = None,
        log_noise: torch.Tensor | None = None,
    ) -> None:
        """``settings``: the rows' ``(mode, temperature, top_k, top_p, n_logprobs)`` as lists of
        ``n`` (default: greedy, temperature 1, no top-k or top-p, no log-probabilities);
        ``log_noise``: the ``(n, V)`` buffer to hold it (default a new one; a caller that steps often
        keeps one)."""
        self.max_k = max(1, max_k)
        mode, temperature, top_k, top_p, n_logprobs = settings or ([0] * n, [1.0] * n, [0] * n, [1.0] * n, [0] * n)
        self.mode = torch.tensor(mode, dtype=torch.int64)
        self.temperature = torch.tensor(temperature, dtype=torch.float32)
        self.top_k = torch.tensor(top_k, dtype=torch.int64)
        self.top_p = torch.tensor(top_p, dtype=torch.float64)
        if log_noise is None:
            log_noise = torch.empty(n, vocab_size)
        _check(log_noise, "Samplers: log_noise", torch.float32, (n, vocab_size))
        self.log_noise = log_noise  # read for sampled rows only
        self.n_logprobs = torch.tensor(n_logprobs, dtype=torch.int64)
        self.token = torch.zeros(n, dtype=torch.int64)
        self.logprob = torch.zeros(n, dtype=torch.float32)
        self.top_ids = torch.zeros(n, self.max_k, dtype=torch.int64)
        self.top_values = torch.zeros(n, self.max_k, dtype=torch.float32)
        self.path = torch.zeros(n, dtype=torch.int64)


# Sizes the check of the C++ Exp(1) draws against torch's draws: across the MT19937's refills
# of 624 words (two a value), odd tails, and one row of a 32,000-id vocabulary.
EXPONENTIAL_PROBE = (1, 5, 311, 312, 313, 1300, 4099, 32000)
_EXPONENTIAL_AGREES: dict[str, bool] = {}  # library path -> whether its draws are this torch's
STATE_BYTES = 5056  # torch's CPU generator state (get_state()): the size the C++ reads (kGenBytes)


def _draw_exponential(lib: ctypes.CDLL, generators: list[torch.Generator], out: torch.Tensor) -> int:
    """Row ``i`` of ``out`` (``(len(generators), n)``, checked by the caller) drawn by the C++ from
    ``generators[i]`` (a generator's rows one stream in row order), each generator's state read,
    advanced and set back. Returns how many values took the scalar ``log1p``; negative, nothing
    drawn, where a state is not one the C++ reads (its size or position)."""
    unique: dict[int, int] = {}
    job = [unique.setdefault(id(g), len(unique)) for g in generators]
    gens = list({id(g): g for g in generators}.values())
    states = [g.get_state() for g in gens]
    if any(s.numel() != STATE_BYTES for s in states):
        return -2
    pointers = (ctypes.c_void_p * len(states))(*(s.data_ptr() for s in states))
    jobs = (ctypes.c_int64 * len(job))(*job)
    _follow_torch_threads()
    redone = lib.wiola_exponential(pointers, STATE_BYTES, len(states), jobs, len(job), out.shape[1], out.data_ptr())
    if redone >= 0:
        for g, state in zip(gens, states, strict=True):
            g.set_state(state)
    return redone


def exponential_agrees(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s Exp(1) draws are this torch's ``exponential_`` draws, bit for bit, and leave
    the generator where torch's leave it: checked once a process per library, on a probe generator
    and ``EXPONENTIAL_PROBE``'s sizes (another torch that draws otherwise, or lays its state out
    otherwise, gets False, and ``exponential_rows`` then keeps torch's own draws)."""
    path = str(getattr(lib, "_name", id(lib)))
    if path not in _EXPONENTIAL_AGREES:
        ours, theirs = torch.Generator().manual_seed(20261207), torch.Generator().manual_seed(20261207)
        agrees = True
        for n in EXPONENTIAL_PROBE:
            drawn = torch.empty(1, n)
            expected = torch.empty(1, n).exponential_(generator=theirs)
            agrees = (
                _draw_exponential(lib, [ours], drawn) >= 0
                and torch.equal(drawn.view(torch.int32), expected.view(torch.int32))
                and torch.equal(ours.get_state(), theirs.get_state())
            )
            if not agrees:
                break
        _EXPONENTIAL_AGREES[path] = agrees
    return _EXPONENTIAL_AGREES[path]


def exponential_rows(
    generators: list[torch.Generator | None], n: int, *, out: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """``(len(generators), n)`` fp32 Exp(1) noise: row ``i`` is ``torch.empty(1, n).exponential_(
    generator=generators[i])`` (None: torch's default CPU generator), drawn for ``i = 0, 1, ...``
    in turn, bit for bit, and every generator is left where those draws leave it.

    torch draws a value at a time through the scalar ``log1p`` (15 ns a value on the Intel(R)
    Xeon(R) Processor, family 6 model 167; 500 us a row of 32,000 ids); the C++
    (``wiola_exponential``) draws the same values from the same states 8 times as fast a thread:
    different generators' rows on separate threads, one generator's stream from 2^14 values on
    shared by the threads (each skipping to its own part). torch's own draws are taken where the
    library is not built, a generator is not a CPU one, or ``exponential_agrees`` found that this
    torch draws otherwise. A generator that another thread draws from meanwhile loses those draws (its state
    is read and set back around the C++), as with ``get_state``/``set_state`` themselves.
    ``out``: where to write them (a contiguous ``(len(generators), n)`` fp32 CPU tensor; default a
    new one); returned. Raises ``ValueError`` for a negative ``n`` or another ``out``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"exponential_rows: n must be a non-negative int, got {n!r}")
    gens = [torch.default_generator if g is None else g for g in generators]
    if out is None:
        out = torch.empty(len(gens), n, dtype=torch.float32)
    _check(out, "exponential_rows: out", torch.float32, (len(gens), n))
    lib = load(isa)
    if lib is not None and gens and all(g.device.type == "cpu" for g in gens) and exponential_agrees(lib):
        if _draw_exponential(lib, gens, out) >= 0:
            return out
    for row, g in zip(out, gens, strict=True):
        row.exponential_(generator=g)
    return out


def nucleus_rows(
    x: torch.Tensor, top_p: float | torch.Tensor, *, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``wiola.generation.nucleus_drop(x, top_p)`` for contiguous ``(B, V)`` fp32 CPU logits and a
    ``top_p`` below 1 (a float, or ``(B,)`` float64): the same mask, decided in C++
    (``wiola_nucleus``), with each row's path (``NUCLEUS_PATHS``). None where the library is not
    built or ``x`` is not such a tensor."""
    lib = load(isa)
    if lib is None or x.dim() != 2 or not _rows_fp32(x) or x.shape[1] >= 2**32:
        return None
    B, V = x.shape
    top = torch.full((B,), top_p, dtype=torch.float64) if not isinstance(top_p, torch.Tensor) else top_p
    _check(top, "top_p", torch.float64, (B,))
    drop, path = torch.zeros(B, V, dtype=torch.uint8), torch.zeros(B, dtype=torch.int64)
    failed = lib.wiola_nucleus(x.data_ptr(), B, V, top.data_ptr(), _NUCLEUS_CALLBACK, drop.data_ptr(), path.data_ptr())
    _raise_caller_error(failed != 0)
    return drop.bool(), path


def sample_rows(lib: ctypes.CDLL, logits: torch.Tensor, samplers: Samplers) -> None:
    """The C++ sampler alone on ``(n, V)`` fp32 logits (contiguous); fills ``samplers``' outputs."""
    n, V = logits.shape
    t = samplers
    scratch = torch.empty(lib.wiola_sample_scratch_floats(V), dtype=torch.float32)
    missing = lib.wiola_sample_rows(
        logits.data_ptr(), n, V, t.mode.data_ptr(), t.temperature.data_ptr(), t.top_k.data_ptr(), t.top_p.data_ptr(),
        t.log_noise.data_ptr(), t.n_logprobs.data_ptr(), t.max_k, _NUCLEUS_CALLBACK, t.token.data_ptr(),
        t.logprob.data_ptr(), t.top_ids.data_ptr(), t.top_values.data_ptr(), t.path.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    _raise_caller_error(missing != 0)


def quant_group(lib: ctypes.CDLL) -> int:
    """The int4 group the library was compiled for; ``RuntimeError`` when it is not
    ``wiola.fast.quantize.GROUP`` (the packed scales would be read with the wrong stride)."""
    from wiola.fast.quantize import GROUP

    group = int(lib.wiola_q4_group())
    if group != GROUP:
        raise RuntimeError(f"the CPU decode step was built for int4 groups of {group}, quantize packs {GROUP}")
    return group


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_mask: torch.Tensor,
    start: int,
    *,
    queries: int | None = None,
    isa: str | None = None,
) -> torch.Tensor | None:
    """``wiola.ops.decode_attention`` for ``T`` new tokens on a CPU in C++ (the prompt, a chunk
    of one, or one token where the one-token step does not run, as for a model with adapters;
    ``PromptAttention`` in the source): the keys rotated and written with the
    values to slots ``[start, start + T)`` of the cache, each query's gated causal attention over
    its row's real slots; ``(B, T, H, D)`` fp32, or with ``queries`` (``1 ≤ queries ≤ T``) that of
    the last ``queries`` tokens only, ``(B, queries, H, D)`` (every key and value still written).
    Its own summation order (``docs/SPEC.md``, "The prompt's attention on a CPU"), each query's
    numbers independent of the batch, the tile, the thread and how many queries attend.

    None where it does not apply, for the caller's PyTorch path: the library not built, other
    than fp32 CPU tensors, ``q``/``k``/``v`` not the fused projection's views (head stride ``D``,
    unit element stride, one layout for the three), a cache of other rows or layout, or ``start``
    not a Python int. ``isa``: the variant (``select_isa``)."""
    lib = load(isa)
    if lib is None or not isinstance(start, int) or q.dim() != 4:
        return None
    B, T, H, D = q.shape
    S = k_cache.shape[2] if k_cache.dim() == 4 else -1
    fp32 = (q, k, v, g, cos, sin, k_cache, v_cache)
    if (
        T < 1
        or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in fp32)
        or k.stride() != q.stride()
        or v.stride() != q.stride()
        or q.stride(3) != 1
        or q.stride(2) != D
        or tuple(k.shape) != (B, T, H, D)
        or tuple(v.shape) != (B, T, H, D)
        or tuple(g.shape) != (B, T, H)
        or tuple(cos.shape) != (B, T, D // 2)
        or tuple(sin.shape) != (B, T, D // 2)
        or tuple(k_cache.shape) != (B, H, S, D)
        or tuple(v_cache.shape) != (B, H, S, D)
        or tuple(key_mask.shape) != (B, S)
        or key_mask.dtype != torch.bool
        or not 0 <= start <= S - T
        or not all(t.is_contiguous() for t in (k_cache, v_cache, key_mask))
    ):
        return None
    kept = check_queries(queries, T)
    g, cos, sin = g.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(B, kept, H, D, dtype=torch.float32)
    scratch = torch.empty(lib.wiola_decode_attention_floats(B, H, D, start + T), dtype=torch.float32)
    n = torch.tensor([B, T, H, D, S, start, q.stride(0), q.stride(1), T - kept], dtype=torch.int64)
    lib.wiola_decode_attention(
        n.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), key_mask.data_ptr(), out.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return out


def _rows_fp32(*tensors: torch.Tensor) -> bool:
    """Whether each tensor is a contiguous fp32 CPU tensor (what the row functions read)."""
    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    isa: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``wiola.ops.rms_norm`` row by row in C++ (the step's own RMSNorm: ``mean(h²)`` as the
    step's dot product, then ``h / sqrt(mean + eps) ⊙ weight``), after ``h = x + residual`` where
    ``residual`` is given: ``out``, or ``(out, h)``; each row's numbers independent of the others.

    None where it does not apply, for the caller's PyTorch path: the library not built, other
    than contiguous fp32 CPU tensors, ``weight`` not ``(d,)``, ``residual`` of another shape.
    ``isa``: the variant (``select_isa``)."""
    lib = load(isa)
    if lib is None or x.dim() < 1 or x.numel() == 0:
        return None
    d = x.shape[-1]
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not _rows_fp32(*tensors) or tuple(weight.shape) != (d,):
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    out = torch.empty_like(x)
    h = None if residual is None else torch.empty_like(x)
    lib.wiola_rms_norm_rows(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
        0 if h is None else h.data_ptr(), x.numel() // d, d,
    )  # fmt: skip
    return out if h is None else (out, h)


def silu_gate(up: torch.Tensor, bp: torch.Tensor, *, isa: str | None = None) -> torch.Tensor | None:
    """The butterfly's middle in C++, ``SiLU(a) ⊙ b + bp`` with ``[a ‖ b] = up`` along the last
    dimension (``up`` ``(..., 2F)``, ``bp`` ``(..., F)``), row by row, in vectors (SiLU as
    ``x·σ(x)`` with ``σ`` from ``e^-|x|``: ``docs/SPEC.md``, "The prompt's element-wise parts").

    None where it does not apply: the library not built, other than contiguous fp32 CPU tensors,
    shapes that do not pair. ``isa``: the variant (``select_isa``)."""
    lib = load(isa)
    if lib is None or bp.dim() < 1 or bp.numel() == 0:
        return None
    F = bp.shape[-1]
    if not _rows_fp32(up, bp) or up.shape[:-1] != bp.shape[:-1] or up.shape[-1] != 2 * F:
        return None
    out = torch.empty_like(bp)
    lib.wiola_silu_gate_rows(up.data_ptr(), bp.data_ptr(), out.data_ptr(), bp.numel() // F, F)
    return out


def product(x: torch.Tensor, weight: torch.Tensor, *, isa: str | None = None) -> torch.Tensor | None:
    """``x · weightᵀ`` (``x`` ``(M, K)``, ``weight`` ``(N, K)``) by the step's own product: each
    output row the same operations in the same order whatever ``M``, the thread count or the rows
    beside it (MKL's and oneDNN's GEMMs pick their kernels by the row count, so a row computed
    alone can differ in its last bits from the same row among others). ``(M, N)`` fp32.

    None where it does not apply, for the caller's PyTorch path: the library not built, other than
    contiguous 2-D fp32 CPU tensors, mismatched ``K``, or no rows. ``isa``: the variant."""
    lib = load(isa)
    if lib is None or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.numel() == 0:
        return None
    if not _rows_fp32(x, weight):
        return None
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=torch.float32)
    lib.wiola_product_rows(weight.data_ptr(), N, K, x.data_ptr(), M, out.data_ptr(), _product_ahead(K))
    return out


def gate(
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``wiola.ops.gate`` (without ``update_carry``: ``(g, total, count)``) in C++, a row at a time
    and a position at a time as the step computes its gate (the head mean, the running sum carried
    forward from ``carry`` over the real positions, their mean, the MLP), so a row's gates are the
    same alone and in a batch, and a prompt's are the step's for the same tokens.

    None where it does not apply, for the caller's PyTorch path: the library not built, ``q`` not
    an fp32 CPU ``(B, T, H, D)`` view with head stride ``D`` and unit element stride, weights,
    rotation tables, mask or carry of other shapes or dtypes, ``H`` or ``D`` above 1024, odd ``D``.
    ``sin`` is given exactly where ``cos`` is (the gate after RoPE)."""
    lib = load(isa)
    if lib is None or q.dim() != 4 or q.dtype != torch.float32 or q.device.type != "cpu" or q.numel() == 0:
        return None
    B, T, H, D = q.shape
    if q.stride(3) != 1 or q.stride(2) != D or H > MAX_HEAD or D > MAX_HEAD or D % 2:
        return None
    for t, shape in ((w1, (H, D)), (w2, (H, H)), (b2, (H,))):
        if not _rows_fp32(t) or tuple(t.shape) != shape:
            return None
    if (cos is None) != (sin is None):
        return None
    if cos is not None:
        if cos.shape != (B, T, D // 2) or sin.shape != cos.shape:
            return None
        cos, sin = cos.contiguous(), sin.contiguous()  # (B, T, D/2): small next to q
        if not _rows_fp32(cos, sin):
            return None
    mask = None
    if attention_mask is not None:
        if attention_mask.shape != (B, T) or attention_mask.device.type != "cpu":
            return None
        mask = attention_mask.to(torch.uint8).contiguous()
    if carry is None:
        run, count = torch.zeros(B, D), torch.zeros(B, dtype=torch.int64)
    else:
        if carry[0].shape != (B, D) or carry[1].shape != (B,) or carry[0].dtype != torch.float32:
            return None
        if carry[1].dtype != torch.int64 or carry[0].device.type != "cpu":
            return None
        run = carry[0].clone(memory_format=torch.contiguous_format)
        count = carry[1].clone(memory_format=torch.contiguous_format)
    g = torch.empty(B, T, H, dtype=torch.float32)
    n = torch.tensor([B, T, H, D, q.stride(0), q.stride(1)], dtype=torch.int64)
    lib.wiola_gate_rows(
        n.data_ptr(), q.data_ptr(), w1.data_ptr(), w2.data_ptr(), b2.data_ptr(),
        0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(),
        0 if mask is None else mask.data_ptr(), run.data_ptr(), count.data_ptr(), g.data_ptr(),
    )  # fmt: skip
    return g, run, count


@functools.cache
def _product_ahead(K: int) -> int:
    """``prefetch_rows`` of fp32 rows of ``K`` weights, once a process (``cpu_info`` parses
    ``/proc/cpuinfo``'s lines, and every product asks)."""
    return prefetch_rows(4 * K)


def _pointers(tensors: list[torch.Tensor | None]) -> tuple[int, ...]:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _check(
    t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], error: type[ValueError] = ValueError
) -> None:
    """The C++ reads raw pointers: anything but the exact layout would read out of bounds."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise error(
            f"CPU decode step: {name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    if tuple(t.shape) != shape:
        raise error(f"CPU decode step: {name} has shape {tuple(t.shape)}, the model needs {shape}")
