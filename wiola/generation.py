"""Autoregressive generation with the static cache: prefill once, then one token per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from wiola.model import WiolaModel


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``ValueError`` for sampling settings that mean nothing."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to ``-inf`` every logit outside the top-k and outside the top-p nucleus. ``(B, V)``."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first is kept).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row from ``(B, V)`` logits: argmax when ``temperature == 0``, else a
    sample of ``softmax(filtered logits / temperature)``. Returns ``(B,)`` int64, no host sync."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_generate_inputs(
    model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None
) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
    total = input_ids.shape[1] + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"prompt of {input_ids.shape[1]} tokens + {max_new_tokens} new tokens = {total} is past "
            f"max_seq_len={model.config.max_seq_len}"
        )
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        if not bool(attention_mask[:, -1].all()):
            raise ValueError("generate needs left padding: the last column of attention_mask must be all ones")


@torch.inference_mode()
def generate(
    model: WiolaModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    streamer: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The prompt followed by up to ``max_new_tokens`` new tokens: ``(B, T + max_new_tokens)`` int64.

    Args:
        input_ids: ``(B, T)`` prompt ids; a batch of unequal prompts is left-padded.
        attention_mask: ``(B, T)``, 0 on the left padding; every row then decodes exactly as
            it would alone.
        temperature: 0 is greedy; otherwise logits are divided by it before sampling.
        top_k, top_p: keep only the ``top_k`` most likely tokens / the smallest nucleus of
            probability ``top_p``.
        eos_token_id: a row that produces it stops; its later slots hold ``pad_token_id``
            (default: ``eos_token_id``). Generation ends early once every row has stopped,
            and the result is still ``T + max_new_tokens`` wide.
        generator: a ``torch.Generator`` for reproducible sampling.
        streamer: called with each step's ``(B,)`` new tokens as soon as they exist.
    """
    check_sampling(temperature, top_k, top_p)
    model._check_inputs(input_ids, attention_mask, None)
    check_generate_inputs(model, input_ids, max_new_tokens, attention_mask)
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.int64, device=input_ids.device)
    out[:, :T] = input_ids
    if max_new_tokens == 0:
        return out
    pad = eos_token_id if pad_token_id is None else pad_token_id
    cache = model.new_cache(B, T + max_new_tokens)
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, pad)
            finished |= token == eos_token_id
        out[:, T + i] = token
        if streamer is not None:
            streamer(token)
        if i + 1 == max_new_tokens:
            break
        if eos_token_id is not None and bool(finished.all()):
            out[:, T + i + 1 :] = pad
            break
        logits = model(token.unsqueeze(1), cache=cache, logits_to_keep=1).logits[:, -1]
    return out
