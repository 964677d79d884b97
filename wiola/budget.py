"""Exact parameter and FLOP budgets (docs/SPEC.md, Exact parameter budget)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from wiola.config import WiolaConfig

# Weight matrices of shape d × d_ff in one feed-forward block, and their names in the table.
FFN_MATRICES = {"butterfly": 4, "swiglu": 3, "gelu": 2}
FFN_NAMES = {"butterfly": "butterfly up, bypass, down", "swiglu": "swiglu gate, up, down", "gelu": "gelu up, down"}
MATCH_TOLERANCE = 0.005  # match_params: the largest relative gap to the base total it accepts


@dataclass
class Budget:
    """Parameter counts per component and FLOPs per token.

    Counting convention: a multiply-add is 2 FLOPs; only matrix products are counted
    (norms, RoPE, softmax, SiLU and the gate's elementwise work are O(d) per token and left
    out). Attention scores and the weighted sum of values cost ``2·2·d·n`` per token and
    layer, where ``n`` is the number of keys the token attends to; averaged over a causal
    sequence of length ``T`` that is ``n = (T + 1) / 2``. Training = forward + backward =
    3 × forward (the backward does two products for each forward product).
    """

    config: WiolaConfig
    seq_len: int
    params: dict[str, int] = field(default_factory=dict)
    forward_flops_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs per token, averaged over a causal sequence of ``seq_len`` tokens."""
        return sum(self.forward_flops_per_token.values())

    @property
    def training_flops(self) -> float:
        """Forward + backward FLOPs per token."""
        return 3.0 * self.forward_flops

    def table(self) -> str:
        """A plain-text table of the budget."""
        c = self.config
        rows = [
            f"Wiola budget: d={c.d_model} L={c.n_layers} H={c.n_heads} d_ff={c.d_ff} V={c.vocab_size} T={self.seq_len}"
        ]
        rows.append(f"{'component':<28}{'parameters':>14}{'share':>9}")
        for name, n in self.params.items():
            rows.append(f"{name:<28}{n:>14,}{n / self.total_params:>9.1%}")
        rows.append(f"{'total':<28}{self.total_params:>14,}")
        rows.append("")
        rows.append(f"{'forward FLOPs per token':<28}{'FLOPs':>14}")
        for name, f in self.forward_flops_per_token.items():
            rows.append(f"{name:<28}{f:>14,.0f}")
        rows.append(f"{'forward total':<28}{self.forward_flops:>14,.0f}")
        rows.append(f"{'training (3x forward)':<28}{self.training_flops:>14,.0f}")
        return "\n".join(rows)


def budget(config: WiolaConfig, seq_len: int | None = None) -> Budget:
    """The exact parameter counts and the FLOPs per token of ``config`` at ``seq_len`` tokens."""
    T = config.max_seq_len if seq_len is None else seq_len
    if T <= 0:
        raise ValueError(f"seq_len must be positive, got {T}")
    if T > config.max_seq_len:  # FLOPs of a length the model cannot run
        raise ValueError(f"seq_len {T} is past the model's max_seq_len={config.max_seq_len}")
    d, L, H, D, f, V = config.d_model, config.n_layers, config.n_heads, config.head_dim, config.d_ff, config.vocab_size
    params = {
        "embedding (tied head)": V * d,
        "attention q,k,v,o": L * 4 * d * d,
        "gate W1, W2, b2": L * (H * D + H * H + H) if config.gate else 0,
        FFN_NAMES[config.ffn]: L * FFN_MATRICES[config.ffn] * d * f,
        "norms": L * 2 * d + d,
    }
    n_keys = (T + 1) / 2
    flops = {
        "attention projections": L * 2 * 4 * d * d,
        "attention scores + values": L * 2 * 2 * d * n_keys,
        "gate": L * 2 * (D * H + H * H) if config.gate else 0,
        config.ffn: L * 2 * FFN_MATRICES[config.ffn] * d * f,
        "head (logits)": 2 * d * V,
    }
    return Budget(config=config, seq_len=T, params=params, forward_flops_per_token=flops)


def match_params(config: WiolaConfig, base: WiolaConfig, tolerance: float = MATCH_TOLERANCE) -> WiolaConfig:
    """``config`` with the ``d_ff`` whose exact total parameter count is nearest ``base``'s.

    The total is ``c + L·k·d·d_ff`` (``k`` = ``FFN_MATRICES[config.ffn]``; ``c`` counts everything
    else, the gate included when on), so the nearest integer is ``round((base_total - c) / (L·k·d))``
    (ties to the smaller). Raises ``ValueError`` when that ``d_ff`` is below 1 or its total is more
    than ``tolerance`` (relative) away from ``base``'s.
    """
    target = budget(base).total_params
    per_unit = config.n_layers * FFN_MATRICES[config.ffn] * config.d_model
    rest = budget(dataclasses.replace(config, d_ff=1)).total_params - per_unit
    num = target - rest
    d_ff = num // per_unit + (1 if 2 * (num % per_unit) > per_unit else 0)
    if d_ff < 1:
        raise ValueError(f"no d_ff matches {target:,} parameters: the rest of the model alone has {rest:,}")
    matched = dataclasses.replace(config, d_ff=d_ff)
    gap = abs(budget(matched).total_params - target) / target
    if gap > tolerance:
        raise ValueError(
            f"the nearest d_ff={d_ff} gives {budget(matched).total_params:,} parameters, {gap:.2%} from "
            f"{target:,} (more than {tolerance:.1%})"
        )
    return matched
