"""The package's import structure: the layers import one way (kernels/ and wiola/ops/ -> the
model -> wiola.fast -> wiola.train -> wiola.cli) with no import circles, counting every import
statement (inside functions and under ``TYPE_CHECKING`` too), and the core install stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower layers never import higher ones: kernels/ (Triton only) and wiola/ops/ (readable PyTorch)
# at the bottom, each importing nothing else of ours; then the model (the rest of wiola/: config,
# cache, model, generation, checkpoint, budget, tokenizer); then wiola.fast; then wiola.export
# (the on-device runtime export); then wiola.train; then wiola.serve (the HTTP server); then wiola.cli.
LAYERS = ["kernels", "ops", "model", "fast", "export", "train", "serve", "cli"]


def _layer(module: str) -> str:
    if module == "wiola_kernels" or module.startswith("wiola_kernels."):
        return "kernels"
    if module == "wiola.ops" or module.startswith("wiola.ops."):
        return "ops"
    for layer in ("fast", "export", "train", "serve", "cli"):
        if module == f"wiola.{layer}" or module.startswith(f"wiola.{layer}."):
            return layer
    return "cli" if module == "wiola.__main__" else "model"


def _modules() -> dict[str, Path]:
    """Every module of wiola/ and kernels/ (installed as ``wiola_kernels``) by dotted name."""
    out = {}
    for package, folder in (("wiola", "wiola"), ("wiola_kernels", "kernels")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere: at the top, under ``if TYPE_CHECKING:``
    and inside functions (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        else:
            assert not isinstance(node, ast.ImportFrom), f"{path}: relative import"
            continue
        found |= {name for name in names if name in modules}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_the_walker_sees_every_kind_of_import() -> None:
    graph = _graph()
    assert "wiola.train.config" in graph["wiola.train.run_folder"], "an `if TYPE_CHECKING:` import was missed"
    assert "wiola.train.plots" in graph["wiola.train.loop"], "an import inside a function was missed"
    assert "wiola.fast.ops" in graph["wiola.fast.generation"], "`from package import submodule` was missed"
    assert "wiola.model" in graph["wiola.fast.generation"], "an `if TYPE_CHECKING:` import was missed"
    assert {"wiola.cli", "wiola.train", "wiola.fast", "wiola_kernels"} <= set(graph)


def test_layers_import_downwards_only() -> None:
    wrong = [
        f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))
        or (_layer(a) == "ops" and _layer(b) == "kernels")  # the two bottom layers are independent
    ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)
    graph = _graph()
    within = graph["wiola.checkpoint"] | graph["wiola.generation"] | graph["wiola.cache"]
    assert "wiola.model" not in within, "checkpoint, generation and cache must not import the model"


def test_the_export_runner_stands_alone() -> None:
    """``wiola/export/runner.py`` is copied into every ONNX export as ``run_onnx.py``: it may import
    numpy, onnxruntime, tokenizers and the standard library, nothing of ours and not torch."""
    path = ROOT / "wiola" / "export" / "runner.py"
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, "relative import"
            tops.add(node.module.split(".")[0])
    outside = tops - {"numpy", "onnxruntime", "tokenizers", "__future__"} - set(sys.stdlib_module_names)
    assert not outside, f"run_onnx.py would need {sorted(outside)}"
    assert "wiola.export.runner" in _graph()["wiola.export.step"], "the walker missed the step's import"


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


LIGHT_CHECK = r"""
import sys, tempfile

HEAVY = ("matplotlib", "datasets", "tqdm", "pandas", "pyarrow", "tokenizers", "huggingface_hub", "transformers")
import torch  # torch itself may import tqdm (torch.hub does where it is installed): not ours to judge
before = set(sys.modules)
import wiola, wiola.fast
loaded = sorted({m.split(".")[0] for m in set(sys.modules) - before} & set(HEAVY))
assert not loaded, f"import wiola / wiola.fast loaded {loaded}"
for name in HEAVY:  # from here on, as if the train extra were not installed
    sys.modules[name] = None
from wiola.cli import main
assert main(["budget", "--preset", "13m"]) == 0
code = main(["train", "--preset", "tiny", "--data", "sample", "--steps", "1", "--no-progress",
             "--out", tempfile.mkdtemp(), "--cache-dir", tempfile.mkdtemp()])
assert code == 2, code
print("LIGHT OK")
"""


def test_core_install_is_light_and_training_names_its_extra() -> None:
    proc = subprocess.run([sys.executable, "-c", LIGHT_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LIGHT OK" in proc.stdout, proc.stdout + proc.stderr
    assert "wiola train: error: training needs the `tqdm` package" in proc.stderr, proc.stderr
    assert "pip install 'wiola-slm[train]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


MISSING_CHECK = r"""
import json, sys, tempfile
from pathlib import Path

import pyarrow as pa, pyarrow.parquet as pq
import torch
import wiola
from wiola.tokenizer import load_tokenizer

root = Path(tempfile.mkdtemp())
torch.manual_seed(0)
config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
wiola.WiolaModel(config).save_pretrained(root / "ckpt", load_tokenizer("gpt2-32k"))
(root / "ft.jsonl").write_text('{"prompt": "Hi", "completion": " there"}\n{"prompt": "Yo", "completion": " man"}\n')
pq.write_table(pa.table({"text": ["One day a cat sat.", "The dog ran home."]}), root / "docs.parquet")
(root / "spec.json").write_text(json.dumps({"seeds": [0], "base": {"preset": "tiny", "data": "sample", "steps": 1},
                                             "grid": {"ffn": ["butterfly", "gelu"]}}))
for name in ("matplotlib", "scipy", "pyarrow"):  # from here on, as if these were not installed
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    sys.modules[name] = None
from wiola.cli import main
code = main(["finetune", "--init", str(root / "ckpt"), "--format", "completion", "--data", str(root / "ft.jsonl"),
             "--out", str(root / "ft"), "--steps", "1", "--batch-size", "2", "--no-progress"])
print("finetune", code, (root / "ft" / "model.safetensors").is_file())
print("ablate", main(["ablate", str(root / "spec.json"), "--out", str(root / "sweep")]), (root / "sweep").exists())
print("eval", main(["eval", "--checkpoint", str(root / "ckpt"), "--val-data", str(root / "docs.parquet"), "--seq-len", "8"]))
"""


def test_missing_extras_are_named_before_the_work_or_skipped_after_it() -> None:
    """Without matplotlib, ``finetune`` saves its model and leaves out only the loss curve; without
    scipy (the ablate extra), ``ablate`` is refused before any run; without pyarrow, a Parquet
    file's message names the train extra."""
    proc = subprocess.run([sys.executable, "-c", MISSING_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    assert "finetune 0 True" in out and "no loss_curve.png: plotting needs the `matplotlib` package" in out + err, (
        out + err
    )
    assert "ablate 2 False" in out, out + err
    assert "the sweep's report needs the `scipy` package" in err and "pip install 'wiola-slm[ablate]'" in err, err
    assert "eval 2" in out and "reading Parquet files needs the `pyarrow` package" in err, err
    assert "Traceback" not in err, err


def test_python_m_wiola_is_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wiola", "budget", "--preset", "13m"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "12,915,888" in proc.stdout, proc.stdout + proc.stderr


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages by hand (kernels/ installs as ``wiola_kernels``), so a
    subpackage missing from the list would be absent from a non-editable install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "wiola").rglob("__init__.py")}
    tree |= {
        ".".join(("wiola_kernels", *p.parent.relative_to(ROOT / "kernels").parts))
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert listed == tree, f"pyproject.toml packages: missing {tree - listed}, extra {listed - tree}"
