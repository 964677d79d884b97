"""The top-p nucleus decided in C++ (``decode_step_cpu.nucleus_rows``, ``wiola_nucleus``; the fast
model's ``cpu_nucleus``) against the reference (``wiola.generation.nucleus_drop``: the float64
softmax of the logits sorted by ``torch.sort``, summed in order).

The C++ does not reproduce torch's float64 rounding: it proves each decision with a bound on both
sides' error and hands the row to the reference where the bound cannot decide. So the masks must be
equal everywhere: for every ``top_p``, after a top-k filter, with ties, ±0, NaN, infinities, odd
sizes, every instruction-set variant this CPU runs; with ``top_p`` put exactly on the reference's own
sums (the bound must hand over), a few ulps from them and 1e-9 and 1e-6 away (it must decide, or the
bound is not the tight one the cost of sampling assumes). The reference is asked where the nucleus
ends inside a run of equal logits and nowhere else; an error it raises reaches the caller; the
exponential's error stays within the bound the C++ assumes."""

from __future__ import annotations

import pytest
import torch
from conftest import ISAS_HERE
from numerics import platform_line

import wiola.fast.generation as fast_generation
import wiola.generation
from wiola.generation import filter_logits, nucleus_drop

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")

if decode_step_cpu.load() is None:
    pytest.skip(f"the CPU decode step is not built: {decode_step_cpu.BUILD_ERROR}", allow_module_level=True)

PATH = {name: i for i, name in enumerate(decode_step_cpu.NUCLEUS_PATHS)}


