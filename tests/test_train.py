"""The trainer (wiola.train): exact resume, Ctrl-C, DDP equivalence, gradient accumulation, bad input,
every preset with the default flags, recipes, precision, the train/eval/gates/demo commands."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from wiola.config import PRESETS, WiolaConfig
from wiola.train import TrainConfig, train
from wiola.train.corpus import write_sample_corpus
from wiola.train.env import model_class
from wiola.train.loop import TrainingDiverged
from wiola.train.optim import WarmupCosine, build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread", "offline_tokenizer")
ROOT = Path(__file__).resolve().parents[1]
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 64}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_sample_corpus(tmp_path_factory.mktemp("corpus"), n_train=40, n_val=6, seed=0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _cfg(corpus: Path, cache: Path, out: Path, **kw) -> TrainConfig:
    settings = dict(
        preset="tiny",
        model=dict(SMALL),
        data=str(corpus),
        cache_dir=str(cache),
        seq_len=32,
        batch_size=4,
        steps=6,
        lr=3e-3,
        warmup=2,
        eval_every=3,
        eval_windows=4,
        log_every=1,
        save_every=100,
        out_dir=str(out),
        progress=False,
        plots=False,
        device="cpu",
    )
    settings.update(kw)
    return TrainConfig(**settings)


def _quiet(*_: object) -> None:
    pass


def _train_losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(corpus, cache, tmp_path_factory):
    """An uninterrupted 6-step run, and the same run stopped after step 3 and resumed."""
    tmp = tmp_path_factory.mktemp("runs")
    full = train(_cfg(corpus, cache, tmp / "full", plots=True), log=_quiet)
    part = train(_cfg(corpus, cache, tmp / "part"), stop_at=3, log=_quiet)
    rest = train(_cfg(corpus, cache, tmp / "part"), resume=tmp / "part", log=_quiet)
    return full, part, rest


# ------------------------------------------------------------------------------------ resume
def test_resume_is_bitwise_exact(runs) -> None:
    full, part, rest = runs
    assert not full.interrupted and full.step == 6
    assert part.interrupted and part.step == 3 and part.checkpoint.name == "step_0000003"
    assert rest.step == 6 and not rest.interrupted
    assert [s for s, _ in full.losses] == [1, 2, 3, 4, 5, 6]
    assert full.losses[0][1] > full.losses[-1][1] + 0.1, f"the loss did not fall: {full.losses}"
    resumed = part.losses + rest.losses
    assert resumed == full.losses, f"losses after resume differ:\n{resumed}\n{full.losses}"
    # The metrics file of the resumed run reads like the uninterrupted one.
    assert _train_losses(part.out_dir) == _train_losses(full.out_dir), "metrics.jsonl differs after resume"
    assert rest.eval.loss == full.eval.loss, f"final validation loss {rest.eval.loss} vs {full.eval.loss}"
    a, b = _weights(full.checkpoint), _weights(rest.checkpoint)
    for name in a:
        assert torch.equal(a[name], b[name]), f"weight {name} differs after resume"


def _metric_rows(run: Path) -> list[dict]:
    """metrics.jsonl without the timing fields and the output folder, which no two runs share."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("tokens_per_s", None), r.pop("mfu", None)
        if r["kind"] == "run":
            r["config"].pop("out_dir")
    return rows


def test_stop_between_log_steps_resumes_the_log_interval(corpus, cache, tmp_path) -> None:
    """Stopped at step 4 with a log line every 3 steps: no off-schedule train row, and the
    resumed run's step-6 loss is the mean over steps 4-6, bit for bit, as without the stop."""
    cfg = dict(log_every=3, eval_every=3, steps=6)
    lines: dict[str, list[str]] = {"full": [], "part": []}
    full = train(_cfg(corpus, cache, tmp_path / "full", **cfg), log=lines["full"].append)
    part = train(_cfg(corpus, cache, tmp_path / "part", **cfg), stop_at=4, log=_quiet)
    assert part.interrupted and part.step == 4
    assert [s for s, _ in _train_losses(tmp_path / "part")] == [3], "a train row was written at the stop"
    rest = train(_cfg(corpus, cache, tmp_path / "part", **cfg), resume=tmp_path / "part", log=lines["part"].append)
    assert _metric_rows(tmp_path / "part") == _metric_rows(tmp_path / "full"), "metrics.jsonl differs after resume"
    assert rest.train_loss == full.train_loss
    summary = {name: re.search(r"train loss \S+", got[-1]).group() for name, got in lines.items()}
    assert summary["part"] == summary["full"], summary


def test_run_folder_contents(runs) -> None:
    full, _, _ = runs
    ckpt = full.checkpoint
    assert (ckpt.parent / "latest").read_text().strip() == ckpt.name
    trainer = json.loads((ckpt / "trainer.json").read_text())
    assert trainer["step"] == 6 and trainer["data"]["position"]["windows_consumed"] == 6 * 4
    assert trainer["tokenizer"] == "gpt2-32k" and trainer["eval"]["loss"] == full.eval.loss
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)  # nothing but tensors and plain containers
    assert state["scheduler"]["last_epoch"] == 6 and len(state["optimizer"]["state"]) > 0
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")], "temporary checkpoint left behind"
    from wiola import WiolaModel

    model = WiolaModel.from_pretrained(ckpt)
    assert model.config.d_model == 32, "the checkpoint folder is a loadable model folder"
    rows = [json.loads(line) for line in (full.out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all(len(r["gates"]) == 2 for r in evals)
    steps = [r for r in rows if r["kind"] == "train"]  # tokens: the targets trained on so far
    assert [(r["step"], r["tokens"]) for r in steps] == [(k, k * 4 * 32) for k in range(1, 7)], steps
    assert all(0 < g < 1 for r in evals for row in r["gates"] for g in row)
    for r in evals:
        assert math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-9)
    for name in ("loss_curve", "gates"):
        assert full.plots[name].read_bytes()[:4] == b"\x89PNG", f"{name} PNG"


def test_a_stop_at_the_last_step_is_a_finished_run(corpus, cache, tmp_path) -> None:
    """A stop asked for at the last step (``stop_at == steps``, as a signal during the last step
    asks) leaves a finished run, not an interrupted one (which the CLI would report with exit 130
    and a "continue with --resume")."""
    result = train(_cfg(corpus, cache, tmp_path / "r", steps=3, eval_every=100), stop_at=3, log=_quiet)
    assert result.step == 3 and not result.interrupted
    early = train(_cfg(corpus, cache, tmp_path / "s", steps=3, eval_every=100), stop_at=2, log=_quiet)
    assert early.step == 2 and early.interrupted


def test_checkpoint_rotation(corpus, cache, tmp_path) -> None:
    result = train(
        _cfg(corpus, cache, tmp_path / "r", steps=5, save_every=1, keep_checkpoints=2, eval_every=100), log=_quiet
    )
    kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("step_*"))
    assert kept == ["step_0000004", "step_0000005"], f"kept {kept}"
    assert result.checkpoint.name == "step_0000005"


