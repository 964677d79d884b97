"""``wiola chat``: a streaming chat in the terminal with a checkpoint (or LoRA folder), through
its chat template (``wiola.chat``).

The history is kept within the model's ``max_seq_len`` (the oldest turns are dropped, and
that is said once); ``/reset`` clears it, ``/exit`` or Ctrl-D leaves, Ctrl-C ends the reply
being written (and keeps what was shown of it), not the session. A reply ends at eos, or at the
template's own end-of-turn marker (ChatML's ``<|im_end|>``) where its turns end with one; the
marker is not shown. A template that does not compile is refused before the first turn.
"""

from __future__ import annotations

import argparse
import sys

from wiola.cli.arguments import non_empty, seed

HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) leaves, /help; Ctrl-C stops a reply"
DEFAULT_MAX_NEW_TOKENS = 200  # clamped to half the model's context when that is shorter


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (its chat template, streamed)")
    p.add_argument("--checkpoint", type=non_empty, required=True, metavar="DIR", help="a checkpoint or a LoRA folder")
    p.add_argument(
        "--base",
        metavar="CHECKPOINT",
        help="a LoRA folder's base (default: the one it names; refused for a full model)",
    )
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"reply length limit (default {DEFAULT_MAX_NEW_TOKENS}, or half the model's context if that is less)",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--fast", action="store_true", help="wiola.fast (the C++ CPU step for a plain checkpoint)")
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    import torch

    from wiola.chat import check_chat_template, check_messages, turn_end_marker
    from wiola.cli.arguments import check_sampling_flags
    from wiola.train.finetune import load_finetuned

    check_sampling_flags(args.temperature, args.top_k, args.top_p)  # before the model loads
    model, tokenizer = load_finetuned(args.checkpoint, base=args.base, fast=args.fast)
    limit = model.config.max_seq_len
    if args.max_new_tokens is None:  # the default leaves the prompt half of a short context
        args.max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, max(1, limit // 2))
    if not 0 < args.max_new_tokens < limit:
        raise ValueError(
            f"--max-new-tokens must be in [1, {limit - 1}] (max_seq_len={limit}), got {args.max_new_tokens}"
        )
    system = [{"role": "system", "content": args.system}] if args.system else []
    check_messages(system or [{"role": "user", "content": ""}])
    generator = torch.Generator().manual_seed(args.seed)
    template = "its own" if tokenizer.chat_template else "wiola's default"
    try:
        check_chat_template(tokenizer)
    except ValueError as e:
        raise ValueError(f"{args.checkpoint}: {e}") from e
    if system:  # kept whole in every prompt (fit_history drops turns, never it): it must leave room for one
        from wiola.chat import apply_chat_template

        budget = limit - args.max_new_tokens
        need = len(
            apply_chat_template(tokenizer, [*system, {"role": "user", "content": ""}], add_generation_prompt=True)
        )
        if need > budget:
            raise ValueError(
                f"--system takes {need} tokens with the template and an empty first turn; the model has room for "
                f"{budget} ({limit} tokens of context less --max-new-tokens {args.max_new_tokens}): shorten it or "
                "lower --max-new-tokens"
            )
    stop_text = turn_end_marker(tokenizer)
    ends = f", whose turns end at {stop_text!r}" if stop_text else ""
    print(f"wiola chat: {args.checkpoint} ({template} chat template{ends}, {limit} tokens of context). {HELP}")
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
        command = text.split()[0]  # a command's first word names it; words after it are ignored
        if command == "/exit":
            return 0
        if command == "/reset":
            history = []
            print("(conversation cleared)")
            continue
        if command == "/help":
            print(f"({HELP})")
            continue
        if text.startswith("/"):
            print(f"(unknown command {command}; {HELP})")
            continue
        try:
            history, dropped = _reply(model, tokenizer, system, history, text, args, generator, stop_text)
        except KeyboardInterrupt:  # before the reply began: the turn is dropped, the session goes on
            print(" [stopped]")
            continue
        if dropped and not said_dropped:
            print(f"(older turns were dropped to fit the model's {limit}-token context; this is said once)")
            said_dropped = True


def _reply(model, tokenizer, system, history, text, args, generator, stop_text) -> tuple[list[dict[str, str]], int]:
    """Stream one answer to ``text`` (ending at eos or ``stop_text``); returns the history with
    both turns and the turns dropped. Ids the tokenizer has no text for (padded embedding rows)
    are said after the reply, not dropped silently."""
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
    answer, textless = "", []
    try:
        for token, piece in stream_reply(
            model,
            tokenizer,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
            stop_text=stop_text,
        ):
            textless += [token] if token >= tokenizer.vocab_size else []
            answer += piece
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    print()
    if textless:
        left_out = "" if answer.strip() else ", and the empty reply is left out of the conversation"
        print(
            f"(note: {len(textless)} generated token(s) (first id {textless[0]}) lie past the {tokenizer.vocab_size:,} "
            f"ids of tokenizer {tokenizer.name!r}, so have no text{left_out}: does this tokenizer belong to this model?)"
        )
    kept = kept[len(system) :]
    return ([*kept, {"role": "assistant", "content": answer}] if answer.strip() else kept[:-1]), dropped
