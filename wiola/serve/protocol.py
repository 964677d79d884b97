"""OpenAI's completion API: request validation (400s in OpenAI's error JSON) and response objects.

Every parameter OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` take is accepted; those
that mean something here are checked and used, unknown ones are ignored (as OpenAI-compatible
servers do). A bad value raises ``ApiError``, which the app turns into
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}`` with status 400.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

BODY_SECONDS = 30.0  # a request body must arrive within this long (a stalled one holds its connection): 408

MAX_N = 16  # choices per prompt
# Choices (prompts × n) per request: a 1 MB body could otherwise list 200,000 prompts, each a job
# queued at once (memory, and every later request waiting behind them).
MAX_CHOICES = 256
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_LOGPROBS = 20


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the problem, the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    """The per-request generation settings shared by completions and chat completions."""

    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    n: int
    logprobs: int | None  # how many best alternatives per token; None: no logprobs at all
    stream: bool
    include_usage: bool


@dataclass
class Completion:
    """A validated ``/v1/completions`` request: ``prompts`` are token-id lists (one per prompt)."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    echo: bool
    sampling: Sampling
    model: str | None = None


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    sampling: Sampling
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _number(
    body: dict, name: str, default: float | None, lo: float, hi: float, *, open_lo: bool = False
) -> float | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{name} must be a number, got {value!r}", name)
    if not math.isfinite(value):  # JSON's NaN compares False with every bound, so refuse it first
        raise ApiError(f"{name} must be a finite number, got {value!r}", name)
    if value > hi or value < lo or (open_lo and value == lo):
        interval = f"{'(' if open_lo else '['}{lo}, {hi}]"
        raise ApiError(f"{name} must be in {interval}, got {value!r}", name)
    return float(value)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, got {value!r}", name)
    if value < lo or (hi is not None and value > hi):
        raise ApiError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP:
        raise ApiError(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    return stops


def _top_k(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value < -1:
        raise ApiError(f"top_k must be 0 or -1 (no top-k filter) or a positive integer, got {value}", "top_k")
    return _int({"top_k": value}, "top_k", None, 1)


def parse_sampling(body: dict, *, default_max_tokens: int | None, logprobs: int | None) -> Sampling:
    """The settings both endpoints share. ``top_k`` of 0 or -1 means no top-k filter (vLLM's
    convention); ``seed`` seeds choice ``i`` with ``seed + i``."""
    refuse_unsupported(body)
    top_k = body.get("top_k")
    if type(top_k) is int and top_k in (0, -1):  # not false or 0.0, which _top_k refuses as the other ints
        top_k = None
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    return Sampling(
        max_tokens=_int(body, "max_tokens", default_max_tokens, 0),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", None, 0.0, 1.0, open_lo=True),
        top_k=_top_k(top_k),
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        stop=_stop(body),
        n=_int(body, "n", 1, 1, MAX_N),
        logprobs=logprobs,
        stream=_bool(body, "stream", False),
        include_usage=_bool(options, "include_usage", False),
    )


# OpenAI parameters that would change the answer and that this server does not implement: given
# with anything but their no-op value they are a 400 naming them, never ignored. (``model``,
# ``user`` and ``metadata`` change nothing here and are taken as they are.)
NO_OP = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "min_tokens": (0,),
}


def refuse_unsupported(body: dict) -> None:
    """``ApiError`` naming the first parameter of ``NO_OP`` set to something it would act on, and
    ``best_of`` other than ``n`` (OpenAI's server-side best-of sampling)."""
    for name, no_op in NO_OP.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in no_op):
            raise ApiError(f"{name} is not supported by this server (got {value!r}); leave it out", name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ApiError(
            f"best_of is not supported by this server (got {best_of!r}); use n for several choices", "best_of"
        )


def check_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_prompts(body: dict, encode, vocab_size: int, n: int = 1) -> tuple[list[list[int]], list[str]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists; at
    most ``MAX_CHOICES`` choices with ``n`` each (checked before any is encoded)."""
    if "prompt" not in body:
        raise ApiError("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ApiError("prompt must be a non-empty string, list of strings or list of token ids", "prompt")
    if len(items) * n > MAX_CHOICES:
        raise ApiError(
            f"prompt holds {len(items)} prompts × n={n} = {len(items) * n} choices; at most {MAX_CHOICES} a request",
            "prompt",
        )
    ids, texts = [], []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise ApiError(f"{where} is empty", "prompt")
            tokens = encode(item)
            text = item
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            tokens, text = item, None
        else:
            raise ApiError(f"{where} must be a non-empty string or list of token ids", "prompt")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(f"{where} has token id {bad[0]} outside [0, {vocab_size})", "prompt")
        ids.append(list(tokens))
        texts.append(text)
    return ids, texts


def check_lengths(prompts: list[list[int]], max_tokens: int, max_len: int) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) + max_tokens > max_len:
            where = "the prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(
                f"{where} has {len(ids)} tokens; with max_tokens={max_tokens} that is {len(ids) + max_tokens}, "
                f"past the model's context of {max_len} tokens",
                "max_tokens",
                code="context_length_exceeded",
            )


def room_after(prompt: list[int], max_len: int) -> int:
    """The ``max_tokens`` of a chat request that gives none: the rest of the context. Raises
    ``ApiError`` (``context_length_exceeded``) when the prompt leaves no room for one new token."""
    if len(prompt) >= max_len:
        raise ApiError(
            f"the messages take {len(prompt)} tokens with the chat template, which leaves no room for a new token "
            f"in the model's context of {max_len} tokens",
            "messages",
            code="context_length_exceeded",
        )
    return max_len - len(prompt)


def parse_completion(body: Any, encode, vocab_size: int, max_len: int) -> Completion:
    """A ``/v1/completions`` request body (already parsed JSON), validated."""
    body = check_object(body)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)  # 0: the chosen tokens' only
    sampling = parse_sampling(body, default_max_tokens=16, logprobs=logprobs)
    prompts, texts = parse_prompts(body, encode, vocab_size, sampling.n)
    check_lengths(prompts, sampling.max_tokens, max_len)
    return Completion(prompts, texts, _bool(body, "echo", False), sampling, body.get("model"))


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` request body: ``messages`` of ``{role, content}`` strings."""
    body = check_object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):  # OpenAI's content parts
            m["content"] = _text_parts(m["content"], f"messages[{i}].content")
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ApiError(f"messages[{i}] must be an object with string role and content", "messages")
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top is not None:
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = None
    else:
        logprobs = top or 0  # logprobs alone: the chosen tokens' log-probabilities, no alternatives
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    sampling = parse_sampling(body, default_max_tokens=None, logprobs=logprobs)
    return ChatRequest([{"role": m["role"], "content": m["content"]} for m in messages], sampling, body.get("model"))


def _text_parts(parts: list, where: str) -> str:
    """OpenAI's content as a list of parts (``[{"type": "text", "text": ...}, ...]``) as the text
    they join to; a part of another type (an image, audio) is a 400 naming it."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(f"{where}[{j}] is a {kind!r} part; this model reads text parts only", "messages")
        texts.append(part["text"])
    return "".join(texts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
