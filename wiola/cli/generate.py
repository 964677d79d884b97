"""``wiola generate``: stream text from a checkpoint (``wiola.fast`` by default), encoded and
decoded with the checkpoint's own tokenizer, stopping at the checkpoint's eos or a ``--stop`` text.

One prompt (``--prompt``) streams as it decodes; many (``--prompt-file FILE`` or ``-`` for stdin,
one a line or JSONL, each ``--num-samples`` times) run as one left-padded batch and print when done,
with a progress bar on a terminal only. ``--json`` prints one object a sample."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from wiola.cli.arguments import add_checkpoint_arguments, check_sampling_flags, non_empty_path, seed, top_k


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import PRESETS

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    add_checkpoint_arguments(p, help="model folder (ours or wiola13m's), a training run folder, or a Hub id (org/name)")
    p.add_argument(
        "--tokenizer", type=non_empty_path, help="gpt2, gpt2-32k or a tokenizer.json path (default: the checkpoint's)"
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="random model when no checkpoint")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default="Once upon a time")
    prompts.add_argument(
        "--prompt-file", type=non_empty_path, metavar="FILE",
        help='many prompts run as one left-padded batch: one a line, or JSONL ({"prompt": ...}); - reads stdin',
    )  # fmt: skip
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (rows of the batch)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop a sample at this text (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object a sample: ids, text, finish_reason, tokens/s")
    p.add_argument("--no-echo", action="store_true", help="print only the new text, not the prompt")
    p.add_argument("--max-new-tokens", type=int, default=100, help="new tokens a sample")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy")
    p.add_argument(
        "--top-k", type=top_k, default=None, help="sample from the k likeliest tokens only; 0: no top-k filter"
    )
    p.add_argument(
        "--top-p", type=float, default=0.95, help="sample from the likeliest tokens holding this probability"
    )
    p.add_argument("--seed", type=seed, default=0, help="the sampler's seed")
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


def load_model(args: argparse.Namespace):
    """(model, tokenizer) of ``--checkpoint`` (``--revision``, ``--tokenizer``, ``--device``, ``--fast``) (or a random ``--preset`` model and its tiktoken encoding)."""
    from wiola import WiolaConfig, WiolaModel
    from wiola.checkpoint import load_checkpoint_tokenizer, quantization_of, resolve_checkpoint
    from wiola.tokenizer import TiktokenTokenizer, encoding_for_vocab, load_tokenizer

    device = torch.device(args.device)  # a name torch does not know: its own error, one line
    if device.type == "cuda" and not torch.cuda.is_available():  # torch would assert deep inside .to()
        raise ValueError(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    cls = WiolaModel
    if getattr(args, "fast", False):
        from wiola.fast import WiolaModel as cls
    if args.checkpoint:
        path = resolve_checkpoint(args.checkpoint, args.revision)  # a run folder: its latest checkpoint
        scheme = quantization_of(path)
        if scheme is not None and not getattr(args, "fast", False):
            raise ValueError(f"drop --reference: {path} holds {scheme}-quantized weights, which run on the fast model")
        model = cls.from_pretrained(path, device=args.device)
        c = model.config
        if args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer).with_special_ids(c.bos_token_id, c.eos_token_id, c.pad_token_id)
        else:
            tokenizer = load_checkpoint_tokenizer(path, tokenizer_flag="--tokenizer")
        tokenizer.check_fits(c.vocab_size)
        return model, tokenizer
    torch.manual_seed(args.seed)
    print(f"no --checkpoint: a randomly initialised {args.preset!r} model (its text is noise)", file=sys.stderr)
    model = cls(WiolaConfig.preset(args.preset)).to(args.device)
    return model, load_tokenizer(args.tokenizer) if args.tokenizer else TiktokenTokenizer(
        encoding_for_vocab(model.config.vocab_size)
    )


def quantize_model(model, scheme: str | None):
    """``model`` quantized with ``scheme`` (a no-op for a checkpoint already quantized with it);
    ``ValueError`` where it cannot be (another scheme already, the reference model, a GPU)."""
    current = getattr(model, "quantization", None)
    if scheme is None or current == scheme:
        return model
    if current is not None:
        raise ValueError(f"the checkpoint is {current}-quantized; --quantize {scheme} cannot redo it")
    from wiola.fast import WiolaModel
    from wiola.fast.quantize import quantize

    if not isinstance(model, WiolaModel):
        raise ValueError("--quantize runs on wiola.fast (drop --reference)")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("--quantize is for the CPU step (use --device cpu)")
    return quantize(model.eval().requires_grad_(False), scheme)


def read_prompts(spec: str, stdin: TextIO | None = None) -> list[str]:
    """Prompts of ``--prompt-file``: a path, or ``-`` for stdin. One prompt a line (blank lines
    skipped), or JSONL when the first non-blank line starts with ``{`` or ``"`` (objects with a
    ``"prompt"`` string, or JSON strings). ``ValueError`` naming the line for anything else."""
    if spec == "-":
        text = (stdin or sys.stdin).read()
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {spec} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {spec} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompt-file {spec} holds no prompt")
    if lines[0][1].lstrip()[:1] not in ("{", '"'):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt-file {spec} line {n} is not JSON ({e.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f'--prompt-file {spec} line {n}: want a JSON string or an object with a "prompt" string')
        prompts.append(prompt)
    return prompts


def encode_batch(enc, prompts: list[str], vocab_size: int, samples: int, device: str):
    """``(ids, attention_mask, rows)``: every prompt ``samples`` times, left-padded into ``(B, T)``
    int64 tensors; ``rows`` the per-row prompt ids. ``ValueError`` for an empty or out-of-vocabulary prompt."""
    rows = []
    for i, text in enumerate(prompts):
        ids = enc.encode(text)
        if not text or not ids:
            raise ValueError(f"prompt {i + 1} is empty" if len(prompts) > 1 else "the prompt is empty")
        enc.check_ids(ids, vocab_size)
        rows += [ids] * samples
    width = max(len(r) for r in rows)
    pad = next((t for t in (enc.pad_token_id, enc.eos_token_id) if t is not None), 0)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask, rows


def finish(row: list[int], eos: int | None, enc, stops: list[str]) -> tuple[list[int], str, str]:
    """A row's new ids up to eos or a stop string, its text (cut before the stop string) and its
    finish reason (``stop`` or ``length``, as OpenAI's API names them).

    The stop strings are looked for in the ids before the first eos: a row that a stop string
    ended is padded after it with the pad id, which is eos itself for a tokenizer without a pad
    token (GPT-2's), so that eos follows the stop text rather than replacing it."""
    from wiola.generation import find_stop

    reason = "length"
    if eos is not None and eos in row:
        row, reason = row[: row.index(eos)], "stop"
    for n in range(1, len(row) + 1) if stops else ():
        text = enc.decode(row[:n])
        cut = find_stop(text, stops)
        if cut is not None:
            return row[:n], text[:cut], "stop"
    return row, enc.decode(row), reason


class _Printer:
    """Streams one row's text to stdout as tokens arrive through ``wiola.text_stream.TextStream``
    (the server's): partial UTF-8 characters, text that could still become a stop string and text
    a later token's decoding may rewrite (a tokenizer's clean-up of spaces) are held back, so the
    printed chunks join to the row's text. The row ends at eos (whose text, such as
    ``<|endoftext|>``, is never printed) or at a stop string; later tokens (the pad id) are ignored.
    ``rest()`` is what was held back, once the row has ended."""

    def __init__(self, enc, stops: list[str], eos: int | None) -> None:
        from wiola.text_stream import TextStream

        self.stream, self.eos, self.ended = TextStream(enc, stops), eos, False

    def __call__(self, token: torch.Tensor) -> None:
        if self.ended:
            return
        token_id = int(token[0])
        if token_id == self.eos:
            self.ended = True
            return
        chunk = self.stream.add(token_id)
        self.ended = self.stream.stopped
        if chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()

    def rest(self) -> str:
        return self.stream.rest()


def _generate(args: argparse.Namespace) -> int:
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    check_sampling_flags(args.temperature, args.top_k, args.top_p, args.stop)  # before the model loads
    prompts = read_prompts(args.prompt_file) if args.prompt_file else [args.prompt]
    model, enc = load_model(args)
    model = quantize_model(model.eval(), getattr(args, "quantize", None))
    from wiola.generation import check_generate_inputs

    if args.fast and torch.device(args.device).type == "cpu":  # which path decodes, in one line
        from wiola.fast.ops import describe_cpu_decoding

        scheme = getattr(model, "quantization", None)
        print(f"CPU decoding: {describe_cpu_decoding(model)}{f', {scheme} weights' if scheme else ''}", file=sys.stderr)
    ids, mask, rows = encode_batch(enc, prompts, model.config.vocab_size, args.num_samples, args.device)
    # generate's own checks (a prompt plus --max-new-tokens past max_seq_len), before the prompt is echoed
    check_generate_inputs(model, ids, args.max_new_tokens, None if len(rows) == 1 else mask)
    printer = _Printer(enc, args.stop or [], enc.eos_token_id) if len(rows) == 1 and not args.json else None
    if printer is not None and not args.no_echo:  # shown now, not with the first whole character
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    progress = None
    if printer is None and sys.stderr.isatty():  # a batch: a progress bar, on a terminal only
        from tqdm import tqdm

        progress = tqdm(total=args.max_new_tokens, unit="step", file=sys.stderr, leave=False)
    start = time.perf_counter()
    out = model.generate(
        ids, args.max_new_tokens, attention_mask=None if len(rows) == 1 else mask,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=enc.eos_token_id,
        pad_token_id=enc.pad_token_id, generator=torch.Generator(device=args.device).manual_seed(args.seed),
        streamer=printer if progress is None else (lambda _: progress.update()),
        stop_strings=args.stop, tokenizer=enc,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return _report(args, prompts, rows, out[:, ids.shape[1] :].tolist(), enc, elapsed, printer)


def _report(args, prompts: list[str], rows: list[list[int]], new_rows, enc, elapsed: float, printer) -> int:
    """Print each sample (its text, or one JSON object a line with ``--json``), then the summary on
    stderr, after a warning when the model generated ids the tokenizer has no text for."""
    total, textless = 0, []
    for i, row in enumerate(new_rows):
        new, text, reason = finish(row, enc.eos_token_id, enc, args.stop or [])
        total += len(new)
        textless += [t for t in new if t >= enc.vocab_size]
        index = i // args.num_samples
        if args.json:
            record = {
                "prompt_index": index, "sample": i % args.num_samples, "prompt": prompts[index],
                "prompt_ids": rows[i], "ids": new, "text": text, "finish_reason": reason,
                "tokens_per_second": round(len(new) / elapsed, 2) if elapsed > 0 else None,
            }  # fmt: skip
            print(json.dumps(record, ensure_ascii=False))
        elif printer is not None:
            sys.stdout.write(printer.rest() + "\n")
        else:
            print(("" if args.no_echo else prompts[index]) + text)
    if textless:  # left out of the text (Tokenizer.decode): said, not dropped silently
        print(
            f"warning: {len(textless)} generated token(s) (first id {textless[0]}) lie past the {enc.vocab_size:,} ids "
            f"of tokenizer {enc.name!r}, so have no text and are left out of it: does this tokenizer belong to this "
            "model?",
            file=sys.stderr,
        )
    rate = total / elapsed if elapsed > 0 else 0.0
    print(f"[{total} tokens in {elapsed:.2f} s, {rate:.1f} tokens/s, {len(new_rows)} samples]", file=sys.stderr)
    return 0
