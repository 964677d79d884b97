"""``wiola serve``: an OpenAI-compatible HTTP server for a checkpoint (``wiola.serve``)."""

from __future__ import annotations

import argparse
import math
import sys

import torch

from wiola.cli.arguments import add_checkpoint_arguments, non_empty_path
from wiola.serve.protocol import BODY_SECONDS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-compatible, continuous batching)")
    add_checkpoint_arguments(p, help="model folder, a training run folder, or a Hub id (org/name)", required=True)
    p.add_argument(
        "--tokenizer", type=non_empty_path, help="gpt2, gpt2-32k or a tokenizer.json path (default: the checkpoint's)"
    )
    p.add_argument(
        "--quantize", choices=("int8", "int4", "bf16"), help="weight-only int8, int4 or bf16 matrices for the C++ step"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="rows decoding at once (continuous batching)")
    p.add_argument(
        "--body-timeout", type=float, default=BODY_SECONDS, metavar="SECONDS",
        help="a request body that has not arrived in this long is a 408, so a stalled client holds no "
        f"connection and does not keep a shutdown waiting (default {BODY_SECONDS:g})",
    )  # fmt: skip
    p.add_argument("--model-name", help="the model id the API reports (default: the checkpoint's folder name)")
    p.add_argument("--device", default="cpu", help="cpu (the C++ step) or cuda")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_serve, fast=True, preset="tiny", seed=0)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from wiola.cli.generate import load_model, quantize_model
    from wiola.serve import listening_socket, serve

    for module in ("starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError as e:
            raise RuntimeError(
                f"serving needs the `{module}` package, which cannot be imported ({e}); "
                "install the serve extra: pip install 'wiola-slm[serve]'"
            ) from e
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not (math.isfinite(args.body_timeout) and args.body_timeout > 0):
        raise ValueError(f"--body-timeout must be a positive number of seconds, got {args.body_timeout}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:  # a port in use is bad input, said before the model loads; the socket is the one served
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    with sock:
        model, tokenizer = load_model(args)
        model = quantize_model(model.eval().requires_grad_(False), args.quantize)
        name = args.model_name or Path(str(args.checkpoint).rstrip("/")).name
        scheme = getattr(model, "quantization", None) or str(next(model.parameters()).dtype).removeprefix("torch.")
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        print(f"wiola serve: {name} ({scheme}) on http://{args.host}:{port}, up to {args.max_batch} rows",
              file=sys.stderr)  # fmt: skip
        with torch.inference_mode():
            serve(model, tokenizer, model_name=name, host=args.host, port=port, max_batch=args.max_batch,
                  log_level=args.log_level, sock=sock, body_seconds=args.body_timeout)  # fmt: skip
    return 0
