"""``wiola ablate``: the spec parser, the matched plan, the statistics, ``--print-commands``, and
a CI-sized sweep run end to end through the CLI, once straight through and once killed mid-run
(SIGTERM to the sweep process) and run again: the continued sweep's ``results.json`` equals the
uninterrupted one's byte for byte."""

from __future__ import annotations

import json
import math
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
    ],
)
def test_bad_specs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(_spec(**change))


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
