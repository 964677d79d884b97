"""``wiola.fast.WiolaModel``: the same model on fused kernels, a drop-in swap.

    from wiola.fast import WiolaModel      # instead of: from wiola import WiolaModel

Same constructor, parameters, state-dict keys, ``forward``, ``generate``, ``save_pretrained``
and ``from_pretrained`` as ``wiola.WiolaModel`` (it *is* that class with another op namespace,
``wiola.fast.ops``), so checkpoints and state dicts move freely between the two.

What runs where:

- Training (``forward``): one GEMM for Q, K and V (views, no copies), the gate kernel, the
  helical-RoPE gated flash-attention kernel, the output projection, fused residual + RMSNorm,
  the butterfly kernel, and the linear cross-entropy kernel when ``labels`` are given (the
  ``(B, T, V)`` logits are then not materialised: pass ``return_logits=True`` to get them).
  No host synchronisation on CUDA (token-id and label range checks are skipped there; a bad
  id trips the embedding's device-side assert instead), so a training step can be captured
  in a CUDA graph; ``torch.compile(model, fullgraph=True)`` traces through every op.
- Decoding: the flash-decoding kernel (``kernels/decode.py``) writes the rotated keys and the
  values into the static cache and attends over it; the gate kernel carries the running sum
  and count. On CUDA, ``generate`` captures the whole one-token step (every layer, the head,
  sampling) as a CUDA graph once per batch size and replays it (``wiola.fast.generation``).
  On a plain CPU, each one-token step (fp32, gradients off) is one call of a C++ step that
  runs every layer and the head (``kernels/decode_step_cpu.py``, compiled on first use).
- Without a GPU: under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests); else a
  PyTorch path (SDPA with the gate folded into the query, the static cache) that is at least
  as fast as the reference. ``use_kernels(False)`` forces that path anywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from wiola.cache import Cache
from wiola.fast import ops
from wiola.fast.ops import use_kernels
from wiola.model import ModelOutput
from wiola.model import WiolaModel as ReferenceModel

__all__ = ["ModelOutput", "WiolaModel", "ops", "use_kernels"]


class WiolaModel(ReferenceModel):
    """Wiola on fused kernels. Everything of ``wiola.WiolaModel`` applies; differences:

    - ``forward(..., labels=...)`` returns ``logits=None`` and the fused loss unless
      ``return_logits=True`` is passed (then the logits are computed and the loss from them).
    - ``generate`` on CUDA replays a CUDA graph per batch size (captured on first use; the
      weights must stay where they are between calls, or the graphs are recaptured).
    """

    ops = ops

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
        """``wiola.WiolaModel.forward``; a one-token CPU step with a cache runs in C++ (see the module)."""
        if (
            cache is not None
            and isinstance(input_ids, torch.Tensor)
            and attention_mask is None
            and labels is None
            and return_logits is not False
        ):
            step = ops.cpu_decode_step(self, input_ids, cache)
            if step is not None:
                self._check_inputs(input_ids, None, cache)
                slot = cache.length
                logits = step(input_ids.reshape(-1).to(torch.int64).contiguous(), slot)
                cache.length += 1
                if getattr(cache, "slot", None) is not None:
                    cache.slot.fill_(cache.length)
                return ModelOutput(logits=logits.unsqueeze(1), cache=cache)
        return super().forward(
            input_ids,
            attention_mask=attention_mask,
            labels=labels,
            cache=cache,
            return_logits=return_logits,
            logits_to_keep=logits_to_keep,
        )

    def _default_return_logits(self, labels: torch.Tensor | None) -> bool:
        return labels is None

    def _sync_checks(self, t: torch.Tensor) -> bool:
        return not t.is_cuda and super()._sync_checks(t)

    def _cache_start(self, cache: Cache, T: int, attention_mask: torch.Tensor | None) -> int | torch.Tensor:
        slot = getattr(cache, "slot", None)
        if slot is None or not getattr(cache, "device_slot", False):
            start = super()._cache_start(cache, T, attention_mask)
            if slot is not None:
                slot.fill_(start + T)
            return start
        # CUDA-graph step: the slot lives on the device, so one captured graph serves every step.
        start = slot.clone()
        index = start + torch.arange(T, device=slot.device)
        if attention_mask is None:
            cache.key_mask.index_fill_(1, index, True)
        else:
            cache.key_mask.index_copy_(1, index, attention_mask.to(torch.bool))
        slot += T
        return start

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        """Prompt followed by up to ``max_new_tokens`` new tokens, ``(B, T + N)``; the arguments of
        ``wiola.generation.generate``. On CUDA with the kernels, the one-token step runs as a CUDA
        graph and sampling stays on the GPU (``wiola.fast.generation``); elsewhere the reference
        loop runs on the fast ops and the static cache. Greedy tokens equal the reference's.
        """
        from wiola.fast.generation import graph_generate, graphs_usable

        if graphs_usable(self, input_ids):
            return graph_generate(self, input_ids, max_new_tokens, **kwargs)
        return super().generate(input_ids, max_new_tokens, **kwargs)
