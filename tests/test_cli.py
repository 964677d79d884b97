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


def test_budget_match_params_matches_the_preset(capsys):
    """``--ffn swiglu --match-params`` prints the table of the swiglu model whose d_ff matches the
    preset's parameter count (not the preset's own d_ff)."""
    from wiola import budget
    from wiola.budget import match_params

    assert main(["budget", "--preset", "13m", "--ffn", "swiglu", "--match-params"]) == 0
    matched = match_params(WiolaConfig.preset("13m", ffn="swiglu"), WiolaConfig.preset("13m"))
    assert capsys.readouterr().out.strip() == budget(matched, 512).table().strip()  # --seq-len 512, the default
    assert matched.d_ff != WiolaConfig.preset("13m").d_ff


def test_tokenizer_train_refuses_max_documents_0(tmp_path, capsys):
    _refuses(["tokenizer", "train", "--data", "sample:5", "--vocab-size", "300", "--out", str(tmp_path / "t"),
              "--max-documents", "0"], capsys, "--max-documents must be >= 1, got 0")  # fmt: skip
    assert not (tmp_path / "t").exists()


def test_demo_takes_samples_0():
    """``--samples 0`` is the documented "no stories" (the check is >= 0)."""
    import argparse

    from wiola.cli.demo import _check_flags

    _check_flags(argparse.Namespace(steps=None, seconds=None, samples=0))


def test_generate_from_a_checkpoint(tmp_path, capsys, plain_cpu):
    """Greedy text from the default (wiola.fast; on a plain CPU, the C++ step) and --reference equals
    the model's own generate."""
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


def test_generate_accepts_a_training_run_folder(tmp_path, capsys, plain_cpu):
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


def _commands(parser, path=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))
    yield path, parser


def test_every_help_shows_the_defaults():
    """Each option's default is in its command's ``--help`` (``wiola generate`` samples unless told
    otherwise: a user must be able to read that)."""
    from wiola.cli import build_parser

    checked = 0
    for path, parser in _commands(build_parser()):
        text = " ".join(parser.format_help().split())
        assert "(default: False)" not in text and "(default: True)" not in text, (
            f"wiola {' '.join(path)} --help shows a switch's default (it says nothing)"
        )
        for action in parser._actions:
            if not action.option_strings or action.default is None or isinstance(action.default, bool):
                continue
            if action.help == "==SUPPRESS==" or action.default == "==SUPPRESS==":
                continue
            shown = f"default: {action.default}" in text or "default" in (action.help or "").lower()
            assert shown, (
                f"wiola {' '.join(path)} --help: {action.option_strings[0]}'s default {action.default!r} is not shown"
            )
            checked += 1
    assert checked > 40
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    for flag in ("--temperature TEMPERATURE sampling temperature; 0 is greedy (default: 0.8)", "(default: 0.95)"):
        assert flag in help_text, help_text


@pytest.mark.parametrize(
    "command, flag",
    [
        *[(c, f) for c in (["bench"], ["export", "--out", "o"], ["generate"]) for f in ("--checkpoint", "--revision")],
        (["eval"], "--checkpoint"),
        (["gates"], "--checkpoint"),
    ],
)
def test_an_empty_checkpoint_or_revision_is_refused(command, flag, capsys):
    """``--checkpoint ''`` read as the current folder (or, for bench, as no checkpoint: the random
    preset); now refused by argparse, exit 2, naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, flag, " "])
    assert exit_info.value.code == 2
    assert f"argument {flag}: is empty" in capsys.readouterr().err


EMPTY_PATHS = [
    *[(["train", flag, " "], flag) for flag in ("--config", "--resume", "--out", "--data", "--val-data", "--cache-dir")],
    *[(["eval", "--checkpoint", "c", flag, " "], flag) for flag in ("--data", "--val-data", "--cache-dir", "--output", "--include-path")],
    (["gates", "--checkpoint", "c", "--out", " "], "--out"),
    (["demo", "--out", " "], "--out"),
    (["demo", "--cache-dir", " "], "--cache-dir"),
    ([ "ablate", " "], "spec"),
    (["ablate", "spec.toml", "--out", " "], "--out"),
    (["chat", "--checkpoint", " "], "--checkpoint"),
    (["export", "--checkpoint", "c", "--out", " "], "--out"),
    (["finetune", "--init", " ", "--data", "d"], "--init"),
    (["finetune", "--init", "c", "--data", " "], "--data"),
    (["finetune", "--init", "c", "--data", "d", "--out", " "], "--out"),
    (["instruct-demo", "--init", " "], "--init"),
    (["instruct-demo", "--init", "c", "--out", " "], "--out"),
    (["generate", "--tokenizer", " "], "--tokenizer"),
    (["generate", "--prompt-file", " "], "--prompt-file"),
    (["merge", "--adapter", " ", "--out", "o"], "--adapter"),
    (["merge", "--adapter", "a", "--out", " "], "--out"),
    (["merge", "--adapter", "a", "--out", "o", "--base", " "], "--base"),
    (["serve", "--checkpoint", "c", "--tokenizer", " "], "--tokenizer"),
    (["tokenizer", "train", "--data", " ", "--out", "o"], "--data"),
    (["tokenizer", "train", "--data", "d", "--out", " "], "--out"),
]  # fmt: skip


@pytest.mark.parametrize("argv, flag", EMPTY_PATHS, ids=[" ".join(a).strip() for a, _ in EMPTY_PATHS])
def test_an_empty_path_is_refused_before_reading_or_writing_the_current_folder(
    argv, flag, tmp_path, monkeypatch, capsys
):
    """An empty path names the current folder: ``train --data ''`` trained on its files,
    ``tokenizer train --out ''`` wrote into it. Refused by argparse, exit 2, naming the argument."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "story.txt").write_text("Once upon a time there was a cat.\n" * 50)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}: is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["story.txt"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seconds", "inf"], "--seconds must be a positive number of seconds, got inf"),
        (["--seconds", "nan"], "--seconds must be a positive number of seconds, got nan"),
        (["--seconds", "0"], "--seconds must be a positive number of seconds, got 0.0"),
        (["--seconds", "-5"], "--seconds must be a positive number of seconds, got -5.0"),
        (["--samples", "-1"], "--samples must be >= 0 (0: no stories), got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "3", "--seconds", "4"], "give --steps or --seconds, not both"),
    ],
)
def test_demo_refuses_bad_lengths_before_any_work(args, message, tmp_path, capsys):
    _refuses(["demo", *args, "--out", str(tmp_path / "demo")], capsys, message)
    assert not (tmp_path / "demo").exists()


