"""``wiola.ops.linear.linear`` on a CPU: each fp32 GEMM (``cpu_gemm``: ATen's, oneDNN's) and the
decoding layout within the fp32 error bound of the float64 product, and where each path applies."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from numerics import LAMBDA, U32, assert_within

from wiola.ops import linear as L

needs_onednn = pytest.mark.skipif(not L.onednn_available(), reason="this torch has no oneDNN")

# (rows, in, out): the 13m preset's prompt products (q/k/v, up, down) and its tied head, odd sizes.
SHAPES = [(512, 256, 768), (130, 256, 1024), (65, 512, 256), (200, 256, 4000), (97, 72, 33)]


def _operands(rows: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / math.sqrt(k)


def _allowed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """λ·√K·u·Σ|w·x| per output (``tests/numerics.py``): one fp32 side against the float64 product."""
    return LAMBDA * math.sqrt(x.shape[-1]) * U32 * (x.double().abs() @ w.double().abs().T)


class _Spy:
    """Counts the products ``linear`` sends to oneDNN."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, real = 0, L._onednn_applies

        def counted(x: torch.Tensor, w: torch.Tensor) -> bool:
            ran = real(x, w)
            self.calls += ran
            return ran

        monkeypatch.setattr(L, "_onednn_applies", counted)


@pytest.mark.parametrize("gemm", L.CPU_GEMMS)
@pytest.mark.parametrize("rows,k,n", SHAPES, ids=[f"{r}x{k}x{n}" for r, k, n in SHAPES])
def test_each_gemm_within_the_fp32_bound(gemm, rows, k, n, monkeypatch):
    if gemm == "onednn" and not L.onednn_available():
        pytest.skip("this torch has no oneDNN")
    spy = _Spy(monkeypatch)
    x, w = _operands(rows, k, n)
    with torch.no_grad(), L.cpu_gemm(gemm):
        got = L.linear(x.view(1, rows, k), w)[0]
    assert spy.calls == (gemm == "onednn"), f"{gemm}: {spy.calls} products went to oneDNN"
    want = x.double() @ w.double().T
    assert_within(f"linear[{gemm}, {rows}x{k}x{n}]", want, got, _allowed(x, w), f"GEMM {gemm}")


