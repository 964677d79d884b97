"""An independent float64 Wiola forward, written from docs/SPEC.md's equations for the tests.

It shares no code with the package: it reads the model's weights by name from a state dict
and recomputes everything with explicit loops and complex-number rotations.
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate(u: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``u`` (T, H, D): pair i is the complex number u_i + j·u_{i+D/2}, turned by pos·θ̃_i."""
    half = u.shape[-1] // 2
    z = torch.complex(u[..., :half], u[..., half:])
    z = z * torch.exp(1j * pos.view(-1, 1, 1).double() * freqs.view(1, 1, -1))
    return torch.cat((z.real, z.imag), dim=-1)


def frequencies(D: int, base: float, alpha: float) -> torch.Tensor:
    i = torch.arange(D // 2, dtype=torch.float64)
    return base ** (-2 * i / D) * (1 + alpha * torch.sqrt(i + 1) / math.sqrt(D / 2))


def _silu(u: torch.Tensor) -> torch.Tensor:
    return u / (1 + torch.exp(-u))


def _gelu(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))


def feed_forward(kind: str, x: torch.Tensor, w: dict) -> torch.Tensor:
    """One feed-forward block on ``x`` (T, d) float64, its weights ``w`` by name within the block
    (``up_proj.weight``, ...): the butterfly (SPEC eq. 14-16), SwiGLU or the erf-GELU MLP."""
    w = {k.removesuffix(".weight"): v.double() for k, v in w.items()}
    if kind == "butterfly":
        ab = x @ w["up_proj"].T
        a, b = ab[:, : ab.shape[1] // 2], ab[:, ab.shape[1] // 2 :]
        return (_silu(a) * b + x @ w["bypass_proj"].T) @ w["down_proj"].T
    if kind == "swiglu":
        return (_silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T
    if kind == "gelu":
        return _gelu(x @ w["up_proj"].T) @ w["down_proj"].T
    raise ValueError(f"unknown feed-forward block {kind!r}")


def forward_row(state: dict, cfg, ids: list[int], real: list[bool] | None = None) -> torch.Tensor:
    """Logits ``(T, V)`` float64 of one row; ``real`` marks non-padding tokens (default all)."""
    sd = {k: v.double() for k, v in state.items()}
    T = len(ids)
    real = real or [True] * T
    H, D, eps = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.norm_eps
    freqs = frequencies(D, cfg.rope_base, cfg.helix_alpha)
    pos = torch.tensor([sum(real[:t]) for t in range(T)], dtype=torch.float64)
    h = sd["embed.weight"][torch.tensor(ids)]
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        x = _rms(h, sd[p + "attn_norm.weight"], eps)
        q = (x @ sd[p + "attn.q_proj.weight"].T).view(T, H, D)
        k = (x @ sd[p + "attn.k_proj.weight"].T).view(T, H, D)
        v = (x @ sd[p + "attn.v_proj.weight"].T).view(T, H, D)
        qr, kr = _rotate(q, pos, freqs), _rotate(k, pos, freqs)
        gate = torch.ones(T, H, dtype=torch.float64)
        if cfg.gate:
            src = q if cfg.gate_pre_rope else qr
            running, count = torch.zeros(D, dtype=torch.float64), 0
            for t in range(T):
                if real[t]:
                    running = running + src[t].mean(0)
                    count += 1
                c = running / max(count, 1)
                hid = sd[p + "attn.gate_w1.weight"] @ c
                hid = hid * torch.sigmoid(hid)
                gate[t] = torch.sigmoid(sd[p + "attn.gate_w2.weight"] @ hid + sd[p + "attn.gate_w2.bias"])
        z = torch.zeros(T, H, D, dtype=torch.float64)
        for t in range(T):
            keys = [s for s in range(t + 1) if real[s]]
            if not keys:
                continue
            for head in range(H):
                scores = torch.stack([gate[t, head] * (qr[t, head] @ kr[s, head]) / math.sqrt(D) for s in keys])
                z[t, head] = torch.softmax(scores, 0) @ v[keys, head]
        h = h + z.reshape(T, H * D) @ sd[p + "attn.o_proj.weight"].T
        x = _rms(h, sd[p + "ffn_norm.weight"], eps)
        h = h + feed_forward(
            getattr(cfg, "ffn", "butterfly"),
            x,
            {k[len(p + "ffn.") :]: v for k, v in sd.items() if k.startswith(p + "ffn.")},
        )
    return _rms(h, sd["norm.weight"], eps) @ sd["embed.weight"].T
