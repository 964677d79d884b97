"""``bench.two_builds``: the A/B scripts' second build of the C++ step. A rebound binding calls the
other library with a workspace of that library's size, and building from another source leaves the
checkout's source in place."""

from __future__ import annotations

import warnings

import pytest
import torch

import wiola
from bench import two_builds
from wiola.fast import decode_step_cpu

CONFIG = wiola.WiolaConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64)


@torch.inference_mode()
def test_rebind_calls_the_other_build_with_its_workspace(plain_cpu, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if decode_step_cpu.load() is None:
            pytest.fail(f"the CPU decode step did not build: {decode_step_cpu.BUILD_ERROR}")
    checkout = decode_step_cpu.SOURCE
    copy = tmp_path / "decode_step_cpu.cpp"
    copy.write_text(checkout.read_text() + "\n// a copy, built apart\n")
    other = two_builds.build(copy)
    assert decode_step_cpu.SOURCE == checkout, "build() left decode_step_cpu.SOURCE pointing at the copy"
    assert other._name != decode_step_cpu.load()._name, "the copy's build is the checkout's library"

    torch.manual_seed(0)
    model = wiola.fast.WiolaModel(CONFIG).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 6))
    caches = [model.new_cache(2, 16) for _ in range(2)]
    for cache in caches:
        model(ids, cache=cache)
    a = decode_step_cpu.DecodeStepCPU(model, caches[0])
    b = decode_step_cpu.DecodeStepCPU(model, caches[1])
    b.work = torch.empty(1)  # a workspace too small for any library: rebind must size it anew
    assert two_builds.rebind(b, other) is b and b.lib is other
    assert b.work.numel() == other.wiola_workspace_floats(b.dims)
    tok = ids[:, -1].contiguous()
    assert torch.equal(a(tok, 6), b(tok, 6)), "the same source built twice gave other logits"
