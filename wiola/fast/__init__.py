"""``wiola.fast.WiolaModel``: the same model on fused kernels, a drop-in swap.

    from wiola.fast import WiolaModel      # instead of: from wiola import WiolaModel

Same constructor, modules, parameters, state-dict keys, ``forward``, ``generate``,
``save_pretrained`` and ``from_pretrained`` as ``wiola.WiolaModel`` (it *is* that class, its
modules built with another op table, ``wiola.fast.ops.KERNEL_OPS``), so checkpoints and state
dicts move freely between the two.

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
  runs every layer and the head (``wiola/fast/decode_step_cpu.py``, compiled on first use).
  ``wiola.fast.quantize.quantize(model, "int8" | "int4" | "bf16")`` gives that step weight-only
  int8 (per-row scales), int4 (per-group scales) or bf16 matrices; the PyTorch path then runs on
  the dequantized weights. A CPU prompt (prefill) runs in fp32 or with bf16 matrix products,
  chosen from the CPU's flags or ``$WIOLA_CPU_PREFILL``; the fp32 products of a gradient-free
  CPU forward run on MKL's or oneDNN's GEMM, chosen from the CPU's vendor and family or
  ``$WIOLA_CPU_GEMM`` (``wiola.fast.prefill``).
- The ablations' feed-forward blocks (``ffn="swiglu"`` or ``"gelu"``) have no kernel and no
  C++ step: they run ``wiola.ops.mlp`` (PyTorch) in every mode, the rest of the model on its
  fast path, and one-token CPU steps stay in PyTorch. The constructor warns and ``describe()``
  says so.
- Without a GPU: under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests); else a
  PyTorch path (SDPA with the gate folded into the query, the static cache) that is at least
  as fast as the reference.

The kernels switch: ``model.use_kernels(False)`` puts one model on the PyTorch path (its
modules get ``wiola.fast.ops.TORCH_OPS``; a compiled model recompiles), and ``with
wiola.fast.use_kernels(False):`` does it for every fast model in the block (per thread and
task; under ``torch.compile``, read when the graph is traced). Kernels run where both are on.
Per-model state lives on the model: the captured CUDA graphs (``cuda_graphs``) and the
derived tensors and C++ step binding (``derived_weights``), none in the state dict.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from wiola.cache import Cache
from wiola.config import WiolaConfig
from wiola.fast import ops, prefill, quantize
from wiola.fast.generation import (
    CPU_SAMPLING,
    GraphSteps,
    cpu_generate,
    cpu_loop_usable,
    graph_generate,
    graphs_usable,
)
from wiola.fast.ops import use_kernels
from wiola.generation import SamplingOps, eager_generate, hf_generate
from wiola.model import ModelOutput, has_adapters
from wiola.model import WiolaModel as ReferenceModel

__all__ = ["ModelOutput", "WiolaModel", "ops", "use_kernels"]


def check_settings() -> None:
    """Raise ``ValueError`` naming any environment variable of the fast model's paths set to a
    value it does not take (``WIOLA_FAST_KERNELS``, ``WIOLA_CPU_ISA``, ``WIOLA_CPU_PREFILL``,
    ``WIOLA_CPU_GEMM``), whether or not this model's calls would read it: a mistyped setting is
    reported when a model is made, not taken silently as the default. Whether the CPU runs the
    ISA asked for is checked where the step is built."""
    from wiola.fast import decode_step_cpu  # here, not at import: a GPU-only program need not load it

    ops.kernels_setting()
    decode_step_cpu.check_isa_name()
    prefill.check_names()


class WiolaModel(ReferenceModel):
    """Wiola on fused kernels. Everything of ``wiola.WiolaModel`` applies; differences:

    - ``forward(..., labels=...)`` returns ``logits=None`` and the fused loss unless
      ``return_logits=True`` is passed (then the logits are computed and the loss from them).
    - ``generate`` on CUDA replays a CUDA graph per batch size (captured on first use; the
      weights must stay where they are between calls, or the graphs are recaptured).
    """

    ops = ops.KERNEL_OPS
    quantization_codec = quantize  # runs int8/bf16 checkpoints in the C++ CPU step

    def __init__(self, config: WiolaConfig) -> None:
        check_settings()  # a mistyped WIOLA_* setting is named here, before any weights are made
        super().__init__(config)
        self.kernels = True  # this model's switch (use_kernels); see kernels_enabled
        self.cuda_graphs = GraphSteps()
        if config.ffn != "butterfly" or not self._attention_kernels():
            warnings.warn(self.describe(), stacklevel=2)

    def _attention_kernels(self) -> bool:
        """Whether the attention kernels are built for this head width (or no kernels are installed)."""
        return not ops.ATTENTION_HEAD_DIMS or self.config.head_dim in ops.ATTENTION_HEAD_DIMS

    def describe(self) -> str:
        """One line: what computes this model's feed-forward block and attention (whether the C++
        CPU step built and which variant runs: ``wiola.fast.decode_step_cpu.describe()``)."""
        parts = []
        if self.config.ffn != "butterfly":
            parts.append(
                f"ffn={self.config.ffn!r} has no fused kernel and no C++ CPU step; its feed-forward "
                f"block runs on PyTorch (wiola.ops.mlp), one-token CPU steps too"
            )
        if not self._attention_kernels():
            parts.append(
                f"head width {self.config.head_dim} has no attention kernel (built for {ops.ATTENTION_HEAD_DIMS}); "
                "attention and decoding attention run on PyTorch (SDPA) on a GPU (on a CPU, in the C++ step's code)"
            )
        if not parts:
            return "wiola.fast: every op on its fused kernel where usable (the butterfly included)"
        return "wiola.fast: " + "; ".join(parts)

    def use_kernels(self, enabled: bool = True) -> WiolaModel:
        """Run this model on the kernels (default) or, with ``False``, on the PyTorch path; returns
        the model. Unlike the ``wiola.fast.use_kernels`` context manager, this stays set."""
        self.kernels = bool(enabled)
        self._bind_ops(ops.KERNEL_OPS if self.kernels else ops.TORCH_OPS)
        return self

    @property
    def kernels_enabled(self) -> bool:
        """Whether the kernels (and the C++ CPU step) may run: this model's switch and the
        ``wiola.fast.use_kernels`` context are both on."""
        return self.kernels and ops.kernels_on()

    def _decoding_step(self, input_ids: torch.Tensor, cache: Cache) -> ModelOutput | None:
        """One new token per row on a CPU, where the C++ step applies (see the module): its logits.
        The inputs were checked by ``forward``."""
        if has_adapters(self):  # the C++ step reads the base weights
            return None
        step = ops.cpu_decode_step(self, input_ids, cache)
        if step is None:
            return None
        slot = cache.length
        logits = step(input_ids.reshape(-1).to(torch.int64).contiguous(), slot)
        cache.length += 1
        if getattr(cache, "slot", None) is not None:
            cache.slot.fill_(cache.length)
        return ModelOutput(logits=logits.unsqueeze(1), cache=cache)

    def _forward_context(self, input_ids: torch.Tensor, cache: Cache | None) -> contextlib.AbstractContextManager:
        # The modules are about to compute with the parameters: a quantized model's must still hold
        # what its packed matrices stand for (the C++ step checks when it binds, and is_current
        # rebinds after any change), else ValueError rather than a model other than it claims.
        quantize.require_current(self, "wiola.fast.WiolaModel")
        return prefill.context(self, input_ids, cache)  # bf16 products, or oneDNN's fp32 GEMM, where chosen

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
        # It is the layers' start as it is (no copy) and moves on after them (_cache_advance).
        index = slot.view(1) if T == 1 else slot + torch.arange(T, device=slot.device)
        if attention_mask is None:
            cache.key_mask.index_fill_(1, index, True)
        else:
            cache.key_mask.index_copy_(1, index, attention_mask.to(torch.bool))
        return slot

    def _rope(
        self, attention_mask: torch.Tensor | None, B: int, T: int, cache: Cache | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if T == 1 and attention_mask is None and getattr(cache, "device_slot", False):
            # CUDA-graph step: each row's position is its count of real tokens, and its cos and
            # sin one gather from the cache's table of every slot's (rope_tables of each position:
            # the same values), instead of a position, a cast, a product, a cos and a sin a step.
            both = cache.rope_table(self.rope_freqs).index_select(1, cache.n_real)  # (2, B, D/2)
            return both[0].unsqueeze(1), both[1].unsqueeze(1)
        return super()._rope(attention_mask, B, T, cache, device)

    def _cache_advance(self, cache: Cache, T: int, attention_mask: torch.Tensor | None) -> None:
        super()._cache_advance(cache, T, attention_mask)
        if getattr(cache, "slot", None) is not None and getattr(cache, "device_slot", False):
            cache.slot += T

    def generate(
        self, input_ids: torch.Tensor | None = None, max_new_tokens: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Prompt followed by up to ``max_new_tokens`` new tokens, ``(B, T + N)``; the arguments of
        ``wiola.generation.generate``. On CUDA with the kernels, the one-token step runs as a CUDA
        graph and sampling stays on the GPU (``wiola.fast.generation``); on a CPU where the C++ step
        applies, the whole loop (steps, sampling with its nucleus, eos) runs in C++ (``cpu_generate``);
        elsewhere the reference loop runs on the fast ops and the static cache (on a CPU its noise and
        its nucleus in C++, ``CPU_SAMPLING``: the same values).
        Greedy tokens equal the reference's.
        """
        prompt = kwargs.get("inputs") if input_ids is None else input_ids  # transformers' name for it
        if isinstance(prompt, torch.Tensor) and graphs_usable(self, prompt) and not has_adapters(self):
            return hf_generate(graph_generate, self, input_ids, max_new_tokens, **kwargs)
        return hf_generate(_cpu_or_eager, self, input_ids, max_new_tokens, **kwargs)


def _cpu_or_eager(model: WiolaModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
    """The loop ``generate`` runs off CUDA: the C++ loop where it applies (``cpu_generate``), else the reference loop."""
    if not has_adapters(model) and cpu_loop_usable(model, input_ids, kwargs):
        out = cpu_generate(model, input_ids, max_new_tokens, **kwargs)
        if out is not None:
            return out
    on_cpu = isinstance(input_ids, torch.Tensor) and input_ids.device.type == "cpu"
    return eager_generate(
        model, input_ids, max_new_tokens, sampling_ops=CPU_SAMPLING if on_cpu else SamplingOps(), **kwargs
    )
