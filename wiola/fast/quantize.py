"""Weight-only quantization for the C++ CPU decoding step: ``quantize(model, "int8" | "int4" | "bf16")``.

The matrices the step streams for every token (the tied embedding/head and each layer's
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``up_proj``, ``bypass_proj``, ``down_proj``) are
stored as

- ``int8``: symmetric, one fp32 scale per output row (``scale = max|W[r]| / 127``, ``q =
  round(W / scale)`` in [-127, 127]); 1 byte a weight, about 4× fewer bytes than fp32;
- ``int4``: symmetric, group-wise: each run of ``GROUP`` consecutive weights of a row has one fp32
  scale (``scale = max|W[r, g]| / 7``, ``q = round(W / scale)`` in [-7, 7]); stored as unsigned
  nibbles ``q + 8``, two a byte, weight ``2j`` in the low nibble of byte ``j`` (ONNX Runtime's
  ``MatMulNBits`` layout, whose default zero point is 8), the scales ``(N, K / GROUP)``: 4 + 32/GROUP
  bits a weight (5 for GROUP = 32). Every matrix's K must be a multiple of ``GROUP``;
- ``bf16``: ``W`` rounded to bfloat16 (nearest even); 2 bytes a weight.

The norms' γ, the gate's small matrices and the helical frequencies stay fp32. The model's own
fp32 parameters are overwritten, in place, with the **dequantized** weights (``q · scale``, or the
bf16 value), so every PyTorch path (prefill, training-free evaluation, CUDA) computes with exactly
the weights the C++ step reads: that path is the oracle the step is tested against
(``tests/test_quantize.py``). The packed tensors live beside the parameters in
``model.quantized`` (not in ``state_dict()``; from 2 MiB of them on, in one mapping advised for
2 MiB pages: ``on_huge_pages``), and ``model.quantization`` names the scheme.

The packed matrices stand for the parameters only while the parameters hold their dequantized
values, so a quantized model keeps them so (``require_current``):

- ``load_state_dict`` refuses (``ValueError``, before anything is copied) a state dict whose value
  for a quantized matrix differs from the model's: to run other fp32 weights quantized, load them
  into an unquantized model and quantize that. Equal matrices (the model's own state dict, one
  quantized the same way from the same weights) and the fp32 norms and gate load as usual.
- A matrix changed another way (in place, a sub-module's ``load_state_dict``, a replaced
  parameter) makes the model stale: its forward, ``generate``, the C++ step's binding and
  ``save_pretrained`` raise ``ValueError`` naming the matrix, never decoding or saving the old
  packed weights beside the new ones. The check compares each matrix's address and version
  counter with those it had when last found equal to its packed form, and compares the values
  themselves when they differ (a copy, a pickle, a move to another device and back: still
  current when the values are). A write through ``p.data`` moves no version counter and is not
  seen: change a quantized model's matrices through the parameter itself, under ``torch.no_grad()``.

``save_pretrained`` of a quantized model writes the packed tensors (int8 and int4 with a
``<name>.scale`` tensor, or bf16) into ``model.safetensors`` and ``{"quantization": {"scheme":
..., "version": 1}}`` into ``config.json``; ``wiola.fast.WiolaModel.from_pretrained`` reads them
back (``wiola.checkpoint.load_pretrained``); any other class refuses such a checkpoint.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from wiola.fast import step_layout
from wiola.fast.step_layout import LAYER_MATRICES, matrix_names, tensor_at  # noqa: F401  (the C++ step's layout table)
from wiola.model import has_adapters

SCHEMES = ("int8", "int4", "bf16")
VERSION = 1  # of the packed layout in a checkpoint
PACKED_DTYPE = {"int8": torch.int8, "int4": torch.uint8, "bf16": torch.bfloat16}
GROUP = 32  # int4 weights per scale (docs/SPEC.md, "int4 weights": why 32)
SCALE_SUFFIX = ".scale"


def matrix_bytes(config: Any, scheme: str | None = None) -> int:
    """The bytes of the matrices a step streams (the tied embedding once, as the head; the layers'
    seven projections) as ``scheme`` stores them: fp32 (None), bf16, int8 with one fp32 scale a
    row, or int4 at half a byte a weight with one fp32 scale a group of ``GROUP``."""
    if scheme is not None:
        _check_scheme(scheme)
    size = step_layout.sizes(config)
    shapes = [step_layout.shape(slot.shape, size) for _, slot in step_layout.slots(config.n_layers) if slot.matrix]
    weights, rows = sum(n * k for n, k in shapes), sum(n for n, _ in shapes)
    if scheme == "int4":
        return weights // 2 + weights // GROUP * 4
    if scheme == "int8":
        return weights + rows * 4
    return weights * (2 if scheme == "bf16" else 4)


def _check_scheme(scheme: Any) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: use one of {', '.join(SCHEMES)}")
    return scheme


def quantize_tensor(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(packed, scales)`` of an fp32 ``(N, K)`` matrix: int8 with ``(N,)`` fp32 scales; int4 as
    ``(N, K/2)`` uint8 nibbles with ``(N, K/GROUP)`` fp32 scales; or bf16 and None. A row (int4: a
    group) of zeros gets scale 0 and dequantizes to zeros. Raises ``ValueError`` for int4 when K is
    not a multiple of ``GROUP``."""
    _check_scheme(scheme)
    w = w.detach().to(torch.float32)
    if scheme == "bf16":
        return w.to(torch.bfloat16).contiguous(), None
    if scheme == "int4":
        return _int4(w)
    scale = w.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4: a ({N}, {K}) matrix: its K = {K} is not a multiple of the group size {GROUP}")
    g = w.view(N, K // GROUP, GROUP)
    scale = g.abs().amax(dim=2) / 7.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = (torch.round(g / safe[..., None]).clamp_(-7, 7) + 8).to(torch.uint8).view(N, K // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous(), scale.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``(N, K/2)`` uint8 nibbles -> the ``(N, K)`` int8 weights ``q`` in [-8, 7] they hold."""
    lo, hi = (packed & 15).to(torch.int8), (packed >> 4).to(torch.int8)
    return torch.stack((lo, hi), dim=-1).view(packed.shape[0], -1) - 8


def dequantize(packed: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 matrix a packed one stands for: ``q · scale`` per row (int8), per group (int4,
    a uint8 ``packed``), or the bf16 values."""
    if packed.dtype == torch.uint8:
        q = unpack_int4(packed).to(torch.float32)
        N, K = q.shape
        return (q.view(N, scale.shape[1], -1) * scale[..., None]).view(N, K)
    w = packed.to(torch.float32)
    return w if scale is None else w * scale[:, None]


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Quantize ``model`` (an fp32 ``wiola.fast.WiolaModel`` on the CPU, in eval mode, its
    parameters not requiring gradients) in place with ``scheme`` (``"int8"``, ``"int4"`` or
    ``"bf16"``); returns it. See the module.

    Raises ``ValueError`` for an unknown scheme, int4 on a model whose ``d_model`` or ``d_ff`` is
    not a multiple of ``GROUP`` (before anything is changed), a model in training mode or with parameters that
    require gradients (quantized weights are for inference: ``model.eval().requires_grad_(False)``),
    a model that is already quantized or has adapters attached, or weights that are not fp32 CPU
    tensors; ``TypeError`` for a model of another class."""
    _check_scheme(scheme)
    _check_model(model)
    if model.training:
        raise ValueError("quantize: the model is in training mode; quantized weights are for inference (model.eval())")
    grads = [name for name, p in model.named_parameters() if p.requires_grad]
    if grads:
        raise ValueError(
            f"quantize: gradients are on for {len(grads)} parameter(s) ({grads[0]}, ...); quantized weights cannot "
            "be trained: call model.requires_grad_(False) first"
        )
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"quantize: the model is already quantized ({model.quantization})")
    if has_adapters(model):
        raise ValueError(
            "quantize: the model has adapters attached (peft's LoRA); fold them into its weights first "
            "(`wiola merge`, or peft's merge_and_unload())"
        )
    params = dict(model.named_parameters())
    for name in matrix_names(model.config.n_layers):
        p = params[name]
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise ValueError(f"quantize: {name} is {p.dtype} on {p.device}; quantize an fp32 model on the CPU")
    if scheme == "int4" and (reason := int4_refusal(model)) is not None:
        raise ValueError(f"quantize: {reason}")
    attach(model, scheme, {name: quantize_tensor(params[name], scheme) for name in matrix_names(model.config.n_layers)})
    return model


def int4_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s matrices cannot be int4 (a K that is not a multiple of ``GROUP``), or None."""
    params = dict(model.named_parameters())
    for name in matrix_names(model.config.n_layers):
        shape = tuple(params[name].shape)
        if shape[1] % GROUP:
            return (
                f"int4 needs every matrix's K to be a multiple of the group size {GROUP}; {name} is {shape} "
                f"(d_model={model.config.d_model}, d_ff={model.config.d_ff})"
            )
    return None


def _check_model(model: Any) -> None:
    if getattr(type(model), "quantization_codec", None) is None:  # wiola.fast.WiolaModel sets it
        raise TypeError(
            f"quantized weights run in wiola.fast.WiolaModel's C++ CPU step; got a {type(model).__module__}."
            f"{type(model).__qualname__}"
        )
    model.config.require_butterfly("wiola.fast.quantize")


def attach(model: torch.nn.Module, scheme: str, packed: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Make ``model`` a ``scheme``-quantized model holding ``packed`` (name -> (packed, scales)):
    its parameters become the dequantized weights (in place), its gradients off, and its
    ``load_state_dict`` refuses other values for them (see the module)."""
    _check_scheme(scheme)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (q, scale) in packed.items():
            params[name].copy_(dequantize(q, scale))
    model.requires_grad_(False)
    matrices = on_huge_pages([q.cpu().contiguous() for q, _ in packed.values()])
    model.quantized = {
        name: (q, None if s is None else s.cpu().contiguous()) for (name, (_, s)), q in zip(packed.items(), matrices)
    }
    model.quantization = scheme
    model.quantized_from = Stamp(_matrices(model))  # the weights the packed matrices stand for
    model.register_load_state_dict_pre_hook(_refuse_other_matrices)


HUGE_PAGE = 2 << 20  # bytes: x86-64's and aarch64's (4 KiB base pages) transparent huge page
_ALIGN = 64  # bytes: each matrix starts on a cache line


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the contiguous CPU ``tensors``, one after another (each 64-byte aligned), in one
    private anonymous mapping that starts on a 2 MiB boundary and is advised ``MADV_HUGEPAGE``, so
    that Linux backs it with 2 MiB pages wherever transparent huge pages are not ``never`` (the
    default mode, ``madvise``, gives them only to memory advised so; torch's allocations are not).
    The C++ step streams these matrices for every token: on 4 KiB pages the 13m preset's bf16
    matrices are about 6,300 pages, more than a core's second-level TLB holds (a few thousand
    entries), so every step walks the page tables again. On 2 MiB pages the bf16 step at batch 1
    ran 1.03-1.08x faster, int8 1.01-1.05x, int4 1.01-1.02x, in one process beside a copy on
    4 KiB pages (Intel Xeon, Ice Lake-SP; docs/SPEC.md, "The packed matrices on huge pages"). The
    tensors themselves where there is nothing to gain or no way to ask: under 2 MiB in all, or a
    platform without ``MADV_HUGEPAGE`` (or where the mapping fails)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
    total = offsets.pop()
    if total < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return tensors
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, total)  # start: a multiple of the base page
    except (OSError, ValueError):
        return tensors
    out = []
    for t, n, at in zip(tensors, sizes, offsets):
        # a storage of its own per matrix (each keeps the mapping alive), as the tensors it replaces had
        view = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=start + at).view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
    return out


