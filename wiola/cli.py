"""The ``wiola`` command: ``budget`` and ``generate`` here; training sub-commands in ``wiola.cli_train``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def _budget(args: argparse.Namespace) -> int:
    from wiola import WiolaConfig, budget

    config = WiolaConfig.preset(args.preset)
    print(budget(config, args.seq_len).table())
    return 0


def _load_model(args: argparse.Namespace):
    from wiola import WiolaConfig, WiolaModel

    cls = WiolaModel
    if getattr(args, "fast", False):
        from wiola.fast import WiolaModel as cls
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
            from wiola.run_folder import find_checkpoint

            path = find_checkpoint(path)  # a training run folder: its latest checkpoint
        return cls.from_pretrained(path, device=args.device)
    torch.manual_seed(args.seed)
    print(f"no --checkpoint: a randomly initialised {args.preset!r} model (its text is noise)", file=sys.stderr)
    return cls(WiolaConfig.preset(args.preset)).to(args.device)


def _generate(args: argparse.Namespace) -> int:
    from wiola.tokenizer import encoding_for_vocab

    model = _load_model(args).eval()
    if args.fast and torch.device(args.device).type == "cpu":  # which path decodes, in one line
        from kernels.decode_step_cpu import describe

        print(f"CPU decoding: {describe()}", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    from wiola.config import PRESETS

    parser = argparse.ArgumentParser(prog="wiola", description="Wiola small language model")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("budget", help="exact parameter counts and FLOPs per token of a preset")
    p.add_argument("--preset", default="13m", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=512, help="sequence length for attention FLOPs")
    p.set_defaults(func=_budget)

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

    try:
        from wiola.cli_train import register
    except ImportError:
        pass
    else:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError, TypeError) as e:
        print(f"wiola {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