def test_a_folder_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "story.txt").write_text("Once upon a time there was a cat.")
    (tmp_path / "afile").write_text("not a folder")
    argv = ["train", "--data", str(tmp_path / "story.txt"), "--cache-dir", str(tmp_path / "afile" / "cache")]
    _refuses(
        [*argv, "--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "run")],
        capsys,
        "cannot write the token cache",
    )


def test_export_and_serve_require_a_checkpoint(capsys):
    for command in (["export", "--out", "o"], ["serve"]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"wiola {command[0]}: error:") and "--checkpoint" in err, err


def _refuses(argv: list[str], capsys, message: str) -> None:
    """``wiola ARGV`` exits 2 with one ``wiola <command>: error:`` line holding ``message``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"wiola {argv[0]}: error: ") and message in err and err.count("\n") == 1, err


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """``--out`` naming a file, or a path under one: exit 2 naming it, before a model loads or a
    corpus is read (export, merge, tokenizer train; train and finetune: tests/test_train.py,
    tests/test_sft.py)."""
    import wiola.model

    def loads(*_, **__):
        raise AssertionError("a checkpoint was loaded before --out was checked")

    torch.manual_seed(0)
    WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).save_pretrained(tmp_path / "ckpt")
    monkeypatch.setattr(wiola.model, "load_pretrained", loads)
    (tmp_path / "file").write_text("x")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "none"}')
    (tmp_path / "corpus.txt").write_text("Once upon a time there was a cat.\n")
    for out, message in ((tmp_path / "file", "is a file, not a folder"), (tmp_path / "file" / "o", "which is a file")):
        _refuses(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)], capsys, message)
        _refuses(["merge", "--adapter", str(tmp_path / "adapter"), "--out", str(out)], capsys, message)
        tokenizer = ["tokenizer", "train", "--data", str(tmp_path / "corpus.txt"), "--vocab-size", "300"]
        _refuses([*tokenizer, "--out", str(out)], capsys, message)
    assert (tmp_path / "file").read_text() == "x"


def test_export_and_merge_out_apart_from_their_sources(tmp_path, monkeypatch, capsys):
    """An export into (or around) the checkpoint it reads, or a merge into its adapter folder, is
    refused: it would overwrite or hide the files it reads."""
    import wiola.model

    monkeypatch.setattr(wiola.model, "load_pretrained", lambda *_, **__: pytest.fail("loaded before --out was checked"))
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).save_pretrained(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    _refuses(["export", "--checkpoint", str(ckpt), "--out", str(ckpt)], capsys, "is the checkpoint itself")
    _refuses(["export", "--checkpoint", str(ckpt), "--out", str(ckpt / "hf")], capsys, "lies inside the checkpoint")
    _refuses(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path)], capsys, "holds the checkpoint")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"base_model_name_or_path": "none"}')
    merge = ["merge", "--adapter", str(tmp_path / "adapter"), "--out"]
    _refuses([*merge, str(tmp_path / "adapter")], capsys, "is the adapter folder itself")


def test_tokenizer_train_refuses_a_corpus_without_text(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    out = tmp_path / "tok"
    argv = ["tokenizer", "train", "--data", str(tmp_path / "blank.txt"), "--vocab-size", "300", "--out", str(out)]
    _refuses(argv, capsys, "holds no text to train on")
    assert not out.exists(), "a tokenizer of no text was written"
    _refuses([*argv[:-4], "--vocab-size", "100", "--out", str(out)], capsys, "--vocab-size 100 is too small")


def test_tokenizer_train_refuses_an_out_holding_a_model_a_run_or_a_tokenizer(tmp_path, capsys):
    """A tokenizer written into a model's folder would be read with its weights (by ``eval`` and
    ``generate``): refused, as is a training run's folder, whatever --overwrite says, before any
    reading; a folder holding a tokenizer is replaced only with --overwrite."""
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer

    (tmp_path / "corpus.txt").write_text("Once upon a time there was a cat. The cat sat.\n" * 20)
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(0)
    WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).save_pretrained(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    argv = ["tokenizer", "train", "--data", str(tmp_path / "corpus.txt"), "--vocab-size", "300", "--no-progress"]
    for flags in ([], ["--overwrite"]):
        _refuses([*argv, "--out", str(ckpt), *flags], capsys, "holds a model (config.json, model.safetensors)")
        _refuses([*argv, "--out", str(run), *flags], capsys, "holds a training run")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    tok = tmp_path / "tok"
    assert main([*argv, "--out", str(tok)]) == 0
    capsys.readouterr()
    first = load_tokenizer(tok).fingerprint
    _refuses([*argv, "--out", str(tok)], capsys, "already holds a tokenizer (tokenizer.json")
    (tmp_path / "corpus.txt").write_text("A dog ran to the park and back again.\n" * 20)
    assert main([*argv, "--out", str(tok), "--overwrite"]) == 0
    assert load_tokenizer(tok).fingerprint != first


def test_chat_checks_sampling_flags_before_loading(tmp_path, monkeypatch, capsys):
    import wiola.train.finetune

    monkeypatch.setattr(wiola.train.finetune, "load_finetuned", lambda *_, **__: pytest.fail("loaded first"))
    _refuses(["chat", "--checkpoint", str(tmp_path), "--top-k", "-1"], capsys, "--top-k -1: top_k must be a positive")
    _refuses(["chat", "--checkpoint", str(tmp_path), "--temperature", "inf"], capsys, "--temperature inf:")


def test_tokenizer_train_reads_exactly_max_documents(tmp_path, capsys):
    """``--max-documents 3`` trains on the first 3 documents: the summary says 3, and the
    tokenizer is the one trained on those 3 alone."""
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer, train_tokenizer

    docs = [f"Story {i}: the cat number {i} sat on mat {i * 7} and looked at sun {i * 13}." for i in range(10)]
    (tmp_path / "c.txt").write_text("<|endoftext|>".join(docs))
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(tmp_path / "c.txt"), "--vocab-size", "300", "--out", str(out),
                 "--max-documents", "3", "--no-progress"]) == 0  # fmt: skip
    assert "trained on 3 documents" in capsys.readouterr().err
    want = train_tokenizer(docs[:3], 300, show_progress=False)
    assert load_tokenizer(out).fingerprint == want.fingerprint


def test_match_params_ties_round_down_and_the_tolerance_is_inclusive():
    """A total exactly between two d_ff's (3,150 between 3,142 and 3,158) takes the smaller; a gap
    equal to ``tolerance`` is taken, one just above it refused."""
    import dataclasses

    from wiola import budget
    from wiola.budget import match_params

    base = WiolaConfig(vocab_size=100, d_model=8, n_layers=1, n_heads=2, d_ff=16, max_seq_len=16)
    gelu = dataclasses.replace(base, ffn="gelu")  # 16 parameters a unit of d_ff
    rest = budget(dataclasses.replace(gelu, d_ff=1)).total_params - 16
    tie = next(b for b in (dataclasses.replace(base, vocab_size=v, d_ff=64) for v in range(100, 200))
               if (budget(b).total_params - rest) % 16 == 8)  # fmt: skip
    target = budget(tie).total_params
    totals = {f: budget(dataclasses.replace(gelu, d_ff=f)).total_params for f in range(1, 400)}
    below = max(f for f, t in totals.items() if t < target)
    assert totals[below + 1] - target == target - totals[below], "not a tie"
    matched = match_params(gelu, tie)
    assert matched.d_ff == below
    gap = (target - totals[below]) / target
    assert match_params(gelu, tie, tolerance=gap).d_ff == below
    with pytest.raises(ValueError, match="more than"):
        match_params(gelu, tie, tolerance=gap * 0.999)


def test_tokenizer_train_says_when_the_corpus_gives_fewer_ids_than_asked(tmp_path, capsys):
    """BPE stops when no pair is left to merge: a --vocab-size the text cannot fill is not met
    silently; the note names both sizes and the vocabulary a model for it needs."""
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer

    (tmp_path / "c.txt").write_text("abc abd\n")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(tmp_path / "c.txt"), "--vocab-size", "5000", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    n = load_tokenizer(out).vocab_size
    err = capsys.readouterr().err
    assert n < 5000 and "--vocab-size 5,000 asked for more ids than this corpus gives" in err, err
    assert f"vocab_size >= {n:,}" in err, err