@needs_onednn
@pytest.mark.parametrize("layout", ["column slice", "row stride", "transposed", "expanded"])
def test_onednn_reads_strided_inputs(layout, monkeypatch):
    """oneDNN's product of a non-contiguous ``x`` (views as the model's layers make them) within
    the fp32 bound of the float64 product, counted on oneDNN."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    k = 256
    x = {
        "column slice": lambda: torch.randn(3, 100, k + 40, generator=gen)[:, :, 20 : 20 + k],
        "row stride": lambda: torch.randn(3, 200, k, generator=gen)[:, ::2],
        "transposed": lambda: torch.randn(3, k, 100, generator=gen).transpose(1, 2),
        "expanded": lambda: torch.randn(1, 100, k, generator=gen).expand(3, 100, k),
    }[layout]()
    w = torch.randn(300, k, generator=gen) / math.sqrt(k)
    assert not x.is_contiguous()
    with torch.no_grad(), L.cpu_gemm("onednn"):
        got = L.linear(x, w)
    assert spy.calls == 1
    want = x.double() @ w.double().T
    xs = x.reshape(-1, k)
    allowed = _allowed(xs, w).reshape(want.shape)
    assert_within(f"linear[onednn, {layout} x]", want, got, allowed, "GEMM onednn")


@torch.no_grad()
def test_the_decoding_layout_within_the_fp32_bound():
    for rows, k, n in ((1, 256, 768), (8, 256, 32000), (64, 512, 256)):
        x, w = _operands(rows, k, n, seed=1)
        layout = L.decode_layout(w)
        assert L.uses_decode_layout(x)
        got = L.linear(x, w, layout)
        assert_within(f"linear[decode layout, {rows}x{k}x{n}]", x.double() @ w.double().T, got, _allowed(x, w))


@needs_onednn
def test_onednn_only_where_it_applies(monkeypatch):
    """Small products, gradients, autocast, a lowered fp32 precision, other dtypes and a
    non-contiguous weight stay on ``F.linear`` (exactly), and outside ``cpu_gemm`` nothing changes."""
    spy = _Spy(monkeypatch)
    x, w = _operands(100, 64, 48)
    assert torch.equal(L.linear(x, w), F.linear(x, w))  # the default: ATen
    with L.cpu_gemm("onednn"):
        with torch.no_grad():
            assert torch.equal(L.linear(x[:64], w), F.linear(x[:64], w))  # 64 rows: not a GEMM's work
            assert torch.equal(L.linear(x.double(), w.double()), F.linear(x.double(), w.double()))
            wt = torch.randn(64, 48).T
            assert torch.equal(L.linear(x, wt), F.linear(x, wt))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert L.linear(x, w).dtype == torch.bfloat16
            before = torch.get_float32_matmul_precision()
            try:  # a caller who allows bf16 products gets F.linear's behaviour
                torch.set_float32_matmul_precision("medium")
                L.linear(x, w)
            finally:
                torch.set_float32_matmul_precision(before)
            mkldnn = torch.backends.mkldnn.matmul
            if hasattr(mkldnn, "fp32_precision"):  # the per-backend API (torch reads the legacy one then refuses)
                old = mkldnn.fp32_precision
                for allowed in ("bf16", "tf32"):
                    try:
                        mkldnn.fp32_precision = allowed
                        L.linear(x, w)
                    finally:
                        mkldnn.fp32_precision = old
        assert spy.calls == 0
        wg = w.clone().requires_grad_()
        L.linear(x, wg).sum().backward()  # gradients: F.linear, which autograd differentiates
        assert spy.calls == 0 and wg.grad is not None
        with torch.no_grad():
            L.linear(x, w)
        assert spy.calls == 1


def test_cpu_gemm_names_a_bad_choice(monkeypatch):
    with pytest.raises(ValueError, match="CPU GEMM 'mkl' is not one of aten, onednn"):
        with L.cpu_gemm("mkl"):
            pass
    monkeypatch.setattr(L, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="this torch has no oneDNN"):
        with L.cpu_gemm("onednn"):
            pass
    with L.cpu_gemm("aten"):
        assert L._CPU_GEMM.get() == "aten"
    assert L._CPU_GEMM.get() == "aten"  # the block's choice ends with it


@pytest.mark.parametrize("gemm", L.CPU_GEMMS)
def test_rows_run_a_sequence_at_a_time(gemm, monkeypatch):
    """Within ``cpu_gemm(name, rows=f)``: up to 64 positions a sequence every row goes to ``f`` in
    one call (its rows are independent); past 64, the GEMM runs once a sequence, each on a
    contiguous input at a 64-byte boundary, into the right place; a batch of one is one call; where
    ``f`` declines, the usual path; gradients or autocast keep ``F.linear``. Each result within the
    fp32 bound of the float64 product."""
    if gemm == "onednn" and not L.onednn_available():
        pytest.skip("this torch has no oneDNN")
    seen: list[tuple[int, ...]] = []

    def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return (x.double() @ w.double().T).float()

    gemms: list[tuple[tuple[int, ...], int]] = []
    real_gemm = L._gemm
    monkeypatch.setattr(L, "_gemm", lambda x, w: gemms.append((tuple(x.shape), x.data_ptr() % 64)) or real_gemm(x, w))
    _, w = _operands(1, 40, 24)
    for B, T in ((3, 64), (3, 65), (1, 130), (2, 1)):
        seen.clear(), gemms.clear()
        x = torch.randn(B, T, 40, generator=torch.Generator().manual_seed(T))
        with torch.no_grad(), L.cpu_gemm(gemm, rows=rows):
            assert not L.uses_decode_layout(x), "a layout would be read within rows"
            got = L.linear(x, w)
        if T <= 64:
            assert seen == [(B * T, 40)] and gemms == [], (B, T, seen, gemms)
        else:
            assert seen == [] and gemms == [((T, 40), 0)] * B, (B, T, gemms)
        want = x.double() @ w.double().T
        assert_within(f"rows[{gemm}] {B}x{T}", want, got, _allowed(x, w), f"GEMM {gemm}")
    seen.clear()
    x = torch.randn(2, 8, 40)
    with torch.no_grad(), L.cpu_gemm(gemm, rows=lambda x, w: seen.append(1)):  # declines: returns None
        assert torch.equal(L.linear(x, w), F.linear(x, w)) and seen == [1]
    with L.cpu_gemm(gemm, rows=rows):
        seen.clear()
        L.linear(x, w)  # gradients on
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            L.linear(x, w)
        assert seen == [], "rows ran with gradients on or under autocast"


class _Wrapped(torch.nn.Module):
    """A projection wrapped as peft's LoRA layer wraps one: ``base(x) + B(A x)``, each an ``nn.Linear``
    (``F.linear`` inside), the base with a bias, and another function (``tanh``) between."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.base, self.a, self.b = (
            torch.nn.Linear(40, 24),
            torch.nn.Linear(40, 3, False),
            torch.nn.Linear(3, 24, False),
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x).tanh())


def test_project_runs_a_wrapped_modules_linears_a_sequence_at_a_time():
    """``project(x, module)`` and ``linear(x, module)`` call the module; within ``cpu_gemm(rows=f)``,
    where ``by_sequence``, its ``F.linear`` calls go to ``f`` (every row in one call), the bias
    added after, and its other functions run as they are; elsewhere (no ``rows``, gradients on,
    float64) it runs as it is. Within the fp32 bound of the float64 function."""
    seen: list[tuple[int, ...]] = []

    def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return (x.double() @ w.double().T).float()

    module = _Wrapped()
    x = torch.randn(3, 9, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with L.cpu_gemm("aten", rows=rows):
            got, via_linear = L.project(x, module), L.linear(x, module)
        assert seen == [(27, 40), (27, 40), (27, 3)] * 2, seen
        assert torch.equal(got, via_linear)
        base, a, b = (m.weight.double() for m in (module.base, module.a, module.b))
        inner = x.double() @ a.T
        want = x.double() @ base.T + module.base.bias.double() + inner.tanh() @ b.T
        # each product's bound, the inner one carried through tanh (|tanh'| <= 1) and B (whose own
        # bound, λ·√3·u·Σ|B·tanh|, also covers tanh's rounding of a few ulp), and the bias and the
        # final add one rounding each
        carried = (_allowed(x, module.a.weight) @ b.abs().T) + _allowed(inner.tanh().float(), module.b.weight)
        allowed = _allowed(x, module.base.weight) + carried + 2 * U32 * want.abs()
        assert_within("project within rows", want, got, allowed, "aten")
        seen.clear()
        assert torch.equal(L.project(x, module), module(x))  # no rows: the module as it is
        with L.cpu_gemm("aten", rows=rows):
            L.project(x.double(), module.double())  # not fp32
        module.float()
        assert seen == [], "a product went to rows outside cpu_gemm(rows=) or in float64"
    with L.cpu_gemm("aten", rows=rows):
        L.project(x, module)  # gradients on
    assert seen == [], "a product went to rows with gradients on"