def test_layer_gradient_norms_are_logged_before_clipping(corpus, cache, tmp_path, monkeypatch) -> None:
    """Each logged step's ``layer_grad_norms`` (one per block) are the gradients' norms before
    ``--grad-clip`` scales them: with a clip of 1e-3 they are far above it, and together at most
    the whole gradient's norm (``grad_norm``, also before clipping), the blocks being part of it;
    the clip is ``--grad-clip``'s."""
    clip = 1e-3
    clipped_to = []
    original = torch.nn.utils.clip_grad_norm_

    def recording(parameters, max_norm, *args, **kwargs):
        clipped_to.append(max_norm)
        return original(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    train(_cfg(corpus, cache, tmp_path / "r", steps=2, eval_every=100, grad_clip=clip), log=_quiet)
    assert clipped_to == [clip, clip], f"the gradient was clipped to {clipped_to}, not --grad-clip {clip}"
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        layers = r["layer_grad_norms"]
        assert len(layers) == SMALL["n_layers"], r
        assert min(layers) > 10 * clip and r["grad_norm"] > 10 * clip, r
        assert math.sqrt(sum(n * n for n in layers)) <= r["grad_norm"] * (1 + 1e-5), r


def _train_command(corpus: Path, cache: Path, out: Path, *flags: str) -> list[str]:
    """``wiola train`` arguments: the ``SMALL`` tiny model on ``corpus``, windows of 32, batches of 4,
    on the CPU into ``out`` without progress bars or plots; ``flags`` (the run's length, ...) added."""
    data = ["--data", str(corpus), "--cache-dir", str(cache), "--seq-len", "32", "--batch-size", "4"]
    quiet = ["--out", str(out), "--no-progress", "--no-plots", "--device", "cpu"]
    model = [arg for key, value in SMALL.items() for arg in ("--model", f"{key}={value}")]
    return ["train", "--preset", "tiny", *data, *flags, *quiet, *model]


# --------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_saves_checkpoint_and_exits_cleanly(corpus, cache, tmp_path, sig) -> None:
    """Ctrl-C, or SIGTERM (a scheduler's stop), during a run: the step ends, a checkpoint of it is
    saved, exit 130, no traceback."""
    out = tmp_path / "sig"
    long_run = ("--steps", "100000", "--log-every", "1", "--eval-every", "100000", "--save-every", "100000")
    cmd = [sys.executable, "-m", "wiola", *_train_command(corpus, cache, out, *long_run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and '"kind": "train"' in metrics.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"trainer exited early:\n{proc.stdout.read()}"
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, f"exit code {proc.returncode}:\n{output}"
    assert "Traceback" not in output and "interrupted at step" in output, output
    assert f"{signal.Signals(sig).name}: stopping after this step" in output, output
    trainer = json.loads(
        (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "trainer.json").read_text()
    )
    logged = _train_losses(out)
    assert trainer["step"] == logged[-1][0] >= 1, f"checkpoint step {trainer['step']} vs last logged {logged[-1]}"


# ------------------------------------------------------------------------ DDP and accumulation
def _torchrun(corpus: Path, cache: Path, out: Path, nproc: int, micro: int) -> subprocess.CompletedProcess:
    run = ("--micro-batch", str(micro), "--steps", "6", "--lr", "3e-3", "--warmup", "2", "--log-every", "1")
    evaluation = ("--eval-every", "6", "--eval-windows", "6")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "wiola"]
    cmd += _train_command(corpus, cache, out, *run, *evaluation)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


# Tolerance of the DDP and accumulation comparisons (fp32, CPU). With DDP each rank averages the
# loss over its 2 windows (64 targets) and the all-reduce averages the two gradients; one process
# averages all 128 targets at once. The math is the same and only the order of the float sums
# differs: gradients agree to ~1e-7 relative, and over six AdamW steps the losses (about 10 nats)
# agree to one or two fp32 ulps (measured: 0 or 9.5e-7 at every step, for DDP and for accumulation).
# 2e-5 allows 20 ulps of drift; a real bug (ranks reading the same windows, a sum instead of a
# mean, a missed micro-batch) changes the data or the scale of the step and moves the loss by
# >2e-2 from step 1 on (measured with another data seed below), three orders of magnitude more.
DDP_TOL = 2e-5


def test_ddp_two_gloo_ranks_match_single_process(corpus, cache, tmp_path, runs) -> None:
    proc = _torchrun(corpus, cache, tmp_path / "ddp", nproc=2, micro=2)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ddp = _train_losses(tmp_path / "ddp")
    single = runs[0].losses  # batch 4 × 32 in one process, same seed and schedule
    assert [s for s, _ in ddp] == [s for s, _ in single]
    for (step, a), (_, b) in zip(ddp, single):
        assert abs(a - b) <= DDP_TOL, f"step {step}: DDP loss {a} vs single-process {b} (diff {abs(a - b):.2e})"
    rows = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in rows if r["kind"] == "run")
    assert run["world_size"] == 2 and run["micro_batch"] == 2 and run["grad_accum"] == 1


def test_grad_accumulation_matches_full_batch(corpus, cache, tmp_path, runs) -> None:
    accum = train(_cfg(corpus, cache, tmp_path / "acc", micro_batch=2), log=_quiet)  # 2 micro-steps of 2
    other = train(_cfg(corpus, cache, tmp_path / "seed", seed=1, steps=2), log=_quiet)
    single = runs[0].losses
    for (step, a), (_, b) in zip(accum.losses, single):
        assert abs(a - b) <= DDP_TOL, f"step {step}: accumulated loss {a} vs full batch {b}"
    # The tolerance is meaningful: other windows change the loss by far more.
    assert max(abs(a - b) for (_, a), (_, b) in zip(other.losses, single)) > 100 * DDP_TOL


# ------------------------------------------------------------------------------------ bad input
def _fresh_cache_untouched(cache: Path) -> bool:
    return not (cache / "tokens").exists()


def test_missing_data_path(corpus, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(_cfg(tmp_path / "nope", tmp_path / "c", tmp_path / "o"), log=_quiet)


def _data_folder(root: Path, train_text: str, val_text: str) -> Path:
    """A data folder of two files, ``train.txt`` and ``val.txt``, holding these texts."""
    (root / "data").mkdir()
    (root / "data" / "train.txt").write_text(train_text)
    (root / "data" / "val.txt").write_text(val_text)
    return root / "data"


def test_empty_corpus(tmp_path) -> None:
    data = _data_folder(tmp_path, "\n\n", "Some text.")
    with pytest.raises(ValueError, match="empty corpus"):
        train(_cfg(data, tmp_path / "c", tmp_path / "o"), log=_quiet)


def test_corpus_shorter_than_one_window(tmp_path) -> None:
    data = _data_folder(tmp_path, "A very short story.", "Another one.")
    with pytest.raises(ValueError, match="fewer than one window"):
        train(_cfg(data, tmp_path / "c", tmp_path / "o"), log=_quiet)


def test_tokenizer_vocab_mismatch(corpus, tmp_path) -> None:
    cache = tmp_path / "c"
    with pytest.raises(ValueError, match=r"50,257 ids but the model.s vocab_size is 32,000"):
        train(_cfg(corpus, cache, tmp_path / "o", tokenizer="gpt2"), log=_quiet)
    with pytest.raises(ValueError, match="no tokenizer has a vocabulary of 1000"):
        train(_cfg(corpus, cache, tmp_path / "o", model={**SMALL, "vocab_size": 1000}), log=_quiet)
    assert _fresh_cache_untouched(cache), "tokenisation started before the tokenizer was checked"
    from wiola import WiolaConfig
    from wiola.train.env import tokenizer_for

    for vocab in (50257, 50304):  # a tokenizer of exactly the model's ids, and a padded embedding
        assert tokenizer_for(WiolaConfig.preset("tiny", vocab_size=vocab), "gpt2").vocab_size == 50257


def test_plain_progress_of_a_resumed_run_counts_from_where_it_resumed() -> None:
    """``Progress(initial=40)``: after 10 more steps of 100 the plain line says 50/100 (50%)."""
    from wiola.train.env import Progress

    lines: list[str] = []
    bar = Progress(100, "train", "step", show=False, log=lines.append, every=0, initial=40)
    bar.update(10)
    assert lines == ["train: 50/100 steps (50%)"], lines


def test_non_writable_output_folder(corpus, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = tmp_path / "c"
    for out, message in ((blocker / "run", "lies under .*which is a file"), (blocker, "is a file, not a folder")):
        with pytest.raises(ValueError, match=message):
            train(_cfg(corpus, cache, out), log=_quiet)
    assert _fresh_cache_untouched(cache), "work started before the output folder was checked"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_in_a_run_folder_is_refused(runs, corpus, cache, tmp_path, capsys) -> None:
    """``wiola train --out DIR`` without --resume, where DIR holds a run: exit 2 before any work,
    the run untouched; --overwrite replaces it; --resume with --overwrite is refused."""
    from wiola.cli import main

    folder = tmp_path / "run"
    shutil.copytree(runs[0].out_dir, folder)
    before = _snapshot(folder)
    fresh = tmp_path / "c"
    assert main(_train_command(corpus, fresh, folder, "--steps", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and f"--resume {folder}" in err[0], err
    assert _snapshot(folder) == before, "the refused run changed the folder"
    assert _fresh_cache_untouched(fresh), "work started before the run folder was checked"
    with pytest.raises(ValueError, match="already holds a run"):
        train(_cfg(corpus, fresh, folder), log=_quiet)
    assert main(_train_command(corpus, cache, folder, "--steps", "2", "--resume", str(folder), "--overwrite")) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(_train_command(corpus, cache, folder, "--steps", "2", "--log-every", "1", "--overwrite")) == 0
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["latest", "step_0000002"]
    assert [s for s, _ in _train_losses(folder)] == [1, 2], "metrics.jsonl still holds the old run's lines"
    assert not (folder / "gates.png").exists() and not (folder / "loss_curve.png").exists(), "old plots kept"


def test_init_takes_the_default_window_from_the_checkpoint(runs, corpus, cache, tmp_path, capsys) -> None:
    """--init without --seq-len: the window fits the checkpoint's max_seq_len (64), not the default
    preset's; a --seq-len past it is refused before any work, and nothing is written."""
    from wiola.cli import main

    quiet = ["--no-progress", "--no-plots", "--device", "cpu", "--batch-size", "4", "--eval-windows", "2"]
    command = ["train", "--init", str(runs[0].checkpoint), "--data", str(corpus), "--steps", "1", *quiet]
    fresh = tmp_path / "c"
    bad = tmp_path / "bad" / "run"
    assert main([*command, "--seq-len", "64", "--cache-dir", str(fresh), "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not fit max_seq_len=64" in err[0], err
    assert not (tmp_path / "bad").exists(), "the refused run created its --out folder"
    assert _fresh_cache_untouched(fresh), "tokenisation started before the window was checked"
    out = tmp_path / "run"
    assert main([*command, "--cache-dir", str(cache), "--out", str(out)]) == 0, capsys.readouterr().err
    trainer = json.loads((out / "checkpoints" / "step_0000001" / "trainer.json").read_text())
    assert trainer["train_config"]["seq_len"] == 63
    before = _snapshot(out)  # --overwrite would delete the checkpoint --init reads; a run around it hides it
    for init in (out, out / "checkpoints" / "step_0000001"):
        again = [*command[:2], str(init), *command[3:], "--cache-dir", str(cache), "--out", str(out), "--overwrite"]
        assert main(again) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--init checkpoint" in err[0], err
        assert _snapshot(out) == before, "the refused run changed its --init checkpoint's folder"


def test_an_init_run_writes_its_run_record(runs, corpus, cache, tmp_path) -> None:
    """A run started from --init opens metrics.jsonl with its run record, as a fresh run does
    (settings, model, parameters, data; ``init``: the folder the weights came from), then its
    reference lines."""
    full = runs[0]
    init = str(full.out_dir)  # a run folder: its latest checkpoint
    cfg = _cfg(corpus, cache, tmp_path / "run", init=init, model={}, steps=1, warmup=1, eval_every=100)
    result = train(cfg, log=_quiet, references={"unigram entropy": 7.5})
    rows = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["run", "reference", "train", "eval"]
    record, fresh = rows[0], _metric_rows(full.out_dir)[0]
    assert record["init"] == str(full.checkpoint) and record["config"]["init"] == init
    assert (record["model_config"], record["parameters"], record["data"]) == (
        fresh["model_config"],
        fresh["parameters"],
        fresh["data"],
    )
    assert fresh["init"] is None, "a fresh run's record says it was not initialised from a checkpoint"
    assert rows[1] == {"kind": "reference", "step": 0, "name": "unigram entropy", "value": 7.5}


def test_resume_with_nothing_to_do_says_so_last(runs, corpus, cache, tmp_path) -> None:
    """Resuming a finished run: the model line, then "nothing to do" as the last word."""
    folder = tmp_path / "run"
    shutil.copytree(runs[0].out_dir, folder)
    lines: list[str] = []
    result = train(_cfg(corpus, cache, folder), resume=folder, log=lines.append)
    assert result.step == 6 and not result.interrupted
    assert lines[-2].startswith("model: "), lines
    assert lines[-1] == "the checkpoint is at step 6 and the run has 6 steps: nothing to do (raise --steps)", lines


def test_an_interrupted_run_redraws_its_loss_curve(corpus, cache, tmp_path, monkeypatch, capsys) -> None:
    """A run stopped after step 5 of 6, whose last evaluation drew the curve at step 3: the curve
    is drawn again at the stop with every metrics record (steps 4 and 5 included), and the command
    line prints the plots' paths before exiting 130."""
    import wiola.train.plots as plots
    from wiola.cli import main

    drawn: list[list[int]] = []
    real = plots.plot_loss_curve

    def spy(records, path):
        drawn.append([r["step"] for r in records if r["kind"] == "train"])
        return real(records, path)

    monkeypatch.setattr(plots, "plot_loss_curve", spy)
    result = train(_cfg(corpus, cache, tmp_path / "run", plots=True), stop_at=5, log=_quiet)
    assert result.interrupted and result.step == 5
    assert drawn == [[1, 2, 3], [1, 2, 3, 4, 5]], drawn
    assert result.plots["loss_curve"].read_bytes()[:4] == b"\x89PNG"

    # the CLI's train call stopped after step 2 as a signal would stop it
    monkeypatch.setattr("wiola.train.train", lambda cfg, **kw: train(cfg, stop_at=2, log=_quiet, **kw))
    argv = ["train", "--preset", "tiny", "--model", "d_model=32", "--data", str(corpus), "--cache-dir", str(cache)]
    code = main([*argv, "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-windows", "2",
                 "--out", str(tmp_path / "cli"), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 130 and f"loss_curve: {tmp_path / 'cli' / 'loss_curve.png'}" in out, out


def test_resume_below_the_checkpoint_step_is_refused(runs, corpus, cache, tmp_path, capsys) -> None:
    """Resuming a run at step 6 with --steps 4 cannot be met: refused naming both counts (exit 2
    on the command line) before anything is written; the run stays as it was."""
    from wiola.cli import main

    folder = tmp_path / "run"
    shutil.copytree(runs[0].out_dir, folder)
    before = (folder / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"with --steps 4: it is at step 6 already"):
        train(_cfg(corpus, cache, folder, steps=4), resume=folder, log=_quiet)
    assert main(["train", "--resume", str(folder), "--steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it is at step 6 already" in err[0], err
    assert (folder / "metrics.jsonl").read_bytes() == before


def test_resume_with_more_steps_stretches_every_group_schedule(runs, corpus, cache, tmp_path) -> None:
    """Resuming a 6-step run from step 3 with 9 steps: from the first resumed step on, the
    learning rate of every parameter group (the decayed matrices and the undecayed norms and bias)
    is the 9-step schedule's at that step: the logged rate of steps 4 and 5, and both groups' rates
    in the optimizer state saved at step 5 (a schedule stretched for one group only, or from the
    second resumed step only, fails it)."""
    from wiola.train.optim import schedule
    from wiola.train.run_folder import read_optimizer_state

    folder = tmp_path / "run"
    shutil.copytree(runs[1].out_dir, folder)
    cfg = _cfg(corpus, cache, folder, steps=9)
    result = train(cfg, resume=folder / "checkpoints" / "step_0000003", stop_at=5, log=_quiet)
    assert result.step == 5 and result.interrupted
    multiplier = schedule(cfg)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in rows if r["kind"] == "train" and r["step"] in (4, 5)}
    assert len([r for r in rows if r["kind"] == "train" and r["step"] in (4, 5)]) == 2, rows
    assert logged == {4: cfg.lr * multiplier(3), 5: cfg.lr * multiplier(4)}, logged
    groups = read_optimizer_state(result.checkpoint)["optimizer"]["param_groups"]
    assert len(groups) == 2 and [g["lr"] for g in groups] == [cfg.lr * multiplier(5)] * 2, groups


def test_resume_with_more_steps_keeps_a_fractional_warmups_length(corpus, cache, tmp_path) -> None:
    """A warm-up given as a share of the steps (0.25 of 20: 5 steps) keeps its 5 steps when the run
    resumes with 200: raised --steps stretch the cosine, not the warm-up, so the first resumed step
    does not fall back inside it (at 8/50 of lr), and the checkpoints after it record the count."""
    from wiola.train.optim import WarmupCosine
    from wiola.train.run_folder import read_trainer_state

    folder = tmp_path / "run"
    first = train(_cfg(corpus, cache, folder, steps=20, warmup=0.25, eval_every=100), stop_at=8, log=_quiet)
    assert first.step == 8 and first.interrupted
    cfg = _cfg(corpus, cache, folder, steps=200, warmup=0.25, eval_every=100)
    result = train(cfg, resume=first.checkpoint, stop_at=10, log=_quiet)
    multiplier = WarmupCosine(5, 200, cfg.min_lr_ratio)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in rows if r["kind"] == "train" and r["step"] in (9, 10)}
    assert logged == {9: cfg.lr * multiplier(8), 10: cfg.lr * multiplier(9)}, logged
    assert min(logged.values()) > 0.99 * cfg.lr, f"the rate fell back into a warm-up: {logged}"
    assert read_trainer_state(result.checkpoint)["train_config"]["warmup"] == 5


def test_a_resumed_share_of_warmup_keeps_the_rounded_count_of_steps() -> None:
    """0.15 of 10 steps is 2 warm-up steps (``warmup_steps`` rounds): resumed with 100 steps the
    run keeps 2, not 1 (a truncation) or 15 (the share of the new length)."""
    from wiola.train.loop import _keep_warmup

    kept = _keep_warmup(TrainConfig(steps=100, warmup=0.15), {"steps": 10})
    assert kept.warmup == 2 == TrainConfig(steps=10, warmup=0.15).warmup_steps
    assert kept.warmup_steps == 2
    assert _keep_warmup(TrainConfig(steps=100, warmup=0.35), {"steps": 10}).warmup == 4  # 3.5 rounds to even


def test_a_warmup_longer_than_the_run_is_refused(corpus, cache, tmp_path) -> None:
    with pytest.raises(ValueError, match="warmup of 100 steps is longer than the run's 4 steps"):
        _cfg(corpus, cache, tmp_path / "r", steps=4, warmup=100)


def test_an_init_run_resumes_after_its_init_checkpoint_is_gone(runs, corpus, cache, tmp_path, capsys) -> None:
    """A run started with --init resumes from its own checkpoint: its model and tokenizer are read
    there, so the --init folder may since have been moved or deleted."""
    from wiola.cli import main

    source = tmp_path / "source"
    shutil.copytree(runs[0].checkpoint, source)
    quiet = ["--no-progress", "--no-plots", "--device", "cpu", "--batch-size", "4", "--eval-windows", "2"]
    out = tmp_path / "run"
    command = ["train", "--data", str(corpus), "--cache-dir", str(cache), *quiet]
    assert main([*command, "--init", str(source), "--steps", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    shutil.rmtree(source)
    assert main([*command, "--resume", str(out), "--steps", "2"]) == 0, capsys.readouterr().err
    trainer = json.loads((out / "checkpoints" / "step_0000002" / "trainer.json").read_text())
    assert trainer["step"] == 2


def test_a_refused_run_leaves_no_out_folder(tmp_path, capsys) -> None:
    from wiola.cli import main

    out = tmp_path / "runs" / "x1"
    assert main(_train_command(tmp_path / "nope", tmp_path / "c", out, "--steps", "1")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "the refused run created its --out folder"


def test_plain_step_lines_without_a_bar(corpus, cache, tmp_path) -> None:
    """With no progress bar (--no-progress here; a pipe below) every logging step prints a line,
    and a summary line ends the run."""
    lines: list[str] = []
    train(_cfg(corpus, cache, tmp_path / "r", steps=4, log_every=2, eval_every=100), log=lines.append)
    steps = [line for line in lines if line.startswith("step ") and ": loss " in line]
    assert [line.split(":")[0] for line in steps] == ["step 2/4", "step 4/4"], lines
    assert lines[-1].startswith("trained steps 1-4 in ") and "train loss" in lines[-1], lines


def test_resume_with_other_config_is_refused(runs, corpus, tmp_path) -> None:
    _, part, _ = runs
    cache = tmp_path / "c"
    with pytest.raises(ValueError, match=r"another model configuration \(d_model: checkpoint 32 vs this run 64"):
        train(_cfg(corpus, cache, tmp_path / "o", model={**SMALL, "d_model": 64}), resume=part.out_dir, log=_quiet)
    with pytest.raises(ValueError, match=r"training settings differ \(seq_len: checkpoint 32 vs this run 16\)"):
        train(_cfg(corpus, cache, tmp_path / "o", seq_len=16), resume=part.out_dir, log=_quiet)
    with pytest.raises(FileNotFoundError, match="neither a training checkpoint"):
        train(_cfg(corpus, cache, tmp_path / "o"), resume=tmp_path, log=_quiet)
    assert _fresh_cache_untouched(cache), "work started before the checkpoint was checked"


@pytest.mark.parametrize(
    "change",
    [{"lr": 1e-4}, {"seed": 1}, {"batch_size": 16}, {"min_lr_ratio": 0.1}, {"warmup": 0.1}, {"betas": [0.9, 0.99]},
     {"eps": 1e-6}, {"weight_decay": 0.1}, {"grad_clip": 0.5}, {"shuffle": False}, {"val_fraction": 0.02},
     {"precision": "bf16"}],
    ids=lambda change: next(iter(change)),
)  # fmt: skip
def test_resume_refuses_each_setting_that_changes_the_numbers(change) -> None:
    """A resumed run is the run it continues, bitwise: a setting that changes the weights, the
    schedule or the data order differs from the checkpoint's: refused, naming it."""
    from wiola.train.loop import _check_resume

    old = TrainConfig(preset="tiny", data="sample", steps=10)
    new = TrainConfig.from_dict({**old.to_dict(), **change})
    saved = {"model_config": old.model_config().to_dict(), "train_config": old.to_dict(), "step": 5}
    name = next(iter(change))
    with pytest.raises(ValueError, match=rf"training settings differ \({name}: checkpoint "):
        _check_resume(saved, new, new.model_config(), Path("ckpt"))
    for resumable in ({"steps": 20}, {"eval_every": 7}, {"micro_batch": 1}):  # these may change
        _check_resume(saved, TrainConfig.from_dict({**old.to_dict(), **resumable}), old.model_config(), Path("ckpt"))


def test_a_fractional_warmup_is_rounded_to_the_nearest_step() -> None:
    """0.15 of 25 steps is 3.75: 4 warm-up steps; 0.05 of 30 is 1.5: 2 (half to even: 0.05 of 50 is 2)."""
    got = [TrainConfig(steps=s, warmup=w).warmup_steps for w, s in ((0.15, 25), (0.05, 30), (0.05, 50), (3, 25))]
    assert got == [4, 2, 2, 3], got


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ValueError, match="betas"):
        TrainConfig(betas=[0.9])
    with pytest.raises(ValueError, match="unknown training settings"):
        TrainConfig.from_dict({"learning_rate": 1.0})


# A setting of the wrong kind or out of range (a config file's value, a flag's NaN) and the message
# that refuses it; NaN and infinity pass comparisons such as ``lr > 0``, so they are named too.
WRONG_SETTINGS = [
    ({"lr": math.inf}, "lr must be a finite number, got inf"),
    ({"lr": math.nan}, "lr must be a finite number, got nan"),
    ({"lr": "abc"}, "lr must be a finite number, got 'abc'"),
    ({"grad_clip": math.nan}, "grad_clip must be a finite number, got nan"),
    ({"weight_decay": math.nan}, "weight_decay must be a finite number, got nan"),
    ({"warmup": math.nan}, "warmup must be a finite number, got nan"),
    ({"warmup": 1.5}, "warmup 1.5 is a step count (>= 1), which must be whole; a fraction of steps is < 1"),
    ({"eps": math.nan}, "eps must be a finite number, got nan"),
    ({"eps": 0}, "eps must be positive, got 0.0"),
    ({"min_lr_ratio": -math.inf}, "min_lr_ratio must be a finite number, got -inf"),
    ({"val_fraction": math.nan}, "val_fraction must be a finite number, got nan"),
    ({"peak_flops": math.inf}, "peak_flops must be a finite number or None, got inf"),
    ({"peak_flops": -1}, "peak_flops (FLOP/s of one device, for MFU) must be positive, got -1"),
    ({"peak_flops": 0}, "peak_flops (FLOP/s of one device, for MFU) must be positive, got 0"),
    ({"num_threads": 0}, "num_threads (tokeniser threads) must be a positive int, got 0"),
    ({"shuffle": "false"}, "shuffle must be true or false, got 'false'"),
    ({"plots": 0}, "plots must be true or false, got 0"),
    ({"betas": 0.9}, "betas must be a list of finite numbers, got 0.9"),
    ({"betas": [0.9, math.nan]}, "betas must be a list of finite numbers, got [0.9, nan]"),
    ({"steps": 5.5}, "steps must be an int, got 5.5"),
    ({"seq_len": "64"}, "seq_len must be an int or None, got '64'"),
    ({"seed": -1}, "seed must be an int in [0, 2**64), got -1"),
    ({"device": "tpu"}, "device must be cpu, cuda or cuda:N (N the GPU's index), got 'tpu'"),
    ({"device": "cuda:x"}, "device must be cpu, cuda or cuda:N (N the GPU's index), got 'cuda:x'"),
    ({"model": [1]}, "model must be a JSON object (a dict), got [1]"),
    ({"model": {"gate": "False"}}, "gate must be true or false, got 'False'"),
    ({"model": {"width": 3}}, "unknown WiolaConfig fields: ['width']"),
]


@pytest.mark.parametrize("settings, message", WRONG_SETTINGS, ids=lambda v: str(v)[:40])
def test_wrong_settings_are_refused_by_name(settings, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TrainConfig.from_dict(settings)


def test_settings_of_a_near_kind_are_stored_as_their_field_s() -> None:
    """An int where a float goes and a tuple of betas: accepted and stored as float and list, so
    the checkpoint's JSON and a resumption's comparison see one kind."""
    cfg = TrainConfig.from_dict({"lr": 1, "betas": (0.9, 0.99), "peak_flops": 10**15, "device": "cuda:1"})
    assert (cfg.lr, cfg.betas, cfg.peak_flops) == (1.0, [0.9, 0.99], 1e15)
    assert type(cfg.lr) is float and type(cfg.peak_flops) is float and type(cfg.betas) is list
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "flags, file_settings, message",
    [
        (["--lr", "inf"], None, "lr must be a finite number, got inf"),
        (["--grad-clip", "nan"], None, "grad_clip must be a finite number, got nan"),
        (["--weight-decay", "nan"], None, "weight_decay must be a finite number, got nan"),
        (["--warmup", "nan"], None, "warmup must be a finite number, got nan"),
        (
            ["--warmup", "1.5"],
            None,
            "warmup 1.5 is a step count (>= 1), which must be whole; a fraction of steps is < 1",
        ),
        (["--eps", "nan"], None, "eps must be a finite number, got nan"),
        (["--peak-flops", "-1"], None, "peak_flops (FLOP/s of one device, for MFU) must be positive, got -1"),
        (["--num-threads", "0"], None, "num_threads (tokeniser threads) must be a positive int, got 0"),
        (["--device", "tpu"], None, "device must be cpu, cuda or cuda:N (N the GPU's index), got 'tpu'"),
        (["--model", "gate=yes"], None, "gate must be true or false, got 'yes'"),
        (["--model", "d_model=wide"], None, "d_model must be an int, got 'wide'"),
        ([], {"shuffle": "false"}, "shuffle must be true or false, got 'false'"),
        ([], {"lr": "abc"}, "lr must be a finite number, got 'abc'"),
        ([], {"betas": 0.9}, "betas must be a list of finite numbers, got 0.9"),
        ([], {"model": [1]}, "model must be a JSON object (a dict), got [1]"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_cli_refuses_wrong_settings_before_any_work(flags, file_settings, message, corpus, tmp_path, capsys) -> None:
    """Exit 2 with one line naming the setting; nothing tokenised and no --out folder made."""
    from wiola.cli import main

    if file_settings is not None:
        (tmp_path / "c.json").write_text(json.dumps(file_settings))
        flags = [*flags, "--config", str(tmp_path / "c.json")]
    fresh, out = tmp_path / "c", tmp_path / "runs" / "x"
    assert main([*_train_command(corpus, fresh, out, "--steps", "2"), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"wiola train: error: {message}"]
    assert not (tmp_path / "runs").exists(), "the refused run created its --out folder"
    assert _fresh_cache_untouched(fresh), "tokenisation started before the settings were checked"


def test_model_flags_take_true_and_false_in_any_case() -> None:
    from wiola.cli.train import config_from_args

    flags = ["--model", "gate=False", "--model", "gate_pre_rope=TRUE", "--model", "ffn=gelu"]
    cfg = config_from_args(_parse(["train", "--preset", "tiny", *flags, "--model", "rope_base=5e3"]))
    assert cfg.model == {"gate": False, "gate_pre_rope": True, "ffn": "gelu", "rope_base": 5e3}
    model = cfg.model_config()
    assert model.gate is False and model.gate_pre_rope is True and model.rope_base == 5000.0


# ------------------------------------------------------------------------------------- divergence
def _strict_json(text: str) -> dict:
    """``text`` as JSON proper: Python's json writes and reads NaN and Infinity, which are not JSON
    (other readers refuse the whole line)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON: {text}")

    return json.loads(text, parse_constant=refuse)


def _strict_json_lines(path: Path) -> list[dict]:
    return [_strict_json(line) for line in path.read_text().splitlines()]


def test_a_diverging_run_stops_with_exit_1_and_keeps_its_good_checkpoint(corpus, cache, tmp_path, capsys) -> None:
    """--lr 1e6: the weights turn NaN in step 3, so the loss of the step-4 log line is NaN. The run
    stops there, exit 1, with one line saying what to change and where the last checkpoint is;
    metrics.jsonl stays JSON, and the step-2 checkpoint stays the latest (a step-4 one would have
    rotated it out: --keep 1)."""
    from wiola.cli import main

    out = tmp_path / "run"
    flags = ["--lr", "1e6", "--warmup", "0", "--steps", "8", "--log-every", "2", "--save-every", "2", "--keep", "1"]
    assert main(_train_command(corpus, cache, out, *flags, "--eval-every", "100")) == 1
    good = out / "checkpoints" / "step_0000002"
    assert capsys.readouterr().err.strip().splitlines() == [
        "wiola train: error: the training loss is nan at step 4: the run diverged; lower --lr (now 1e+06), then "
        f"start again or go on from the last checkpoint before it, step 2, with --init {good} and a new --out "
        "(without --model)"
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_0000002"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000002"
    assert all(bool(w.isfinite().all()) for w in _weights(good).values())
    assert _strict_json((good / "trainer.json").read_text())["step"] == 2
    assert [(r["kind"], r["step"]) for r in _strict_json_lines(out / "metrics.jsonl")] == [("run", 0), ("train", 2)]


@pytest.mark.parametrize(
    "every, message",
    [
        # The gradient of step 3 is NaN; its loss, computed before it, is not.
        ({"log_every": 1}, "the gradient norm is nan at step 3"),
        ({"log_every": 1, "grad_clip": 0.0}, "the gradient norm of layer 0 is nan at step 3"),
        ({"eval_every": 1}, "the validation loss is nan at step 3"),
        ({"save_every": 1}, "the model's weights are not finite at step 3"),
    ],
    ids=["log", "log-no-clip", "eval", "save"],
)
def test_divergence_is_caught_where_the_numbers_reach_the_host(every, message, corpus, cache, tmp_path) -> None:
    """The weights turn NaN in step 3 (lr 1e6). A log line catches it in the gradient norm, an
    evaluation in the validation loss, a checkpoint in the weights; none of them writes it."""
    settings = {"lr": 1e6, "warmup": 0, "steps": 8, "log_every": 100, "eval_every": 100, "save_every": 100, **every}
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as caught:
        train(_cfg(corpus, cache, out, **settings), log=_quiet)
    clip = "" if settings.get("grad_clip", 1.0) else " or clip the gradients (--grad-clip 1)"
    saved = every.get("save_every") == 1
    good = out / "checkpoints" / "step_0000002"
    way_on = (
        f"start again or go on from the last checkpoint before it, step 2, with --init {good} and a new --out "
        "(without --model)"
        if saved
        else "start again (no checkpoint was saved before it)"
    )
    assert str(caught.value) == f"{message}: the run diverged; lower --lr (now 1e+06){clip}, then {way_on}"
    assert caught.value.step == 3 and caught.value.checkpoint == (good if saved else None)
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == (["step_0000001", "step_0000002"] if saved else []), kept
    rows = _strict_json_lines(out / "metrics.jsonl")
    assert all(r["step"] < 3 for r in rows), "a line of the diverged step was written"


def test_batch_and_window_checks(corpus, tmp_path) -> None:
    with pytest.raises(ValueError, match="not a multiple of micro_batch 3"):
        train(_cfg(corpus, tmp_path / "c", tmp_path / "o", micro_batch=3), log=_quiet)
    with pytest.raises(ValueError, match="do not fit max_seq_len=64"):
        train(_cfg(corpus, tmp_path / "c", tmp_path / "o", seq_len=64), log=_quiet)


def test_fast_unavailable_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wiola.fast", None)  # import of wiola.fast now fails
    with pytest.raises(RuntimeError, match="--fast needs wiola.fast.*drop --fast"):
        model_class(True)


# --------------------------------------------------------------------------- recipe, schedule, groups
def test_paper_recipe() -> None:
    from wiola.train import recipe, recipe_names

    assert recipe_names() == ["paper"]
    paper = recipe("paper")
    assert "_comment" not in paper and not (ROOT / "recipes").exists(), "the recipes live in wiola/train/recipes only"
    cfg = TrainConfig.from_dict(paper)
    with pytest.raises(ValueError, match="unknown recipe 'papers'; choose one of"):
        recipe("papers")
    assert (cfg.lr, cfg.betas, cfg.weight_decay, cfg.eps, cfg.grad_clip) == (3e-4, [0.9, 0.95], 0.01, 1e-8, 1.0)
    assert (cfg.steps, cfg.warmup_steps, cfg.batch_size, cfg.seq_len) == (20000, 1000, 32, 512)
    assert cfg.model_config().vocab_size == 32000 and cfg.preset == "13m"


def test_warmup_cosine_schedule() -> None:
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert [f(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    for step in (10, 35, 60, 85, 110, 500):
        progress = min(1.0, (step - 10) / 100)
        ref = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert abs(f(step) - ref) < 1e-15, f"schedule at step {step}"
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_weight_decay_on_matrices_only() -> None:
    from wiola import WiolaConfig, WiolaModel

    model = WiolaModel(WiolaConfig.preset("tiny", **SMALL))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.01), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert (
        "embed.weight" in decay and "layers.0.attn.gate_w1.weight" in decay and "layers.1.ffn.up_proj.weight" in decay
    )
    assert no_decay == {"norm.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in ("attn_norm.weight", "ffn_norm.weight", "attn.gate_w2.bias")
    }
    assert len(decay) + len(no_decay) == len(names), "a parameter is in no group"
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    other = build_optimizer(model, TrainConfig(betas=(0.8, 0.9), eps=0.1, lr=2e-3), torch.device("cpu"))
    assert (other.defaults["betas"], other.defaults["eps"], other.defaults["lr"]) == ((0.8, 0.9), 0.1, 2e-3)


def test_the_schedule_of_a_config_takes_its_warmup_steps_and_final_ratio() -> None:
    from wiola.train.optim import schedule

    f = schedule(TrainConfig(steps=110, warmup=10, min_lr_ratio=0.5))
    assert (f.warmup, f.total, f.min_ratio) == (10, 110, 0.5)
    assert f(110) == 0.5 and f(0) == 0.1
    assert schedule(TrainConfig(steps=10, warmup=0.15)).warmup == 2  # a share: rounded, as warmup_steps is


# ------------------------------------------------------------------------------------------ CLI
def _parse(argv: list[str]):
    from wiola.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_config_precedence(runs, tmp_path) -> None:
    from wiola.cli.train import config_from_args

    cfg = config_from_args(_parse(["train", "--recipe", "paper", "--steps", "10", "--model", "d_model=64"]))
    assert (cfg.steps, cfg.lr, cfg.preset, cfg.model) == (10, 3e-4, "13m", {"d_model": 64})
    (tmp_path / "c.json").write_text(json.dumps({"lr": 1e-3, "seq_len": 128}))
    cfg = config_from_args(_parse(["train", "--recipe", "paper", "--config", str(tmp_path / "c.json"), "--lr", "2e-3"]))
    assert (cfg.lr, cfg.seq_len, cfg.batch_size) == (2e-3, 128, 32), "flags > config file > recipe"
    part = runs[1]
    cfg = config_from_args(_parse(["train", "--resume", str(part.out_dir), "--steps", "9"]))
    assert (cfg.steps, cfg.seq_len, cfg.model, cfg.out_dir) == (9, 32, SMALL, str(part.out_dir)), (
        "resume keeps saved values"
    )
    with pytest.raises(ValueError, match="KEY=VALUE"):
        config_from_args(_parse(["train", "--model", "width=3"]))


def test_cli_eval_and_gates(runs, capsys, tmp_path) -> None:
    from wiola.cli import main

    full = runs[0]
    assert main(["eval", "--checkpoint", str(full.out_dir), "--eval-windows", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["loss"] == pytest.approx(full.eval.loss, rel=1e-9) and out["bits_per_byte"] == pytest.approx(
        full.eval.bits_per_byte, rel=1e-9
    ), "wiola eval disagrees with the trainer's final evaluation"
    png = tmp_path / "g.png"
    assert main(["gates", "--checkpoint", str(full.checkpoint), "--out", str(png), "--windows", "8"]) == 0
    text = capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG" and "layer" in text
    rows = json.loads((full.out_dir / "metrics.jsonl").read_text().splitlines()[-1])
    expected = [f"{g:.3f}" for g in rows["gates"][0]]
    assert "    0  " + "  ".join(expected) in text, f"gates table {text!r} vs trainer's {expected}"
    assert main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert out["precision"] == "auto"  # the run's
    # a run trained in bf16 is scored in bf16 unless --precision says otherwise
    copy = tmp_path / "bf16-run"
    shutil.copytree(full.checkpoint, copy)
    trainer = json.loads((copy / "trainer.json").read_text())
    trainer["train_config"]["precision"] = "bf16"
    (copy / "trainer.json").write_text(json.dumps(trainer))
    for flags, precision in (([], "bf16"), (["--precision", "fp32"], "fp32")):
        assert main(["eval", "--checkpoint", str(copy), "--eval-windows", "2", "--json", *flags]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["precision"] == precision, flags


@pytest.mark.parametrize(
    "flags",
    [
        ["--eval-windows", "0"],
        ["--eval-windows", "-3"],
        ["--seq-len", "-5"],
        ["--seq-len", "0"],
        ["--batch-size", "-1"],
        ["--batch-size", "0"],
    ],
)
def test_cli_eval_refuses_counts_below_one(runs, monkeypatch, capsys, flags) -> None:
    """A count below 1 is refused before the model loads, naming the flag: none would score a
    window (loss 0.0000, perplexity 1.000) or silently mean the default (--seq-len 0)."""
    import wiola.cli.evaluate as evaluate
    from wiola.cli import main

    def loads(*_):
        raise AssertionError("the checkpoint was loaded before the flags were checked")

    monkeypatch.setattr(evaluate, "_load_for_eval", loads)
    # gates has no --eval-windows or --batch-size (test_cli_gates_refuses_the_scoring_flags_it_would_ignore)
    for command in ("eval", "gates") if flags[0] == "--seq-len" else ("eval",):
        code = main([command, "--checkpoint", str(runs[0].out_dir), *flags])
        captured = capsys.readouterr()
        assert code == 2 and captured.out == "", captured
        assert captured.err == f"wiola {command}: error: {flags[0]} must be >= 1, got {flags[1]}\n", captured.err


def test_cli_gates_refuses_the_scoring_flags_it_would_ignore(runs, capsys) -> None:
    """``gates`` averages ``--windows`` windows in one forward pass: ``--eval-windows`` and
    ``--batch-size`` (``eval``'s) are refused, exit 2, not accepted and ignored."""
    from wiola.cli import main

    for flags in (["--eval-windows", "8"], ["--batch-size", "4"]):
        with pytest.raises(SystemExit) as stop:
            main(["gates", "--checkpoint", str(runs[0].out_dir), "--windows", "4", *flags])
        assert stop.value.code == 2
        assert f"unrecognized arguments: {' '.join(flags)}" in capsys.readouterr().err


def test_cli_gates_checks_its_png_folder_first(runs, monkeypatch, tmp_path, capsys) -> None:
    """``wiola gates --out`` under a file is refused before any work; a missing folder is made."""
    import wiola.cli.evaluate as evaluate
    from wiola.cli import main

    (tmp_path / "file").write_text("x")
    real = evaluate._load_for_eval
    monkeypatch.setattr(evaluate, "_load_for_eval", lambda *_: pytest.fail("loaded before --out was checked"))
    assert main(["gates", "--checkpoint", str(runs[0].out_dir), "--out", str(tmp_path / "file" / "g.png")]) == 2
    assert "the folder of --out" in capsys.readouterr().err
    monkeypatch.setattr(evaluate, "_load_for_eval", real)
    png = tmp_path / "new" / "deeper" / "g.png"
    assert main(["gates", "--checkpoint", str(runs[0].out_dir), "--out", str(png), "--windows", "2"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_demo_smoke(tmp_path, capsys) -> None:
    from wiola.cli import main

    out = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                "--steps",
                "2",
                "--samples",
                "1",
                "--out",
                str(out),
                "--cache-dir",
                str(tmp_path / "c"),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    entropy = float(text.split("unigram entropy of the training tokens: ")[1].split()[0])
    assert 4.0 < entropy < 7.0, f"unigram entropy {entropy}"
    assert "[1] " in text and "validation: loss" in text and "training: 2 steps" in text, text
    for name in ("loss_curve.png", "gates.png", "checkpoints/step_0000002/model.safetensors"):
        assert (out / name).is_file(), f"demo did not write {name}"


def test_demo_again_replaces_its_own_folder_and_no_other(tmp_path, monkeypatch, capsys) -> None:
    """A second ``wiola demo`` replaces the run the first left in its default folder (runs/demo);
    into another --out that holds a run it is refused (exit 2, the run untouched) unless --overwrite."""
    from wiola.cli import main

    monkeypatch.chdir(tmp_path)
    flags = ["--steps", "2", "--samples", "1", "--cache-dir", str(tmp_path / "c"), "--no-progress", "--device", "cpu"]
    for _ in range(2):
        assert main(["demo", *flags]) == 0
        assert (tmp_path / "runs" / "demo" / "checkpoints" / "step_0000002" / "model.safetensors").is_file()
    other = tmp_path / "mine"
    assert main(["demo", *flags, "--out", str(other)]) == 0
    before = (other / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["demo", *flags, "--out", str(other)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (other / "metrics.jsonl").read_bytes() == before
    assert main(["demo", *flags, "--out", str(other), "--overwrite"]) == 0


def test_demo_that_diverges_exits_1_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    """The demo has no --lr to lower: a diverged run (its learning rate raised here) ends with exit
    1 and one line naming the step, not the train command's advice or a traceback."""
    import wiola.cli.demo
    from wiola.cli import main

    build = wiola.cli.demo._demo_config

    def diverging(args, device):
        cfg = build(args, device)
        cfg.lr = 1e6
        return cfg

    monkeypatch.setattr(wiola.cli.demo, "_demo_config", diverging)
    flags = ["--steps", "6", "--samples", "1", "--cache-dir", str(tmp_path / "c"), "--no-progress", "--device", "cpu"]
    assert main(["demo", *flags, "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("wiola demo: error: the demo's training diverged at step "), err


def test_demo_tokenizer_error_says_what_to_set(monkeypatch) -> None:
    from wiola import tokenizer
    from wiola.cli.demo import _demo_tokenizer

    tokenizer.get_encoding.cache_clear()
    monkeypatch.setenv("WIOLA_BPE_FILE", "/nonexistent/gpt2.tiktoken")
    try:
        with pytest.raises(RuntimeError, match="set WIOLA_BPE_FILE"):
            _demo_tokenizer()
    finally:
        tokenizer.get_encoding.cache_clear()


# ------------------------------------------------------------------ presets, flags, precision
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_with_the_default_flags(preset, corpus, cache, tmp_path, capsys) -> None:
    """``wiola train --preset P --data DIR`` with every setting but the step count and the batch
    at its default (one step of one window keeps the larger presets cheap on a CPU): the
    default seq_len fits the preset, and one step gives the loss of a near-uniform prediction."""
    from wiola.cli import main
    from wiola.cli.train import config_from_args
    from wiola.train.run_folder import read_trainer_state

    max_len = PRESETS[preset]["max_seq_len"]
    assert TrainConfig(preset=preset).seq_len == min(512, max_len - 1)
    assert config_from_args(_parse(["train", "--preset", preset])).seq_len == min(512, max_len - 1)
    out = tmp_path / preset
    code = main(["train", "--preset", preset, "--data", str(corpus), "--cache-dir", str(cache), "--out", str(out),
                 "--steps", "1", "--batch-size", "1", "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    trainer = read_trainer_state(out)
    assert trainer["step"] == 1 and trainer["train_config"]["seq_len"] == min(512, max_len - 1)
    # At initialisation the logits W·h (tied embedding W of std σ = init_std, RMS-normalised h)
    # spread with variance σ²·d around 0, so the loss is ln V + σ²·d / 2 to second order. One
    # window's first loss was measured 0.005-0.15 from it (the four presets on torch 2.11 and
    # 2.13). One AdamW step then lowers the validation loss.
    config = WiolaConfig.preset(preset)
    expected = math.log(config.vocab_size) + config.init_std**2 * config.d_model / 2
    loss, val_loss = trainer["train_loss"], trainer["eval"]["loss"]
    assert abs(loss - expected) < 0.3, f"{preset}: first loss {loss} vs {expected:.4f} at initialisation"
    assert val_loss < loss, f"{preset}: validation loss {val_loss} after one step vs {loss} before it"


def test_activation_checkpointing_flag_reaches_the_model() -> None:
    from wiola.cli.train import config_from_args
    from wiola.train import build_model

    on = config_from_args(_parse(["train", "--preset", "tiny", "--activation-checkpointing", "--model", "n_layers=1"]))
    off = config_from_args(_parse(["train", "--preset", "tiny", "--model", "n_layers=1"]))
    assert on.activation_checkpointing is True and off.activation_checkpointing is False
    for cfg in (on, off):
        model = build_model(cfg, cfg.model_config(), torch.device("cpu"))
        assert model.activation_checkpointing is cfg.activation_checkpointing, "train() builds its model here"


def test_one_autocast_rule() -> None:
    from wiola.train.env import autocast, uses_bf16

    table = {("cpu", "auto"): False, ("cuda", "auto"): True, ("cpu", "bf16"): True, ("cuda", "fp32"): False}
    for (device, precision), bf16 in table.items():
        assert uses_bf16(device, precision) is bf16, f"{device} {precision}"
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for precision, dtype in (("auto", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        with autocast("cpu", precision):
            assert (a @ b).dtype == dtype, f"matmul under precision {precision!r}"
    with pytest.raises(ValueError, match="precision must be one of"):
        uses_bf16("cpu", "fp16")


def test_missing_plotting_package_names_the_extra(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    cache = tmp_path / "c"
    with pytest.raises(ImportError, match=r"`matplotlib` package.*pip install 'wiola-slm\[train\]'"):
        train(_cfg(corpus, cache, tmp_path / "o", plots=True), log=_quiet)
    assert _fresh_cache_untouched(cache), "tokenisation started before the packages were checked"


# ------------------------------------------------------------------------------------ progress
def _wiola(*args: str) -> subprocess.CompletedProcess:
    """``python -m wiola ARGS`` with stdout and stderr into one pipe (not a terminal), as
    ``wiola ... 2>&1 | cat`` or a log file gets them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "wiola", *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )


def test_progress_in_a_pipe_is_plain_lines(corpus, tmp_path) -> None:
    """Not a terminal, progress not turned off: no bar (no carriage return) while tokenising,
    training or scoring; step lines instead, and a summary line at the end of each."""
    out = tmp_path / "run"
    flags = _train_command(corpus, tmp_path / "c1", out, "--steps", "4", "--log-every", "2")
    flags.remove("--no-progress")
    done = _wiola(*flags)
    assert done.returncode == 0, done.stdout
    assert "\r" not in done.stdout, f"a progress bar was drawn into a pipe:\n{done.stdout!r}"
    assert "step 2/4: loss " in done.stdout and "step 4/4: loss " in done.stdout, done.stdout
    assert "trained steps 1-4 in " in done.stdout and "tokens: " in done.stdout, done.stdout
    done = _wiola("eval", "--checkpoint", str(out), "--cache-dir", str(tmp_path / "c2"), "--device", "cpu")
    assert done.returncode == 0, done.stdout
    assert "\r" not in done.stdout, f"a progress bar was drawn into a pipe:\n{done.stdout!r}"
    assert "tokens: " in done.stdout and "scored " in done.stdout and "perplexity" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_progress_on_a_terminal_is_a_bar(corpus, tmp_path) -> None:
    """On a terminal (tmux): tqdm bars while tokenising, training and validating, and no plain step lines."""
    import shlex

    from terminal import run_to_exit

    flags = _train_command(corpus, tmp_path / "c", tmp_path / "run", "--steps", "6", "--log-every", "2")
    flags.remove("--no-progress")
    cmd = [sys.executable, "-m", "wiola", *flags]
    record = tmp_path / "terminal.log"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in os.environ.items() if k in ("WIOLA_BPE_FILE", "PYTHONPATH"))
    screen = run_to_exit(f"cd {shlex.quote(str(ROOT))} && env OMP_NUM_THREADS=1 {env} {shlex.join(cmd)}", record)
    assert "EXIT=0" in screen, screen
    written = record.read_text(errors="replace")
    assert re.search(r"6/6 \[[^\r\n]*step", written), f"no training bar was drawn:\n{written}"
    assert "tokenising train" in written, f"no tokenising bar was drawn:\n{written}"
    assert re.search(r"validation: [^\r\n]*window", written), f"no bar while validating:\n{written}"
    assert "step 2/6: loss" not in written, "plain step lines beside the bar"
    assert "trained steps 1-6 in " in screen, screen


def test_progress_off_a_terminal_logs_lines_and_a_summary(monkeypatch) -> None:
    """wiola.train.env.Progress: no tqdm off a terminal (stderr is captured here), a plain line
    through ``log`` once ``every`` seconds have passed, and the summary on close."""
    import wiola.train.env as env

    clock = iter([0.0, 10.0, 31.0, 40.0, 62.0])  # the start, then one reading per update
    monkeypatch.setattr(env.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(env, "require", lambda *_: pytest.fail("tqdm was used off a terminal"))
    lines: list[str] = []
    bar = env.Progress(200, "tokenising train", "doc", log=lines.append)
    for _ in range(4):
        bar.update(50)
    bar.close("tokens: done")
    assert not bar.drawn
    assert lines == ["tokenising train: 100/200 docs (50%)", "tokenising train: 200/200 docs (100%)", "tokens: done"]


# ------------------------------------------------------------------- a damaged or full run folder
def _fail_at_step(monkeypatch, what: str, step: int) -> dict[str, bytes]:
    """Make the checkpoint of ``step`` fail as on a full disk while writing ``what`` (``weights``:
    safetensors' error; ``optimizer``: torch.save's short write), after writing part of the file.
    Returns the complete files ``checkpoints/`` held when the failing write began (filled in then)."""
    import safetensors.torch
    from safetensors import SafetensorError

    before: dict[str, bytes] = {}
    real = safetensors.torch.save_file if what == "weights" else torch.save

    def failing(obj, path, *args, **kwargs):
        if f".step_{step:07d}.tmp-" not in str(path):
            return real(obj, path, *args, **kwargs)
        root = Path(path).parent.parent
        before.update({name: data for name, data in _snapshot(root).items() if not name.startswith(".")})
        Path(path).write_bytes(b"PK\x03\x04 cut short")
        if what == "weights":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    if what == "weights":
        monkeypatch.setattr(safetensors.torch, "save_file", failing)
    else:
        monkeypatch.setattr(torch, "save", failing)
    return before


@pytest.mark.parametrize(
    "what, file, reason",
    [
        ("weights", "model.safetensors", r"No space left on device \(os error 28\) \(the disk is full: "),
        ("optimizer", "optimizer.pt", r"unexpected pos 576 vs 534 \(a short write, as on a full disk: "),
    ],
)  # fmt: skip
def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_checkpoint(
    what, file, reason, corpus, cache, tmp_path, monkeypatch, capsys
) -> None:
    """The step-4 checkpoint cannot be written: exit 2 (not 1, "diverged") with one line naming the
    file, the cause with the space left, and the step-2 checkpoint, which is byte for byte as it
    was and still the latest; nothing temporary is left, and --resume goes on from it."""
    from wiola.cli import main

    out = tmp_path / "run"
    before = _fail_at_step(monkeypatch, what, 4)
    flags = ["--steps", "6", "--log-every", "2", "--save-every", "2", "--eval-every", "100"]
    assert main(_train_command(corpus, cache, out, *flags)) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    good = out / "checkpoints" / "step_0000002"
    size = sum(len(data) for name, data in before.items() if name.startswith("step_0000002/")) / 2**20
    assert re.fullmatch(
        re.escape(f"wiola train: error: cannot write {out / 'checkpoints' / 'step_0000004' / file}: ")
        + r".*"
        + reason
        + r"[\d,.]+ MiB free, "
        + re.escape(f"a checkpoint takes {size:,.1f} MiB)")
        + re.escape(
            f"; the last complete checkpoint, {good}, is as it was (checkpoints/latest names it): "
            f"make room, then continue with wiola train --resume {out}"
        ),
        err,
    ), err
    assert _snapshot(out / "checkpoints") == before, "the failed write changed the complete checkpoint"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_0000002"]
    monkeypatch.undo()
    assert main([*_train_command(corpus, cache, out, *flags), "--resume", str(out)]) == 0, capsys.readouterr().err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000006"


def test_a_run_whose_first_checkpoint_failed_is_started_again(corpus, cache, tmp_path, monkeypatch, capsys) -> None:
    """The first checkpoint cannot be written: the message says there is none, no empty
    checkpoints/ is left, and the folder (its metrics only) is refused by a plain run and by
    --resume, each saying to start again with --overwrite, which then works."""
    from wiola.cli import main

    out = tmp_path / "run"
    _fail_at_step(monkeypatch, "weights", 2)
    flags = ["--steps", "2", "--log-every", "1", "--eval-every", "100"]
    assert main(_train_command(corpus, cache, out, *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("; the run has no complete checkpoint: make room, then start it again (--overwrite)"), err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"], "an empty checkpoints/ was left"
    monkeypatch.undo()
    assert main(_train_command(corpus, cache, out, *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a run with no complete checkpoint" in err and "--overwrite" in err, err
    assert "--resume" not in err, "it points to --resume, which has nothing to continue from"
    (out / "checkpoints" / ".step_0000002.tmp-999999999").mkdir(parents=True)  # what a killed first save leaves
    assert main([*_train_command(corpus, cache, out, *flags), "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{out} holds a training run with no complete checkpoint" in err, err
    assert err.endswith(f"start the run again with wiola train --out {out} --overwrite"), err
    assert main([*_train_command(corpus, cache, out, *flags), "--overwrite"]) == 0, capsys.readouterr().err
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000002"


def test_a_torn_last_metrics_line_is_dropped_and_resume_goes_on(runs, corpus, cache, tmp_path) -> None:
    """A run killed while appending to metrics.jsonl leaves a cut-short last line: --resume drops
    it with a warning naming the file and goes on; the log holds only whole lines again."""
    folder = tmp_path / "run"
    shutil.copytree(runs[0].out_dir, folder)
    metrics = folder / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"kind": "train", "step": 7, "lo')
    lines: list[str] = []
    result = train(_cfg(corpus, cache, folder, steps=7), resume=folder, log=lines.append)
    assert result.step == 7
    assert f"{metrics}: dropped its last line ({whole.count(chr(10)) + 1}), cut short" in "\n".join(lines), lines
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line whole
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6, 7]


def test_metrics_lines_that_do_not_parse(tmp_path) -> None:
    """Only the last line may be cut short (dropped, with a warning); a damaged line before it, or
    one that is not an object, is a ValueError naming the file and the line."""
    from wiola.train.run_folder import MetricsLog, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "run", "step": 0}\n\n{"kind": "train", "step": 1}\n{"kind": "tr')
    with pytest.warns(UserWarning, match=re.escape(f"{path}: dropped its last line (4), cut short")):
        assert [r["step"] for r in read_metrics(path)] == [0, 1]
    log: list[str] = []
    MetricsLog(path, True, 1, path, log.append).close()
    assert path.read_text() == '{"kind": "run", "step": 0}\n{"kind": "train", "step": 1}\n' and len(log) == 1
    path.write_text('{"kind": "run", "step": 0}\n{"kind": "tr\n{"kind": "train", "step": 1}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2: not valid JSON")):
        read_metrics(path)
    path.write_text('{"kind": "run", "step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2: not a JSON object")):
        read_metrics(path)


def _dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_temporaries_are_removed_and_a_live_ones_kept(tmp_path) -> None:
    """What a process killed mid-checkpoint leaves in checkpoints/ goes (its temporary folder and
    latest; the checkpoint it had moved aside comes back where it is missing); a running process's
    entries and anything else stay."""
    from wiola.train.run_folder import remove_stale_temporaries

    root = tmp_path / "checkpoints"
    dead, live = _dead_pid(), os.getppid()
    for name in (f".step_0000009.tmp-{dead}", f".step_0000009.tmp-{live}", f".step_0000006.old-{dead}",
                 f".step_0000004.old-{dead}", "step_0000006", f".step_0000008.tmp-{os.getpid()}", ".notes"):  # fmt: skip
        (root / name).mkdir(parents=True)
        (root / name / "trainer.json").write_text(name)
    (root / f".latest.tmp-{dead}").write_text("step_0000009\n")
    gone = remove_stale_temporaries(root)
    assert sorted(gone) == sorted(
        [f".latest.tmp-{dead}", f".step_0000004.old-{dead}", f".step_0000006.old-{dead}",
         f".step_0000008.tmp-{os.getpid()}", f".step_0000009.tmp-{dead}"]
    )  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == [
        ".notes",
        f".step_0000009.tmp-{live}",
        "step_0000004",
        "step_0000006",
    ]
    assert (root / "step_0000004" / "trainer.json").read_text() == f".step_0000004.old-{dead}", "not moved back"
    assert (root / "step_0000006" / "trainer.json").read_text() == "step_0000006", "the newer checkpoint was replaced"


def test_saving_a_checkpoint_removes_a_killed_writers_temporary_folder(runs, corpus, cache, tmp_path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(runs[0].out_dir, folder)
    dead, live = _dead_pid(), os.getppid()
    for pid in (dead, live):
        (folder / "checkpoints" / f".step_0000007.tmp-{pid}").mkdir()
    train(_cfg(corpus, cache, folder, steps=7), resume=folder, log=_quiet)
    left = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert left == [f".step_0000007.tmp-{live}", "latest", "step_0000006", "step_0000007"], left


def test_a_run_resumed_into_another_folder_holds_its_whole_history(runs, corpus, cache, tmp_path) -> None:
    """Resumed from the step-3 checkpoint into a new --out: the new metrics.jsonl starts with the
    run record and rows 1-3 of the run it came from, and reads as the uninterrupted run's."""
    full, part, _ = runs
    checkpoint = part.out_dir / "checkpoints" / "step_0000003"
    moved = tmp_path / "moved"
    result = train(_cfg(corpus, cache, moved), resume=checkpoint, log=_quiet)
    assert result.step == 6
    rows = {name: _metric_rows(folder) for name, folder in (("moved", moved), ("full", full.out_dir))}
    for got in rows.values():
        got[0]["config"].pop("plots")  # the uninterrupted run drew them
    assert rows["moved"] == rows["full"], "the new folder's history is not whole"


def test_init_from_a_folder_without_a_tokenizer_points_to_the_tokenizer_flag(tmp_path, capsys) -> None:
    from wiola.checkpoint import export_wiola13m
    from wiola.cli import main

    folder = tmp_path / "wiola13m"
    export_wiola13m(model_class(False)(WiolaConfig(**SMALL, vocab_size=300)), folder)
    assert main(["train", "--init", str(folder), "--out", str(tmp_path / "run"), "--data", "sample"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("holds no tokenizer.json: its tokenizer is unknown; copy the tokenizer files of the model's "
                        "training run next to the weights, or name one with --tokenizer"), err  # fmt: skip


def test_one_non_finite_weight_stops_a_checkpoint(monkeypatch) -> None:
    """A checkpoint is refused when any weight is not finite, not only when all are (a single
    parameter blowing up, the rest finite)."""
    import types

    from wiola import WiolaModel
    from wiola.train import loop

    model = WiolaModel(WiolaConfig.preset("tiny"))
    with torch.no_grad():
        model.layers[0].ffn.up_proj.weight[0, 0] = float("nan")
    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda *args, **kwargs: saved.append(args) or "checkpoint")
    run = types.SimpleNamespace(
        raw_model=model, step=5, world=1, main=True, cfg=types.SimpleNamespace(lr=1e-3, grad_clip=1.0), last_good=None,
        out_dir=None, optimizer=None, scheduler=None, stream=None, model_config=None, data=None, tokenizer=None,
        last_eval=None, train_loss=1.0, last_ckpt=None,
    )  # fmt: skip
    meter = types.SimpleNamespace(state_dict=lambda: {"start_step": 5, "loss_sums": [0.0]})
    with pytest.raises(TrainingDiverged, match="the model's weights are not finite at step 5"):
        loop._save(run, meter)
    assert saved == [] and run.last_good is None


def test_each_logged_loss_is_the_mean_of_its_own_steps() -> None:
    """The training loss of a log line is the mean over the steps since the previous line: two
    intervals of two steps whose losses are all 3.0 both log 3.0."""
    import types

    from wiola.train import loop

    lines = []
    run = types.SimpleNamespace(
        device=torch.device("cpu"), world=1, step=0, layer_grad_norms=None, losses=[],
        cfg=types.SimpleNamespace(batch_size=1, seq_len=8, peak_flops=1.0), model_config=WiolaConfig.preset("tiny"),
        stream=types.SimpleNamespace(epoch=0.0), metrics=types.SimpleNamespace(write=lines.append), train_loss=None,
        last_good=None,
    )  # fmt: skip
    meter = loop._Meter(run)
    for step in range(1, 7):
        run.step = step
        meter.loss_sum += 3.0 if step <= 2 else 5.0
        if step % 2 == 0:
            meter.record(1e-3, None)
    assert [(r["step"], r["loss"]) for r in lines] == [(2, 3.0), (4, 5.0), (6, 5.0)], lines