class Stamp:
    """The quantized matrices' ``(address, version counter)`` when last found equal to their
    packed form, and the tensors themselves (kept, so that a freed address cannot come back as a
    false match). A copy or a pickle of the model starts with an empty stamp: its first check
    compares the values."""

    def __init__(self, tensors: list[torch.Tensor] | tuple[()] = ()) -> None:
        self.tensors = tuple(t.detach() for t in tensors)
        self.keys = _keys(tensors)

    def __deepcopy__(self, memo: dict) -> Stamp:
        return type(self)()

    def __reduce__(self) -> tuple:
        return (type(self), ())


def _keys(tensors: Any) -> tuple:
    # Inference tensors have no version counter; nothing outside inference mode can change them.
    return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors)


def _matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters that the packed matrices stand for, in ``matrix_names`` order."""
    return [tensor_at(model, name) for name in matrix_names(model.config.n_layers)]


def stale_matrices(model: torch.nn.Module) -> list[str]:
    """The names of a quantized model's matrices whose values are no longer their packed form's
    dequantized values (compared exactly, whatever the parameters' dtype and device)."""
    return [
        name
        for name, p in zip(matrix_names(model.config.n_layers), _matrices(model), strict=True)
        if not _holds(p, *model.quantized[name])
    ]


def _holds(t: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether ``t`` holds exactly the values ``dequantize(packed, scale)`` stands for."""
    t, want = t.detach(), dequantize(packed, scale).to(t.device)
    if t.dtype != torch.float32:  # f64 holds every fp32 value exactly; bf16 may not
        t, want = t.double(), want.double()
    return t.shape == want.shape and torch.equal(t, want)


def is_stamped(model: torch.nn.Module, matrices: list[torch.Tensor] | None = None) -> bool:
    """Whether a quantized model's matrices (``matrices``, when the caller has them in
    ``matrix_names`` order) are where they were, unchanged, since last found equal to their packed
    form (addresses and version counters only: False asks ``require_current``)."""
    stamp = getattr(model, "quantized_from", None)
    return isinstance(stamp, Stamp) and stamp.keys == _keys(_matrices(model) if matrices is None else matrices)


def _first_of(names: list[str]) -> str:
    """The first of ``names`` and how many more, for a message."""
    return names[0] + (f" (and {len(names) - 1} more matrices)" if len(names) > 1 else "")


def require_current(model: torch.nn.Module, what: str) -> None:
    """Raise ``ValueError`` (starting with ``what``) when ``model`` is quantized and a matrix no
    longer holds the values its packed form stands for (see the module); nothing for an fp32 model.
    The addresses and version counters are compared each call, the values only when those moved."""
    if getattr(model, "quantization", None) is None or is_stamped(model):
        return
    matrices = _matrices(model)
    stale = stale_matrices(model)
    if stale:
        raise ValueError(
            f"{what}: the {model.quantization}-quantized model's {_first_of(stale)} changed after quantize(): its "
            "packed matrices no longer stand for it. To run other fp32 weights quantized, load them into an "
            "unquantized wiola.fast.WiolaModel and quantize that"
        )
    model.quantized_from = Stamp(matrices)


def _refuse_other_matrices(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A quantized model's ``load_state_dict`` pre-hook: ``ValueError`` before anything is copied
    when the state dict holds a quantized matrix whose values (cast to the parameter's dtype, as
    ``load_state_dict`` copies them) are not those its packed form stands for."""
    if getattr(module, "quantization", None) is None:
        return
    changed = []
    for name, p in zip(matrix_names(module.config.n_layers), _matrices(module), strict=True):
        new = state_dict.get(prefix + name)
        if new is None:
            continue  # not loaded (strict=False), or reported missing by load_state_dict itself
        if not isinstance(new, torch.Tensor) or not _holds(new.to(p.dtype), *module.quantized[name]):
            changed.append(name)
    if changed:
        raise ValueError(
            f"load_state_dict: this model is {module.quantization}-quantized, and the state dict's "
            f"{_first_of(changed)} differs from the weights its packed matrices stand for. To run these weights "
            "quantized, load them into an unquantized wiola.fast.WiolaModel and quantize that "
            "(wiola.fast.quantize.quantize)"
        )


def packed_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A quantized model's state dict as a checkpoint stores it: each quantized matrix packed (and
    its ``<name>.scale`` for int8 and int4), everything else as ``state_dict()`` has it. Raises
    ``ValueError`` for a stale model (``require_current``): its packed matrices are not its weights."""
    require_current(model, "save_pretrained")
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    for name, (q, scale) in model.quantized.items():
        state[name] = q
        if scale is not None:
            state[name + SCALE_SUFFIX] = scale
    return state


def checkpoint_record(model: torch.nn.Module) -> dict[str, Any]:
    """What ``config.json`` records of a quantized model."""
    return {"scheme": model.quantization, "version": VERSION}


def read_record(record: Any, where: Any) -> str:
    """The scheme of a checkpoint's ``quantization`` record; ``ValueError`` naming ``where`` for one
    this version cannot read."""
    if not isinstance(record, dict) or record.get("scheme") not in SCHEMES:
        raise ValueError(f"{where}: unknown quantization {record!r} (this version reads schemes {', '.join(SCHEMES)})")
    if record.get("version") != VERSION:
        raise ValueError(f"{where}: quantization version {record.get('version')!r}; this version reads {VERSION}")
    return record["scheme"]


def unpack_state(
    state: dict[str, torch.Tensor],
    scheme: str,
    n_layers: int,
    where: Any,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """A checkpoint's packed state -> (the state dict with dequantized fp32 matrices, the packed
    matrices for ``attach``). ``shapes``: the model's ``(N, K)`` of each matrix, from its config;
    a packed matrix of another shape is named before its scale is read. Raises ``ValueError``
    naming a missing or malformed tensor."""
    state = dict(state)
    packed: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name in matrix_names(n_layers):
        q = state.get(name)
        if q is None:
            raise ValueError(f"{where}: missing tensor {name!r}")
        if q.dtype != PACKED_DTYPE[scheme] or q.dim() != 2:
            raise ValueError(f"{where}: {name!r} is a {q.dtype} {tuple(q.shape)} tensor, expected a 2-D {scheme} one")
        if shapes is not None and name in shapes:
            n, k = shapes[name]
            stored = (n, k // 2) if scheme == "int4" else (n, k)  # int4: two weights a byte
            if tuple(q.shape) != stored:
                raise ValueError(
                    f"{where}: {name!r} has shape {tuple(q.shape)}; the config's {n}×{k} matrix is stored as {stored} "
                    f"in {scheme}"
                )
        want = {"int8": q.shape[:1], "int4": (q.shape[0], 2 * q.shape[1] // GROUP)}.get(scheme)
        scale = state.pop(name + SCALE_SUFFIX, None) if want is not None else None  # bf16's: left as unexpected
        if scheme == "int4" and (2 * q.shape[1]) % GROUP:
            raise ValueError(f"{where}: {name!r} holds {2 * q.shape[1]} int4 weights a row, not a multiple of {GROUP}")
        if want is not None and (scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != tuple(want)):
            raise ValueError(f"{where}: {name + SCALE_SUFFIX!r} must be an fp32 tensor of shape {tuple(want)}")
        packed[name] = (q, scale)
        state[name] = dequantize(q, scale)
    return state, packed
