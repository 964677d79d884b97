"""Shared test setup. Without CUDA, Triton kernels run under the interpreter: the variable
must be set before any module that defines a kernel is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from numerics import DEVICE


@pytest.fixture
def device() -> str:
    return DEVICE
