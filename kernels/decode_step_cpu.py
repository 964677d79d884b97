"""One decoding step of the whole model on a CPU, in C++ (``decode_step_cpu.cpp``).

``wiola.fast.WiolaModel`` runs it for every one-token step with a cache on a plain CPU (fp32,
gradients off): every layer and the tied head in one call, the static cache written in place.
It computes what ``wiola.WiolaModel.forward(ids, cache=cache)`` computes for ``ids`` of shape
``(B, 1)``, in fp32 with its own summation order (``tests/test_decode_step_cpu.py``).

The source is compiled on first use with the system C++ compiler (``$CXX``, else ``g++``;
``-O3 -march=native -fopenmp``) into ``$WIOLA_CACHE_DIR`` (default ``~/.cache/wiola``), keyed by
the source, the flags, the compiler and the CPU, and loaded with ``ctypes``. Its OpenMP
parallel region runs on the ``libgomp`` that torch has already loaded (the same thread pool as
torch's own ops, sized by ``torch.set_num_threads``). Where no compiler works, ``load()``
returns None and ``BUILD_ERROR`` says why; the model then keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from wiola.cache import Cache
    from wiola.model import WiolaModel

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")
MAX_HEAD = 1024  # the C++ keeps a head's gate vectors on the stack

BUILD_ERROR: str | None = None  # why the library could not be built or loaded
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cache_dir() -> Path:
    """``$WIOLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/wiola`` or ``~/.cache/wiola``; a per-user
    folder under the temporary directory when that cannot be written (a read-only home)."""
    explicit = os.environ.get("WIOLA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wiola"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"wiola-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(keep)))


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent build never sees half a file


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first call), or None with ``BUILD_ERROR`` set."""
    global _LIB, _TRIED, BUILD_ERROR
    if _TRIED:
        return _LIB
    _TRIED = True
    try:
        compiler = os.environ.get("CXX") or "g++"
        path = shutil.which(compiler)
        if path is None:
            raise RuntimeError(f"no C++ compiler: `{compiler}` is not on PATH (set CXX)")
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256(
            "\0".join((SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature())).encode()
        ).hexdigest()[:20]
        target = _cache_dir() / f"decode_step_cpu-{key}.so"
        if not target.exists():
            _compile(path, target)
        lib = ctypes.CDLL(str(target))
        lib.wiola_workspace_floats.argtypes = [ctypes.c_void_p]
        lib.wiola_workspace_floats.restype = ctypes.c_int64
        lib.wiola_decode_step.argtypes = (
            [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_float] + [ctypes.c_void_p] * 2
        )
        lib.wiola_decode_step.restype = ctypes.c_int
        _LIB = lib
    except Exception as exc:  # no compiler, a compile error, an unloadable library
        BUILD_ERROR = f"{type(exc).__name__}: {exc}"
    return _LIB


def step_parameters(model: WiolaModel) -> list[torch.Tensor | None]:
    """The tensors the step reads, in the C++'s order: embedding, final γ, helical frequencies,
    then per layer attn γ, W_q, W_k, W_v, W_o, gate W_1, W_2, b_2 (None without a gate), ffn γ,
    W_up, W_bp, W_down."""
    tensors: list[torch.Tensor | None] = [model.embed.weight, model.norm.weight, model.rope_freqs]
    for layer in model.layers:
        a, f = layer.attn, layer.ffn
        gate = (a.gate_w1.weight, a.gate_w2.weight, a.gate_w2.bias) if model.config.gate else (None,) * 3
        tensors += [layer.attn_norm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight]
        tensors += [*gate, layer.ffn_norm.weight, f.up_proj.weight, f.bypass_proj.weight, f.down_proj.weight]
    return tensors


