"""The C++ Exp(1) noise (``wiola.fast.decode_step_cpu.exponential_rows``, ``wiola_exponential``)
against torch's own ``exponential_``: the same fp32 values, bit for bit, from the same generator
states, and the generators left in the same states, for every instruction-set variant this CPU
runs: seeded generators, torch's default one, generators shared by several rows, sizes across the
MT19937's refills and odd tails, and crafted states whose values are the hard cases (u = 0, the
smallest and largest u, values within a few ulp of a float's rounding boundary, where the
vectorized log hands the value to the scalar ``log1p``). Also what it refuses and where it keeps
torch's draws."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from conftest import ISAS_HERE
from generator_states import crafted, hard_units
from numerics import platform_line

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
from wiola.fast.decode_step_cpu import STATE_BYTES, _draw_exponential, exponential_agrees, exponential_rows  # noqa: E402

if decode_step_cpu.load() is None:
    pytest.skip(f"the CPU decode step is not built: {decode_step_cpu.BUILD_ERROR}", allow_module_level=True)

SIZES = (1, 3, 311, 312, 313, 623, 1249, 4099, 32000)  # one value takes two of the 624 words a refill makes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _assert_same(name: str, want: torch.Tensor, got: torch.Tensor, isa: str) -> None:
    differ = (_bits(want) != _bits(got)).nonzero()
    assert differ.numel() == 0, (
        f"{name}: {differ.shape[0]} of {want.numel()} values differ from torch's exponential_, first at "
        f"{differ[0].tolist()}: torch {want[tuple(differ[0])].item()!r}, C++ {got[tuple(differ[0])].item()!r} ({platform_line(isa)})"
    )


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_draws_equal_torchs_bit_for_bit(isa):
    """Rows of seeded, shared and default generators in an interleaved order, each size: row i equals
    ``torch.empty(1, n).exponential_(generator=g_i)`` drawn in row order, every state after as torch's."""
    lib = decode_step_cpu.load(isa)
    for n in SIZES:
        mine = {s: torch.Generator().manual_seed(s) for s in (7, 2**63 + 5)}
        theirs = {s: torch.Generator().manual_seed(s) for s in (7, 2**63 + 5)}
        order = [7, None, 2**63 + 5, 7, None, 7]
        torch.manual_seed(n)
        want = torch.stack([torch.empty(1, n).exponential_(generator=theirs.get(s))[0] for s in order])
        default_after = torch.default_generator.get_state()
        torch.manual_seed(n)
        got = torch.full((len(order), n), float("nan"))
        assert _draw_exponential(lib, [mine[s] if s is not None else torch.default_generator for s in order], got) >= 0
        _assert_same(f"n={n}", want, got, isa)
        for s in mine:
            assert torch.equal(mine[s].get_state(), theirs[s].get_state()), f"seed {s}, n={n}: {platform_line(isa)}"
        assert torch.equal(torch.default_generator.get_state(), default_after), f"default, n={n}"


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_values_at_zero_and_next_to_a_rounding_boundary_equal_torchs(isa):
    """The cases the vectorized log cannot decide alone: each value equals torch's, and the scalar
    log1p took some (the check that hands them over is exercised)."""
    lib = decode_step_cpu.load(isa)
    redone = 0
    for seed in range(6):
        units = hard_units(300, seed)
        want = torch.empty(1, len(units)).exponential_(generator=crafted(units, seed))
        assert want[0, 0].item() == 0 and math.copysign(1.0, want[0, 0].item()) == 1.0  # torch's +0.0 at u = 0
        got = torch.full((1, len(units)), float("nan"))
        count = _draw_exponential(lib, [crafted(units, seed)], got)
        assert count >= 0, count
        redone += count
        _assert_same(f"crafted seed {seed}", want, got, isa)
    assert redone >= 6, f"the scalar log1p took {redone} of the 1,800 values next to a boundary ({platform_line(isa)})"


