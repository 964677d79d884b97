"""``export_onnx``: a Wiola model as one ONNX decoding step, run by ONNX Runtime.

The folder it writes:

- ``model.onnx``: ``wiola.export.step.DecodeStep`` exported by ``torch.onnx.export`` (the
  ``torch.export`` exporter, opset 18), batch and cache length dynamic;
- ``wiola_onnx.json``: the model's shape, its special ids and how its weights are stored;
- ``tokenizer.json`` (+ its configs) when a tokenizer is given;
- ``run_onnx.py``: ``wiola.export.runner``, which runs the folder with numpy + onnxruntime.

Weights: fp32; or, for a model quantized by ``wiola.fast.quantize``, the int8 (per-row fp32
scales) or bf16 matrices as stored tensors, dequantized in the graph (``q · scale``, exactly the
oracle's weights). ONNX Runtime folds that dequantization into fp32 constants when it loads the
file, so these exports are 4× (int8) or 2× (bf16) smaller on disk and compute exactly what the
PyTorch path computes on the dequantized weights (greedy tokens identical), at fp32 speed.

int4 weights are stored the same way (two a byte, fp32 group scales) and unpacked in the graph
in exact fp32 arithmetic: again the oracle's weights, folded to fp32 when ONNX Runtime loads the
file (5–6× smaller on disk than fp32 with the scales and the fp32 norms: 5.8× for the 13m preset; fp32 speed).

``int8_matmul=True`` (int8 or int4 weights) keeps the weights packed in memory instead: every
product is ONNX Runtime's ``com.microsoft.MatMulNBits`` (int8: 8 bits, one block of up to 128
inputs per scale, the same per-row scale repeated; int4: 4 bits, ``block_size`` = the int4 group,
our nibbles and scales as they are, MatMulNBits' default zero point 8 being ours) with
``accuracy_level=4``, which quantizes the activations to int8 per block as well. It is the fastest form here, and it is not the oracle's function (the
activations are rounded): its quality is measured, not assumed (README, Quality). Exact int8
products in MatMulNBits (``export_onnx(..., accuracy_level=0)``, kept for comparisons) ran at
113–119 tok/s here, slower than fp32, so the command line does not offer them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from wiola.export import runner
from wiola.export.step import OUTPUT_NAMES, DecodeStep, PackedMatrix, unpack_nibbles

if TYPE_CHECKING:
    from wiola.model import WiolaModel
    from wiola.tokenizer import Tokenizer

OPSET = 18
NBITS_BLOCK = 128  # inputs per MatMulNBits scale block (each block repeats its row's one scale)
_EXTERNAL_DATA_BYTES = 1_500_000_000  # past this, weights go to model.onnx.data (protobuf's 2 GB limit)


@torch.library.custom_op("wiola_export::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, K: int, N: int, block_size: int, bits: int
) -> torch.Tensor:
    """``x · Wᵀ`` with ``W = (w − 2^(bits−1)) · scale`` stored as MatMulNBits stores it: ``w`` uint8
    ``(N, K / block_size, block_size · bits / 8)`` (4 bits: two a byte, low nibble first), ``scale``
    fp32 ``(N · K / block_size,)``. This eager form is what tracing sees; ONNX Runtime's kernel
    rounds the activations too at accuracy level 4 (see the module)."""
    u = unpack_nibbles(w.reshape(N, -1)) if bits == 4 else w.reshape(N, K).to(torch.float32)
    dense = (u - float(1 << (bits - 1))) * scale.reshape(N, -1).repeat_interleave(block_size, dim=1)
    return F.linear(x, dense)


@matmul_nbits.register_fake
def _(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, K: int, N: int, block_size: int, bits: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], N)


class NBitsMatrix(PackedMatrix):
    """An int8 or int4 ``PackedMatrix`` in MatMulNBits' layout (int8: uint8 = q + 128, the row's
    scale repeated per block; int4: our nibbles (q + 8) and group scales, one block a group)."""

    def __init__(self, packed: PackedMatrix, name: str) -> None:
        torch.nn.Module.__init__(self)
        q, scale = packed.weight, packed.scale
        if q.dtype == torch.uint8:  # int4
            N, K = q.shape[0], 2 * q.shape[1]
            self.K, self.N, self.block, self.bits = K, N, K // scale.shape[1], 4
            self.register_buffer("weight", q.reshape(N, K // self.block, self.block // 2).contiguous())
            self.register_buffer("scale", scale.reshape(-1).contiguous())
            return
        N, K = q.shape
        self.bits = 8
        if K % 16:
            raise ValueError(
                f"export: {name} has {K} inputs; ONNX Runtime's MatMulNBits needs a multiple of 16 (export without "
                "int8_matmul: the int8 weights are then dequantized when the model loads)"
            )
        block = next(b for b in (NBITS_BLOCK, 64, 32, 16) if K % b == 0)
        self.K, self.N, self.block = K, N, block
        u8 = (q.to(torch.int16) + 128).to(torch.uint8).reshape(N, K // block, block).contiguous()
        self.register_buffer("weight", u8)
        self.register_buffer("scale", scale.repeat_interleave(K // block).contiguous())

    def _row_scale(self, index: torch.Tensor) -> torch.Tensor:
        return self.scale.reshape(self.N, -1)[index, :1]

    def dense(self) -> torch.Tensor:
        raise NotImplementedError("MatMulNBits weights are only read by the matmul and the row lookup")

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        if self.bits == 4:
            return self._widen(self.weight[index].flatten(-2), self.scale.reshape(self.N, -1)[index])
        return (self.weight[index].reshape(*index.shape, self.K).to(torch.float32) - 128.0) * self._row_scale(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_nbits(x, self.weight, self.scale, self.K, self.N, self.block, self.bits)


def _register_matmul_nbits_schema() -> Any:
    """The ``com.microsoft`` opset with ``MatMulNBits`` known to onnx's checker (ONNX Runtime's
    contrib op; onnx itself has no schema for it)."""
    import onnx
    import onnxscript
    from onnx.defs import OpSchema

    if not onnx.defs.has("MatMulNBits", "com.microsoft"):
        schema = OpSchema(
            "MatMulNBits",
            "com.microsoft",
            1,
            inputs=[
                OpSchema.FormalParameter("A", "T1"),
                OpSchema.FormalParameter("B", "T2"),
                OpSchema.FormalParameter("scales", "T1"),
            ],
            outputs=[OpSchema.FormalParameter("Y", "T1")],
            type_constraints=[("T1", ["tensor(float)"], ""), ("T2", ["tensor(uint8)"], "")],
            attributes=[
                OpSchema.Attribute(name, OpSchema.AttrType.INT, "")
                for name in ("K", "N", "bits", "block_size", "accuracy_level")
            ],
        )
        onnx.defs.register_schema(schema)
    return onnxscript.values.Opset("com.microsoft", 1)


def _translations(int8_matmul: bool, accuracy_level: int) -> dict[Any, Any]:
    if not int8_matmul:
        return {}
    msft = _register_matmul_nbits_schema()

    def matmul_nbits_onnx(x: Any, w: Any, scale: Any, K: int, N: int, block_size: int, bits: int) -> Any:
        return msft.MatMulNBits(x, w, scale, K=K, N=N, bits=bits, block_size=block_size, accuracy_level=accuracy_level)

    return {torch.ops.wiola_export.matmul_nbits.default: matmul_nbits_onnx}


def decode_step(model: WiolaModel, *, int8_matmul: bool = False) -> DecodeStep:
    """The ``DecodeStep`` that ``export_onnx`` exports (its MatMulNBits form with ``int8_matmul``)."""
    from wiola.model import WiolaModel

    if not isinstance(model, WiolaModel):
        raise TypeError(f"export: expected a WiolaModel, got {type(model).__module__}.{type(model).__qualname__}")
    if model.embed.weight.device.type != "cpu":
        raise ValueError(f"export: the model is on {model.embed.weight.device}; move it to the CPU first")
    model.config.require_butterfly("export")
    scheme = getattr(model, "quantization", None)
    if int8_matmul and scheme not in ("int8", "int4"):
        raise ValueError(
            f"export: int8_matmul needs an int8- or int4-quantized model (wiola.fast.quantize(model, 'int8')); this "
            f"one is {scheme or 'not quantized'}"
        )
    step = DecodeStep(model).eval()
    if int8_matmul:
        step.embed = NBitsMatrix(step.embed, "embed.weight")
        for i, mats in enumerate(step.matrices):
            for name in list(mats.keys()):
                mats[name] = NBitsMatrix(mats[name], f"layers.{i}.{name}.weight")
    return step


def _optimize(model: Any) -> None:
    """The exporter's graph optimizer (constant folding, redundancy elimination), in place, except
    that a packed weight's widening (``Cast`` of an int8 or bf16 initializer) is never folded:
    folded, a small matrix would be stored as fp32 (ONNX Runtime folds them when it loads the
    file instead, so the file stays packed)."""
    import onnx_ir as ir
    import onnxscript.optimizer

    packed = {ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.BFLOAT16}

    def should_fold(node: Any) -> bool | None:
        if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None:
            source = node.inputs[0]
            if source.is_initializer() and source.dtype in packed:
                return False
        return None  # the optimizer's own rules

    onnxscript.optimizer.optimize_ir(model, should_fold=should_fold)


@contextlib.contextmanager
def _quiet_exporter() -> Any:
    """The exporter's notices that say nothing about this model (torchvision absent, deprecations
    inside torch, shared dynamic axes) kept off the user's terminal; errors still raise."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used.*")
            yield
    finally:
        logger.setLevel(level)


