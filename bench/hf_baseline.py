"""The published ``wiola13m`` package (Hugging Face ``transformers``) as a benchmark baseline,
loaded with exactly the weights of one of our models."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch
from packaging.requirements import Requirement

from wiola import WiolaModel
from wiola.checkpoint import to_wiola13m_state


def check_wiola13m_requirements() -> None:
    """Raise ``ImportError`` naming both versions when the installed ``transformers`` is outside
    the range ``wiola13m`` declares (1.0.1: >=4.40,<4.46). Under transformers 5 its model fails
    deep inside ``post_init`` (``'list' object has no attribute 'keys'``: its tied-weight keys are
    a list, transformers 5 expects a dict); this says why instead. Installed without its
    metadata (or not at all), nothing is checked here and the import decides."""
    try:
        declared = metadata.requires("wiola13m") or []
    except metadata.PackageNotFoundError:
        return
    for line in declared:
        req = Requirement(line)
        if req.name != "transformers" or req.marker is not None:
            continue
        try:
            have = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            raise ImportError(f"wiola13m needs transformers{req.specifier}; transformers is not installed") from None
        if not req.specifier.contains(have, prereleases=True):
            raise ImportError(
                f"wiola13m {metadata.version('wiola13m')} needs transformers{req.specifier}; this environment has "
                f"transformers {have}"
            )


def wiola13m_like(model: WiolaModel) -> Any:
    """A ``wiola13m.WiolaForCausalLM`` with ``model``'s configuration, weights, device and dtype.

    Raises ``ImportError`` when ``wiola13m`` (or a ``transformers`` it works with) is missing,
    and ``ValueError`` when the weights do not load exactly.
    """
    check_wiola13m_requirements()
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
    missing, unexpected = hf.load_state_dict(to_wiola13m_state(model.state_dict(), c.n_layers), strict=False)
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
