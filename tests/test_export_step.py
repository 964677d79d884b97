"""``wiola.export.step.DecodeStep`` (the traceable one-token step that exports carry) against the
model's own full pass, and ``wiola.export.runner.StepDriver`` (the numpy decoding loop around it)
against ``model.generate``: fp32, int8 and bf16 weights, left padding, the gate's variants."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from numerics import AbsSums, assert_within, bound, left_padded_prompt, reference_on

from wiola import WiolaConfig, WiolaModel
from wiola.export.runner import StepDriver
from wiola.export.step import DecodeStep, torch_runner
from wiola.fast import WiolaModel as FastModel
from wiola.fast.quantize import quantize

SMALL = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64, init_std=0.2)


def _model(cls: type = WiolaModel, **overrides: object) -> WiolaModel:
    torch.manual_seed(0)
    return cls(WiolaConfig(**{**SMALL, **overrides})).eval().requires_grad_(False)


def driver(model: WiolaModel) -> StepDriver:
    c = model.config
    step = DecodeStep(model)
    return StepDriver(
        torch_runner(step),
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        max_seq_len=c.max_seq_len,
    )


def stepped_logits(model: WiolaModel, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, T, V)`` logits of every prompt position, one step a token."""
    logits: list[np.ndarray] = []
    driver(model).generate(ids.numpy(), 0, attention_mask=None if mask is None else mask.numpy(), logits_out=logits)
    return torch.from_numpy(np.stack(logits, axis=1))


def assert_steps_equal_the_pass(
    name: str, model: WiolaModel, reference: WiolaModel, ids: torch.Tensor, mask: torch.Tensor
) -> None:
    """``model`` stepped one token at a time gives ``reference``'s full-pass logits at every real
    (unpadded) position, within the error bound of the pass's absolute sums."""
    with AbsSums(reference) as sums:
        ref = reference(ids, attention_mask=mask).logits
    got = stepped_logits(model, ids, mask)
    real = mask.bool()
    allowed = bound(model.config, ids.shape[1], sums.head)[real]
    assert_within(name, ref[real], got[real], allowed, "ONNX Runtime CPU")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"gate_pre_rope": False}, {"gate": False}, {"helix_alpha": 0.0}],
    ids=lambda o: str(o) or "default",
)
@pytest.mark.parametrize("B, pad", [(1, 0), (3, 5)])
def test_step_by_step_equals_the_full_pass(overrides: dict, B: int, pad: int) -> None:
    model = _model(**overrides)
    ids, mask = left_padded_prompt(model.config.vocab_size, B, 12, pad)
    assert_steps_equal_the_pass(f"logits {overrides}", model, model, ids, mask)


@pytest.mark.parametrize("scheme", ["int8", "bf16"])
def test_quantized_step_equals_the_dequantized_oracle(scheme: str) -> None:
    model = quantize(_model(FastModel), scheme)
    step = DecodeStep(model)
    held = {name: module.weight.dtype for name, module in step.named_modules() if hasattr(module, "dense")}
    assert set(held.values()) == {torch.int8 if scheme == "int8" else torch.bfloat16}, held  # packed, not fp32
    ids, mask = left_padded_prompt(model.config.vocab_size, 3, 10, 4)
    oracle = reference_on(model)  # the PyTorch path on the dequantized weights
    assert_steps_equal_the_pass(f"{scheme} logits", model, oracle, ids, mask)


@pytest.mark.parametrize("B, pad", [(1, 0), (4, 6)])
def test_greedy_tokens_equal_generate(B: int, pad: int) -> None:
    model = _model()
    ids, mask = left_padded_prompt(model.config.vocab_size, B, 10, pad)
    ref = model.generate(ids, 30, attention_mask=mask)
    got = driver(model).generate(ids.numpy(), 30, attention_mask=mask.numpy())
    np.testing.assert_array_equal(got, ref.numpy())


def test_eos_stops_a_row_and_pads_it_as_generate_does() -> None:
    model = _model()
    ids, mask = left_padded_prompt(model.config.vocab_size, 3, 8, 3)
    free = model.generate(ids, 20, attention_mask=mask)
    eos = int(free[0, 8 + 4])  # row 0 emits it at its fifth new token
    ref = model.generate(ids, 20, attention_mask=mask, eos_token_id=eos, pad_token_id=7)
    got = driver(model).generate(ids.numpy(), 20, attention_mask=mask.numpy(), eos_token_id=eos, pad_token_id=7)
    np.testing.assert_array_equal(got, ref.numpy())
    assert (got[0, 8 + 5 :] == 7).all()
    # Row 0 alone: every row has finished, so the loop ends early and pads the rest itself.
    ref = model.generate(ids[:1], 20, attention_mask=mask[:1], eos_token_id=eos, pad_token_id=7)
    got = driver(model).generate(ids[:1].numpy(), 20, attention_mask=mask[:1].numpy(), eos_token_id=eos, pad_token_id=7)
    np.testing.assert_array_equal(got, ref.numpy())
    assert (got[0, 8 + 5 :] == 7).all() and got.shape == (1, 8 + 20)


def test_the_step_leaves_the_model_alone() -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    step = DecodeStep(model)
    with torch.no_grad():
        for t in step.buffers():
            if t.is_floating_point():
                t.add_(1.0)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_bad_models_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="bfloat16.*fp32"):
        DecodeStep(_model().to(torch.bfloat16))
    d = driver(_model())
    ids = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="token id 300 is outside"):
        d.generate(ids + 300, 2)
    with pytest.raises(ValueError, match="past max_seq_len=64"):
        d.generate(ids, 61)
    with pytest.raises(TypeError, match="integers"):
        d.generate(ids.astype(np.float32), 2)
    with pytest.raises(ValueError, match="attention_mask shape"):
        d.generate(ids, 2, attention_mask=np.ones((1, 3)))
    with pytest.raises(ValueError, match="only 0 and 1"):
        d.generate(ids, 2, attention_mask=np.full((1, 4), 2))
    with pytest.raises(ValueError, match="left padding"):
        d.generate(ids, 2, attention_mask=np.array([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="non-empty"):
        d.generate(np.zeros((1, 0), dtype=np.int64), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        d.generate(ids, -1)