def check_export_packages() -> None:
    """``ImportError`` naming the package and the extra to install where onnx or onnxscript (what
    the export needs beside torch) cannot be imported."""
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError as e:
            raise ImportError(f"export to ONNX needs {package}: pip install 'wiola-slm[export]'") from e


def special_ids(config: Any, tokenizer: Any) -> dict[str, int | None]:
    """The bos/eos/pad ids an export records: the model config's, else the tokenizer's; pad
    falls back to eos, as ``wiola.generation`` resolves it."""
    specials = {}
    for role in ("bos", "eos", "pad"):
        value = getattr(config, f"{role}_token_id")
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, f"{role}_token_id")
        specials[f"{role}_token_id"] = value
    if specials["pad_token_id"] is None:
        specials["pad_token_id"] = specials["eos_token_id"]
    return specials


def export_onnx(
    model: WiolaModel,
    directory: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    *,
    int8_matmul: bool = False,
    accuracy_level: int = 4,
) -> dict[str, Any]:
    """Write ``model`` (fp32, or quantized by ``wiola.fast.quantize``) as an ONNX Runtime export
    into ``directory`` (see the module); returns what ``wiola_onnx.json`` records.

    ``accuracy_level`` (with ``int8_matmul``): MatMulNBits' own; 4 rounds the activations to int8
    (the fast form), 0 keeps fp32 products (exact, and far slower here: for comparisons).

    Raises ``TypeError`` for something that is not a ``WiolaModel``, ``ValueError`` for a model
    the export cannot express (not fp32, not on the CPU, ``int8_matmul`` without int8 or int4 weights or
    with a width MatMulNBits cannot take), ``ImportError`` naming the missing package."""
    check_export_packages()
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"export: accuracy_level must be one of MatMulNBits' 0-4, got {accuracy_level!r}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"export: {str(directory)!r} is a file, not a folder to write the export into")
    step = decode_step(model, int8_matmul=int8_matmul)
    c = model.config
    directory.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=4096)
    slots = torch.export.Dim("slots", min=1, max=c.max_seq_len)
    cache = {1: batch, 3: slots}  # (L, B, H, S, D)
    dims = [{0: batch}, {0: batch}, {0: batch}, {0: batch, 1: slots}, cache, cache, {1: batch}, {1: batch}]
    weight_bytes = sum(t.numel() * t.element_size() for t in step.buffers())
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / runner.MODEL_FILE
        with torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(
                step,
                step.example_inputs(2, min(8, c.max_seq_len)),
                input_names=list(runner.INPUT_NAMES),
                output_names=list(OUTPUT_NAMES),
                dynamic_shapes=dims,
                dynamo=True,
                opset_version=OPSET,
                custom_translation_table=_translations(int8_matmul, accuracy_level),
                verbose=False,
                optimize=False,
            )
            _optimize(program.model)
        program.save(str(path), external_data=weight_bytes > _EXTERNAL_DATA_BYTES)
        for stale in directory.glob(runner.MODEL_FILE + "*"):  # an earlier export's (external data too)
            stale.unlink()
        for produced in Path(tmp).iterdir():
            os.replace(produced, directory / produced.name)
    specials = special_ids(c, tokenizer)
    if tokenizer is not None:
        from wiola.tokenizer import TiktokenTokenizer

        (tokenizer.to_hf() if isinstance(tokenizer, TiktokenTokenizer) else tokenizer).save(directory)
    import onnx

    meta = {
        "format": runner.FORMAT,
        "format_version": runner.FORMAT_VERSION,
        "n_layers": c.n_layers,
        "n_heads": c.n_heads,
        "head_dim": c.head_dim,
        "d_model": c.d_model,
        "vocab_size": c.vocab_size,
        "max_seq_len": c.max_seq_len,
        **specials,
        "quantization": step.scheme,
        "int8_matmul": int8_matmul,
        "accuracy_level": accuracy_level if int8_matmul else None,
        "inputs": list(runner.INPUT_NAMES),
        "outputs": list(OUTPUT_NAMES),
        "opset": OPSET,
        "exported_with": {"torch": torch.__version__.split("+")[0], "onnx": onnx.__version__},
    }
    (directory / runner.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.copyfile(runner.__file__, directory / "run_onnx.py")
    return meta
