"""CPU decoding (issue 2's benchmark): the 13m preset, fp32, batch 1 and 8, a 16-token prompt and
128 greedy new tokens, against the published ``wiola13m`` package's Hugging Face ``generate`` on
the same weights, identical tokens asserted. Goal: at least 4× wiola13m at batch 1.

Two rows: ``wiola.WiolaModel.generate`` (the readable reference, PyTorch ops) and
``wiola.fast.WiolaModel.generate``, whose one-token steps run the C++ step of
``kernels/decode_step_cpu`` (every layer and the head in one call).

Under ``--benchmark-disable`` (the CI smoke run) only 8 tokens are generated.
"""

from __future__ import annotations

import pytest
import torch

import wiola
from bench import roofline
from bench.hf_baseline import hf_greedy, wiola13m_like

PROMPT, NEW_TOKENS, SMOKE_TOKENS = 16, 128, 8
BATCHES = [1, 8]


@pytest.fixture(scope="module")
def model() -> wiola.WiolaModel:
    torch.manual_seed(0)
    return wiola.WiolaModel(wiola.WiolaConfig.preset("13m")).eval()


@pytest.fixture(scope="module")
def hf_model(model: wiola.WiolaModel):
    """wiola13m on our weights, or the reason it is unavailable (a string)."""
    try:
        return wiola13m_like(model)
    except Exception as exc:  # ImportError without the package, or a transformers it cannot run on
        return f"wiola13m unavailable: {type(exc).__name__}: {exc}"


def _prompt(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + batch)
    return torch.randint(0, 32000, (batch, PROMPT), generator=gen)


def _cost(config: wiola.WiolaConfig, batch: int, new: int) -> roofline.Cost:
    # The prompt's forward gives the first new token; each further token costs one decoding step.
    cost = roofline.prefill(config, batch, PROMPT, torch.float32)
    if new > 1:
        cost = cost + roofline.decode(config, batch, PROMPT, new - 1, torch.float32)
    return cost


def _wiola13m_baseline(hf_model, ids: torch.Tensor, new: int, ours: torch.Tensor):
    """wiola13m's greedy ``generate`` as a baseline, after asserting it gives our tokens (or the
    reason it is unavailable)."""
    if isinstance(hf_model, str):
        return hf_model
    mismatch = (hf_greedy(hf_model, ids, new) != ours).nonzero()
    assert mismatch.numel() == 0, f"greedy tokens differ from wiola13m's first at (row, slot) {mismatch[0].tolist()}"
    return lambda: hf_greedy(hf_model, ids, new)


def _summary(batch: int, name: str, rec: dict) -> None:
    hf = rec["baselines"]["wiola13m"]
    if "speedup" in hf:
        print(
            f"\ndecode CPU B{batch}: {name} {rec['tokens_per_s']:.1f} tok/s, wiola13m {hf['tokens_per_s']:.1f} tok/s, "
            f"ratio {hf['speedup']:.2f}x (goal at B1: >= 4x)"
        )


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu(cpu_bench, model, hf_model, batch: int) -> None:
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)

    def ours() -> torch.Tensor:
        return model.generate(ids, new, temperature=0)

    baselines = {}
    expected = ours()
    assert expected.shape == (batch, PROMPT + new), f"generate returned shape {tuple(expected.shape)}"
    baselines["wiola13m"] = _wiola13m_baseline(hf_model, ids, new, expected)

    rec = cpu_bench.run(
        ours,
        op="decode_cpu",
        mode="greedy",
        name="reference",
        cost=_cost(model.config, batch, new),
        shape={"B": batch, "P": PROMPT, "N": new},
        dtype=torch.float32,
        tokens=batch * new,
        baselines=baselines,
        notes=["13m preset, random weights, same weights in every implementation; greedy tokens identical"],
    )
    if not cpu_bench.quick:
        _summary(batch, "reference", rec)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cpu_fast(cpu_bench, model, hf_model, batch: int) -> None:
    fast = pytest.importorskip("wiola.fast", reason="wiola.fast does not exist yet")
    if not hasattr(fast, "WiolaModel"):
        pytest.skip("wiola.fast.WiolaModel does not exist yet")
    new = SMOKE_TOKENS if cpu_bench.quick else NEW_TOKENS
    ids = _prompt(batch)
    fast_model = fast.WiolaModel(model.config).eval()
    fast_model.load_state_dict(model.state_dict())

    expected = model.generate(ids, new, temperature=0)
    got = fast_model.generate(ids, new, temperature=0)
    mismatch = (got != expected).nonzero()
    assert mismatch.numel() == 0, (
        f"wiola.fast greedy tokens differ from the reference's first at {mismatch[0].tolist()}"
    )
    baselines = {"reference": lambda: model.generate(ids, new, temperature=0)}
    baselines["wiola13m"] = _wiola13m_baseline(hf_model, ids, new, got)

    rec = cpu_bench.run(
        lambda: fast_model.generate(ids, new, temperature=0),
        op="decode_cpu",
        mode="greedy",
        name="wiola.fast",
        cost=_cost(model.config, batch, new),
        shape={"B": batch, "P": PROMPT, "N": new},
        dtype=torch.float32,
        tokens=batch * new,
        baselines=baselines,
        notes=["13m preset, random weights; greedy tokens identical to the reference and to wiola13m"],
    )
    if not cpu_bench.quick:
        _summary(batch, "wiola.fast", rec)
