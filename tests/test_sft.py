"""Supervised fine-tuning data (wiola.train.sft) and `wiola finetune`: only answer tokens are
labels, bad lines are named with their numbers, long examples are dropped and counted."""

from __future__ import annotations

import json
import math
import signal
import sys

import pytest
import torch
import torch.nn.functional as F

import wiola
from wiola.chat import apply_chat_template
from wiola.cli import main
from wiola.tokenizer import load_tokenizer
from wiola.train.sft import IGNORE, collate, encode_chat, encode_completion, load_sft_data

CHAT = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "A story about a cat."},
    {"role": "assistant", "content": "Once upon a time, a cat sat."},
    {"role": "user", "content": "More."},
    {"role": "assistant", "content": "The cat ran home."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gpt2-32k")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tok):
    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    wiola.WiolaModel(config).save_pretrained(path, tok)
    return path


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_chat_labels_are_the_assistant_turns(tok) -> None:
    ids, labels = encode_chat(tok, CHAT)
    assert ids == apply_chat_template(tok, CHAT, add_generation_prompt=False)
    kept = [i for i, label in enumerate(labels) if label != IGNORE]
    assert all(labels[i] == ids[i] for i in kept)
    # two runs of labels: each assistant content and its eos, nothing of the markers or other turns
    runs, run = [], []
    for i in range(len(ids)):
        if labels[i] != IGNORE:
            run.append(ids[i])
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    assert [tok.decode(r) for r in runs] == [
        "Once upon a time, a cat sat.<|endoftext|>",
        "The cat ran home.<|endoftext|>",
    ]
    # each run is exactly what generation must produce after the generation prompt
    prompt = apply_chat_template(tok, CHAT[:2], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt and labels[len(prompt)] == ids[len(prompt)]
    assert labels[len(prompt) - 1] == IGNORE


def test_completion_labels(tok) -> None:
    ids, labels = encode_completion(tok, "Tell me:", " a story.")
    assert tok.decode(ids) == "<|endoftext|>Tell me: a story.<|endoftext|>"
    assert tok.decode([t for t in labels if t != IGNORE]) == " a story.<|endoftext|>"


def test_loss_counts_only_labelled_tokens(tok) -> None:
    torch.manual_seed(0)
    model = wiola.WiolaModel(wiola.WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16))
    examples = [encode_chat(tok, CHAT), encode_completion(tok, "Hi", " there")]
    ids, mask, labels = collate(examples, pad_id=0)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    logits = model(ids, attention_mask=mask).logits
    pos = [(b, t) for b in range(2) for t in range(ids.shape[1] - 1) if labels[b, t + 1] != IGNORE]
    want = torch.stack([F.cross_entropy(logits[b, t], labels[b, t + 1]) for b, t in pos]).mean()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    assert len(pos) == sum(int((torch.tensor(y) != IGNORE).sum()) - 0 for _, y in examples)


@pytest.mark.parametrize(
    "line, fmt, message",
    [
        ('{"messages": [', "chat", "malformed JSON"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "chat", "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}, "chat", "empty"),
        ({"messages": [{"role": "user", "content": "x"}]}, "chat", "no assistant turn"),
        ({"prompt": "x"}, "completion", "needs a string 'completion'"),
        ({"prompt": "x", "completion": " "}, "completion", "the completion is empty"),
        ([1, 2], "chat", "expected a JSON object"),
    ],
)
def test_bad_lines_are_named_with_their_number(tmp_path, tok, line, fmt, message) -> None:
    good = {"messages": CHAT[1:3]} if fmt == "chat" else {"prompt": "a", "completion": "b"}
    path = _write(tmp_path / "d.jsonl", [good, "", line])
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: .*{message}"):
        load_sft_data(path, fmt, tok, 64)


def test_long_examples_are_dropped_and_counted(tmp_path, tok) -> None:
    long = {"prompt": "word " * 100, "completion": "end"}
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, long, long])
    data = load_sft_data(path, "completion", tok, 64)
    assert len(data.examples) == 1 and data.dropped == [2, 3]
    assert "2 longer than max_seq_len=64 dropped (lines 2, 3)" in data.summary(64)
    with pytest.raises(ValueError, match="no usable example .all 2 are longer"):
        load_sft_data(_write(tmp_path / "e.jsonl", [long, long]), "completion", tok, 64)


