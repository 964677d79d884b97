"""Evaluation: validation loss, perplexity and bits per byte; the mean gate per layer × head;
per-layer gradient norms; validation loss by token position.

Bits per byte is the validation stream's code length in bits divided by its text's UTF-8 bytes:
``Σ_targets nats / ln 2 / Σ_targets bytes(target)``, where a token's bytes are those it adds to
its document's decoded text and the tokens that frame documents (``<|endoftext|>``, ``<s>``,
``</s>``) count 0 bytes (their cost — knowing where a story ends — is part of the code length;
the text has no byte for them). A Metaspace tokenizer (Llama-2's) puts a ``▁`` before a
document's first word that the text does not have: that token counts its bytes without the
space (``token_byte_lengths``). So the targets of a document sum to its UTF-8 bytes, and the
number is comparable across tokenizers, unlike the per-token loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wiola.train.batches import eval_batches, eval_windows
from wiola.train.env import autocast
from wiola.train.token_cache import TokenSplit

if TYPE_CHECKING:
    from wiola.tokenizer import Tokenizer

MAX_EXP = 709.0  # exp(709) ≈ 8.2e307; exp(710) overflows a float: the perplexity is inf past it


@dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy in nats
    perplexity: float  # exp(loss); inf past a float's range (None in ``to_dict``: JSON has no inf)
    bits_per_byte: float
    tokens: int  # targets scored
    bytes: int  # UTF-8 bytes of the scored targets' text
    windows: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity if math.isfinite(self.perplexity) else None}

    def perplexity_text(self) -> str:
        """The perplexity to print: 3 decimals, or 4 significant digits once it is large."""
        return f"{self.perplexity:.3f}" if self.perplexity < 1e6 else f"{self.perplexity:.4g}"

    def __str__(self) -> str:
        return (
            f"loss {self.loss:.4f}  perplexity {self.perplexity_text()}  bits/byte {self.bits_per_byte:.4f}  "
            f"({self.tokens:,} tokens, {self.bytes:,} bytes)"
        )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    split: TokenSplit,
    byte_lengths: torch.Tensor,
    seq_len: int,
    *,
    batch_size: int = 8,
    max_windows: int | None = None,
    precision: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Loss, perplexity and bits per byte of ``model`` on the first ``max_windows`` windows of ``split``.

    Args:
        model: a ``WiolaModel`` (or a wrapper with the same ``forward``), on any device.
        split: the validation tokens; windows of ``seq_len + 1`` tokens at stride ``seq_len``
            and a shorter last one (``eval_windows``): with all windows every token after the
            first is a target once. The loss is the mean over the targets, not the windows.
        byte_lengths: int64 bytes per token (``token_byte_lengths``): ``(V,)``, or ``(2, V)``
            whose second row counts a document's first token (a target after a 0-byte token).
        precision: ``"auto"``, ``"bf16"`` or ``"fp32"``, as in training (``wiola.train.env.autocast``).
        rank, world_size: under DDP every rank scores a disjoint share and the sums are
            all-reduced, so every rank returns the same result.
        progress: called with the number of windows of each batch once it is scored.

    Raises ``ValueError`` when the split holds less than one window, or ``batch_size`` or
    ``max_windows`` is below 1 (no window would be scored, and the loss would read 0).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None (all), got {max_windows}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    byte_lengths = byte_lengths.to(device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # targets, bytes
    try:
        for batch in eval_batches(
            split, seq_len, batch_size, max_windows=max_windows, rank=rank, world_size=world_size
        ):
            x = batch.to(device, non_blocking=True)
            with autocast(device, precision):
                loss = model(x, labels=x).loss  # mean over the B·T targets x[:, 1:]
            n = x[:, 1:].numel()
            nats += loss.double() * n
            counts[0] += n
            counts[1] += target_bytes(byte_lengths, x).sum()
            if progress is not None:
                progress(x.shape[0])
    finally:
        model.train(was_training)
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(nats)
        dist.all_reduce(counts)
    total_nats, n_tokens, n_bytes = float(nats), int(counts[0]), int(counts[1])
    loss = total_nats / max(n_tokens, 1)
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss) if loss <= MAX_EXP else math.inf,
        bits_per_byte=total_nats / math.log(2) / max(n_bytes, 1),
        tokens=n_tokens,
        bytes=n_bytes,
        windows=eval_windows(split, seq_len, max_windows),
    )


@torch.no_grad()
def gate_statistics(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean gate ``g_t^(h)`` per layer and head over the real tokens of a batch: ``(L, H)`` float64.

    Runs the model's own forward once with a forward hook on every layer's gate module
    (``layers[i].attn.gate``), which records the ``(B, T, H)`` gate it returns; the hooks are
    removed afterwards. A model built with ``gate=False`` has every gate at 1.

    Args:
        model: a ``WiolaModel`` (not a DDP or compiled wrapper).
        input_ids: ``(B, T)`` token ids; attention_mask: ``(B, T)`` 1 for real tokens.
    """
    cfg = model.config
    if not cfg.gate:
        return torch.ones(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    recorded: dict[int, torch.Tensor] = {}

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: Any, g: torch.Tensor) -> None:
            recorded[index] = g.detach().double()  # (B, T, H)

        return record

    handles = [layer.attn.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    was_training = model.training
    model.eval()
    try:
        model(input_ids, attention_mask=attention_mask)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if len(recorded) != cfg.n_layers:
        raise RuntimeError(f"recorded the gates of {len(recorded)} layers, the model has {cfg.n_layers}")
    g = torch.stack([recorded[i] for i in range(cfg.n_layers)])  # (L, B, T, H)
    real = torch.ones(g.shape[1:3], dtype=torch.float64, device=g.device)
    if attention_mask is not None:
        real = attention_mask.to(device=g.device, dtype=torch.float64)
    return ((g * real[None, :, :, None]).sum(dim=(1, 2)) / real.sum()).cpu()


def token_byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """int64 UTF-8 bytes per token (``Tokenizer.token_byte_lengths``); special tokens count 0.

    ``(vocab_size,)`` where a token adds the same bytes wherever it stands (byte-level BPE,
    tiktoken). ``(2, vocab_size)`` for a Metaspace tokenizer (Llama-2's): row 0 a token's bytes
    within a document, ▁ a space; row 1 as a document's first token, whose ``▁`` the tokenizer
    put there and the text does not have. ``target_bytes`` picks the row of each target, so a
    document's targets sum to its UTF-8 bytes.
    """
    within = tokenizer.token_byte_lengths()
    first = tokenizer.token_byte_lengths(at_start=True)
    return torch.tensor(within if first == within else [within, first], dtype=torch.int64)


def target_bytes(byte_lengths: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bytes of the targets ``x[:, 1:]`` of windows ``x`` ``(B, T + 1)``, from a
    ``(V,)`` or ``(2, V)`` ``token_byte_lengths`` table. With two rows a target after a 0-byte
    token (a special token: in the token cache only the framing of documents) is a document's
    first token and takes row 1."""
    targets = x[:, 1:]
    if byte_lengths.dim() == 1:
        return byte_lengths[targets]
    first = byte_lengths[0][x[:, :-1]] == 0
    return torch.where(first, byte_lengths[1][targets], byte_lengths[0][targets])


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the tokens' empirical unigram distribution: the loss of the best model
    that ignores context, the bar a trained model must get well below."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@torch.no_grad()
def layer_grad_norms(model: torch.nn.Module) -> torch.Tensor | None:
    """The L2 norm of each layer's gradients (every parameter of ``model.layers[i]``): ``(L,)``
    float32 on the model's device, or None before any backward pass. Reads, never changes, the
    gradients (clipping comes after)."""
    norms = []
    for layer in model.layers:
        grads = [p.grad.detach().float().norm() for p in layer.parameters() if p.grad is not None]
        if not grads:
            return None
        norms.append(torch.stack(grads).norm())
    return torch.stack(norms)


@torch.no_grad()
def position_losses(
    model: torch.nn.Module,
    split: TokenSplit,
    seq_len: int,
    bucket: int = 64,
    *,
    batch_size: int = 8,
    max_windows: int | None = None,
) -> list[dict[str, float | int]]:
    """Validation loss by the position of the target in its window: targets ``1 ... seq_len``
    grouped by the predicting token's position ``t`` (0-based) into buckets
    ``[0, bucket), [bucket, 2·bucket), ...``. Each entry: ``start``, ``end`` (exclusive),
    ``loss`` (mean nats), ``tokens``. Same windows as ``evaluate``: the shorter last window's
    targets count at their positions, so the early buckets may hold one window more than the
    late ones. Raises ``ValueError`` for ``bucket < 1``."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = torch.zeros(seq_len, dtype=torch.float64)
    counts = torch.zeros(seq_len, dtype=torch.int64)
    try:
        for batch in eval_batches(split, seq_len, batch_size, max_windows=max_windows):
            x = batch.to(device)
            logits = model(x).logits[:, :-1].float()  # (B, T', V), T' ≤ T: position t predicts x[:, t + 1]
            nats = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
            width = nats.shape[1]
            sums[:width] += nats.double().sum(0).cpu()
            counts[:width] += x.shape[0]
    finally:
        model.train(was_training)
    out = []
    for start in range(0, seq_len, bucket):
        end = min(start + bucket, seq_len)
        n = int(counts[start:end].sum())
        out.append({"start": start, "end": end, "loss": float(sums[start:end].sum()) / max(n, 1), "tokens": n})
    return out
