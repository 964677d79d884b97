"""The published ``wiola13m`` package (Hugging Face ``transformers``) as a benchmark baseline,
loaded with exactly the weights of one of our models."""

from __future__ import annotations

import re
from typing import Any

import torch

from wiola import WiolaModel

# Our parameter names -> wiola13m's (issue 2's list; the head is tied in both).
_RENAMES = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.([qkvo])_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.attn\.gate_w1\.weight", r"model.layers.\1.self_attn.gate_fc1.weight"),
    (r"layers\.(\d+)\.attn\.gate_w2\.(weight|bias)", r"model.layers.\1.self_attn.gate_fc2.\2"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.ffn\.(up|bypass|down)_proj\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
]


def to_wiola13m_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our state dict to wiola13m's names (plus its tied ``lm_head.weight``).

    Raises ``KeyError`` naming a tensor that has no counterpart.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for pattern, repl in _RENAMES:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, repl, name)] = tensor
                break
        else:
            raise KeyError(f"no wiola13m name for our tensor {name!r}")
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def wiola13m_like(model: WiolaModel) -> Any:
    """A ``wiola13m.WiolaForCausalLM`` with ``model``'s configuration, weights, device and dtype.

    Raises ``ImportError`` when ``wiola13m`` (or a ``transformers`` it works with) is missing,
    and ``ValueError`` when the weights do not load exactly.
    """
    import wiola13m

    c = model.config
    hf_config = wiola13m.WiolaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_base,
        spiral_alpha=c.helix_alpha,
        gate_pre_rope=c.gate_pre_rope,
        use_attention_gate=c.gate,
        rms_norm_eps=c.norm_eps,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: both sides produce exactly max_new_tokens
        pad_token_id=0,
    )
    w = model.embed.weight
    hf = wiola13m.WiolaForCausalLM(hf_config).to(device=w.device, dtype=w.dtype).eval()
    missing, unexpected = hf.load_state_dict(to_wiola13m_state(model.state_dict()), strict=False)
    if missing or unexpected:
        raise ValueError(f"wiola13m weights did not load exactly: missing {missing}, unexpected {unexpected}")
    return hf


def hf_greedy(hf: Any, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """wiola13m's Hugging Face ``generate``, greedy, exactly ``max_new_tokens`` new tokens: ``(B, T + N)``."""
    with torch.inference_mode():
        return hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
