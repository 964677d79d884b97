"""The Wiola model (SPEC.md): pre-norm decoder with gated helical attention and butterfly FFN.

The forward pass is written once, in terms of the op functions of ``self.ops`` (``wiola.ops``
here: readable PyTorch). ``wiola.fast.WiolaModel`` runs the same code on fused kernels by
swapping that namespace.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import wiola.ops as reference_ops
from wiola.cache import Cache
from wiola.config import WiolaConfig
from wiola.ops.linear import linear
from wiola.ops.rope import helix_frequencies, positions_from_mask, rope_tables, upcast


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V) float32, None when the fused loss skipped them
    loss: torch.Tensor | None = None  # float32 scalar when labels were given
    cache: Cache | None = None


def inference_cached(owner: nn.Module, key: str, build, *sources: torch.Tensor) -> torch.Tensor:
    """``build()``, reused across calls during CPU inference until a source tensor changes.

    Decoding one token at a time on a CPU is bound by reading the weights; rebuilding the fused
    QKV matrix every step costs more than multiplying by it. With gradients on, on GPUs and
    under tracing, this is plain ``build()``. The cache is keyed on each source's storage and version counter,
    so in-place updates (optimizer steps, ``load_state_dict``) invalidate it.
    """
    if torch.is_grad_enabled() or sources[0].device.type != "cpu" or torch.compiler.is_compiling():
        return build()
    if any(t.is_inference() for t in sources):  # no version counter to notice in-place updates
        return build()
    stamp = tuple((t.data_ptr(), t._version) for t in sources)
    store = owner.__dict__.setdefault("_inference_cache", {})
    hit = store.get(key)
    if hit is None or hit[0] != stamp:
        hit = store[key] = (stamp, build())
    return hit[1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class GatedHelicalAttention(nn.Module):
    def __init__(self, config: WiolaConfig) -> None:
        super().__init__()
        d, H, D = config.d_model, config.n_heads, config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        if config.gate:
            self.gate_w1 = nn.Linear(D, H, bias=False)  # W_1: c_t (d_h) -> H
            self.gate_w2 = nn.Linear(H, H, bias=True)  # W_2, b_2

    def qkv_weight(self) -> torch.Tensor:
        """The three projections as one ``(3d, d)`` matrix: one GEMM, q/k/v as strided views."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        return inference_cached(self, "qkv", lambda: torch.cat(weights), *weights)


class Butterfly(nn.Module):
    def __init__(self, config: WiolaConfig) -> None:
        super().__init__()
        d, f = config.d_model, config.d_ff
        self.up_proj = nn.Linear(d, 2 * f, bias=False)  # [a ‖ b]
        self.bypass_proj = nn.Linear(d, f, bias=False)  # W_bp
        self.down_proj = nn.Linear(f, d, bias=False)


