"""The chat template: conversations (``[{"role": ..., "content": ...}, ...]``) to token ids.

One Jinja template (``CHAT_TEMPLATE``, docs/SPEC.md "Chat and fine-tuning") renders a
conversation to text, which the tokenizer then encodes with special-token text read as special
tokens and no other framing. That is what ``transformers``' ``apply_chat_template`` does with the
``chat_template`` of ``tokenizer_config.json``, so an exported folder gives the same ids there
as ``apply_chat_template`` here::

    <s><|user|>
    Write a story.</s><|assistant|>
    Once upon a time ...</s>

``<s>``/``</s>`` are the tokenizer's bos and eos text (``<|endoftext|>`` for both with GPT-2's);
every turn ends with eos, so generation stops where an assistant turn ends. The role markers
are plain text, or one token each after ``add_role_tokens``. Contents are stripped of
surrounding whitespace, which keeps each turn's token boundaries independent of its neighbours.

Also here: ``add_role_tokens`` (the tokenizer) and ``resize_token_embeddings`` (the model).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from wiola.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] | trim) + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

Message = dict[str, str]


def check_messages(messages: Any, *, need_assistant: bool = False) -> list[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, or ``ValueError`` naming what is
    wrong: not a non-empty list, an entry without a string role/content, an unknown role, an
    empty assistant turn, or (``need_assistant``) no assistant turn to learn from."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: expected an object with string 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i}: unknown role {m['role']!r} (use {', '.join(ROLES)})")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ValueError(f"message {i}: the assistant turn is empty")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn to learn from")
    return messages


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """``tojson`` as ``transformers`` defines it for chat templates: plain ``json.dumps`` (Jinja's
    own escapes non-ASCII text and ``<>&'`` for HTML, which would change the prompt's ids)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    from jinja2 import ext, nodes
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    class Generation(ext.Extension):
        """``{% generation %}...{% endgeneration %}``, which marks an assistant turn for
        ``transformers``' assistant-token mask; its body renders as written."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    # transformers' environment: trim_blocks/lstrip_blocks, the same sandbox, {% break %} and
    # {% continue %}, {% generation %}, and its tojson, raise_exception and strftime_now
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id])


def render_chat(tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The text of ``messages`` under ``tokenizer.chat_template`` (``CHAT_TEMPLATE`` when it has none).

    The template sees what ``transformers``' ``apply_chat_template`` passes it on the saved folder:
    the tokenizer's special tokens by role (``tokenizer.special_tokens_map``: ``bos_token`` is
    ``<s>``, or GPT-2's ``<|endoftext|>``; a role the tokenizer lacks is undefined, which renders
    as nothing), ``tools`` and ``documents`` as None. Raises ``ValueError`` for bad messages or a
    template error."""
    from jinja2.exceptions import TemplateError

    check_messages(list(messages))
    try:
        return _compiled(tokenizer.chat_template or CHAT_TEMPLATE).render(
            messages=list(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **tokenizer.special_tokens_map,
        )
    except TemplateError as e:
        raise ValueError(f"chat template: {e}") from e


def check_chat_template(tokenizer: Tokenizer) -> None:
    """``ValueError`` when the tokenizer's chat template (``CHAT_TEMPLATE`` when it has none)
    does not compile (a Jinja syntax error), so a command can refuse it before any work."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        _compiled(tokenizer.chat_template or CHAT_TEMPLATE)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e


_PROBE = [{"role": "user", "content": "wiola-probe-question"}, {"role": "assistant", "content": "wiola-probe-reply"}]


def turn_end_marker(tokenizer: Tokenizer) -> str | None:
    """The text the chat template puts after an assistant turn's content when that is not the
    eos token, stripped of whitespace: ChatML's ``<|im_end|>`` (from ``...reply<|im_end|>\n``;
    from ``...reply<|im_end|><eos>`` too). None when the turn ends with eos (``CHAT_TEMPLATE``),
    with nothing but whitespace, or the end cannot be found (the template cannot render a probe
    conversation, or changes the reply's text). Found by rendering a user turn and a reply."""
    try:
        text = render_chat(tokenizer, _PROBE, add_generation_prompt=False)
    except ValueError:
        return None
    reply = _PROBE[-1]["content"]
    at = text.rfind(reply)
    if at < 0:
        return None
    tail = text[at + len(reply) :]
    eos = _token_text(tokenizer, tokenizer.eos_token_id)
    if eos and eos in tail:
        tail = tail[: tail.index(eos)]
    return tail.strip() or None


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of rendered chat text: special-token text becomes its id, no framing is added
    (``transformers``' ``tokenizer(text, add_special_tokens=False)``)."""
    from wiola.tokenizer import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return tokenizer._tok.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text)  # tiktoken: specials allowed, never framed


def apply_chat_template(
    tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` (``[{"role": "system"|"user"|"assistant", "content": str}, ...]``),
    ending with the assistant marker when ``add_generation_prompt`` (the prompt of a reply).

    Equals ``transformers``' ``apply_chat_template(messages, add_generation_prompt=...)`` on the
    folder the tokenizer saves. Raises ``ValueError`` naming a bad message."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, add_generation_prompt))


def with_chat_template(tokenizer: Tokenizer, template: str | None = None) -> Tokenizer:
    """``tokenizer`` itself with ``chat_template`` set (``template``, else its own, else
    ``CHAT_TEMPLATE``): what it then saves carries the template."""
    tokenizer.chat_template = template or tokenizer.chat_template or CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------- role tokens
def add_role_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """A tokenizer (a ``tokenizers`` one: GPT-2's is converted) in which ``<|system|>``,
    ``<|user|>`` and ``<|assistant|>`` are special tokens, one id each after the vocabulary."""
    from wiola.tokenizer import TiktokenTokenizer

    hf = tokenizer.to_hf() if isinstance(tokenizer, TiktokenTokenizer) else tokenizer
    out = hf.with_added_tokens(list(ROLE_TOKENS))
    for role in ("bos", "eos", "pad"):
        if getattr(tokenizer, f"{role}_token_id") is not None:
            setattr(out, f"{role}_token_id", getattr(tokenizer, f"{role}_token_id"))
    out.chat_template = tokenizer.chat_template
    return out


@torch.no_grad()
def resize_token_embeddings(model: torch.nn.Module, vocab_size: int) -> torch.nn.Module:
    """Grow ``model``'s embedding (and with it the tied head) to ``vocab_size`` rows in place;
    each new row is the mean of the old rows (a new token starts as an average token, its
    logit near the average one). ``config.vocab_size`` follows. Raises ``ValueError`` for a
    shrink. Returns ``model``."""
    old = model.embed.weight
    n = old.shape[0]
    if vocab_size < n:
        raise ValueError(f"cannot shrink the embedding from {n} to {vocab_size} rows")
    if vocab_size == n:
        return model
    weight = torch.cat([old, old.mean(dim=0, keepdim=True).expand(vocab_size - n, -1)])
    model.embed = torch.nn.Embedding(vocab_size, old.shape[1], device=old.device, dtype=old.dtype)
    model.embed.weight.copy_(weight)
    model.config.vocab_size = vocab_size
    if hasattr(model, "derived_weights"):
        model.derived_weights.clear()
    return model


# --------------------------------------------------------------------------- conversations
def fit_history(tokenizer: Tokenizer, messages: list[Message], budget: int) -> tuple[list[int], list[Message], int]:
    """The prompt ids of ``messages`` (with the generation prompt) in at most ``budget`` tokens:
    the oldest non-system turns are dropped (a user turn with the answer after it) until it
    fits. Returns ``(ids, messages kept, turns dropped)``; raises ``ValueError`` when even the
    system message and the last turn do not fit."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system) :]
    dropped = 0
    while True:
        ids = apply_chat_template(tokenizer, system + turns, add_generation_prompt=True)
        if len(ids) <= budget:
            return ids, system + turns, dropped
        if len(turns) <= 1:
            raise ValueError(f"the message takes {len(ids)} tokens with the template; the model has room for {budget}")
        cut = 2 if len(turns) > 2 and turns[1]["role"] == "assistant" else 1
        turns, dropped = turns[cut:], dropped + cut


@torch.no_grad()
def stream_reply(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_text: str | None = None,
) -> Generator[tuple[int, str], None, str]:
    """The reply to ``prompt`` (ids from ``apply_chat_template``) token by token: ``(token id,
    new text)`` pairs, ending at eos or after ``max_new_tokens``; the generator's return value is
    why it ended, ``"length"`` (cut at ``max_new_tokens``) or ``"stop"``. Sampling as in
    ``wiola.generation.generate``; one prefill, then one cached step per token. Raises
    ``ValueError`` when prompt and reply would pass ``max_seq_len``.

    The text is streamed by ``wiola.text_stream.TextStream``: it is held back while a character
    is incomplete, while the tokenizer's clean-up of spaces (``decode_reach``) may still rewrite
    it, and while it could be the start of ``stop_text`` (resolved once the reply goes another
    way); so the pieces join to the decoding of the reply. What is held back when the reply
    ends comes with its last token: with eos (the only pair that carries eos, yielded only when
    text was held back) or with the token at ``max_new_tokens`` (a character that token left
    incomplete shows as U+FFFD, as in the decoding).

    ``stop_text`` (a template's end-of-turn marker that is not eos, ``turn_end_marker``): the
    reply also ends where that text appears, which is never shown; the last pair then carries
    the text before the marker, with the token that completed it."""
    from wiola.generation import resolve_sampling, sample_next
    from wiola.text_stream import TextStream

    limit = model.config.max_seq_len
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"{len(prompt)} prompt tokens + {max_new_tokens} new ones pass max_seq_len={limit}")
    sampling = resolve_sampling(temperature, top_k, top_p, model.config.vocab_size)
    device = model.embed.weight.device if hasattr(model, "embed") else next(model.parameters()).device
    cache = model.new_cache(1, len(prompt) + max_new_tokens)
    logits = model(torch.tensor([prompt], device=device), cache=cache, logits_to_keep=1).logits[:, -1]
    stream = TextStream(tokenizer, [stop_text] if stop_text else [], tight_hold=True)
    for step in range(1, max_new_tokens + 1):
        token = int(sample_next(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)[0])
        if token == tokenizer.eos_token_id:
            rest = stream.rest()
            if rest:
                yield token, rest
            return "stop"
        new = stream.add(token)
        if stream.stopped:
            yield token, new
            return "stop"
        if step == max_new_tokens:
            yield token, new + stream.rest()
            return "length"
        yield token, new
        logits = model(torch.tensor([[token]], device=device), cache=cache).logits[:, -1]
    return "length"  # max_new_tokens = 0
