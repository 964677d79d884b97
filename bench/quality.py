"""Quality of the on-device forms of a trained checkpoint (issue 15): validation loss, bits per
byte and greedy agreement of fp32, bf16, int8 and int4 weights, in our CPU step and in the ONNX
Runtime export, side by side.

    python -m bench.quality CHECKPOINT [CHECKPOINT ...] --out DIR [--windows 16] [--seq-len 256]

For each checkpoint (a model folder or a run folder) and its own tokenizer:

- the validation windows of the sample corpus (``--data sample``'s held-out split) are scored
  token by token through a decoding step with a cache: ``wiola.fast.WiolaModel`` one token a
  call (the C++ step on this CPU) for fp32, bf16, int8 and int4 weights, and the ONNX export run
  by ONNX Runtime (fp32, bf16, int8 and int4 stored and dequantized at load, and ``--int8-matmul``
  for int8 and int4: MatMulNBits with int8 activations);
- the reference's full pass in fp32 (``wiola.train.evaluate``) is the row they are read against;
- next-token distributions against the fp32 reference's, over every scored position, as
  llama.cpp's ``perplexity --kl-divergence`` reports them: the KL divergence
  ``KL(p_fp32 ‖ p_form) = Σ_v p_fp32(v) (log p_fp32(v) − log p_form(v))`` per position (mean
  with its standard error, median, 99th percentile, max), "same top token" (the share of
  positions whose argmax equals the reference's) and Δ loss (the form's mean next-token loss
  minus fp32's);
- greedy agreement: 8 prompts (the first 16 tokens of validation windows), ``--new-tokens``
  greedy tokens each (default 256, no stop at eos), each form against the fp32 reference: the
  tokens before the first difference (mean and minimum over the prompts) and the share of
  positions that hold the same token.

Writes ``quality.json`` and ``quality.md`` (the table the README quotes) into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PROMPTS, PROMPT_LEN = 8, 16


def _nll_sums(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1), reduction="sum"))


def loss_columns(logits: torch.Tensor, targets: torch.Tensor, n_bytes: int, fp32_loss: float) -> dict[str, float]:
    """A form's validation columns: its mean loss (nats a target), bits per byte of the targets'
    text (``n_bytes``) and the loss's difference from the fp32 reference's (positive: worse)."""
    nats = _nll_sums(logits, targets)
    loss = nats / targets.numel()
    return {"val_loss": loss, "bits_per_byte": nats / math.log(2) / n_bytes, "delta_loss_vs_fp32": loss - fp32_loss}


@torch.inference_mode()
def step_logits(model: Any, x: torch.Tensor) -> torch.Tensor:
    """``(B, T, V)`` logits of ``x`` fed one token a call through ``model``'s cache (the C++ step)."""
    B, T = x.shape
    cache = model.new_cache(B, T)
    out = [model(x[:, t : t + 1], cache=cache).logits[:, -1] for t in range(T)]
    return torch.stack(out, dim=1)


def runtime_logits(runtime: Any, x: torch.Tensor) -> torch.Tensor:
    logits: list[np.ndarray] = []
    runtime.driver.generate(x.numpy(), 0, logits_out=logits)
    return torch.from_numpy(np.stack(logits, axis=1))


def kl_statistics(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 4096) -> dict[str, float]:
    """Per-position ``KL(softmax(ref) ‖ softmax(logits))`` in nats, over ``(..., V)`` logits (float64
    sums, ``chunk`` positions at a time): mean, its standard error, median, 99th percentile, max,
    and the percentage of positions whose top token is the reference's."""
    ref_logits, logits = ref_logits.reshape(-1, ref_logits.shape[-1]), logits.reshape(-1, logits.shape[-1])
    kls, same = [], 0
    for start in range(0, ref_logits.shape[0], chunk):
        lp = torch.log_softmax(ref_logits[start : start + chunk].double(), -1)
        lq = torch.log_softmax(logits[start : start + chunk].double(), -1)
        kls.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))  # >= 0 up to rounding
        same += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    kl = torch.cat(kls)
    n = kl.numel()
    return {
        "kl_mean": float(kl.mean()),
        "kl_mean_stderr": float(kl.std() / math.sqrt(n)) if n > 1 else 0.0,
        "kl_median": float(kl.quantile(0.5)),
        "kl_p99": float(kl.quantile(0.99)),
        "kl_max": float(kl.max()),
        "same_top_pct": 100.0 * same / n,
    }