class Block(nn.Module):
    def __init__(self, config: WiolaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = GatedHelicalAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = Butterfly(config)


class WiolaModel(nn.Module):
    """Wiola language model. ``forward``, ``generate``, ``save_pretrained``/``from_pretrained``."""

    ops: types.ModuleType = reference_ops

    def __init__(self, config: WiolaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)  # also the tied head
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        # Not a buffer: `model.to(torch.bfloat16)` must not round the frequencies.
        self._freqs = {}  # (device, dtype) -> (D/2,) helical frequencies
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, 0.0, std, -2 * std, 2 * std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)  # b_2 = 0: every gate starts at 0.5
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def rope_freqs(self) -> torch.Tensor:
        """``(D/2,)`` helical frequencies θ̃ on the model's device, float32 (float64 for a float64 model)."""
        w = self.embed.weight
        key = (w.device, torch.float64 if w.dtype == torch.float64 else torch.float32)
        if key not in self._freqs:
            c = self.config
            self._freqs[key] = helix_frequencies(c.head_dim, c.rope_base, c.helix_alpha, torch.float64).to(*key)
        return self._freqs[key]

    # ------------------------------------------------------------------ inputs
    def _check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0 or B == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if input_ids.device != self.embed.weight.device:
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {self.embed.weight.device}")
        if self._sync_checks(input_ids):
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside [0, vocab_size={self.config.vocab_size})")
        if attention_mask is not None:
            past = cache.length if cache is not None else 0
            if (
                attention_mask.dim() != 2
                or attention_mask.shape[0] != B
                or attention_mask.shape[1] not in (T, past + T)
            ):
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
                )
            if attention_mask.dtype.is_floating_point and self._sync_checks(attention_mask):
                if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                    raise ValueError("attention_mask must hold only 0 and 1")
        if cache is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} is past max_seq_len={self.config.max_seq_len}")
        else:
            if cache.batch_size != B:
                raise ValueError(f"cache was made for batch size {cache.batch_size}, input has {B} rows")
            if cache.length + T > cache.max_len:
                raise ValueError(
                    f"{T} new tokens after {cache.length} cached ones is past the cache's max_len={cache.max_len}"
                )
            if cache.device != input_ids.device:
                raise ValueError(f"cache is on {cache.device} but input_ids is on {input_ids.device}")

    def _sync_checks(self, t: torch.Tensor) -> bool:
        """Value checks read tensors on the host; skip them where that would break tracing."""
        if torch.compiler.is_compiling():
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        return_logits: bool | None = None,
        logits_to_keep: int = 0,
    ) -> ModelOutput:
        """Logits, and the next-token loss when ``labels`` are given.

        Args:
            input_ids: ``(B, T)`` integer token ids in ``[0, vocab_size)``.
            attention_mask: ``(B, T)`` (or ``(B, cached + T)`` with a cache), 1 for real tokens
                and 0 for padding. Left padding (generation) and right padding (training)
                both work: every row computes what it would compute alone.
            labels: ``(B, T)`` aligned with ``input_ids`` and shifted inside (position ``t``
                predicts ``labels[t + 1]``); ``-100`` and padding positions are ignored.
            cache: a ``Cache``; the new tokens are appended and attend to everything cached.
            return_logits: compute the ``(B, T, V)`` logits. Defaults to True here; the fast
                model defaults to False when labels are given (fused loss, no logits).
            logits_to_keep: if positive, logits only for the last ``logits_to_keep`` positions
                (``(B, logits_to_keep, V)``; what generation needs). Not with ``labels``.

        Returns a ``ModelOutput`` with ``logits`` (float32), ``loss`` and ``cache``.
        Raises ``TypeError``/``ValueError`` naming the problem for bad ids, shapes, masks,
        lengths past ``max_seq_len`` or the cache, and a cache of another batch size.
        """
        self._check_inputs(input_ids, attention_mask, cache)
        ops, cfg = self.ops, self.config
        B, T = input_ids.shape
        H, D = cfg.n_heads, cfg.head_dim
        if attention_mask is not None:
            attention_mask = attention_mask[:, -T:].to(torch.bool)
        start = 0
        if cache is not None:
            positions = positions_from_mask(attention_mask, B, T, offset=cache.n_real, device=input_ids.device)
            start = self._cache_start(cache, T, attention_mask)
        else:
            positions = positions_from_mask(attention_mask, B, T, device=input_ids.device)
        cos, sin = rope_tables(positions, self.rope_freqs)  # (B, T, D/2) fp32

        h = self.embed(input_ids)  # (B, T, d): the residual stream
        x = ops.rms_norm(h, self.layers[0].attn_norm.weight, cfg.norm_eps)
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            qkv = linear(x, attn.qkv_weight()).view(B, T, 3, H, D)
            q, k, v = qkv.unbind(2)  # (B, T, H, D) strided views, not rotated
            if cfg.gate:
                carry = None if cache is None else (cache.gate_sum[i], cache.gate_count[i])
                gate_rope = {} if cfg.gate_pre_rope else {"cos": cos, "sin": sin}
                g, gate_sum, gate_count = ops.gate(
                    q, attn.gate_w1.weight, attn.gate_w2.weight, attn.gate_w2.bias,
                    attention_mask=attention_mask, carry=carry, **gate_rope,
                )  # fmt: skip
                if cache is not None:
                    cache.gate_sum[i].copy_(gate_sum)
                    cache.gate_count[i].copy_(gate_count)
            else:
                g = torch.ones(B, T, H, device=x.device, dtype=cos.dtype)
            if cache is None:
                o = ops.attention(q, k, v, g, cos, sin, attention_mask)
            else:
                o = ops.decode_attention(q, k, v, g, cos, sin, cache.k[i], cache.v[i], cache.key_mask, start)
            a = linear(o.reshape(B, T, H * D), attn.o_proj.weight)
            x, h = ops.rms_norm(a, layer.ffn_norm.weight, cfg.norm_eps, residual=h)  # h' = h + GSA
            f = layer.ffn
            f_out = ops.butterfly(x, f.up_proj.weight, f.bypass_proj.weight, f.down_proj.weight)
            next_norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            x, h = ops.rms_norm(f_out, next_norm.weight, cfg.norm_eps, residual=h)  # h'' = h' + FFN

        if cache is not None:
            cache.length += T
            cache.n_real += T if attention_mask is None else attention_mask.sum(dim=1)

        if labels is not None:
            if logits_to_keep:
                raise ValueError("logits_to_keep cannot be combined with labels (the loss needs every position)")
            labels = self._shifted_labels(labels, attention_mask, input_ids)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if return_logits is None:
            return_logits = self._default_return_logits(labels)
        logits = loss = None
        if return_logits:
            logits = upcast(linear(x, self.embed.weight))  # (B, T, V) fp32, head tied to E
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="sum")
                loss = loss / (labels != -100).sum().clamp(min=1)
        elif labels is not None:
            loss = ops.linear_cross_entropy(x[:, :-1].reshape(-1, cfg.d_model), self.embed.weight, labels.reshape(-1))
        return ModelOutput(logits=logits, loss=loss, cache=cache)

    def _default_return_logits(self, labels: torch.Tensor | None) -> bool:
        return True

    def _cache_start(self, cache: Cache, T: int, attention_mask: torch.Tensor | None) -> int | torch.Tensor:
        """Mark the ``T`` new slots in ``cache.key_mask``; return the first one (``decode_attention``'s
        ``start``). ``wiola.fast`` overrides this to keep the slot on the device for CUDA graphs."""
        start = cache.length
        cache.key_mask[:, start : start + T] = True if attention_mask is None else attention_mask
        return start

    def _shifted_labels(
        self, labels: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """``labels[:, 1:]`` with padding positions set to -100: ``(B, T - 1)`` int64."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
        labels = labels.to(torch.int64)
        if attention_mask is not None:
            labels = labels.masked_fill(~attention_mask, -100)
        if self._sync_checks(labels):
            bad = (labels != -100) & ((labels < 0) | (labels >= self.config.vocab_size))
            if bool(bad.any()):
                raise ValueError(
                    f"label {int(labels[bad][0])} is outside [0, vocab_size={self.config.vocab_size}) and is not -100"
                )
        return labels[:, 1:]

    # ------------------------------------------------------------- decoding
    def new_cache(self, batch_size: int, max_len: int | None = None) -> Cache:
        """A static cache on the model's device and dtype, for ``max_len`` slots (default max_seq_len)."""
        w = self.embed.weight
        return Cache(self.config, batch_size, max_len or self.config.max_seq_len, device=w.device, dtype=w.dtype)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        """Prompt followed by ``max_new_tokens`` new tokens, ``(B, T + N)``. See ``wiola.generation.generate``."""
        from wiola.generation import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    # ---------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the tied head is not stored twice)."""
        from wiola.checkpoint import save_pretrained

        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ) -> WiolaModel:
        """Load a checkpoint written by ``save_pretrained`` or by the published ``wiola13m`` package."""
        from wiola.checkpoint import load_pretrained

        return load_pretrained(cls, directory, device=device, dtype=dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
