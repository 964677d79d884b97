"""The top-p nucleus on a CPU with its sort in C++ (``wiola.fast.generation.cpu_nucleus``,
``decode_step_cpu.sort_descending``) against the reference (``wiola.generation.nucleus_drop``,
``torch.sort``): the C++ sort equals ``torch.sort(descending=True, stable=True)`` (values and ids:
ties, -0.0 and 0.0, NaN, infinities, odd sizes, several rows, every instruction-set variant this
CPU runs), and the nucleus mask equals the reference's for every ``top_p``, also where the nucleus
ends inside a run of equal logits (there the reference itself decides: checked), after a top-k
filter, and for a ``top_p`` given as a tensor."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS_HERE
from numerics import platform_line

import wiola.fast.generation as fast_generation
from wiola.generation import filter_logits, nucleus_drop

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")

if decode_step_cpu.load() is None:
    pytest.skip(f"the CPU decode step is not built: {decode_step_cpu.BUILD_ERROR}", allow_module_level=True)


def _special(B: int, V: int, seed: int) -> torch.Tensor:
    """Logits with runs of equal values, both zeros, NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 4).round() / 2  # many ties
    x[0, ::7] = 0.0
    x[0, ::11] = -0.0
    if V > 3:
        x[-1, 1] = float("nan")
        x[-1, 2] = float("inf")
        x[-1, 3] = float("-inf")
    return x


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("B,V", [(1, 1), (1, 2), (3, 17), (2, 300), (4, 32000)], ids=lambda v: str(v))
def test_sort_descending_equals_torchs_stable_sort(isa, B, V):
    for seed, x in enumerate((torch.randn(B, V, generator=torch.Generator().manual_seed(V)) * 3, _special(B, V, V))):
        got = decode_step_cpu.sort_descending(x, isa=isa)
        want = torch.sort(x, dim=-1, descending=True, stable=True)
        assert got is not None
        where = f"B={B} V={V} case {seed} ({platform_line(isa)})"
        assert torch.equal(got[1], want.indices), f"ids differ: {where}"
        assert torch.equal(got[0].view(torch.int32), x.gather(-1, want.indices).view(torch.int32)), f"values: {where}"


def test_sort_descending_declines_what_it_does_not_read():
    for x in (torch.randn(5), torch.randn(2, 5, dtype=torch.float64), torch.randn(5, 2).t(), torch.randn(2, 2, 2)):
        assert decode_step_cpu.sort_descending(x) is None


@pytest.mark.parametrize("top_p", [0.0, 1e-9, 0.3, 0.9, 0.95, 0.999999, torch.tensor(0.8)], ids=str)
def test_cpu_nucleus_equals_the_reference(top_p):
    torch.manual_seed(0)
    for logits in (torch.randn(3, 1000) * 2, torch.randn(2, 32000), _special(2, 500, 3)):
        assert torch.equal(fast_generation.cpu_nucleus(logits, top_p), nucleus_drop(logits, top_p)), top_p
        topk = filter_logits(logits, 20, None)  # -inf beyond the top 20, as sample_next filters before
        assert torch.equal(fast_generation.cpu_nucleus(topk, top_p), nucleus_drop(topk, top_p)), f"top-k, {top_p}"


def test_a_nucleus_that_ends_inside_equal_logits_is_the_references(monkeypatch):
    """Four equal logits at the boundary of a 0.5 nucleus: which of them stay depends on the order of
    equal ids, so the reference decides; with the boundary between distinct logits the C++ order
    decides alone."""
    calls = []

    def reference(logits, top_p):
        calls.append(top_p)
        return nucleus_drop(logits, top_p)

    monkeypatch.setattr(fast_generation, "nucleus_drop", reference)
    tied = torch.tensor([[0.0, 2.0, 2.0, 2.0, 2.0, -1.0, -3.0]])  # each 2.0 about 0.24 of the mass
    assert torch.equal(fast_generation.cpu_nucleus(tied, 0.5), nucleus_drop(tied, 0.5))
    assert calls == [0.5]
    distinct = torch.tensor([[0.0, 2.5, 2.0, 1.5, 1.0, -1.0, -3.0]])
    assert torch.equal(fast_generation.cpu_nucleus(distinct, 0.5), nucleus_drop(distinct, 0.5))
    assert calls == [0.5], "the reference ran where the C++ sort decides alone"
