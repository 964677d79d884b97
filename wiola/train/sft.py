"""Supervised fine-tuning data: JSONL conversations or prompt/completion pairs to token ids
and labels in which only the answer counts (docs/SPEC.md "Chat and fine-tuning").

- ``chat`` lines: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``,
  rendered with the chat template (``wiola.chat``); every assistant turn's tokens (its content
  and the eos that ends it) are labels, everything else (bos, role markers, system and user
  turns) is -100.
- ``completion`` lines: ``{"prompt": ..., "completion": ...}``: the document prefix and the
  prompt's ids, then the completion's ids and eos, encoded apart (a completion starts a new
  token, as when the model continues a prompt); the completion and eos are labels.

Labels are aligned with the ids (``labels[t]`` is ``ids[t]`` or -100); the model shifts them.
A chat template whose assistant turns do not end with eos (ChatML's ``<|im_end|>\n``) leaves
the model nothing to learn to stop with: ``load_sft_data`` warns once (``wiola chat`` stops at
such a template's marker, but ``generate`` and the server run on).
Bad lines raise ``ValueError`` naming the file and line number. An example longer than the
model's ``max_seq_len`` is dropped, not truncated (a cut answer would teach the model to stop
without its eos), and counted.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wiola.chat import apply_chat_template, check_chat_template, check_messages, turn_end_marker
from wiola.tokenizer import Tokenizer

FORMATS = ("chat", "completion")
IGNORE = -100


@dataclass
class SFTData:
    """Encoded examples: ``examples[i] = (ids, labels)``, two equal-length lists of ints."""

    examples: list[tuple[list[int], list[int]]]
    dropped: list[int] = field(default_factory=list)  # line numbers of examples past max_seq_len
    label_tokens: int = 0  # tokens that count in the loss

    def summary(self, max_len: int) -> str:
        """One line for the run's log: examples kept, dropped, tokens, answer tokens."""
        tokens = sum(len(ids) for ids, _ in self.examples)
        dropped = (
            f"; {len(self.dropped)} longer than max_seq_len={max_len} dropped (lines {_lines(self.dropped)})"
            if self.dropped
            else ""
        )
        return f"{len(self.examples)} examples, {tokens:,} tokens, {self.label_tokens:,} in the loss{dropped}"


def _lines(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")


def read_jsonl(path: str | os.PathLike, fmt: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, example)`` for each non-blank line of ``path``, checked for ``fmt``.

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` naming ``path:line`` for
    malformed JSON, a missing or non-string field, an unknown role or an empty answer."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}: choose one of {', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                yield number, _check_example(example, fmt)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: malformed JSON: {e.msg} (column {e.colno})") from e
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from e


def _check_example(example: Any, fmt: str) -> dict[str, Any]:
    if not isinstance(example, dict):
        raise ValueError(f"expected a JSON object, got {type(example).__name__}")
    if fmt == "chat":
        if "messages" not in example:
            raise ValueError("a chat line needs a 'messages' list (or use --format completion)")
        check_messages(example["messages"], need_assistant=True)
        if example["messages"][0]["role"] == "assistant":
            raise ValueError("message 0: a conversation cannot open with an assistant turn (it answers nothing)")
        return example
    for key in ("prompt", "completion"):
        if not isinstance(example.get(key), str):
            raise ValueError(f"a completion line needs a string {key!r} (or use --format chat)")
    if not example["completion"].strip():
        raise ValueError("the completion is empty")
    return example


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of a conversation: the ids are ``apply_chat_template(messages,
    add_generation_prompt=False)``; the labels are -100 but for each assistant turn's tokens.

    A turn's tokens are those between the conversation up to it with the generation prompt and
    the conversation through it, so they are exactly what generation after that prompt must
    produce. Raises ``ValueError`` if the template does not render turns as prefixes of each other."""
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = apply_chat_template(tokenizer, messages[:i], add_generation_prompt=True)
        through = apply_chat_template(tokenizer, messages[: i + 1], add_generation_prompt=False)
        start = len(prompt)
        if ids[: len(through)] != through or through[:start] != prompt:
            raise ValueError(f"message {i}: the chat template does not render this turn as a prefix of the next")
        labels[start : len(through)] = through[start:]
    return ids, labels


def encode_completion(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """``(ids, labels)``: document prefix + prompt (-100), completion + eos (labels)."""
    head = tokenizer.document_prefix + (tokenizer.encode_batch([prompt])[0] if prompt else [])
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    tail = tokenizer.encode_batch([completion])[0] + eos
    return head + tail, [IGNORE] * len(head) + tail


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def stop_warning(tokenizer: Tokenizer, without_eos: int, conversations: int) -> str:
    """The warning for ``without_eos`` of ``conversations`` whose assistant-turn labels hold no
    eos id: the model cannot learn to stop. Names the template's end-of-turn text if found."""
    counted = f"the answers' labels hold no eos in {without_eos} of {conversations} conversations"
    if tokenizer.eos_token_id is None:
        return f"warning: tokenizer {tokenizer.name!r} has no eos token: {counted}, so the model cannot learn to stop"
    eos = tokenizer.decode([tokenizer.eos_token_id])
    marker = turn_end_marker(tokenizer)
    ends = f"with {marker!r}, not with" if marker else "without"
    chat = f"; wiola chat stops at {marker!r}, but generation that stops at eos runs on" if marker else ""
    return (
        f"warning: the chat template ends assistant turns {ends} the eos token {eos!r}: {counted}, so the model "
        f"cannot learn to stop{chat}. End each assistant turn with {{{{ eos_token }}}} in the template"
    )


def load_sft_data(
    path: str | os.PathLike,
    fmt: str,
    tokenizer: Tokenizer,
    max_len: int,
    warn: Callable[[str], None] = _stderr,
) -> SFTData:
    """Read, check and encode ``path`` (JSONL in ``fmt``); examples over ``max_len`` tokens are
    dropped and their line numbers kept. Raises ``ValueError`` for a chat template that does
    not compile (before any line is read), a bad line (see ``read_jsonl``) or when no example is
    left. ``warn`` gets one line (``stop_warning``) when conversations' answers hold no eos."""
    data = SFTData([])
    if fmt == "chat":
        check_chat_template(tokenizer)
    without_eos = 0
    for number, example in read_jsonl(path, fmt):
        try:
            if fmt == "chat":
                ids, labels = encode_chat(tokenizer, example["messages"])
            else:
                ids, labels = encode_completion(tokenizer, example["prompt"], example["completion"])
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from e
        if len(ids) > max_len:
            data.dropped.append(number)
            continue
        data.examples.append((ids, labels))
        data.label_tokens += sum(label != IGNORE for label in labels)
        if fmt == "chat" and tokenizer.eos_token_id not in labels:  # no eos id (or none at all) to learn
            without_eos += 1
    if not data.examples:
        why = f" (all {len(data.dropped)} are longer than max_seq_len={max_len})" if data.dropped else ""
        raise ValueError(f"{path} holds no usable example{why}")
    if without_eos:
        warn(stop_warning(tokenizer, without_eos, len(data.examples)))
    return data


def collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each ``(B, T_max)`` int64; padding
    has mask 0 and label -100."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return ids, mask, labels


def batches(data: SFTData, batch_size: int, seed: int) -> Iterator[list[tuple[list[int], list[int]]]]:
    """Endless batches of ``batch_size`` examples, reshuffled (by ``seed``) every epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(data.examples)))
                rng.shuffle(order)
            batch.append(data.examples[order.pop()])
        yield batch