def _special(B: int, V: int, seed: int) -> torch.Tensor:
    """Logits with runs of equal values, both zeros, NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 4).round() / 2  # many ties
    x[0, ::7] = 0.0
    x[0, ::11] = -0.0
    if V > 3 and B > 1:
        x[-1, 1] = float("nan")
        x[-1, 2] = float("inf")
        x[-1, 3] = float("-inf")
    return x


def _above(x: torch.Tensor) -> torch.Tensor:
    """The reference's float64 ``cumsum(probs) - probs`` of each row sorted in descending order."""
    probs = torch.softmax(torch.sort(x, dim=-1, descending=True).values.double(), dim=-1)
    return torch.cumsum(probs, dim=-1) - probs


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_the_exponential_is_within_the_bound_the_nucleus_assumes(isa):
    """``exp_nonpositive_double`` against ``std::exp`` over a million points of [-708, 0] and of
    [-1, 0]: within 2^-50, a quarter of the 2^-48 (``kExpDoubleError``) the bound counts on."""
    lib = decode_step_cpu.load(isa)
    for lo in (-708.0, -1.0):
        worst = lib.wiola_exp_error(lo, 10**6)
        assert worst <= 2**-50, f"{isa}: exp error {worst:.3g} on [{lo}, 0]; {platform_line(isa)}"


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("B,V", [(1, 1), (1, 2), (3, 17), (2, 300), (4, 32000)], ids=lambda v: str(v))
def test_the_mask_is_the_references(isa, B, V):
    g = torch.Generator().manual_seed(V)
    cases = {"randn": torch.randn(B, V, generator=g) * 3, "ties": _special(B, V, V), "wide": torch.randn(B, V) * 40}
    paths = torch.zeros(len(PATH), dtype=torch.int64)
    for name, x in cases.items():
        for top_p in (1e-300, 1e-9, 0.3, 0.9, 0.95, 0.999999, 1 - 2**-53):
            for k in (None, 20):
                logits = x if k is None or k >= V else filter_logits(x, k, None)
                drop, path = decode_step_cpu.nucleus_rows(logits.contiguous(), top_p, isa=isa)
                assert torch.equal(drop, nucleus_drop(logits, top_p)), (
                    f"{name} B={B} V={V} top_p={top_p} top_k={k}: the mask differs; {platform_line(isa)}"
                )
                paths += torch.bincount(path, minlength=len(PATH))
    if V >= 300:
        assert paths[PATH["bound"]] > paths[PATH["caller"]], f"the bound decided too few rows: {paths.tolist()}"


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("V", [5, 203, 4099])
def test_top_p_on_the_references_own_sums(isa, V):
    """``top_p`` exactly equal to the reference's float64 sum above a rank (the reference drops that
    rank): no bound can tell which side torch's rounding falls, so the C++ must hand the row over.
    One and four ulps away the reference still decides alone or the bound is wide; 1e-9 and 1e-6
    away the bound (about 1e-12 wide for 4,099 ids) must decide by itself."""
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(V)) * 2
    above = _above(x)[0]
    for rank in sorted({1, 2, V // 2, V - 1}):
        if rank >= V:
            continue
        a = float(above[rank])
        for shift, expected in ((0.0, "caller"), (1e-9, "bound"), (-1e-9, "bound"), (1e-6, "bound"), (-1e-6, "bound")):
            top_p = a + shift
            if not 0 < top_p < 1:
                continue
            drop, path = decode_step_cpu.nucleus_rows(x, top_p, isa=isa)
            where = f"V={V} rank {rank} top_p = sum {shift:+g}; {platform_line(isa)}"
            assert torch.equal(drop, nucleus_drop(x, top_p)), f"the mask differs: {where}"
            assert decode_step_cpu.NUCLEUS_PATHS[int(path[0])] == expected, f"decided by the wrong path: {where}"
        for ulps in (1, 4):
            top_p = a
            for _ in range(ulps):
                top_p = float(torch.nextafter(torch.tensor(top_p, dtype=torch.float64), torch.tensor(2.0).double()))
            drop, _ = decode_step_cpu.nucleus_rows(x, top_p, isa=isa)
            assert torch.equal(drop, nucleus_drop(x, top_p)), f"V={V} rank {rank} +{ulps} ulps; {platform_line(isa)}"


def test_the_reference_decides_ties_at_the_edge_and_nothing_else(monkeypatch):
    """Four equal logits at the edge of a 0.5 nucleus: which of them stay depends on torch.sort's
    order of equal ids, so the reference decides (one call); with distinct logits, none."""
    calls = []

    def reference(logits, top_p):
        calls.append(top_p)
        return nucleus_drop(logits, top_p)

    monkeypatch.setattr(wiola.generation, "nucleus_drop", reference)
    tied = torch.tensor([[0.0, 2.0, 2.0, 2.0, 2.0, -1.0, -3.0]])  # each 2.0 about 0.24 of the mass
    drop, path = decode_step_cpu.nucleus_rows(tied, 0.5)
    assert torch.equal(drop, nucleus_drop(tied, 0.5)) and path.tolist() == [PATH["caller"]]
    assert calls == [0.5]
    distinct = torch.tensor([[0.0, 2.5, 2.0, 1.5, 1.0, -1.0, -3.0]])
    drop, path = decode_step_cpu.nucleus_rows(distinct, 0.5)
    assert torch.equal(drop, nucleus_drop(distinct, 0.5)) and path.tolist() == [PATH["bound"]]
    assert calls == [0.5], "the reference ran where the bound decides alone"


def test_rows_the_softmax_leaves_nan_drop_nothing():
    """A NaN, a +inf or only -inf in a row: the reference's softmax is NaN and drops nothing."""
    x = torch.randn(3, 50)
    x[0, 7] = float("nan")
    x[1, 3] = float("inf")
    x[2] = float("-inf")
    drop, path = decode_step_cpu.nucleus_rows(x, 0.5)
    assert torch.equal(drop, nucleus_drop(x, 0.5)) and not drop.any()
    assert path.tolist() == [PATH["none"]] * 3


def test_an_error_in_the_reference_reaches_the_caller(monkeypatch):
    def broken(logits, top_p):
        raise MemoryError("no room for the sort")

    monkeypatch.setattr(wiola.generation, "nucleus_drop", broken)
    with pytest.raises(MemoryError, match="no room for the sort"):
        decode_step_cpu.nucleus_rows(torch.zeros(1, 8), 0.5)  # all tied: the reference is asked
    assert decode_step_cpu.nucleus_rows(torch.arange(8.0)[None], 0.5) is not None  # nothing left over
    samplers = decode_step_cpu.Samplers(2, 8, 1, ([1, 1], [1.0, 1.0], [0, 0], [1.0, 0.5], [0, 0]))
    samplers.log_noise.zero_()
    with pytest.raises(MemoryError, match="no room for the sort"):  # the sampler: its second row tied
        decode_step_cpu.sample_rows(decode_step_cpu.load(), torch.zeros(2, 8), samplers)


@pytest.mark.parametrize("top_p", [1e-9, 0.3, 0.95, torch.tensor(0.8, dtype=torch.float64)], ids=str)
def test_cpu_nucleus_is_the_references(top_p):
    """The fast model's hook (``CPU_SAMPLING``): the C++ for a float ``top_p``, the reference for a
    tensor one."""
    torch.manual_seed(0)
    for logits in (torch.randn(3, 1000) * 2, _special(2, 500, 3)):
        assert torch.equal(fast_generation.cpu_nucleus(logits, top_p), nucleus_drop(logits, top_p)), top_p
