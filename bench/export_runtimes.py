"""ExecuTorch against ONNX Runtime for the exported decoding step (issue 15: try both, choose by
measurement). Not a pytest benchmark: ExecuTorch pins its own torch build and is not a dependency,
so this runs in a virtualenv that has both (``pip install executorch onnxruntime onnx onnxscript``).

    python -m bench.export_runtimes --out DIR

The same ``wiola.export.step.DecodeStep`` of the 13m preset (random weights) goes to

- ONNX Runtime (``torch.onnx.export``, CPU execution provider): fp32; int8 stored and
  dequantized at load (``wiola export --quantize int8``); int8 in ``MatMulNBits`` with int8
  activations (``--int8-matmul``, accuracy level 4); and exact int8 products in MatMulNBits
  (accuracy level 0);
- ExecuTorch (``torch.export`` → ``to_edge_transform_and_lower`` with the XNNPACK partitioner →
  ``.pte``, run by ``executorch.runtime``): fp32; int8 weight-only (``dequantize_per_channel``
  before each linear, the QDQ form XNNPACK's partitioner reads).

Each form decodes a 16-token prompt and 128 greedy tokens (``StepDriver``, the prompt fed one
token a step) at batch 1 and 8; its tokens are compared with the oracle's (the reference on the
same, dequantized, weights), and its file size and export time recorded. Writes
``runtimes.json`` and ``runtimes.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PROMPT, NEW = 16, 128


def _timed(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _onnx_forms(model: Any, int8: Any, work: Path) -> dict[str, tuple[Callable, Path, float]]:
    import onnxruntime as ort

    from wiola.export import onnx as wonnx

    out = {}
    forms = [("fp32", model, False, 4), ("int8 stored, dequantized at load", int8, False, 4)]
    forms += [("int8 MatMulNBits, int8 activations", int8, True, 4), ("int8 MatMulNBits, exact", int8, True, 0)]
    for name, m, nbits, level in forms:
        folder = work / f"ort-{len(out)}"
        t0 = time.perf_counter()
        wonnx.export_onnx(m, folder, int8_matmul=nbits, accuracy_level=level)
        seconds = time.perf_counter() - t0
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        out[name] = (lambda inputs, s=session: s.run(None, inputs), folder / "model.onnx", seconds)
    return out


def _executorch_forms(model: Any, int8: Any, work: Path, batch: int) -> dict[str, tuple[Callable, Path, float]]:
    import executorch.kernels.quantized  # noqa: F401  (the out variants of dequantize_per_channel)
    import torch.ao.quantization.fx._decomposed
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from wiola.export.runner import INPUT_NAMES
    from wiola.export.step import DecodeStep, PackedMatrix

    class WeightOnlyInt8(PackedMatrix):
        """dequantize_per_channel + linear: the pattern XNNPACK's partitioner reads."""

        def __init__(self, packed: PackedMatrix) -> None:
            torch.nn.Module.__init__(self)
            self.register_buffer("weight", packed.weight)
            self.register_buffer("scale", packed.scale)
            self.register_buffer("zero_point", torch.zeros(packed.weight.shape[0], dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = torch.ops.quantized_decomposed.dequantize_per_channel.default(
                self.weight, self.scale, self.zero_point, 0, -127, 127, torch.int8
            )
            return F.linear(x, w)

    out = {}
    for name, m in (("fp32", model), ("int8 weight-only", int8)):
        step = DecodeStep(m).eval()
        if name != "fp32":
            step.embed = WeightOnlyInt8(step.embed)
            for mats in step.matrices:
                for key in list(mats.keys()):
                    mats[key] = WeightOnlyInt8(mats[key])
        t0 = time.perf_counter()
        program = torch.export.export(step, step.example_inputs(batch, PROMPT + NEW))  # static shapes
        lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
        path = work / f"et-{len(out)}-B{batch}.pte"
        path.write_bytes(lowered.buffer)
        seconds = time.perf_counter() - t0
        method = Runtime.get().load_program(str(path)).load_method("forward")

        def run(inputs: dict, method: Any = method) -> list[np.ndarray]:
            outs = method.execute([torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in INPUT_NAMES])
            return [o.numpy() for o in outs]

        out[name] = (run, path, seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from wiola import WiolaConfig, WiolaModel
    from wiola.export.runner import StepDriver
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    torch.manual_seed(0)
    model = FastModel(WiolaConfig.preset("13m")).eval().requires_grad_(False)
    int8 = quantize(copy.deepcopy(model), "int8")
    c = model.config
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        forms: dict[tuple[str, int], dict] = {}
        ort_forms = _onnx_forms(model, int8, work)
        for batch in (1, 8):
            forms[("onnxruntime", batch)] = ort_forms
            try:
                forms[("executorch", batch)] = _executorch_forms(model, int8, work, batch)
            except ImportError as exc:
                print(f"ExecuTorch unavailable: {exc}", file=sys.stderr)
        for (runtime, batch), table in forms.items():
            gen = torch.Generator().manual_seed(1234 + batch)
            ids = torch.randint(0, c.vocab_size, (batch, PROMPT), generator=gen)
            for name, (run, path, seconds) in table.items():
                source = int8 if "int8" in name else model
                oracle = WiolaModel(c).eval()
                oracle.load_state_dict(source.state_dict())
                want = oracle.generate(ids, NEW, temperature=0).numpy()
                driver = StepDriver(
                    run, n_layers=c.n_layers, n_heads=c.n_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                    max_seq_len=c.max_seq_len,
                )  # fmt: skip
                prompt = ids.numpy()
                got = driver.generate(prompt, NEW)
                same = got[:, PROMPT:] == want[:, PROMPT:]
                t = _timed(lambda d=driver, x=prompt: d.generate(x, NEW))
                rows.append(
                    {
                        "runtime": runtime,
                        "form": name,
                        "batch": batch,
                        "tokens_per_s": batch * NEW / t,
                        "identical_to_oracle": bool(same.all()),
                        "tokens_before_first_difference": np.cumprod(same, axis=1).sum(axis=1).tolist(),
                        "file_mb": path.stat().st_size / 1e6,
                        "export_s": seconds,
                    }
                )
                r = rows[-1]
                print(
                    f"{runtime:11s} {name:38s} B{batch}: {r['tokens_per_s']:7.1f} tok/s, identical "
                    f"{r['identical_to_oracle']}, {r['file_mb']:.1f} MB, export {seconds:.1f} s",
                    file=sys.stderr,
                )
    versions = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for package in ("onnxruntime", "onnx", "onnxscript", "executorch"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = None
    from wiola.fast.decode_step_cpu import cpu_info

    cpu = cpu_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtimes.json").write_text(json.dumps({"env": versions, "cpu": cpu, "rows": rows}, indent=2) + "\n")
    lines = [
        f"13m preset, random weights; {PROMPT}-token prompt fed one token a step, {NEW} greedy tokens; "
        f"{cpu['name']}, {versions['threads']} threads; " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        "",
        "| runtime | weights | batch | tok/s | tokens identical to the oracle | file MB | export s |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['runtime']} | {r['form']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
            f"{'yes' if r['identical_to_oracle'] else 'no (first difference after ' + str(min(r['tokens_before_first_difference'])) + ')'} | "
            f"{r['file_mb']:.1f} | {r['export_s']:.1f} |"
        )
    (args.out / "runtimes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
