"""The benchmark frame's fixtures: ``cuda_bench`` and ``cpu_bench`` (see bench/README.md).

``cuda_bench`` skips with a one-line reason when there is no CUDA device, so ``pytest bench/
--benchmark-only`` exits 0 on a CPU machine after running the CPU benchmarks. The ceilings (a
large bf16 matmul and a large device-to-device copy on CUDA; an fp32 matmul and a memory copy
on the CPU) are measured once per session. Results go to pytest-benchmark (its statistics are
the measured times, CUDA-event times on the GPU) and, when ``WIOLA_BENCH_JSONL`` names a file,
one JSON line per benchmark as soon as it finishes. ``WIOLA_BENCH_DEADLINE`` (Unix time) skips
the benchmarks that would start after it, so a time-boxed run still ends cleanly;
``WIOLA_BENCH_SKIP_CPU=1`` skips the CPU benchmarks (the GPU check spends its time on the GPU);
``WIOLA_BENCH_THREADS=N`` runs the CPU benchmarks on N torch threads (recorded with each result);
``WIOLA_BENCH_COMPILED=0`` leaves out the compile-heavy baselines (``bench.frame.compile_heavy``).
The marker ``headline`` selects the device check's headline benchmarks (``-m headline``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.frame import Bench, Ceilings, environment, measure_cpu_ceilings, measure_cuda_ceilings

try:
    import pytest_benchmark  # noqa: F401

    HAVE_PYTEST_BENCHMARK = True
except ImportError:  # the frame still runs and writes $WIOLA_BENCH_JSONL; see bench/README.md
    HAVE_PYTEST_BENCHMARK = False

_SESSION: dict[str, Any] = {}


def _skip(benchmark: Any, reason: str) -> None:
    benchmark.skipped = True  # tells pytest-benchmark not to warn that the fixture went unused
    pytest.skip(reason)


def _check_deadline(benchmark: Any) -> None:
    deadline = os.environ.get("WIOLA_BENCH_DEADLINE")
    if deadline and time.time() > float(deadline):
        _skip(benchmark, "time budget of this run (WIOLA_BENCH_DEADLINE) is spent")


if not HAVE_PYTEST_BENCHMARK:

    class _StubBenchmark:
        """Stands in for pytest-benchmark's fixture: timing by the frame, results to the JSONL file."""

        def __init__(self, node: Any) -> None:
            self.name = node.name
            self.fullname = node.nodeid
            self.group: str | None = None
            self.extra_info: dict[str, Any] = {}
            self.disabled = os.environ.get("WIOLA_BENCH_DISABLE") == "1"

    @pytest.fixture
    def benchmark(request: pytest.FixtureRequest) -> _StubBenchmark:
        return _StubBenchmark(request.node)


def ceilings(device: str) -> Ceilings:
    """The ceilings of ``device`` ("cuda" or "cpu"), measured on first use and kept for the session."""
    if device not in _SESSION:
        _SESSION[device] = measure_cuda_ceilings() if device == "cuda" else measure_cpu_ceilings()
    return _SESSION[device]


@pytest.fixture
def cuda_bench(benchmark: Any) -> Bench:
    """A ``Bench`` on the GPU: ``cuda_bench.run(fn, op=, cost=, shape=, dtype=, inputs=, baselines=)``.

    Skips (one line) without a CUDA device. Under ``--benchmark-disable`` no ceilings are measured.
    """
    if not torch.cuda.is_available():
        _skip(benchmark, "CUDA benchmark: no CUDA device on this machine")
    _check_deadline(benchmark)
    torch.manual_seed(0)
    ceil = None if getattr(benchmark, "disabled", False) else ceilings("cuda")
    return Bench(benchmark, "cuda", ceil, os.environ.get("WIOLA_BENCH_JSONL"))


@pytest.fixture
def cpu_bench(benchmark: Any) -> Iterator[Bench]:
    """A ``Bench`` on the CPU, same API as ``cuda_bench``. ``WIOLA_BENCH_SKIP_CPU=1`` skips it (GPU runs)."""
    if os.environ.get("WIOLA_BENCH_SKIP_CPU") == "1":
        _skip(benchmark, "CPU benchmark: skipped in this run (WIOLA_BENCH_SKIP_CPU=1)")
    _check_deadline(benchmark)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    if os.environ.get("WIOLA_BENCH_THREADS"):  # e.g. 1 on a loaded shared CPU, where OpenMP barriers thrash
        torch.set_num_threads(int(os.environ["WIOLA_BENCH_THREADS"]))
    ceil = None if getattr(benchmark, "disabled", False) else ceilings("cpu")
    yield Bench(benchmark, "cpu", ceil, os.environ.get("WIOLA_BENCH_JSONL"))
    torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "headline: the device check's headline stage (train step eager and as a CUDA graph, decode B1/B8, attention vs SDPA)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    env = environment()
    gpu = env["gpu"] or "no CUDA device: CUDA benchmarks will be skipped"
    return f"wiola bench: torch {env['torch']}, triton {env['triton']}, GPU: {gpu}"


if HAVE_PYTEST_BENCHMARK:

    def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
        """Add the GPU, driver, torch/triton versions, the date and the measured ceilings to the JSON."""
        machine_info["wiola"] = environment()
        machine_info["wiola"]["ceilings"] = {k: v.as_dict() for k, v in _SESSION.items()}
