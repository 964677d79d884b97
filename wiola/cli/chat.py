"""``wiola chat``: a streaming chat in the terminal with a checkpoint (or LoRA folder), through
its chat template (``wiola.chat``).

The history is kept within the model's ``max_seq_len`` (the oldest turns are dropped, and
that is said once); ``/reset`` clears it, ``/exit`` or Ctrl-D leaves, Ctrl-C ends the reply
being written (and keeps what was shown of it), not the session.
"""

from __future__ import annotations

import argparse
import sys

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops a reply"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (its chat template, streamed)")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or a LoRA folder")
    p.add_argument("--base", metavar="CHECKPOINT", help="a LoRA folder's base (default: the one it names)")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast", action="store_true", help="wiola.fast (the C++ CPU step for a plain checkpoint)")
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    import torch

    from wiola.chat import check_messages
    from wiola.cli.arguments import check_sampling_flags
    from wiola.train.finetune import load_finetuned

    check_sampling_flags(args.temperature, args.top_k, args.top_p)  # before the model loads
    model, tokenizer = load_finetuned(args.checkpoint, base=args.base, fast=args.fast)
    limit = model.config.max_seq_len
    if not 0 < args.max_new_tokens < limit:
        raise ValueError(
            f"--max-new-tokens must be in [1, {limit - 1}] (max_seq_len={limit}), got {args.max_new_tokens}"
        )
    system = [{"role": "system", "content": args.system}] if args.system else []
    check_messages(system or [{"role": "user", "content": ""}])
    generator = torch.Generator().manual_seed(args.seed)
    template = "its own" if tokenizer.chat_template else "wiola's default"
    print(f"wiola chat: {args.checkpoint} ({template} chat template, {limit} tokens of context). {HELP}")
    history: list[dict[str, str]] = []
    said_dropped = False
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            history = []
            print("(conversation cleared)")
            continue
        if text.startswith("/"):
            print(f"(unknown command {text.split()[0]}; {HELP})")
            continue
        try:
            history, dropped = _reply(model, tokenizer, system, history, text, args, generator)
        except KeyboardInterrupt:  # before the reply began: the turn is dropped, the session goes on
            print(" [stopped]")
            continue
        if dropped and not said_dropped:
            print(f"(older turns were dropped to fit the model's {limit}-token context; this is said once)")
            said_dropped = True


def _reply(model, tokenizer, system, history, text, args, generator) -> tuple[list[dict[str, str]], int]:
    """Stream one answer to ``text``; returns the history with both turns and the turns dropped."""
    from wiola.chat import fit_history, stream_reply

    budget = model.config.max_seq_len - args.max_new_tokens
    messages = [*system, *history, {"role": "user", "content": text}]
    try:
        prompt, kept, dropped = fit_history(tokenizer, messages, budget)
    except ValueError as e:
        print(f"(cannot answer: {e})")
        return history, 0
    sys.stdout.write("model> ")
    sys.stdout.flush()
    answer = ""
    try:
        for _, piece in stream_reply(
            model,
            tokenizer,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
        ):
            answer += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    print()
    kept = kept[len(system) :]
    return ([*kept, {"role": "assistant", "content": answer}] if answer.strip() else kept[:-1]), dropped
