"""Shared test setup. Without CUDA, Triton kernels run under the interpreter: the variable
must be set before any module that defines a kernel is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings

import pytest
from numerics import DEVICE

from wiola.fast import decode_step_cpu

# Under pytest-xdist (`-n auto`) each worker process gets its share of the cores for torch's pool
# (which the C++ step also uses): N workers of all-core pools would oversubscribe the CPU.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


@pytest.fixture
def device() -> str:
    return DEVICE


def _runs_here(isa: str) -> bool:
    try:
        return decode_step_cpu.select_isa(isa) == isa
    except ValueError:
        return False


ISAS_HERE = [isa for isa in decode_step_cpu.ISAS if _runs_here(isa)]  # all three on an AVX-512 CPU


@pytest.fixture(params=ISAS_HERE)
def isa(request) -> str:
    """Each variant of the C++ CPU step this CPU runs; the step is built (on first use) or the
    test fails naming why."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the failure is reported below instead
        lib = decode_step_cpu.load(request.param)
    if lib is None:
        pytest.fail(f"the CPU decode step ({request.param}) did not build: {decode_step_cpu.BUILD_ERROR}")
    return request.param


@pytest.fixture
def plain_cpu(monkeypatch) -> None:
    """A plain CPU (here and in subprocesses): without the interpreter, the fast model takes its
    CPU paths (the C++ step)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


BPE_FILE = "/work/shared/tokenizers/gpt2.tiktoken"  # GPT-2's ranks, shared on these machines


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: on a shared 2-core CI machine two threads contend
    and run ~5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline_tokenizer():
    """``WIOLA_BPE_FILE`` set to the shared ranks file (no download) for a module's tests, when it
    is unset and the file is there."""
    if not os.environ.get("WIOLA_BPE_FILE") and os.path.isfile(BPE_FILE):
        os.environ["WIOLA_BPE_FILE"] = BPE_FILE
        yield
        os.environ.pop("WIOLA_BPE_FILE", None)
    else:
        yield


def count_step_calls(monkeypatch) -> list[int]:
    """A one-element list counting the C++ step's one-token calls (``DecodeStepCPU.__call__``)
    from now on in this test."""
    from wiola.fast import decode_step_cpu

    calls = [0]
    original = decode_step_cpu.DecodeStepCPU.__call__

    def counted(self, tokens, slot):
        calls[0] += 1
        return original(self, tokens, slot)

    monkeypatch.setattr(decode_step_cpu.DecodeStepCPU, "__call__", counted)
    return calls
