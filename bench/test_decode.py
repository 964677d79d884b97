"""CUDA decoding and prefill of the 13m preset in bf16 (issues 3 and 6).

- Decoding: a 512-token prompt, then 256 greedy new tokens, at batch 1, 8 and 64; tokens/s counts
  the new tokens over the whole ``generate`` call (the prompt's prefill included). Goal (issue 6,
  ``wiola.fast``): at least 8,000 tokens/s at batch 1.
- Prefill: one forward over the prompt into a fresh cache, logits for the last token only, at
  T 512 and 2048 (the preset with ``max_seq_len=2048``), batch 1 and 8; tokens/s = B·T / time.

The measured implementation is ``wiola.fast.WiolaModel`` when it exists, with the reference and
the published ``wiola13m`` (Hugging Face ``generate``, same weights) as baselines; without it, the
reference is measured against wiola13m. Greedy tokens are compared before timing: the reference
and wiola.fast must agree exactly; wiola13m's are reported (bf16 rounding may make a near-tie
flip), not asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import wiola
from bench import roofline
from bench.hf_baseline import hf_greedy, wiola13m_like

PROMPT, NEW_TOKENS = 512, 256
DECODE_BATCHES = [1, 8, 64]
PREFILL_SHAPES = [dict(B=1, T=512), dict(B=8, T=512), dict(B=1, T=2048), dict(B=8, T=2048)]
DTYPE = torch.bfloat16


def _models(max_seq_len: int = 1024) -> dict[str, Any]:
    """The implementations on the same random weights: reference, wiola.fast, wiola13m (or why not)."""
    cfg = wiola.WiolaConfig.preset("13m", max_seq_len=max_seq_len)
    torch.manual_seed(0)
    ref = wiola.WiolaModel(cfg).to("cuda", DTYPE).eval()
    out: dict[str, Any] = {"config": cfg, "reference": ref}
    try:
        import wiola.fast as fast

        fm = fast.WiolaModel(cfg).to("cuda", DTYPE).eval()
        fm.load_state_dict(ref.state_dict())
        out["wiola.fast"] = fm
    except Exception as exc:
        out["wiola.fast"] = f"wiola.fast unavailable: {type(exc).__name__}: {exc}"
    try:
        out["wiola13m"] = wiola13m_like(ref)
    except Exception as exc:
        out["wiola13m"] = f"wiola13m unavailable: {type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("CUDA benchmark: no CUDA device on this machine")
    return _models()


@pytest.fixture(scope="module")
def long_models() -> dict[str, Any]:
    if not torch.cuda.is_available():
        pytest.skip("CUDA benchmark: no CUDA device on this machine")
    return _models(max_seq_len=2048)


def _split(fns: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """(name, fn, baselines): wiola.fast is measured when it exists, else the reference."""
    name = "wiola.fast" if callable(fns.get("wiola.fast")) else "reference"
    return name, fns[name], {k: v for k, v in fns.items() if k not in (name, "wiola.fast")}


@pytest.mark.parametrize("batch", DECODE_BATCHES, ids=lambda b: f"B{b}-P{PROMPT}-N{NEW_TOKENS}")
def test_decode_cuda(cuda_bench, models, batch: int) -> None:
    cfg = models["config"]
    new = 16 if cuda_bench.quick else NEW_TOKENS
    gen = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch, PROMPT), device="cuda", generator=gen)
    ref = models["reference"]
    fns: dict[str, Any] = {"reference": lambda: ref.generate(ids, new, temperature=0)}
    expected = fns["reference"]()
    notes = []
    if isinstance(models["wiola.fast"], str):
        notes.append(models["wiola.fast"])
    else:
        fm = models["wiola.fast"]
        fns["wiola.fast"] = lambda: fm.generate(ids, new, temperature=0)
        got = fns["wiola.fast"]()
        bad = (got != expected).nonzero()
        assert bad.numel() == 0, f"wiola.fast greedy tokens differ from the reference's first at {bad[0].tolist()}"
    hf = models["wiola13m"]
    if isinstance(hf, str):
        fns["wiola13m"] = hf
    else:
        fns["wiola13m"] = lambda: hf_greedy(hf, ids, new)
        same = (fns["wiola13m"]() == expected).all(dim=1).float().mean().item()
        notes.append(f"wiola13m greedy tokens identical to the reference in {same:.0%} of rows (bf16)")

    name, fn, baselines = _split(fns)
    cost = roofline.prefill(cfg, batch, PROMPT, DTYPE) + roofline.decode(cfg, batch, PROMPT, new - 1, DTYPE)
    cuda_bench.run(
        fn,
        op="decode",
        mode="greedy",
        name=name,
        cost=cost,
        shape={"B": batch, "P": PROMPT, "N": new},
        dtype=DTYPE,
        tokens=batch * new,
        baselines=baselines,
        notes=notes,
    )


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: f"B{s['B']}-T{s['T']}")
def test_prefill_cuda(cuda_bench, long_models, shape: dict[str, int]) -> None:
    models = long_models
    cfg = models["config"]
    B, T = shape["B"], shape["T"]

    def prefill_fn(model: Any) -> Callable[[torch.Tensor], Any]:
        def run(ids: torch.Tensor) -> Any:
            with torch.inference_mode():
                return model(ids, cache=model.new_cache(B, T), logits_to_keep=1).logits

        return run

    fns: dict[str, Any] = {"reference": prefill_fn(models["reference"])}
    notes = []
    if isinstance(models["wiola.fast"], str):
        notes.append(models["wiola.fast"])
    else:
        fns["wiola.fast"] = prefill_fn(models["wiola.fast"])
    hf = models["wiola13m"]
    if isinstance(hf, str):
        fns["wiola13m"] = hf
    else:

        def hf_prefill(ids: torch.Tensor) -> Any:
            with torch.inference_mode():
                return hf(ids, use_cache=True).logits[:, -1:]

        fns["wiola13m"] = hf_prefill
        notes.append("wiola13m computes the logits of every position (its forward has no option to skip them)")

    name, fn, baselines = _split(fns)
    cuda_bench.run(
        fn,
        op="prefill",
        mode="fwd",
        name=name,
        cost=roofline.prefill(cfg, B, T, DTYPE),
        shape={"B": B, "T": T},
        dtype=DTYPE,
        inputs=lambda: torch.randint(0, cfg.vocab_size, (B, T), device="cuda"),
        tokens=B * T,
        baselines=baselines,
        notes=notes,
    )
