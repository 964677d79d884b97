"""``wiola ablate``: the spec parser, the matched plan, the statistics, ``--print-commands``, and
a CI-sized sweep run end to end through the CLI, once straight through and once killed mid-run
(SIGTERM to the sweep process) and run again: the continued sweep's ``results.json`` equals the
uninterrupted one's byte for byte."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wiola.budget import budget
from wiola.cli import main
from wiola.train.ablate import parse_spec, plan
from wiola.train.ablate_report import mean_ci

BASE = {
    "preset": "tiny",
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
    "data": "sample:200",
    "seq_len": 32,
    "batch_size": 4,
    "steps": 12,
    "warmup": 2,
    "lr": 0.003,
    "eval_every": 6,
    "eval_windows": 8,
    "log_every": 3,
    "save_every": 3,
    "plots": False,
}


def _spec(**kw) -> dict:
    return {"name": "ci", "seeds": [0, 1], "gate_threshold": 0.45, "position_bucket": 16, "base": dict(BASE), **kw}


def test_grid_plan_matches_parameters_and_pairs_seeds(tmp_path):
    spec = parse_spec(_spec(grid={"ffn": ["butterfly", "swiglu", "gelu"], "gate": [True, False]}))
    runs = plan(spec, tmp_path)
    assert len(runs) == 12 and spec.baseline == "ffn=butterfly,gate=true"
    base_total = budget(runs[0].config.model_config()).total_params
    for run in runs:
        total = budget(run.config.model_config()).total_params
        assert abs(total - base_total) <= 0.005 * base_total, run.variant
        # The seed alone sets initialisation and data order; the rest of the settings are shared.
        settings = run.config.to_dict()
        assert settings["seed"] == run.seed and settings["data"] == BASE["data"]
        assert run.run_dir == tmp_path / "runs" / run.variant / f"seed{run.seed}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grid": {"ffn": ["moe"]}}, "ffn must be one of"),
        ({"grid": {"d_model": [64]}}, "unknown keys"),
        ({"grid": {"ffn": ["gelu"]}, "variants": [{"ffn": "gelu"}]}, "exactly one of grid"),
        ({"grid": {"ffn": ["gelu"]}, "baseline": "swiglu"}, "baseline 'swiglu'"),
        ({"grid": {"ffn": ["gelu"]}, "seeds": [1, 1]}, "distinct ints"),
        ({"grid": {"ffn": ["gelu"]}, "steps": 3}, "unknown keys"),
        ({"variants": [{"name": "a b", "ffn": "gelu"}]}, "letters, digits"),
        # Seeds the runs would refuse one by one, each after its folder was made.
        ({"grid": {"ffn": ["gelu"]}, "seeds": [-1]}, r"distinct ints in \[0, 2\*\*64\), got \[-1\]"),
        ({"grid": {"ffn": ["gelu"]}, "base": {**BASE, "init": "ckpt"}}, "base.init is not for a sweep"),
        ({"grid": {"ffn": ["gelu"]}, "seeds": [True]}, "distinct ints in"),
        # Variant values of the wrong kind: "false" is a true string (it trained a gated model as no-gate).
        ({"grid": {"gate": ["false"]}}, "variant 'false': gate must be true or false, got 'false'"),
        ({"variants": [{"name": "no-gate", "gate": "no"}]}, "variant 'no-gate': gate must be true or false"),
        ({"grid": {"gate_pre_rope": [1]}}, "variant 'gate_pre_rope=1': gate_pre_rope must be true or false"),
        ({"grid": {"helix_alpha": ["big"]}}, "variant 'big': helix_alpha must be a finite number, got 'big'"),
        ({"grid": {"helix_alpha": [True]}}, "variant 'helix_alpha=true': helix_alpha must be a finite number"),
        ({"grid": {"helix_alpha": [math.nan]}}, "variant 'helix_alpha=nan': helix_alpha must be a finite number"),
        ({"grid": {"helix_alpha": [-1]}}, "variant 'helix_alpha=-1': helix_alpha must be >= 0"),
        ({"grid": {"ffn": [3]}}, "variant 'ffn=3': ffn must be a string, got 3"),
        # The sweep's own settings, by name: neither coerced (bool("false") is True) nor failing inside.
        ({"grid": {"ffn": ["gelu"]}, "match_params": "false"}, "match_params must be true or false, got 'false'"),
        ({"grid": {"ffn": ["gelu"]}, "position_bucket": 2.7}, "position_bucket must be an int >= 1"),
        ({"grid": {"ffn": ["gelu"]}, "position_bucket": "x"}, "position_bucket must be an int >= 1"),
        ({"grid": {"ffn": ["gelu"]}, "position_bucket": True}, "position_bucket must be an int >= 1"),
        ({"grid": {"ffn": ["gelu"]}, "gate_threshold": "abc"}, r"gate_threshold must be a number in \[0, 1\]"),
        ({"grid": {"ffn": ["gelu"]}, "gate_threshold": -1}, r"gate_threshold must be a number in \[0, 1\]"),
        ({"grid": {"ffn": ["gelu"]}, "gate_threshold": math.nan}, "gate_threshold must be a number in"),
        ({"grid": {"ffn": ["gelu"]}, "gate_threshold": 1.5}, r"gate_threshold must be a number in \[0, 1\]"),
        (
            {"grid": {"ffn": ["gelu"]}, "seeds": [2**64]},
            r"distinct ints in \[0, 2\*\*64\), got \[18446744073709551616\]",
        ),
        ({"grid": {"ffn": ["gelu"]}, "seeds": []}, "seeds must be a non-empty list"),
        ({"grid": {"ffn": ["gelu"]}, "base": 3}, "base must be a table of TrainConfig fields, got 3"),
        ({"grid": {"ffn": ["gelu"]}, "base": {**BASE, "model": 3}}, "base.model must be a table"),
        ({"variants": [3]}, r"variants\[0\] must be a table \(name and model keys\), got 3"),
        ({"variants": ["abc"]}, r"variants\[0\] must be a table"),
        ({"variants": 3}, "variants must be a non-empty list of tables"),
        ({"variants": [{"name": 3}]}, "a variant's name must be a string, got 3"),
        ({"grid": {"ffn": ["gelu"]}, "name": 3}, "name \\(the report's title\\) must be a non-empty string"),
        ({"grid": {"ffn": ["gelu"]}, "name": " "}, "name \\(the report's title\\) must be a non-empty string"),
        (
            {"variants": [{"name": "a", "ffn": "gelu"}, {"name": "b", "ffn": "gelu"}]},
            r"variants 'a' and 'b' have the same settings \{'ffn': 'gelu'\}",
        ),
    ],
)
def test_bad_specs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(_spec(**change))


def test_the_ends_of_the_seed_and_threshold_ranges_are_taken():
    """Seeds 0 and 2**64 - 1 (torch's range) and gate thresholds 0 and 1 are specs' values."""
    spec = parse_spec(_spec(grid={"ffn": ["gelu"]}, seeds=[0, 2**64 - 1], gate_threshold=1))
    assert (spec.seeds, spec.gate_threshold) == ([0, 2**64 - 1], 1.0)
    assert parse_spec(_spec(grid={"ffn": ["gelu"]}, gate_threshold=0)).gate_threshold == 0.0


def test_spec_file_types(tmp_path):
    """The extension decides the parser in any case; another file type or a folder is named."""
    from wiola.train.ablate import load_spec

    upper = tmp_path / "S.TOML"
    upper.write_text('seeds = [0]\n[base]\npreset = "tiny"\n[grid]\nffn = ["gelu"]\n')
    assert load_spec(upper).variants[0].name == "gelu"
    yaml = tmp_path / "s.yaml"
    yaml.write_text("seeds: [0]\n")
    with pytest.raises(ValueError, match=r"is a \.yaml file; a spec is a \.toml or a \.json file"):
        load_spec(yaml)
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(ValueError, match="is a folder, not a spec file"):
        load_spec(tmp_path / "d.toml")


def test_mean_ci_is_the_t_interval():
    stat = mean_ci([1.0, 2.0, 3.0])
    # Student's t with 2 degrees of freedom has the closed-form quantile (2q - 1) / sqrt(2 q (1 - q)); s = 1, n = 3.
    t = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    assert stat["mean"] == 2.0 and math.isclose(stat["ci95"], t / math.sqrt(3), rel_tol=1e-9)
    assert mean_ci([5.0])["ci95"] is None


def test_print_commands_and_bad_spec_exit_code(tmp_path, capsys):
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps(_spec(variants=[{"ffn": "butterfly"}, {"name": "no-gate", "gate": False}])))
    assert main(["ablate", str(spec), "--out", str(tmp_path / "out"), "--print-commands", "--torchrun", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 4 and all(
        line.startswith("torchrun --nproc_per_node=2 -m wiola train --config ") for line in lines
    )
    config = json.loads((tmp_path / "out" / "runs" / "no-gate" / "seed1.json").read_text())
    assert config["seed"] == 1 and config["model"]["gate"] is False
    spec.write_text("{not json")
    assert main(["ablate", str(spec)]) == 2
    assert capsys.readouterr().err.startswith("wiola ablate: error: ")


def _write_spec(path: Path, **change) -> Path:
    path.write_text(json.dumps(_spec(**change)))
    return path


def _fake_checkpoints(spec: Path, out: Path, step: int) -> None:
    """A checkpoint at ``step`` in every run folder of ``spec`` under ``out``, holding the settings
    the spec plans (what ``wiola train`` writes in ``trainer.json``; no weights are needed here)."""
    from wiola.train.ablate import load_spec

    for run in plan(load_spec(spec), out):
        checkpoint = run.run_dir / "checkpoints" / f"step_{step:07d}"
        checkpoint.mkdir(parents=True)
        settings = {"train_config": run.config.to_dict(), "model_config": run.config.model_config().to_dict()}
        (checkpoint / "trainer.json").write_text(json.dumps({"step": step, **settings}))
        (checkpoint.parent / "latest").write_text(checkpoint.name + "\n")
        (run.run_dir / "metrics.jsonl").write_text('{"kind": "run", "step": 0}\n')


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base": {**BASE, "lr": 0.0001}}, "lr 0.003 → 0.0001"),
        ({"base": {**BASE, "steps": 6}}, "steps 12 → 6 (and 1 more)"),  # and the checkpoint is past steps = 6
        ({"base": {**BASE, "steps": 18}}, "steps 12 → 18"),  # a continued run would follow another schedule
        ({"variants": [{"ffn": "butterfly"}, {"name": "no-gate", "gate": True}]}, "model.gate false → true"),
    ],
)
def test_a_sweep_folder_of_another_spec_is_refused_before_anything_is_written(tmp_path, capsys, change, message):
    """A sweep folder whose runs were trained with other settings is neither continued nor
    reported (every number would be the old spec's): exit 2 naming the run and the first
    difference, nothing written; --overwrite deletes the runs and starts again."""
    variants = [{"ffn": "butterfly"}, {"name": "no-gate", "gate": False}]
    old, out = _write_spec(tmp_path / "old.json", variants=variants), tmp_path / "sweep"
    _fake_checkpoints(old, out, 12)
    for log in ("runs/butterfly/seed0.log", "runs/no-gate/seed1.log"):  # each run's output, beside its folder
        (out / log).write_text("the old run's output\n")
    assert main(["ablate", str(old), "--out", str(out), "--print-commands"]) == 0  # the same spec: all finished
    assert [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")] == []
    before = _snapshot(out)
    new = _write_spec(tmp_path / "new.json", **{"variants": variants, **change})
    for extra in ([], ["--print-commands"]):
        assert main(["ablate", str(new), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        run = "no-gate seed 0" if "gate" in message else "butterfly seed 0"
        assert f"already holds run {run}" in err and f"trained with other settings: {message}" in err, err
        assert "pass --overwrite to delete the sweep's runs and start again" in err
        assert _snapshot(out) == before  # configs, checkpoints: untouched; no spec.json
    from wiola.train.ablate_report import REPORT_FILES

    for name in REPORT_FILES:  # the old sweep's report, as write_report left it
        (out / name).write_text("the old sweep's report\n")
    assert main(["ablate", str(new), "--out", str(out), "--print-commands", "--overwrite"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 4 and not any("--resume" in line or "--overwrite" in line for line in lines)
    assert not list(out.glob("runs/*/seed*/")), "--overwrite keeps no old run folder"
    assert [name for name in REPORT_FILES if (out / name).exists()] == [], "--overwrite keeps the old report"
    assert not list(out.glob("runs/*/seed*.log")), "--overwrite keeps an old log (the new run would append to it)"


def test_a_moved_sweep_of_the_same_spec_continues(tmp_path, capsys):
    """Paths are not settings: a sweep folder copied elsewhere continues its runs (--resume)."""
    spec = _write_spec(tmp_path / "s.json", grid={"ffn": ["butterfly"]})
    _fake_checkpoints(spec, tmp_path / "a", 6)
    (tmp_path / "a").rename(tmp_path / "b")
    assert main(["ablate", str(spec), "--out", str(tmp_path / "b"), "--print-commands"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all("--resume" in line for line in lines)


def test_a_sweep_whose_checkpoints_saved_a_relative_data_path_continues(tmp_path, monkeypatch, capsys):
    """Older checkpoints saved ``data`` as typed (``corpus.txt``); the plan now holds it absolute.
    The same file from the same folder is the same setting: the runs continue (--resume)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("Once upon a time.<|endoftext|>A cat sat.\n")
    spec = _write_spec(tmp_path / "s.json", grid={"ffn": ["butterfly"]}, base={**BASE, "data": "corpus.txt"})
    _fake_checkpoints(spec, tmp_path / "out", 6)
    for trainer in (tmp_path / "out").rglob("trainer.json"):
        saved = json.loads(trainer.read_text())
        assert saved["train_config"]["data"] == str(tmp_path / "corpus.txt")
        saved["train_config"]["data"] = "corpus.txt"
        trainer.write_text(json.dumps(saved))
    assert main(["ablate", str(spec), "--out", str(tmp_path / "out"), "--print-commands"]) == 0, capsys.readouterr()
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all("--resume" in line for line in lines)


def test_a_checkpoint_past_steps_is_refused(tmp_path, capsys):
    spec = _write_spec(tmp_path / "s.json", grid={"ffn": ["butterfly"]})
    _fake_checkpoints(spec, tmp_path / "out", 15)  # the same settings, trained further by hand
    assert main(["ablate", str(spec), "--out", str(tmp_path / "out"), "--print-commands"]) == 2
    assert "its checkpoint is at step 15, past steps = 12" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--out", "{f}"], "--out '{f}' is a file, not a folder"),
        (["--out", "{f}/sub"], "--out '{f}/sub' lies under '{f}', which is a file, not a folder"),
        (["--out", "{f}", "--print-commands"], "--out '{f}' is a file, not a folder"),
        (
            ["--out", "{d}", "--print-commands", "--torchrun", "0"],
            "--torchrun must be >= 1 (processes per node), got 0",
        ),
        (["--out", "{d}", "--print-commands", "--torchrun", "-1"], "--torchrun must be >= 1"),
        (["--out", "{d}", "--torchrun", "2"], "--torchrun goes with --print-commands"),
        (["--out", "{d}", "--print-commands", "--jobs", "2"], "--jobs goes with a local sweep"),
        (["--out", "{d}", "--jobs", "0"], "--jobs must be >= 1, got 0"),
    ],
)
def test_bad_flags_exit_2_and_write_nothing(tmp_path, capsys, flags, message):
    spec = _write_spec(tmp_path / "s.json", grid={"ffn": ["butterfly"]})
    afile, folder = tmp_path / "afile", tmp_path / "new"
    afile.write_text("hi\n")
    fill = {"f": str(afile), "d": str(folder)}
    assert main(["ablate", str(spec), *[flag.format(**fill) for flag in flags]]) == 2
    assert f"wiola ablate: error: {message.format(**fill)}" in capsys.readouterr().err
    assert afile.read_text() == "hi\n" and not folder.exists() and sorted(tmp_path.iterdir()) == [afile, spec]