def test_cli_bad_data_exits_2_naming_the_line(tmp_path, tiny_checkpoint, capsys) -> None:
    path = _write(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}])
    code = main(["finetune", "--init", str(tiny_checkpoint), "--data", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("wiola finetune: error: ") and "d.jsonl:2:" in err[0]


def test_cli_full_finetune_lowers_the_answer_loss_and_saves_the_template(tmp_path, tiny_checkpoint) -> None:
    import subprocess

    path = _write(tmp_path / "d.jsonl", [{"messages": CHAT}] * 4)
    out = tmp_path / "full"
    cmd = [sys.executable, "-m", "wiola", "finetune", "--init", str(tiny_checkpoint), "--data", str(path)]
    cmd += [
        "--out",
        str(out),
        "--steps",
        "12",
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--log-every",
        "4",
        "--no-progress",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "data: 4 examples" in run.stdout
    losses = json.loads((out / "finetune.json").read_text())["losses"]
    assert losses[-1][1] < 0.8 * losses[0][1], losses  # 4 copies of one conversation: memorised
    assert f"(loss curve: {out / 'loss_curve.png'})" in run.stdout and (out / "loss_curve.png").stat().st_size > 0
    from wiola.checkpoint import load_checkpoint_tokenizer

    assert load_checkpoint_tokenizer(out).chat_template is not None
    assert wiola.WiolaModel.from_pretrained(out).config.vocab_size == 32000


def _no_loading(monkeypatch) -> None:
    """Fail the test if a checkpoint's weights are read (the checks must come first)."""
    import wiola.model

    def loads(*_, **__):
        raise AssertionError("a checkpoint was loaded before the arguments were checked")

    monkeypatch.setattr(wiola.model, "load_pretrained", loads)  # what every from_pretrained calls


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-rank", "2", "--lora-dropout", "-1"], "--lora-dropout must be in [0, 1), got -1.0"),
        (["--lora-rank", "2", "--lora-dropout", "2"], "--lora-dropout must be in [0, 1), got 2.0"),
        (["--lora-rank", "2", "--lora-alpha", "-3"], "--lora-alpha must be a positive number, got -3.0"),
        (["--warmup", "-5"], "--warmup must be >= 0 steps, got -5"),
        (["--lora-rank", "2", "--add-role-tokens"], "--add-role-tokens with --lora-rank: the new embedding rows"),
        (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--steps", "5", "--warmup", "6"], "--warmup 6 is more than --steps 5: the learning rate would never reach"),
        # the LoRA settings without --lora-rank: a full fine-tune would run and ignore them
        (["--lora-alpha", "16"], "--lora-alpha applies to LoRA adapters, which only --lora-rank makes"),
        (["--lora-targets", "q_proj"], "--lora-targets applies to LoRA adapters, which only --lora-rank makes"),
        (["--lora-dropout", "0"], "--lora-dropout applies to LoRA adapters, which only --lora-rank makes"),
        (
            ["--lora-alpha", "16", "--lora-targets", "q_proj", "--lora-dropout", "0.5"],
            "--lora-alpha, --lora-targets and --lora-dropout apply to LoRA adapters, which only --lora-rank makes",
        ),
    ],
)
def test_cli_bad_settings_exit_2_before_loading(tmp_path, tiny_checkpoint, monkeypatch, capsys, flags, message):
    _no_loading(monkeypatch)
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    code = main(["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"wiola finetune: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("flags", "warmup"), [([], 10), (["--steps", "4"], 4), (["--warmup", "0"], 0)])
def test_cli_warmup_defaults_to_10_steps_at_most_steps(tmp_path, tiny_checkpoint, monkeypatch, capsys, flags, warmup):
    """``--warmup`` unset: 10 steps, or ``--steps`` when fewer (the schedule's warm-up)."""
    import wiola.train.finetune as ft

    seen = []

    def record(cfg, **_):
        seen.append(cfg.warmup_steps)
        raise ValueError("recorded")

    monkeypatch.setattr(ft, "finetune", record)
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    argv = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(tmp_path / "o"), *flags]
    assert main(argv) == 2 and "recorded" in capsys.readouterr().err
    assert seen == [warmup]


def test_cli_out_that_overlaps_the_init_checkpoint_or_is_a_file_is_refused(
    tmp_path, tiny_checkpoint, monkeypatch, capsys
) -> None:
    """--out equal to, inside or holding the --init checkpoint, or a file (or under one): exit 2
    before loading anything, and the checkpoint's files are unchanged."""
    import shutil

    _no_loading(monkeypatch)
    init = tmp_path / "init"
    shutil.copytree(tiny_checkpoint, init)
    before = {p.name: p.read_bytes() for p in init.iterdir()}
    (tmp_path / "file").write_text("x")
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    cases = {
        init: "is the --init checkpoint itself",
        init / "sub": "lies inside the --init checkpoint",
        tmp_path: "holds the --init checkpoint",
        tmp_path / "file": "is a file, not a folder",
        tmp_path / "file" / "o": "which is a file, not a folder",
    }
    for out, message in cases.items():
        code = main(["finetune", "--init", str(init), "--data", str(data), "--out", str(out), "--steps", "1"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("wiola finetune: error: --out ") and message in err, (out, err)
    assert {p.name: p.read_bytes() for p in init.iterdir()} == before, "the --init checkpoint changed"
    assert (tmp_path / "file").read_text() == "x"


def test_cli_progress_off_a_terminal_is_step_lines(tmp_path, tiny_checkpoint, capsys) -> None:
    """stderr is not a terminal here (captured): no bar even without --no-progress, a line per
    logging step and a summary."""
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}] * 2)
    args = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(tmp_path / "o")]
    assert main([*args, "--steps", "4", "--log-every", "2", "--batch-size", "1"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out, f"a progress bar was drawn off a terminal: {captured.err!r}"
    steps = [line.split(":")[0] for line in captured.out.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/4", "step 4/4"], captured.out
    assert "4 steps in " in captured.out.splitlines()[-1], captured.out


def test_cli_out_holding_a_model_or_adapters_is_refused_without_overwrite(
    tmp_path, tiny_checkpoint, monkeypatch, capsys
) -> None:
    """finetune and merge into a folder holding adapters or a model: exit 2 before loading, the
    folder unchanged; finetune --overwrite replaces the adapters, leaving none of their files."""
    from wiola.train.finetune import load_finetuned

    out = tmp_path / "o"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_checkpoint)}))
    (out / "adapter_model.safetensors").write_bytes(b"stale")
    (out / "README.md").write_text("---\nlibrary_name: peft\n---\n")  # peft's model card
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    args = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(out), "--steps", "1"]
    with monkeypatch.context() as m:
        _no_loading(m)
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "already holds a model or adapters (adapter_config.json" in err[0], err
        merged = tmp_path / "merged"
        merged.mkdir()
        (merged / "config.json").write_text("{}")
        assert main(["merge", "--adapter", str(out), "--out", str(merged)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "already holds a model or adapters (config.json)" in err[0] and "--overwrite" in err[0]
        assert [p.name for p in merged.iterdir()] == ["config.json"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the refused run changed --out"
    assert main([*args, "--batch-size", "1", "--no-progress", "--overwrite"]) == 0
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    assert not (out / "README.md").exists(), "peft's model card stayed beside the full model"
    assert (out / "notes.txt").read_text() == "mine", "--overwrite deleted a file that is not the model's"
    (out / "README.md").write_text("mine too")  # beside a full model, a README is the user's
    assert main([*args, "--batch-size", "1", "--no-progress", "--overwrite"]) == 0
    assert (out / "README.md").read_text() == "mine too", "--overwrite deleted a README that is not peft's"
    model, _ = load_finetuned(out)
    assert type(model) is wiola.WiolaModel, "the stale adapters were loaded"


# What other writers leave in a folder: an ONNX export, a tokenizer alone, and a transformers
# checkpoint saved in shards (both kinds) with its generation config.
ONNX_EXPORT = ("model.onnx", "model.onnx.data", "wiola_onnx.json", "run_onnx.py", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")  # fmt: skip
TOKENIZER_ONLY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHARDED = ("config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
           "model-00002-of-00002.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json",
           "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")  # fmt: skip


def _folder(path, names):
    path.mkdir()
    for name in names:
        (path / name).write_text(f"the old {name}")
    (path / "notes.txt").write_text("mine")
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.parametrize(
    ("names", "held"),
    [
        (ONNX_EXPORT, "a model or adapters (model.onnx, model.onnx.data, wiola_onnx.json, tokenizer.json"),
        (TOKENIZER_ONLY, "the tokenizer or settings of a model (tokenizer.json, tokenizer_config.json"),
        (SHARDED, "a model or adapters (config.json, model.safetensors.index.json, model-00001-of-00002.safetensors"),
    ],
    ids=["onnx-export", "tokenizer", "sharded"],
)
def test_cli_out_holding_any_models_files_is_left_whole_without_overwrite(
    tmp_path, tiny_checkpoint, monkeypatch, capsys, names, held
) -> None:
    """finetune and merge into an ONNX export, a tokenizer's folder or a sharded checkpoint: exit 2
    before loading, every file as it was (a tokenizer beside an ONNX graph is not deleted)."""
    _no_loading(monkeypatch)
    out = tmp_path / "o"
    before = _folder(out, names)
    adapters = tmp_path / "lora"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_checkpoint)}))
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    for args in (
        ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--steps", "1"],
        ["merge", "--adapter", str(adapters)],
    ):
        assert main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {str(out)!r} already holds {held}" in err[0], err
        assert "--overwrite" in err[0], err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, f"wiola {args[0]} changed --out"