class DecodeStepCPU:
    """The C++ step bound to one model's weights and one cache (pointers taken once).

    Raises ``ValueError`` naming the tensor when a weight or cache buffer is not a contiguous
    CPU tensor of the expected dtype and shape (a cache made for another model, say).
    """

    def __init__(self, model: WiolaModel, cache: Cache) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"the CPU decode step is not available: {BUILD_ERROR}")
        cfg = model.config
        if cfg.head_dim > MAX_HEAD or cfg.n_heads > MAX_HEAD:
            raise ValueError(f"the CPU decode step needs head_dim and n_heads <= {MAX_HEAD}")
        self.lib, self.config = lib, cfg
        self.tensors = step_parameters(model)  # references keep the storage alive
        d, H, D, F, L, V = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.n_layers, cfg.vocab_size
        layer = [(d,), (d, d), (d, d), (d, d), (d, d), (H, D), (H, H), (H,), (d,), (2 * F, d), (F, d), (d, F)]
        shapes = [(V, d), (d,), (D // 2,), *(layer * L)]
        for i, (t, shape) in enumerate(zip(self.tensors, shapes, strict=True)):
            if t is not None:
                _check(t, f"weight #{i}", torch.float32, shape)
        B, S = cache.batch_size, cache.max_len
        self.state = (cache.k, cache.v, cache.key_mask, cache.gate_sum, cache.gate_count, cache.n_real)
        for name, t, dtype, shape in zip(
            ("k", "v", "key_mask", "gate_sum", "gate_count", "n_real"),
            self.state,
            (torch.float32, torch.float32, torch.bool, torch.float32, torch.int64, torch.int64),
            ((L, B, H, S, D), (L, B, H, S, D), (B, S), (L, B, D), (L, B), (B,)),
            strict=True,
        ):
            _check(t, f"cache.{name}", dtype, shape)
        dims = (B, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.d_ff, S)
        self.batch_size, self.max_len = B, S
        self.dims = (ctypes.c_int64 * 10)(*dims, int(cfg.gate), int(cfg.gate_pre_rope))
        self.weights = (ctypes.c_void_p * len(self.tensors))(*(0 if t is None else t.data_ptr() for t in self.tensors))
        self.state_ptrs = (ctypes.c_void_p * len(self.state))(*(t.data_ptr() for t in self.state))
        self.work = torch.empty(lib.wiola_workspace_floats(self.dims), dtype=torch.float32)
        self.eps = float(cfg.norm_eps)
        self.registrations = _registrations
        self.pointers = self._pointers()

    def _pointers(self) -> tuple[int, ...]:
        return tuple(0 if t is None else t.data_ptr() for t in self.tensors)

    def is_current(self) -> bool:
        """Whether the bound weights are still the model's, where they were: False after any
        parameter was replaced (``load_state_dict(assign=True)``, ``module.weight = ...``) or
        moved (``.to()``, ``.half()``). In-place updates need no rebinding. Costs ~10 µs."""
        return self.registrations == _registrations and self.pointers == self._pointers()

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """``(B, V)`` fp32 logits of ``tokens`` ``(B,)`` (int64, contiguous, each in range) placed at
        cache slot ``slot``; writes the cache (k, v, key mask, gate sums and counts, ``n_real``).
        The caller checks the ids and the slot, and advances ``cache.length``."""
        logits = torch.empty(self.batch_size, self.config.vocab_size, dtype=torch.float32)
        rc = self.lib.wiola_decode_step(
            self.dims, self.weights, self.state_ptrs, tokens.data_ptr(), slot, self.eps,
            logits.data_ptr(), self.work.data_ptr(),
        )  # fmt: skip
        if rc != 0:  # pragma: no cover - the C++ has no failing path today
            raise RuntimeError(f"wiola_decode_step returned {rc}")
        return logits


_registrations = 0  # parameters (re)registered on any module since import


def _count_registration(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The C++ reads raw pointers: anything but the exact layout would read out of bounds."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"CPU decode step: {name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    if tuple(t.shape) != shape:
        raise ValueError(f"CPU decode step: {name} has shape {tuple(t.shape)}, the model needs {shape}")
