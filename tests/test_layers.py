"""The package's import structure: the layers import one way (model -> kernels -> wiola.fast ->
wiola.train -> wiola.cli) with no import circles, and the core install stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower layers never import higher ones. "model" is the rest of wiola/ (config, cache, model,
# generation, checkpoint, budget, tokenizer, ops).
LAYERS = ["model", "kernels", "fast", "train", "cli"]

# Circles inside the model layer and wiola.fast, in files this test does not own: the model
# imports generation and checkpoint inside its methods, and they import the model for type
# annotations (wiola.fast and wiola.fast.generation likewise). Listed edge by edge; an entry that
# is no longer needed fails the test so that it is removed.
ALLOWED_CYCLE_EDGES = {
    ("wiola.model", "wiola.generation"),
    ("wiola.model", "wiola.checkpoint"),
    ("wiola.fast", "wiola.fast.generation"),
}


def _layer(module: str) -> str:
    if module.startswith("kernels"):
        return "kernels"
    for layer in ("fast", "train", "cli"):
        if module == f"wiola.{layer}" or module.startswith(f"wiola.{layer}."):
            return layer
    return "cli" if module == "wiola.__main__" else "model"


def _modules() -> dict[str, Path]:
    """Every module of wiola/ and kernels/ by dotted name."""
    out = {}
    for package in ("wiola", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
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
    assert {"wiola.cli", "wiola.train", "wiola.fast", "kernels"} <= set(graph)


def test_layers_import_downwards_only() -> None:
    wrong = [
        f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))
    ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = _graph()
    for a, b in ALLOWED_CYCLE_EDGES:
        assert b in graph[a], f"{a} no longer imports {b}: remove it from ALLOWED_CYCLE_EDGES"
    graph = {a: {b for b in targets if (a, b) not in ALLOWED_CYCLE_EDGES} for a, targets in graph.items()}
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

HEAVY = ("matplotlib", "datasets", "tqdm", "pandas", "pyarrow")

class Block:  # as if the train extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"No module named {name!r} (blocked)")

sys.meta_path.insert(0, Block())
import wiola, wiola.fast
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
assert not loaded, f"import wiola / wiola.fast loaded {loaded}"
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


def test_python_m_wiola_is_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wiola", "budget", "--preset", "13m"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "12,915,888" in proc.stdout, proc.stdout + proc.stderr
