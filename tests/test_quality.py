"""``bench.quality.kl_statistics``: the next-token statistics llama.cpp's perplexity tool reports,
on distributions with closed-form answers; ``main`` refuses what it cannot measure before any work."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from bench.quality import PROMPT_LEN, agreement, kl_statistics, loss_columns, main, markdown


def test_identical_distributions():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))
    stats = kl_statistics(logits, logits.clone())
    assert stats["kl_mean"] == 0.0 and stats["kl_max"] == 0.0 and stats["same_top_pct"] == 100.0


def test_two_token_distributions():
    """Position i: reference (1/2, 1/2) against q_i = (1 - e_i, e_i); KL = ½ ln(½/(1-e)) + ½ ln(½/e)."""
    eps = [0.4, 0.3, 0.1, 0.01]
    ref = torch.zeros(len(eps), 2, dtype=torch.float64)
    got = torch.tensor([[math.log(1 - e), math.log(e)] for e in eps], dtype=torch.float64)
    want = [0.5 * math.log(0.5 / (1 - e)) + 0.5 * math.log(0.5 / e) for e in eps]
    stats = kl_statistics(ref, got, chunk=3)  # chunks of 3 and 1 positions
    assert math.isclose(stats["kl_mean"], sum(want) / 4, rel_tol=1e-12)
    assert math.isclose(stats["kl_max"], max(want), rel_tol=1e-12)
    # torch.quantile interpolates linearly: the 99th percentile of 4 sorted values is 0.97 of the way from the 3rd to the 4th.
    ordered = sorted(want)
    assert math.isclose(stats["kl_p99"], ordered[2] + 0.97 * (ordered[3] - ordered[2]), rel_tol=1e-12)
    # The reference's argmax of a tie is token 0, which every q also ranks first.
    assert stats["same_top_pct"] == 100.0
    assert math.isclose(stats["kl_mean_stderr"], statistics.stdev(want) / math.sqrt(4), rel_tol=1e-12)


def test_top_tokens_that_differ():
    """Two positions: the same top token at the first, another at the second: 50%."""
    ref = torch.tensor([[2.0, 0.0, 1.0], [2.0, 0.0, 1.0]])
    got = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 1.0]])
    assert kl_statistics(ref, got)["same_top_pct"] == 50.0


def test_agreement_by_hand():
    """Greedy continuations after ``PROMPT_LEN`` tokens: equal tokens before each row's first
    difference (a row that differs at its first new token has none), and the share of equal ones."""
    ref = torch.zeros(3, PROMPT_LEN + 4, dtype=torch.long)
    got = ref.clone()
    got[0, PROMPT_LEN] = 1  # differs at once, then the same again
    got[1, PROMPT_LEN + 2] = 1  # two equal, then one different
    got[:, 0] = 7  # the prompts are not compared
    got_stats = agreement(ref, got)
    assert (got_stats["mean_before_diff"], got_stats["min_before_diff"]) == (2.0, 0), got_stats
    assert math.isclose(got_stats["same_pct"], 100 * 10 / 12, rel_tol=1e-12), got_stats


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}"], "does not exist"),
        (["{empty}"], "not a checkpoint (no config.json) nor a run folder holding one"),
        (["{empty}", "--windows", "0"], "--windows must be >= 1, got 0"),
    ],
)
def test_bad_input_exits_2_before_making_out(args, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_lengths_past_the_model_and_an_out_that_is_a_file_exit_2_before_any_work(tmp_path, capsys):
    """A window (``--seq-len`` + 1 tokens) or the greedy prompt and ``--new-tokens`` past the
    checkpoint's positions, and an ``--out`` that is a file: one line, exit 2, nothing made."""
    from wiola import WiolaConfig, WiolaModel

    WiolaModel(WiolaConfig.preset("tiny", max_seq_len=64)).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "afile").write_text("kept")
    cases = [
        (["--seq-len", "64"], f"--seq-len 64 + 1 is past {tmp_path / 'ckpt'}'s 64 positions"),
        (["--seq-len", "63", "--new-tokens", "49"], f"16 prompt + --new-tokens 49 is past {tmp_path / 'ckpt'}'s 64"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path / "ckpt"), *flags, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags
        assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "afile")])
    assert exit_info.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "kept"


def test_loss_columns_by_hand():
    """Uniform logits over 3 ids: ln 3 nats a target; 2 targets of 4 bytes: 2 ln 3 / ln 2 / 4 bits
    a byte; the difference from an fp32 loss of 0.5 is ln 3 - 0.5 (positive: worse)."""
    got = loss_columns(torch.zeros(1, 2, 3), torch.tensor([[1, 2]]), 4, 0.5)
    assert got["val_loss"] == pytest.approx(math.log(3), rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(2 * math.log(3) / math.log(2) / 4, rel=1e-6)
    assert got["delta_loss_vs_fp32"] == pytest.approx(math.log(3) - 0.5, rel=1e-6)


def test_markdown_rows_by_hand():
    row = {"form": "int8", "runs_in": "our step", "val_loss": 1.25, "delta_loss_vs_fp32": -0.001, "bits_per_byte": 0.5,
           "next_token": {"kl_mean": 1e-4, "kl_mean_stderr": 2e-5, "kl_p99": 3e-3, "same_top_pct": 99.5},
           "greedy": {"mean_before_diff": 200.0, "min_before_diff": 7, "same_pct": 90.0}}  # fmt: skip
    res = {"checkpoint": "c", "model": {"parameters": 1234}, "tokenizer": "t", "rows": [row],
           "validation": {"windows": 2, "seq_len": 3, "targets": 6, "bytes": 9},
           "greedy": {"prompts": 8, "new_tokens": 256}}  # fmt: skip
    (line,) = [line for line in markdown([res]).splitlines() if line.startswith("| int8")]
    assert line == (
        "| int8 | our step | 1.2500 | -0.0010 | 0.5000 | 1.00e-04 ± 2.0e-05 | 3.00e-03 | 99.50% | 200 / 7 | 90.0% |"
    ), line


def test_step_logits_run_the_cpp_step(plain_cpu, monkeypatch):
    """``step_logits`` feeds one token a call with gradients off, so that the C++ step computes
    them (the quality table's "our step" row), and returns every position's logits."""
    from conftest import count_step_calls

    import wiola
    import wiola.fast
    from bench.quality import step_logits

    calls = count_step_calls(monkeypatch)
    config = wiola.WiolaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16)
    model = wiola.fast.WiolaModel(config).eval()
    x = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    logits = step_logits(model, x)
    assert logits.shape == (2, 5, 100) and calls[0] == 5, calls