def agreement(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    same = got[:, PROMPT_LEN:] == ref[:, PROMPT_LEN:]
    first = same.cumprod(dim=1).sum(dim=1).double()
    return {
        "mean_before_diff": float(first.mean()),
        "min_before_diff": int(first.min()),
        "same_pct": 100 * float(same.double().mean()),
    }


def measure(checkpoint: Path, windows: int, seq_len: int, new_tokens: int, work: Path) -> dict[str, Any]:
    from wiola import WiolaModel
    from wiola.checkpoint import load_checkpoint_tokenizer, resolve_checkpoint
    from wiola.export.onnx import export_onnx
    from wiola.export.runner import OnnxModel
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast import ops as fast_ops
    from wiola.fast.quantize import quantize
    from wiola.train.evaluate import evaluate, target_bytes, token_byte_lengths
    from wiola.train.sources import resolve_source
    from wiola.train.token_cache import prepare_data

    checkpoint = resolve_checkpoint(checkpoint)  # a run folder: its latest checkpoint
    tokenizer = load_checkpoint_tokenizer(checkpoint)
    reference = WiolaModel.from_pretrained(checkpoint).eval()
    data = prepare_data(resolve_source("sample"), tokenizer, work / "tokens", progress=False, log=lambda *a: None)
    lengths = token_byte_lengths(tokenizer)
    full = evaluate(reference, data.val, lengths, seq_len, batch_size=windows, max_windows=windows, precision="fp32")
    vals = torch.from_numpy(data.val.read(0, windows * seq_len + 1))
    x = torch.stack([vals[i * seq_len : (i + 1) * seq_len + 1] for i in range(windows)])  # (W, T + 1)
    inputs, targets = x[:, :-1], x[:, 1:]
    with torch.inference_mode():  # the reference's full-pass distributions, one window at a time
        ref_logits = torch.cat([reference(inputs[i : i + 1]).logits for i in range(windows)])
    n_bytes = int(target_bytes(lengths, x).sum())  # a Metaspace tokenizer's table has a row for documents' first tokens
    prompts = x[:PROMPTS, :PROMPT_LEN]
    want = reference.generate(prompts, new_tokens, temperature=0, eos_token_id=None)  # as the runtimes: no eos

    def row(form: str, where: str, logits: torch.Tensor, tokens: torch.Tensor, extra: dict | None = None) -> dict:
        return {
            "form": form,
            "runs_in": where,
            **loss_columns(logits, targets, n_bytes, full.loss),
            "next_token": kl_statistics(ref_logits, logits),
            "greedy": agreement(want, tokens),
            **(extra or {}),
        }

    rows = [
        {
            "form": "fp32",
            "runs_in": "reference full pass (PyTorch)",
            "val_loss": full.loss,
            "bits_per_byte": full.bits_per_byte,
            "delta_loss_vs_fp32": 0.0,
            "next_token": kl_statistics(ref_logits, ref_logits),
            "greedy": agreement(want, want),
        }
    ]
    fp32 = FastModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    for scheme in ("fp32", "bf16", "int8", "int4"):
        model = fp32 if scheme == "fp32" else quantize(copy.deepcopy(fp32), scheme)
        t0 = time.perf_counter()
        logits = step_logits(model, inputs)
        with torch.inference_mode():
            tokens = model.generate(prompts, new_tokens, temperature=0, eos_token_id=None)
        rows.append(
            row(
                scheme,
                f"our step ({fast_ops.describe_cpu_decoding(model)})",
                logits,
                tokens,
                {"seconds": time.perf_counter() - t0},
            )
        )
        forms = [(scheme, False)] + ([(f"{scheme}-matmul", True)] if scheme in ("int8", "int4") else [])
        for form, int8_matmul in forms:
            folder = work / f"onnx-{checkpoint.parent.parent.name}-{form}"
            export_onnx(model, folder, tokenizer, int8_matmul=int8_matmul)
            runtime = OnnxModel(folder, threads=torch.get_num_threads())
            t0 = time.perf_counter()
            logits = runtime_logits(runtime, inputs)
            tokens = torch.from_numpy(runtime.generate(prompts.numpy(), new_tokens, eos_token_id=None))
            mb = (folder / "model.onnx").stat().st_size / 1e6
            rows.append(
                row(form, "ONNX Runtime export", logits, tokens, {"seconds": time.perf_counter() - t0, "export_mb": mb})
            )
    config = reference.config
    return {
        "checkpoint": str(checkpoint),
        "model": {"parameters": reference.num_parameters(), "d_model": config.d_model, "n_layers": config.n_layers},
        "tokenizer": tokenizer.name,
        "validation": {"windows": windows, "seq_len": seq_len, "targets": int(targets.numel()), "bytes": n_bytes},
        "greedy": {"prompts": int(prompts.shape[0]), "prompt_tokens": PROMPT_LEN, "new_tokens": new_tokens},
        "rows": rows,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        v, g = res["validation"], res["greedy"]
        lines += [
            f"**{res['checkpoint']}** ({res['model']['parameters']:,} parameters, tokenizer {res['tokenizer']}): "
            f"{v['windows']} validation windows × {v['seq_len']} tokens ({v['targets']:,} targets, {v['bytes']:,} bytes); "
            f"greedy: {g['prompts']} prompts × {g['new_tokens']} new tokens against the fp32 reference.",
            "",
            "| weights | runs in | val loss | Δ loss | bits/byte | mean KLD | 99% KLD | same top token "
            "| greedy: tokens before the first difference (mean / min) | same tokens |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in res["rows"]:
            a, k = r["greedy"], r["next_token"]
            lines.append(
                f"| {r['form']} | {r['runs_in']} | {r['val_loss']:.4f} | {r['delta_loss_vs_fp32']:+.4f} | "
                f"{r['bits_per_byte']:.4f} | {k['kl_mean']:.2e} ± {k['kl_mean_stderr']:.1e} | {k['kl_p99']:.2e} | "
                f"{k['same_top_pct']:.2f}% | {a['mean_before_diff']:.0f} / {a['min_before_diff']} | {a['same_pct']:.1f}% |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    from wiola.checkpoint import CONFIG_FILE, read_config, resolve_checkpoint

    for flag in ("windows", "seq_len", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file, not a folder")
    resolved = []  # every checkpoint found, and the lengths checked against it, before any work or folder is made
    for checkpoint in args.checkpoints:
        try:
            folder = resolve_checkpoint(checkpoint)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            p.error(str(e))
        if not (folder / CONFIG_FILE).is_file():
            p.error(f"{checkpoint}: not a checkpoint (no {CONFIG_FILE}) nor a run folder holding one")
        positions = read_config(folder)[0].max_seq_len
        if args.seq_len + 1 > positions:  # a window is seq_len inputs and their seq_len targets
            p.error(f"--seq-len {args.seq_len} + 1 is past {checkpoint}'s {positions} positions")
        if PROMPT_LEN + args.new_tokens > positions:
            p.error(
                f"{PROMPT_LEN} prompt + --new-tokens {args.new_tokens} is past {checkpoint}'s {positions} positions"
            )
        resolved.append(folder)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for checkpoint in resolved:
            print(f"measuring {checkpoint} ...", file=sys.stderr)
            results.append(measure(checkpoint, args.windows, args.seq_len, args.new_tokens, Path(tmp)))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    try:
        import onnxruntime

        env["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    (args.out / "quality.json").write_text(json.dumps({"env": env, "results": results}, indent=2) + "\n")
    table = markdown(results)
    (args.out / "quality.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