def test_cli_overwrite_leaves_no_file_of_the_old_model(tmp_path, tiny_checkpoint) -> None:
    """finetune --overwrite over an ONNX export and over a sharded transformers checkpoint: none
    of their files stays (a stale generation_config.json would change the eos id the new model
    loads with), and a file of the user's does."""
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    for i, names in enumerate((ONNX_EXPORT, SHARDED)):
        out = tmp_path / f"o{i}"
        _folder(out, names)
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "pad_token_id": 7}))
        args = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(out), "--steps", "1"]
        assert main([*args, "--batch-size", "1", "--no-progress", "--overwrite"]) == 0
        stale = [p.name for p in out.iterdir() if p.read_bytes().startswith(b"the old ")]
        assert not stale and not (out / "generation_config.json").exists(), f"old files stayed: {stale}"
        assert (out / "notes.txt").read_text() == "mine", "--overwrite deleted a file that is not the model's"
        want = wiola.WiolaModel.from_pretrained(tiny_checkpoint).config
        assert wiola.WiolaModel.from_pretrained(out).config == want


def test_cli_out_holding_a_training_run_is_refused(tmp_path, tiny_checkpoint, monkeypatch, capsys) -> None:
    """finetune and merge into a run folder (metrics.jsonl, checkpoints/), its checkpoints/ folder
    or one of its checkpoints, --overwrite or not: exit 2 before loading, nothing written. A model
    at a run's top would be what --checkpoint of the run reads from then on."""
    _no_loading(monkeypatch)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_0000001\n")
    (run / "checkpoints" / "step_0000001" / "trainer.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    adapters = tmp_path / "lora"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_checkpoint)}))
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    files = sorted(p.relative_to(run) for p in run.rglob("*"))
    cases = {
        run: "holds a training run (metrics.jsonl and checkpoints)",
        run / "checkpoints": "is a training run's checkpoints folder",
        run / "checkpoints" / "step_0000001": "is a training run's checkpoint",
    }
    for out, message in cases.items():
        for overwrite in ([], ["--overwrite"]):
            finetune = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--steps", "1"]
            for args in (finetune, ["merge", "--adapter", str(adapters)]):
                assert main([*args, "--out", str(out), *overwrite]) == 2, (args, out)
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and err[0].startswith(f"wiola {args[0]}: error: --out ") and message in err[0], err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == files, "a refused command wrote into the run"


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory, tok):
    """The tiny checkpoint with 64 padded rows past the tokenizer's 32000 ids, 60 times as large
    as the others (so the model's own numbers, not chance, would pick them)."""
    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32064, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
    model = wiola.WiolaModel(config)
    with torch.no_grad():
        model.embed.weight[32000:] *= 60
    path = tmp_path_factory.mktemp("ckpt") / "padded"
    model.save_pretrained(path, tok)
    return path