@pytest.fixture
def threads():
    """Sets torch's (and so the C++'s) thread count for a test, and puts it back."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# (rows, n, values drawn before): one generator's stream long enough that the threads share it
# (each skips to its own part: 2^14 values and up), from the start of a refill's words and from
# the middle, the last thread's part ending inside a refill or on one.
SHARED = ((1, 2**14 - 1, 0), (1, 2**14, 0), (1, 2**14 + 1, 5), (8, 32000, 311), (1, 100_003, 623), (3, 49_921, 1))


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("count", (2, 3, 4))
def test_one_stream_shared_by_the_threads_equals_torchs(isa, count, threads):
    """One generator's rows (``generate``'s noise, ``Rows`` without seeds) drawn by ``count`` threads
    at once: every value equals torch's, bit for bit, and the generator is left where torch leaves it."""
    lib = decode_step_cpu.load(isa)
    threads(count)
    for rows, n, before in SHARED:
        mine, theirs = torch.Generator().manual_seed(n + before), torch.Generator().manual_seed(n + before)
        for g in (mine, theirs):
            torch.empty(before).exponential_(generator=g)
        want = torch.empty(rows, n).exponential_(generator=theirs)
        got = torch.full((rows, n), float("nan"))
        assert _draw_exponential(lib, [mine] * rows, got) >= 0
        _assert_same(f"{rows} rows of {n}, {before} drawn before, {count} threads", want, got, isa)
        assert torch.equal(mine.get_state(), theirs.get_state()), f"{rows} x {n}, {count} threads: {platform_line(isa)}"


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_hard_values_in_a_shared_stream_equal_torchs(isa, threads):
    """The crafted hard cases at the head of a stream the threads share: handed to the scalar log1p
    there too, and every value after them (the next refills', in the other thread's part) torch's."""
    lib = decode_step_cpu.load(isa)
    threads(2)
    redone = 0
    for seed in range(3):
        units = hard_units(300, seed)
        want = torch.empty(1, 40_000).exponential_(generator=crafted(units, seed))
        got = torch.full((1, 40_000), float("nan"))
        count = _draw_exponential(lib, [crafted(units, seed)], got)
        assert count >= 0, count
        redone += count
        _assert_same(f"crafted seed {seed}, shared", want, got, isa)
    assert redone >= 3, f"the scalar log1p took {redone} values of the shared streams ({platform_line(isa)})"


def test_the_cpp_draws_are_this_torchs():
    """The once-a-process check passes on this torch (the C++ draws are in use), for every variant."""
    for isa in ISAS_HERE:
        assert exponential_agrees(decode_step_cpu.load(isa)), f"torch {torch.__version__}: {platform_line(isa)}"


def test_exponential_rows_out_and_the_generators_after():
    """The public function: writes ``out`` (returned), draws as torch, leaves each generator as torch."""
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    out = torch.full((3, 1000), float("nan"))
    assert exponential_rows([a, a, a], 1000, out=out) is out
    _assert_same("rows", torch.empty(3, 1000).exponential_(generator=b), out, None)
    assert torch.equal(a.get_state(), b.get_state())
    assert exponential_rows([], 5).shape == (0, 5) and exponential_rows([a], 0).shape == (1, 0)


def test_bad_arguments_are_refused_and_an_unreadable_state_draws_nothing():
    g = torch.Generator().manual_seed(0)
    for n in (-1, 2.0, True):
        with pytest.raises(ValueError, match="n must be a non-negative int"):
            exponential_rows([g], n)
    for out in (torch.empty(2, 10), torch.empty(1, 10, dtype=torch.float64), torch.empty(10, 2).t()):
        with pytest.raises(ValueError, match="exponential_rows: out"):
            exponential_rows([g], 10, out=out)
    lib = decode_step_cpu.load()
    state = g.get_state()
    before = state.clone()
    pointers = (decode_step_cpu.ctypes.c_void_p * 1)(state.data_ptr())
    job = (decode_step_cpu.ctypes.c_int64 * 1)(0)
    out = torch.full((1, 4), float("nan"))
    assert lib.wiola_exponential(pointers, STATE_BYTES - 8, 1, job, 1, 4, out.data_ptr()) == -2
    bad_job = (decode_step_cpu.ctypes.c_int64 * 1)(1)
    assert lib.wiola_exponential(pointers, STATE_BYTES, 1, bad_job, 1, 4, out.data_ptr()) == -2
    for left, next_ in ((0, 0), (2, 624), (700, 0)):  # no output left, or reads past the words
        struct.pack_into("<i", state.numpy(), 8, left)
        struct.pack_into("<Q", state.numpy(), 16, next_)
        assert lib.wiola_exponential(pointers, STATE_BYTES, 1, job, 1, 4, out.data_ptr()) == -1
        assert torch.isnan(out).all()
    state.copy_(before)


def test_torchs_own_draws_where_the_cpp_does_not_apply(monkeypatch):
    """No library, or a torch that draws otherwise: torch's exponential_ itself, the same values."""
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    monkeypatch.setattr(decode_step_cpu, "load", lambda isa=None: None)
    _assert_same("no library", torch.empty(2, 77).exponential_(generator=b), exponential_rows([a, a], 77), None)
    monkeypatch.undo()
    monkeypatch.setattr(decode_step_cpu, "exponential_agrees", lambda lib: False)
    calls = []
    monkeypatch.setattr(decode_step_cpu, "_draw_exponential", lambda *args: calls.append(args) or 0)
    _assert_same("disagrees", torch.empty(1, 77).exponential_(generator=b), exponential_rows([a], 77), None)
    assert calls == []
