"""Imports run one way: ``kernels/`` and ``wiola/ops/`` at the bottom, then the model
(config, cache, model, generation, checkpoint, budget, tokenizer), then ``wiola.fast``. Every
``import`` statement counts, inside functions and under ``TYPE_CHECKING`` too. And the kernel
imports of ``wiola.fast.ops`` are loud: with triton importable every kernel imports, a broken
kernel module raises, and only a missing triton falls back (with the reason in ``MISSING``)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOTTOM, MODEL, FAST = 0, 1, 2
MODEL_MODULES = {"config", "cache", "model", "generation", "checkpoint", "budget", "tokenizer"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    """The layer of a module of ours; None for the layers above ``wiola.fast`` (not checked here)."""
    if module == "kernels" or module.startswith(("kernels.", "wiola.ops")):
        return BOTTOM
    if module == "wiola" or module.removeprefix("wiola.") in MODEL_MODULES:
        return MODEL
    if module.startswith("wiola.fast"):
        return FAST
    return None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of ours it imports}`` from every import statement in wiola/ and kernels/."""
    files = {_module_name(p): p for d in ("wiola", "kernels") for p in (ROOT / d).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                # `from a import b` imports the module a.b when there is one, else a name of a
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """A cycle among ``nodes`` (depth-first search), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n] & nodes):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(nodes):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_up_to_wiola_fast():
    graph = import_graph()
    ours = {n for n in graph if _layer(n) is not None}
    assert {"wiola.model", "wiola.generation", "wiola.checkpoint", "wiola.fast.ops"} <= ours, sorted(ours)
    cycle = _cycle(graph, ours)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_wiola_imports_point_down():
    graph = import_graph()
    bad = [
        f"{a} -> {b}"
        for a in sorted(graph)
        if a.startswith("wiola") and _layer(a) is not None
        for b in sorted(graph[a])
        if _layer(b) is None or _layer(b) > _layer(a)
    ]
    assert not bad, f"imports against the layering: {bad}"
    within_model = {b for b in graph["wiola.checkpoint"] | graph["wiola.generation"] | graph["wiola.cache"]}
    assert "wiola.model" not in within_model, "checkpoint, generation and cache must not import the model"


@pytest.mark.xfail(
    strict=True,
    reason="kernels/decode_step_cpu.py imports wiola.model and wiola.cache for type hints (not this change's file)",
)
def test_kernels_import_nothing_of_wiola():
    graph = import_graph()
    bad = [f"{a} -> {b}" for a in sorted(graph) if a.startswith("kernels") for b in graph[a] if b.startswith("wiola")]
    assert not bad, f"kernels/ imports wiola: {bad}"


def test_the_graph_sees_type_checking_and_function_imports():
    """The walker itself: the fast model's CUDA-graph module imports the model under TYPE_CHECKING."""
    graph = import_graph()
    assert "wiola.model" in graph["wiola.fast.generation"], "a TYPE_CHECKING import was missed"
    assert "wiola.data" in graph["wiola.evaluate"] and "wiola.fast" in graph["wiola.cli"], "an import was missed"


# ------------------------------------------------------------------ kernel imports
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_kernel_imports_where_triton_does():
    from wiola.fast import ops

    expected = {"rms_norm", "gate", "attention", "decode_attention", "write_cache", "butterfly", "linear_cross_entropy"}
    assert set(ops.KERNELS) == expected, f"kernels missing: {sorted(expected - set(ops.KERNELS))}, {ops.MISSING}"
    assert not expected & set(ops.MISSING), f"MISSING lists importable kernels: {ops.MISSING}"


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_without_triton_the_reason_is_recorded_and_the_model_runs():
    run = _run(
        """
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        from wiola import WiolaConfig, WiolaModel
        from wiola.fast import WiolaModel as Fast, ops
        assert not ops.KERNELS, ops.KERNELS
        assert all("triton is not installed" in why for why in ops.MISSING.values()), ops.MISSING
        assert len(ops.MISSING) == 7, ops.MISSING
        torch.manual_seed(0)
        ref = WiolaModel(WiolaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=32))
        fast = Fast(ref.config)
        fast.load_state_dict(ref.state_dict())
        ids = torch.randint(0, 100, (2, 7))
        with torch.no_grad():
            print(float((ref(ids).logits - fast(ids).logits).abs().max()))
        """
    )
    assert run.returncode == 0, f"subprocess failed:\n{run.stderr[-3000:]}"
    err = float(run.stdout.strip().splitlines()[-1])
    assert err <= 1e-5, f"logits without triton differ by {err:.2e}"


@pytest.mark.parametrize(
    "broken, error",
    [
        ("None", "ModuleNotFoundError"),  # the module fails to import
        ("types.ModuleType('kernels.gate')", "AttributeError"),  # a module without its kernel
    ],
    ids=["import-error", "no-kernel-function"],
)
def test_a_broken_kernel_module_raises(broken, error):
    run = _run(
        f"""
        import sys, types
        sys.modules["kernels.gate"] = {broken}
        import wiola.fast
        """
    )
    assert run.returncode != 0, "wiola.fast imported although a kernel module is broken"
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(error) and "kernels.gate" in last, run.stderr[-2000:]