def test_cli_role_tokens_on_a_padded_checkpoint_start_as_the_mean_row(tmp_path, padded_checkpoint, capsys) -> None:
    """--add-role-tokens on a model with rows past its tokenizer: the three new ids (32000-32002)
    fall on padded rows, which must start as the mean of the tokenizer's 32000 rows (docs/SPEC.md
    "Role tokens"), not keep the padded rows' values; the other rows stay. One step at lr 1e-9:
    AdamW moves a weight by at most lr per step (|m / (sqrt(v) + eps)| <= 1 on the first step),
    plus the rounding of weights of |w| <= 1 (2^-23)."""
    from wiola.checkpoint import load_checkpoint_tokenizer

    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    out = tmp_path / "roles"
    args = ["finetune", "--init", str(padded_checkpoint), "--data", str(data), "--out", str(out), "--steps", "1"]
    assert main([*args, "--lr", "1e-9", "--batch-size", "1", "--add-role-tokens", "--no-progress"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    tokenizer = load_checkpoint_tokenizer(out)
    role_ids = [tokenizer.encode(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")]
    assert role_ids == [[32000], [32001], [32002]] and tokenizer.vocab_size == 32003
    before = wiola.WiolaModel.from_pretrained(padded_checkpoint).embed.weight.detach()
    after = wiola.WiolaModel.from_pretrained(out).embed.weight.detach()
    assert after.shape == before.shape == (32064, 32)
    atol = 1e-9 + 2**-23 * float(before.abs().max())
    mean = before[:32000].mean(dim=0).expand(3, -1)
    torch.testing.assert_close(after[32000:32003], mean, atol=atol, rtol=0, msg="role-token rows")
    torch.testing.assert_close(after[:32000], before[:32000], atol=atol, rtol=0, msg="the tokenizer's rows")
    torch.testing.assert_close(after[32003:], before[32003:], atol=atol, rtol=0, msg="the padded rows left over")
    assert summary.startswith("1 step in "), summary  # not "1 steps"


def _poison_weights_after_each_step(monkeypatch) -> None:
    """Every AdamW step leaves a NaN in the first weight, as a step of too high a learning rate
    would: the loss of that step was computed before, and is finite."""
    step = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = math.nan
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)


@pytest.mark.parametrize(
    ("steps", "found"),
    [(1, "the model's weights are not finite at step 1"), (3, "the training loss is nan at step 2")],
)
def test_cli_diverged_finetune_exits_1_and_saves_nothing(tmp_path, tiny_checkpoint, monkeypatch, capsys, steps, found):
    """A fine-tune whose loss, gradient or weights turn non-finite: exit 1 with one line naming
    the step and --lr (as `wiola train`), nothing written; with --overwrite the model already in
    --out stays as it was."""
    import shutil

    _poison_weights_after_each_step(monkeypatch)
    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}] * 2)
    kept = tmp_path / "kept"
    shutil.copytree(tiny_checkpoint, kept)
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    for out, overwrite in ((tmp_path / "new", []), (kept, ["--overwrite"])):
        args = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(out), "--no-progress"]
        assert main([*args, "--steps", str(steps), "--batch-size", "1", *overwrite]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"wiola finetune: error: {found}: the fine-tune diverged"), err
        assert "--lr" in err[0] and "nothing was saved" in err[0], err
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before, "the diverged run replaced the model in --out"


