"""``wiola generate``: stream text from a checkpoint (``wiola.fast`` by default), encoded and
decoded with the checkpoint's own tokenizer, stopping at the checkpoint's eos."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import PRESETS

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument(
        "--checkpoint", help="model folder (ours or wiola13m's), a training run folder, or a Hub id (org/name)"
    )
    p.add_argument("--revision", help="with a Hub id: a branch, tag or commit")
    p.add_argument("--tokenizer", help="gpt2, gpt2-32k or a tokenizer.json path (default: the checkpoint's)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="random model when no checkpoint")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--quantize", choices=("int8", "int4", "bf16"),
        help="weight-only int8 (per-row scales), int4 (per-group scales) or bf16 matrices for the C++ CPU step",
    )  # fmt: skip
    impl = p.add_mutually_exclusive_group()
    impl.add_argument(
        "--fast", dest="fast", action="store_true", default=True,
        help="wiola.fast (the default): fused kernels on CUDA, one C++ call per token on a CPU",
    )  # fmt: skip
    impl.add_argument("--reference", dest="fast", action="store_false", help="the readable reference model")
    p.set_defaults(func=_generate)


def _load_model(args: argparse.Namespace):
    """(model, tokenizer) of ``--checkpoint`` (or a random ``--preset`` model and its tiktoken encoding)."""
    from wiola import WiolaConfig, WiolaModel
    from wiola.checkpoint import load_checkpoint_tokenizer, resolve_checkpoint
    from wiola.tokenizer import TiktokenTokenizer, encoding_for_vocab, load_tokenizer

    cls = WiolaModel
    if getattr(args, "fast", False):
        from wiola.fast import WiolaModel as cls
    if args.checkpoint:
        path = resolve_checkpoint(args.checkpoint, args.revision)
        if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
            from wiola.train.run_folder import find_checkpoint

            path = find_checkpoint(path)  # a training run folder: its latest checkpoint
        model = cls.from_pretrained(path, device=args.device)
        if args.tokenizer:
            c = model.config
            return model, load_tokenizer(args.tokenizer).with_special_ids(
                c.bos_token_id, c.eos_token_id, c.pad_token_id
            )
        return model, load_checkpoint_tokenizer(path)
    torch.manual_seed(args.seed)
    print(f"no --checkpoint: a randomly initialised {args.preset!r} model (its text is noise)", file=sys.stderr)
    model = cls(WiolaConfig.preset(args.preset)).to(args.device)
    return model, load_tokenizer(args.tokenizer) if args.tokenizer else TiktokenTokenizer(
        encoding_for_vocab(model.config.vocab_size)
    )


def _quantize(model, scheme: str | None):
    """``model`` quantized with ``scheme`` (a no-op for a checkpoint already quantized with it)."""
    current = getattr(model, "quantization", None)
    if scheme is None or current == scheme:
        return model
    if current is not None:
        raise SystemExit(f"wiola generate: the checkpoint is {current}-quantized; --quantize {scheme} cannot redo it")
    from wiola.fast import WiolaModel
    from wiola.fast.quantize import quantize

    if not isinstance(model, WiolaModel):
        raise SystemExit("wiola generate: --quantize runs on wiola.fast (drop --reference)")
    if next(model.parameters()).device.type != "cpu":
        raise SystemExit("wiola generate: --quantize is for the CPU step (use --device cpu)")
    return quantize(model.eval().requires_grad_(False), scheme)


def _generate(args: argparse.Namespace) -> int:
    model, enc = _load_model(args)
    model.eval()
    model = _quantize(model, getattr(args, "quantize", None))
    if args.fast and torch.device(args.device).type == "cpu":  # which path decodes, in one line
        from wiola.fast.decode_step_cpu import describe

        scheme = getattr(model, "quantization", None)
        print(f"CPU decoding: {describe()}{f', {scheme} weights' if scheme else ''}", file=sys.stderr)
    ids = enc.encode(args.prompt)
    if not ids:
        raise SystemExit("wiola generate: the prompt is empty")
    enc.check_ids(ids, model.config.vocab_size)
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
        eos_token_id=enc.eos_token_id,
        pad_token_id=enc.pad_token_id,
        generator=generator,
        streamer=stream,
    )
    elapsed = time.perf_counter() - start
    sys.stdout.write(enc.decode(new)[printed:] + "\n")
    print(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0
