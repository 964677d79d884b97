"""The serving benchmark (bench/serve.py) run for real on a tiny load: a ``wiola serve`` process per
weight form on a free loopback port, streamed greedy requests all at once and one after another."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from bench import serve
from wiola.fast.decode_step_cpu import cpu_info


def test_every_request_is_counted_and_the_cpu_is_named(tmp_path, plain_cpu):
    """3 requests of 4 new tokens (greedy, no eos in the model: each runs to its length) give 12
    tokens in each mode; the concurrent row's ratio is its rate over the sequential one's; the
    JSON and the Markdown name the CPU with its family and model numbers (a VM's model name alone
    can be bare, one name for two CPUs)."""
    out = tmp_path / "serve"
    args = ["--out", str(out), "--schemes", "int8", "--requests", "3", "--max-tokens", "4", "--max-batch", "2"]
    assert serve.main([*args, "--note", "a test"]) == 0
    got = json.loads((out / "results.json").read_text())
    rows = {r["mode"]: r for r in got["rows"]}
    assert set(rows) == {"concurrent", "sequential"} and all(r["scheme"] == "int8" for r in rows.values())
    assert rows["concurrent"]["tokens"] == rows["sequential"]["tokens"] == 12 and rows["sequential"]["requests"] == 3
    assert rows["concurrent"]["speedup"] == pytest.approx(
        rows["concurrent"]["tok_per_s"] / rows["sequential"]["tok_per_s"]
    )
    name = cpu_info()["name"]
    assert got["meta"]["cpu_model"] == name and got["meta"]["max_batch"] == 2
    md = (out / "results.md").read_text()
    assert f"CPU: {name} (" in md and "a test" in md and "| int8 | concurrent | 3 | 12 |" in md, md
