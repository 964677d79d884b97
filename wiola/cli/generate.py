"""``wiola generate``: stream text from a checkpoint (``wiola.fast`` by default)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import PRESETS

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", help="model folder (ours or wiola13m's) or a training run folder")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="random model when no checkpoint")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    impl = p.add_mutually_exclusive_group()
    impl.add_argument(
        "--fast", dest="fast", action="store_true", default=True,
        help="wiola.fast (the default): fused kernels on CUDA, one C++ call per token on a CPU",
    )  # fmt: skip
    impl.add_argument("--reference", dest="fast", action="store_false", help="the readable reference model")
    p.set_defaults(func=_generate)


def _load_model(args: argparse.Namespace):
    from wiola import WiolaConfig, WiolaModel

    cls = WiolaModel
    if getattr(args, "fast", False):
        from wiola.fast import WiolaModel as cls
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
            from wiola.train.run_folder import find_checkpoint

            path = find_checkpoint(path)  # a training run folder: its latest checkpoint
        return cls.from_pretrained(path, device=args.device)
    torch.manual_seed(args.seed)
    print(f"no --checkpoint: a randomly initialised {args.preset!r} model (its text is noise)", file=sys.stderr)
    return cls(WiolaConfig.preset(args.preset)).to(args.device)


def _generate(args: argparse.Namespace) -> int:
    from wiola.tokenizer import encoding_for_vocab

    model = _load_model(args).eval()
    enc = encoding_for_vocab(model.config.vocab_size)
    ids = enc.encode(args.prompt, allowed_special="all")
    if not ids:
        raise SystemExit("wiola generate: the prompt is empty")
    prompt = torch.tensor([ids], device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    new: list[int] = []
    printed = 0

    def stream(token: torch.Tensor) -> None:
        nonlocal printed
        new.append(int(token[0]))
        text = enc.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)

    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    model.generate(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=enc.eot_token,
        generator=generator,
        streamer=stream,
    )
    elapsed = time.perf_counter() - start
    sys.stdout.write(enc.decode(new)[printed:] + "\n")
    print(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0