def test_without_out_a_sweep_goes_to_runs_ablate_and_the_specs_name(tmp_path, capsys, monkeypatch):
    """No ``--out``: ``runs/ablate-<spec file name without its suffix>``, under the current folder."""
    spec = _write_spec(tmp_path / "ffn.json", grid={"ffn": ["butterfly"]})
    monkeypatch.chdir(tmp_path)
    assert main(["ablate", str(spec), "--print-commands"]) == 0
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["ablate-ffn"]
    assert "runs/ablate-ffn" in capsys.readouterr().out


def test_the_report_hint_is_shell_quoted(tmp_path, capsys):
    import shlex

    spec = _write_spec(tmp_path / "my spec.json", grid={"ffn": ["butterfly"]})
    out = tmp_path / "the sweep"
    assert main(["ablate", str(spec), "--out", str(out), "--print-commands"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint.startswith(f"# then: {shlex.join(['wiola', 'ablate', str(spec), '--out', str(out)])}   (")


def test_report_wording_and_figures(tmp_path, monkeypatch):
    """One seed is "1 seed"; a no-gate variant's share of switched-off heads is not measured (—);
    grad_norms.png wraps variants into rows of GRAD_NORM_COLUMNS panels instead of growing wide;
    positions.png's axis is the buckets' positions, even with one bucket."""
    from wiola.train import ablate_report
    from wiola.train.ablate_report import write_report

    axes, save = {}, ablate_report._save

    def kept(fig, path):
        axes[path.name] = fig.axes
        return save(fig, path)

    monkeypatch.setattr(ablate_report, "_save", kept)

    def variant(gate: bool) -> dict:
        stat = mean_ci([4.0])
        run = {
            "model_config": {"gate": gate},
            "val_loss": [[6, 5.0], [12, 4.0]],
            "gate_share_under": [[6, 0.0], [12, 0.0]],
            "layer_grad_norms": [[3, [1.0, 0.5]], [12, [0.5, 0.25]]],
            "positions": [{"start": 0, "end": 16, "loss": 4.0}],
        }
        entry = {"d_ff": 64, "parameters": 1000, "final": {"loss": stat, "bits_per_byte": stat}, "seeds": {"0": run}}
        return {**entry, "paired_vs_baseline": {"loss": mean_ci([0.0]), "bits_per_byte": mean_ci([0.0])}}

    names = ["butterfly", "swiglu", "gelu", "no-gate", "rope"]
    results = {
        "name": "ci", "baseline": "butterfly", "seeds": [0], "gate_threshold": 0.1, "position_bucket": 16,
        "variants": {name: variant(name != "no-gate") for name in names},
    }  # fmt: skip
    del results["variants"]["butterfly"]["paired_vs_baseline"]
    text = write_report(None, results, tmp_path).read_text()
    assert "1 seed (0) per variant" in text
    assert "| no-gate (no gate) | — | — |" in text and "| swiglu | 0.000 | 0.000 |" in text
    png = (tmp_path / "grad_norms.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width < 3.2 * 4 * 110 and height > 2 * 3 * 110, (width, height)  # 3 columns, 2 rows at 110 dpi
    (positions,) = axes["positions.png"]
    assert [t.get_text() for t in positions.get_xticklabels()] == ["0–15"] and positions.get_xlim() == (-8.0, 8.0)
    assert all(-8 < x < 8 for line in positions.get_lines() for x in line.get_xdata())


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path):
    """The command of each run: plain when its folder is new, --resume with a checkpoint, and
    --overwrite when a killed attempt left only its metrics (wiola train refuses such a folder
    otherwise, and the sweep would stop there)."""
    from wiola.train.ablate import train_arguments

    run = plan(parse_spec(_spec(grid={"ffn": ["butterfly"]})), tmp_path)[0]
    assert train_arguments(run)[-2:] == ["--config", str(run.config_file)]
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "metrics.jsonl").write_text('{"kind": "run", "step": 0}\n')
    assert train_arguments(run)[-1] == "--overwrite"
    (run.run_dir / "checkpoints").mkdir()  # damaged (no latest): never overwritten, train names the problem
    assert "--overwrite" not in train_arguments(run) and "--resume" not in train_arguments(run)


def test_a_run_folder_without_its_run_record_is_named(tmp_path):
    """A metrics.jsonl with evaluations but no run record (the model's size and settings) is a
    ValueError naming the file, not a StopIteration from deep in the report."""
    from wiola.train.ablate_report import _run_summary

    run = plan(parse_spec(_spec(grid={"ffn": ["butterfly"]})), tmp_path)[0]
    run.run_dir.mkdir(parents=True)
    path = run.run_dir / "metrics.jsonl"
    path.write_text('{"kind": "eval", "step": 12, "loss": 4.0, "bits_per_byte": 1.5, "gates": [[0.5]]}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path} has no run record")):
        _run_summary(run, {"buckets": []}, 0.1)


def _sweep(spec: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "wiola", "ablate", str(spec), "--out", str(out), "--jobs", "2", "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sweep_report_and_killed_sweep_continues_bit_identically(tmp_path):
    spec = tmp_path / "ci.toml"
    base = {**BASE, "cache_dir": str(tmp_path / "cache")}
    model = ", ".join(f"{k} = {v}" for k, v in base.pop("model").items())
    lines = ['name = "ci"', "seeds = [0, 1]", "gate_threshold = 0.45", "position_bucket = 16", "", "[base]"]
    lines += [f"{k} = {json.dumps(v)}".replace("false", "false") for k, v in base.items()]
    lines += [f"model = {{ {model} }}", "", "[grid]", 'ffn = ["butterfly", "swiglu"]']
    spec.write_text("\n".join(lines) + "\n")

    straight = _sweep(spec, tmp_path / "a")
    output = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, output
    a = tmp_path / "a"
    results = json.loads((a / "results.json").read_text())
    swiglu = results["variants"]["swiglu"]
    assert set(swiglu["final"]["loss"]) == {"mean", "ci95", "n", "values"} and swiglu["final"]["loss"]["n"] == 2
    assert swiglu["paired_vs_baseline"]["loss"]["ci95"] > 0
    butterfly = results["variants"]["butterfly"]
    for k in ("loss", "bits_per_byte"):  # variant minus baseline, seed by seed
        deltas = [swiglu["seeds"][s]["final"][k] - butterfly["seeds"][s]["final"][k] for s in ("0", "1")]
        assert swiglu["paired_vs_baseline"][k]["values"] == deltas, (k, swiglu["paired_vs_baseline"][k], deltas)
    assert [b["start"] for b in swiglu["seeds"]["0"]["positions"]] == [0, 16]
    assert len(swiglu["seeds"]["0"]["layer_grad_norms"][-1][1]) == 2
    for name in ("report.md", "loss_curves.png", "gates.png", "grad_norms.png", "positions.png"):
        assert (a / name).stat().st_size > 0, name
    assert "Δ loss vs butterfly" in (a / "report.md").read_text()

    b = tmp_path / "b"
    killed = _sweep(spec, b)
    deadline = time.monotonic() + 300
    while not list((b / "runs").glob("*/seed*/checkpoints/latest")) and time.monotonic() < deadline:
        assert killed.poll() is None, killed.communicate()[0]
        time.sleep(0.05)
    killed.send_signal(signal.SIGTERM)
    output = killed.communicate(timeout=300)[0]
    assert killed.returncode == 130, output
    assert not (b / "results.json").exists()
    again = _sweep(spec, b)
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0, output
    assert "continuing" in output
    assert (b / "results.json").read_bytes() == (a / "results.json").read_bytes()


def test_readme_specs_parse():
    """The README's sweep (a ```toml block) and its paper-scale spec (a heredoc) are valid specs,
    and the sweep is the one whose report the README shows (its spec is kept beside the report)."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    small = re.search(r"```toml\n(# ffn.toml\n.*?)```", readme, re.S).group(1)
    paper = re.search(r"cat > paper.toml <<'TOML'\n(.*?)TOML\n", readme, re.S).group(1)
    spec = parse_spec(tomllib.loads(small))
    assert [v.name for v in spec.variants] == ["butterfly", "swiglu", "gelu"] and len(spec.seeds) >= 4
    kept = root / "bench" / "results" / "2026-12-02_cpu_ablate-ffn"
    assert tomllib.loads(small) == tomllib.loads((kept / "ffn.toml").read_text())
    assert json.loads((kept / "spec.json").read_text()) == json.loads(json.dumps(tomllib.loads(small)))
    spec = parse_spec(tomllib.loads(paper))
    assert spec.base["data"] == "tinystories" and spec.variants[0].name == spec.baseline == "wiola"


def test_a_short_series_is_drawn_with_markers_on_whole_steps():
    """A sweep that logged one or a few points still shows them: a mean line of few points is
    marked (one point drew nothing), and the step axis ticks whole steps only."""
    pytest.importorskip("matplotlib")
    from wiola.train.ablate_report import _band
    from wiola.train.plots import _figure

    fig = _figure(4, 3)
    ax = fig.subplots()
    _band(ax, [[[6, 0.67]], [[6, 0.57]]], "layer 0")
    (line,) = ax.get_lines()
    assert line.get_marker() == "o" and list(line.get_xdata()) == [6]
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()


def test_a_runs_summary_takes_the_logging_grid_and_the_last_step(tmp_path):
    """The training lines a run's summary keeps: those on the ``log_every`` grid and the last
    step's (25 of 25, logged though off the grid); a line of a step it stopped at and resumed
    from (15) averages a shorter interval and is left out."""
    from types import SimpleNamespace

    from wiola.train.ablate_report import _run_summary

    lines = [{"kind": "run", "parameters": 1, "model_config": {"d_ff": 8}}]
    lines += [{"kind": "train", "step": s, "loss": 1.0, "layer_grad_norms": [s / 10, s / 5]} for s in (10, 15, 20, 25)]
    lines += [{"kind": "eval", "step": 25, "loss": 2.0, "bits_per_byte": 1.0, "gates": [[0.5, 0.3]]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = SimpleNamespace(run_dir=tmp_path, config=SimpleNamespace(steps=25, log_every=10))
    got = _run_summary(run, {"buckets": []}, 0.4)
    assert [step for step, _ in got["layer_grad_norms"]] == [10, 20, 25], got["layer_grad_norms"]
    assert got["final"] == {"loss": 2.0, "bits_per_byte": 1.0, "step": 25} and got["gate_share_under"] == [[25, 0.5]]


def test_paired_differences_carry_their_sign():
    """A Δ against the baseline shows its sign either way (+0.0096, -0.0400), as the README's table does."""
    from wiola.train.ablate_report import _pm

    assert _pm({"mean": 0.0096, "ci95": 0.2165}, signed=True) == "+0.0096 ± 0.2165"
    assert _pm({"mean": -0.04, "ci95": None}, signed=True) == "-0.0400"
    assert _pm({"mean": 3.5, "ci95": 0.1}) == "3.5000 ± 0.1000"
