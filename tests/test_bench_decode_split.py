"""bench/decode_split.py: bad arguments and a machine without CUDA get exit code 2 and a message;
on CUDA, a small split whose parts fit inside the whole."""

from __future__ import annotations

import json

import pytest
import torch

from bench import decode_split


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--prompt", "1000", "--new", "100"], "exceeds the 13m preset's 1024 positions"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    assert decode_split.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--new", "-3"], ["--dtype", "int8"]])
def test_argparse_refuses_non_positive_counts_and_other_dtypes(argv):
    with pytest.raises(SystemExit) as exc:
        decode_split.parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_exits_2(capsys):
    assert decode_split.main(["--batch", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA-graph decoding")
def test_split_parts_fit_inside_the_call(tmp_path, monkeypatch):
    """The records alone in --out (the device check parses it), also with autotuning messages on."""
    monkeypatch.setenv("TRITON_PRINT_AUTOTUNING", "1")
    out = tmp_path / "split.jsonl"
    argv = ["--preset", "micro", "--batch", "1", "2", "--prompt", "8", "--new", "6", "--out", str(out)]
    assert decode_split.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["prefill_s"] < r["generate_s"], r
        assert 0 < r["generate_kernel_busy_s"] <= r["generate_s"], r
        assert 0 < r["kernel_busy_s_per_step"] <= r["replay_s_per_step"], r
        assert r["kernels_per_step"] > 0, r
