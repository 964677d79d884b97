"""AdamW and its warm-up + cosine schedule.

Weight decay applies to every matrix (``p.dim() >= 2``): the projections, the butterfly, the
gate's ``W_1``/``W_2`` and the embedding, which is also the tied output head. That is the paper's
"matrices only" read literally, and the Hugging Face Trainer's default (only biases and norm
weights exempt) for a model like ``wiola13m``. RMSNorm γ and the gate bias ``b_2`` are not
decayed. The paper gives no final learning rate: the cosine decays to ``min_lr_ratio`` (0 in the
paper recipe) after the linear warm-up, as Hugging Face's "cosine" schedule does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from wiola.train.config import TrainConfig


class WarmupCosine:
    """``lr(step) / lr``: linear warm-up from ``1/warmup`` to 1 over ``warmup`` steps, then a
    cosine from 1 down to ``min_ratio`` at ``total`` steps. A picklable callable for ``LambdaLR``."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (see the module docstring); fused on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def schedule(cfg: TrainConfig) -> WarmupCosine:
    """The learning-rate multiplier of ``cfg`` (its warm-up, steps and final ratio)."""
    return WarmupCosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over ``schedule(cfg)``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg))
