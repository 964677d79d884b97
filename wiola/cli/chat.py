"""``wiola chat``: a streaming chat in the terminal with a checkpoint (or LoRA folder), through
its chat template (``wiola.chat``).

The history is kept within the model's ``max_seq_len`` (the oldest turns are dropped, and
that is said once); ``/reset`` clears it, ``/exit`` or Ctrl-D leaves, Ctrl-C ends the reply
being written (and keeps what was shown of it), not the session. A reply ends at eos, or at the
template's own end-of-turn marker (ChatML's ``<|im_end|>``) where its turns end with one; the
marker is not shown. A template that does not compile is refused before the first turn, and so
are a system message or ``--max-new-tokens`` that leave no room for a message.

In a terminal, input goes through GNU readline: line editing and history, no limit on a line's
length (the terminal's own line mode cuts lines at 4095 bytes), and bracketed paste, so a pasted
text of several lines is one message, sent with Enter. A line that is not valid in stdin's
encoding (UTF-8) is said and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from wiola.cli.arguments import non_empty, seed, top_k

HELP = (
    "commands: /reset clears the conversation, /exit (or Ctrl-D) leaves, /help; Ctrl-C stops a reply; "
    "a pasted text of several lines is one message"
)
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
    p.add_argument(
        "--top-k", type=top_k, default=50, help="sample from the k likeliest tokens only; 0: no top-k filter"
    )
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
    _check_room(tokenizer, system, limit, args.max_new_tokens)
    stop_text = turn_end_marker(tokenizer)
    ends = f", whose turns end at {stop_text!r}" if stop_text else ""
    print(f"wiola chat: {args.checkpoint} ({template} chat template{ends}, {limit} tokens of context). {HELP}")
    history: list[dict[str, str]] = []
    said_dropped = False
    with _terminal_input():
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            if not _is_text(line):
                encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
                print(f"(that line is not valid {encoding} text, so it was not sent)")
                continue
            text = line.strip()
            if not text:
                continue
            # a command is one line, named by its first word (words after it are ignored); a pasted
            # text of several lines is a message even when it starts with "/"
            command = "" if "\n" in text else text.split()[0]
            if command == "/exit":
                return 0
            if command == "/reset":
                history = []
                print("(conversation cleared)")
                continue
            if command == "/help":
                print(f"({HELP})")
                continue
            if command.startswith("/"):
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


def _check_room(tokenizer, system: list[dict[str, str]], limit: int, max_new_tokens: int) -> None:
    """``ValueError`` (one line) when the prompt of an empty first message, with the system
    message, does not fit in ``limit - max_new_tokens`` tokens: every message would be refused.
    The system message is kept whole in every prompt (``fit_history`` drops turns, never it)."""
    from wiola.chat import apply_chat_template

    budget = limit - max_new_tokens
    need = len(apply_chat_template(tokenizer, [*system, {"role": "user", "content": ""}], add_generation_prompt=True))
    if need <= budget:
        return
    room = f"the model has room for {budget} ({limit} tokens of context less --max-new-tokens {max_new_tokens})"
    if system:
        raise ValueError(
            f"--system takes {need} tokens with the template and an empty first turn; {room}: shorten it or "
            "lower --max-new-tokens"
        )
    raise ValueError(
        f"--max-new-tokens {max_new_tokens} leaves no room for a message: the template takes {need} tokens around "
        f"an empty one; {room}: lower --max-new-tokens"
    )


@contextlib.contextmanager
def _terminal_input() -> Iterator[None]:
    """Input as a person types and pastes it. In a terminal, ``input()`` goes through GNU
    readline (line editing, history, lines past the 4095 bytes of the terminal's line mode) with
    bracketed paste on (Python turns it off), so a paste of several lines is one line of
    ``input()``; readline switches the terminal's paste mode on only while it reads a line, Ctrl-C
    included. stdin decodes with ``surrogateescape`` meanwhile, so a line that is not valid text
    reaches ``_is_text`` (a strict decoder would raise, losing the rest of a piped chunk too)."""
    if sys.stdin.isatty():
        try:
            import readline
        except ImportError:  # a Python built without it: the terminal's line mode
            pass
        else:
            if "libedit" not in (readline.__doc__ or ""):  # libedit has no such variable
                readline.parse_and_bind("set enable-bracketed-paste on")
    errors = getattr(sys.stdin, "errors", None)
    tolerant = errors not in (None, "surrogateescape") and hasattr(sys.stdin, "reconfigure")
    if tolerant:
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        yield
    finally:
        if tolerant:
            sys.stdin.reconfigure(errors=errors)


def _is_text(line: str) -> bool:
    """Whether ``line`` decoded cleanly: ``surrogateescape`` turns each undecodable byte into a
    lone surrogate, which no text holds and UTF-8 cannot encode."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    reply = stream_reply(
        model,
        tokenizer,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        stop_text=stop_text,
    )
    try:
        while True:
            try:
                token, piece = next(reply)
            except StopIteration as end:  # its value: why the reply ended
                if end.value == "length":
                    sys.stdout.write(f" [cut at --max-new-tokens {args.max_new_tokens}]")
                break
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
