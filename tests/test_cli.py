"""The wiola console script: budget and generate."""

from __future__ import annotations

import pytest
import torch

from wiola import WiolaConfig, WiolaModel
from wiola.cli import main


def test_budget_prints_the_13m_table(capsys):
    assert main(["budget", "--preset", "13m"]) == 0
    out = capsys.readouterr().out
    assert "12,915,888" in out and "8,192,000" in out


def test_generate_from_a_checkpoint(tmp_path, capsys):
    """Greedy text from the default (wiola.fast) and --reference equals the model's own generate."""
    from wiola.tokenizer import encoding_for_vocab

    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).eval()
    model.save_pretrained(tmp_path)
    enc = encoding_for_vocab(model.config.vocab_size)
    prompt = torch.tensor([enc.encode("Once upon")])
    want = "Once upon" + enc.decode(model.generate(prompt, 5, temperature=0)[0, prompt.shape[1] :].tolist()) + "\n"
    for flag in ([], ["--reference"]):
        code = main(["generate", "--checkpoint", str(tmp_path), "--prompt", "Once upon", "--max-new-tokens", "5",
                     "--temperature", "0", "--device", "cpu", *flag])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out == want, f"wiola generate {flag}: {captured.out!r} != {want!r}"
        assert "5 tokens" in captured.err


def test_generate_reports_a_bad_checkpoint(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_accepts_a_training_run_folder(tmp_path, capsys):
    """A run folder (checkpoints/latest -> step_N) resolves to its latest checkpoint."""
    from wiola.train.run_folder import LATEST_FILE, TRAINER_FILE

    torch.manual_seed(0)
    step = tmp_path / "checkpoints" / "step_0000002"
    WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).save_pretrained(step)
    (step / TRAINER_FILE).write_text("{}")
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("step_0000002")
    code = main(["generate", "--checkpoint", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "3",
                 "--temperature", "0", "--device", "cpu"])  # fmt: skip
    assert code == 0 and "3 tokens" in capsys.readouterr().err


def test_shared_flags_keep_each_command_s_defaults():
    """The flags declared once in wiola.cli.arguments keep every command's own defaults and names."""
    from wiola.cli import build_parser

    parser = build_parser()
    finetune = parser.parse_args(["finetune", "--init", "ckpt", "--data", "d.jsonl"])
    assert (finetune.steps, finetune.batch_size, finetune.lr, finetune.progress) == (200, 8, 3e-4, True)
    demo = parser.parse_args(["instruct-demo", "--init", "ckpt", "--no-progress"])
    assert (demo.steps, demo.batch_size, demo.lr, demo.progress) == (300, 8, 1e-3, False)
    for command in (["export", "--out", "o"], ["serve"], ["generate"]):
        args = parser.parse_args([*command, "--checkpoint", "org/name", "--revision", "v1"])
        assert (args.checkpoint, args.revision) == ("org/name", "v1"), command


def test_export_and_serve_require_a_checkpoint(capsys):
    for command in (["export", "--out", "o"], ["serve"]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"wiola {command[0]}: error:") and "--checkpoint" in err, err
