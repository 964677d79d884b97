"""``wiola export``: a checkpoint of ours (a folder, a run folder or a Hub id) in another format.

- ``--format wiola13m`` (default): the ``wiola13m`` / ``transformers`` format (``config.json``,
  ``model.safetensors`` under ``wiola13m``'s tensor names, the tokenizer as ``tokenizer.json`` +
  its configs);
- ``--format onnx``: one decoding step for ONNX Runtime, the tokenizer and ``run_onnx.py``
  (``wiola.export.onnx``); ``--quantize int8|int4|bf16`` stores the weights that way (exact to our
  quantized model), ``--int8-matmul`` runs int8 products (int8 activations too; fastest).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wiola.cli.arguments import add_checkpoint_arguments, non_empty_path

if TYPE_CHECKING:
    from wiola.tokenizer import Tokenizer

FORMATS = ("wiola13m", "onnx")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint in the wiola13m / transformers format, or for ONNX Runtime")
    add_checkpoint_arguments(p, help="model folder, training run folder or Hub id", required=True)
    p.add_argument("--out", type=non_empty_path, required=True, help="folder to write")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="wiola13m",
        help="wiola13m: loadable by wiola13m.WiolaForCausalLM (default); onnx: ONNX Runtime (run with run_onnx.py)",
    )
    p.add_argument(
        "--quantize",
        choices=("int8", "int4", "bf16"),
        help="onnx only: store the weights int8 (per-row scales), int4 (per-group scales) or bf16; a quantized "
        "checkpoint keeps its own",
    )
    p.add_argument(
        "--int8-matmul",
        action="store_true",
        help="onnx with int8 or int4 weights: ONNX Runtime's MatMulNBits products (activations rounded to int8 too)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model a folder already holds (a checkpoint, an export or adapters, and the files saved "
        "beside them), deleting its files; without it such an --out is refused",
    )
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from wiola.checkpoint import load_checkpoint_tokenizer, resolve_checkpoint

    if args.format != "onnx" and (args.quantize or args.int8_matmul):
        raise ValueError(
            f"--quantize and --int8-matmul are for --format onnx; the {args.format} format stores fp32 weights"
        )
    from wiola.train.run_folder import (
        check_apart,
        check_not_a_run,
        check_output_folder,
        clear_model_folder,
        describe_model_files,
        held_model_files,
    )

    out = Path(args.out)
    check_output_folder(out, "--out")
    path = resolve_checkpoint(args.checkpoint, args.revision)  # a run folder: its latest checkpoint
    check_apart(out, path, "--out", "checkpoint")  # a run folder's --out is refused too: it holds the checkpoint
    check_not_a_run(out)
    held = held_model_files(out)
    if held and not args.overwrite:
        raise ValueError(
            f"--out {str(out)!r} already holds {describe_model_files(held)}: pass --overwrite to replace it, or "
            "export to another folder"
        )
    tokenizer = load_checkpoint_tokenizer(path)
    if args.format == "wiola13m":
        import json

        from wiola import WiolaModel
        from wiola.checkpoint import CONFIG_FILE, export_wiola13m

        record = (
            json.loads((path / CONFIG_FILE).read_text()).get("quantization") if (path / CONFIG_FILE).is_file() else None
        )
        if isinstance(record, dict):
            raise ValueError(
                f"{path} holds {record.get('scheme', 'quantized')} weights, which the wiola13m format cannot hold (its "
                "weights are fp32): export the fp32 checkpoint it was made from, or use --format onnx"
            )
        model = WiolaModel.from_pretrained(path)
        if held:  # --overwrite, once the new model has loaded
            clear_model_folder(out)
        export_wiola13m(model, out, tokenizer)
        print(f"{path} -> {out} (wiola13m format, tokenizer {tokenizer.name!r}, {tokenizer.vocab_size:,} ids)")
        return 0
    return _export_onnx(path, out, tokenizer, args, held)


def _export_onnx(path: Path, out: Path, tokenizer: Tokenizer, args: argparse.Namespace, replacing: list[str]) -> int:
    import torch

    from wiola.export.onnx import check_export_packages, export_onnx
    from wiola.export.runner import MODEL_FILE
    from wiola.fast import WiolaModel
    from wiola.fast.quantize import quantize
    from wiola.train.run_folder import clear_model_folder

    check_export_packages()  # before any work, and before an --overwrite deletes the export it replaces
    model = WiolaModel.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    held = getattr(model, "quantization", None)
    if args.quantize and held and args.quantize != held:
        raise ValueError(f"--quantize {args.quantize}: the checkpoint {path} is already {held}-quantized")
    if args.int8_matmul and not (args.quantize or held):
        raise ValueError("--int8-matmul needs int8 or int4 weights: add --quantize int8 (or int4)")
    if args.int8_matmul and (args.quantize or held) == "bf16":
        where = "--quantize bf16" if args.quantize else f"the checkpoint {path} is bf16-quantized"
        raise ValueError(f"--int8-matmul needs int8 or int4 weights, and {where}: drop --int8-matmul")
    if args.quantize and not held:
        quantize(model, args.quantize)
    if replacing:  # --overwrite, once the new model has loaded
        clear_model_folder(out)
    t0 = time.perf_counter()
    print(f"exporting {path} to {out} (ONNX; tens of seconds) ...", file=sys.stderr)
    existed = out.exists()
    with _interrupts() as seen:
        try:
            meta = export_onnx(model, out, tokenizer, int8_matmul=args.int8_matmul)
        except BaseException as e:
            if not (seen or isinstance(e, KeyboardInterrupt)):
                raise
            # Ctrl-C inside torch.export can surface as torch's own export error: it was an
            # interrupt all the same (exit 130), and the files written so far go
            clear_model_folder(out)
            if not existed and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            raise KeyboardInterrupt from None
    size = sum(f.stat().st_size for f in out.glob(MODEL_FILE + "*"))
    weights = (meta["quantization"] or "fp32") + (", int8 products" if meta["int8_matmul"] else "")
    print(
        f"{path} -> {out}/{MODEL_FILE} (ONNX opset {meta['opset']}, {weights}, {size / 1e6:.1f} MB, "
        f"{time.perf_counter() - t0:.1f} s), tokenizer {tokenizer.name!r}\n"
        f"run it: python {shlex.quote(str(out / 'run_onnx.py'))} {shlex.quote(str(out))} --prompt 'Once upon a time'"
    )
    return 0


@contextlib.contextmanager
def _interrupts() -> Iterator[list[int]]:
    """While open, SIGINT raises ``KeyboardInterrupt`` as Python's own handler does and is also
    recorded in the list it yields (empty: none came), for code that may wrap the interrupt in an
    error of its own."""
    seen: list[int] = []

    def handler(sig: int, frame: Any) -> None:
        seen.append(sig)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, old)
