"""A whole training step: forward with the loss, backward, AdamW.

- CPU: the tiny preset at B 4, T 256 (fp32), tokens/s (the smoke run uses B 1, T 32).
- CUDA: the paper's 13m preset at T 512, B 32 and 64, bf16 autocast with fp32 master weights,
  fused AdamW; tokens/s and MFU against the measured bf16 matmul peak. The measured model is
  ``wiola.fast.WiolaModel`` when it exists, with the reference eager and ``torch.compile`` of the
  reference as baselines (without ``wiola.fast`` the reference eager is measured against its
  compiled self). Goal (issue 6): at least 1.5× ``torch.compile`` of the reference and 25% MFU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import wiola
from bench import roofline

CUDA_SHAPES = [dict(B=32, T=512), dict(B=64, T=512)]


def _fast_model_class() -> type | str:
    """``wiola.fast.WiolaModel``, or why it is unavailable."""
    try:
        import wiola.fast as fast

        return fast.WiolaModel
    except Exception as exc:
        return f"wiola.fast unavailable: {type(exc).__name__}: {exc}"


def make_step(model: torch.nn.Module, device: str, compiled: bool = False) -> Callable[[torch.Tensor], None]:
    """One training step of ``model`` (bf16 autocast on CUDA) with its own AdamW, on ids ``(B, T)``."""
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=fused)
    forward = torch.compile(model) if compiled else model

    def step(ids: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = forward(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _random_ids(B: int, T: int, V: int, device: str) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, V, (B, T), device=device)


def test_train_step_cpu(cpu_bench) -> None:
    cfg = wiola.WiolaConfig.preset("tiny")
    B, T = (1, 32) if cpu_bench.quick else (4, 256)
    torch.manual_seed(0)
    model = wiola.WiolaModel(cfg).train()
    cpu_bench.run(
        make_step(model, "cpu"),
        op="train_step",
        mode="fwd_bwd_adamw",
        name="reference",
        cost=roofline.train_step(cfg, B, T, torch.float32),
        shape={"preset": "tiny", "B": B, "T": T},
        dtype=torch.float32,
        inputs=_random_ids(B, T, cfg.vocab_size, "cpu"),
        tokens=B * T,
        notes=["fp32, torch.optim.AdamW (foreach)"],
    )


@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: f"13m-B{s['B']}-T{s['T']}")
def test_train_step_cuda(cuda_bench, shape: dict[str, int]) -> None:
    cfg = wiola.WiolaConfig.preset("13m")
    B, T = shape["B"], shape["T"]
    torch.manual_seed(0)
    init = wiola.WiolaModel(cfg).state_dict()

    def reference(compiled: bool) -> Callable[[torch.Tensor], None]:
        m = wiola.WiolaModel(cfg).to("cuda").train()
        m.load_state_dict(init)
        return make_step(m, "cuda", compiled)

    fast_cls = _fast_model_class()
    if isinstance(fast_cls, str):
        name, ours = "reference", reference(False)
        baselines = {"torch.compile": reference(True)}
        notes = [fast_cls]
    else:
        fm = fast_cls(cfg).to("cuda").train()
        fm.load_state_dict(init)
        name, ours = "wiola.fast", make_step(fm, "cuda")
        baselines = {"reference": reference(False), "torch.compile": reference(True)}
        notes = []
    cuda_bench.run(
        ours,
        op="train_step",
        mode="fwd_bwd_adamw",
        name=name,
        cost=roofline.train_step(cfg, B, T, torch.bfloat16),
        shape={"preset": "13m", "B": B, "T": T},
        dtype=torch.bfloat16,
        inputs=_random_ids(B, T, cfg.vocab_size, "cuda"),
        tokens=B * T,
        baselines=baselines,
        notes=["bf16 autocast, fp32 master weights, fused AdamW", *notes],
    )