def _interrupt_at_step(monkeypatch, step: int, signals: int = 1, sig: int = signal.SIGINT) -> None:
    """``sig`` (SIGINT) ``signals`` times while the batch of step ``step`` is being made (the signal
    comes mid-step, as a Ctrl-C would)."""
    import wiola.train.finetune as ft

    collate, calls = ft.collate, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            for _ in range(signals):
                signal.raise_signal(sig)
        return collate(*args, **kwargs)

    monkeypatch.setattr(ft, "collate", interrupted)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_finetune_saves_the_model_of_its_last_step(tmp_path, tiny_checkpoint, monkeypatch, sig) -> None:
    """Ctrl-C (or SIGTERM) during step 2 of 4: the step ends, the model is saved and
    ``FinetuneInterrupted`` (a KeyboardInterrupt) names the step and folder. Under a constant
    learning rate the saved weights are bitwise those of a 2-step run. A second Ctrl-C aborts
    with nothing saved."""
    import wiola.train.finetune as ft

    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}])

    def config(out: str, steps: int) -> ft.FinetuneConfig:
        return ft.FinetuneConfig(
            init=str(tiny_checkpoint), data=str(data), out=str(tmp_path / out), steps=steps, batch_size=1,
            lr=1e-2, warmup=0, min_lr_ratio=1.0, log_every=1, progress=False,
        )  # fmt: skip

    lines: list[str] = []
    with monkeypatch.context() as m:
        _interrupt_at_step(m, 2, sig=sig)
        with pytest.raises(KeyboardInterrupt) as stopped:
            ft.finetune(config("stopped", 4), log=lines.append)
    assert getattr(stopped.value, "step", None) == 2 and getattr(stopped.value, "out", None) == tmp_path / "stopped"
    said = f"interrupted at step 2/4; the model as of that step saved to {tmp_path / 'stopped'}"
    assert f"{said} (loss curve: {tmp_path / 'stopped' / 'loss_curve.png'})" in lines, lines
    assert (tmp_path / "stopped" / "loss_curve.png").stat().st_size > 0
    assert json.loads((tmp_path / "stopped" / "finetune.json").read_text())["steps_done"] == 2
    ft.finetune(config("two", 2), log=lambda _: None)
    got = wiola.WiolaModel.from_pretrained(tmp_path / "stopped").state_dict()
    want = wiola.WiolaModel.from_pretrained(tmp_path / "two").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "the saved model is not that of the last step"
    with monkeypatch.context() as m:
        _interrupt_at_step(m, 2, signals=2)
        with pytest.raises(KeyboardInterrupt) as aborted:
            ft.finetune(config("aborted", 4), log=lambda _: None)
    assert not isinstance(aborted.value, ft.FinetuneInterrupted) and not (tmp_path / "aborted").exists()


def test_cli_interrupted_finetune_exits_130_saying_where_it_saved(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """`wiola finetune` stopped by Ctrl-C: exit 130 (wiola.cli's contract), the model of the last
    step saved in --out and named on stdout; the same for LoRA adapters."""
    import importlib.util

    from wiola.train.finetune import load_finetuned

    data = _write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    runs = [("full", [], "the model")]
    runs += [("lora", ["--lora-rank", "2"], "the adapters")] if importlib.util.find_spec("peft") else []
    for out, flags, what in runs:
        args = ["finetune", "--init", str(tiny_checkpoint), "--data", str(data), "--out", str(tmp_path / out)]
        with monkeypatch.context() as m:
            _interrupt_at_step(m, 3)
            assert main([*args, "--steps", "5", "--batch-size", "1", "--no-progress", *flags]) == 130
        captured = capsys.readouterr()
        saved = f"interrupted at step 3/5; {what} as of that step saved to {tmp_path / out}"
        assert saved in captured.out and captured.err.endswith("wiola finetune: interrupted\n"), captured
        load_finetuned(tmp_path / out)
