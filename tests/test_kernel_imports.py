"""The kernel imports of ``wiola.fast.ops`` are loud: with triton importable every kernel
imports, a broken kernel module raises, and only a missing triton falls back (with the reason in
``MISSING``). (The import layering is ``tests/test_layers.py``.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
        ("types.ModuleType('wiola_kernels.gate')", "AttributeError"),  # a module without its kernel
    ],
    ids=["import-error", "no-kernel-function"],
)
def test_a_broken_kernel_module_raises(broken, error):
    run = _run(
        f"""
        import sys, types
        sys.modules["wiola_kernels.gate"] = {broken}
        import wiola.fast
        """
    )
    assert run.returncode != 0, "wiola.fast imported although a kernel module is broken"
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(error) and "wiola_kernels.gate" in last, run.stderr[-2000:]


# ------------------------------------------------------------------ the name `kernels` from a checkout
# With the checkout's root on sys.path, `import kernels` finds the root's kernels/ folder first (the
# wiola_kernels package); transformers imports Hugging Face's `kernels` by that name, and newer
# releases require it. The folder hands that package over, or an empty namespace package where it is
# not installed (kernels/__init__.py). A stand-in for Hugging Face's package sits in a folder after
# the root on sys.path; `-S` leaves site-packages out, where the real one may be installed.
FAKE_HF = "def get_kernel(repo_id):\n    return repo_id\n"


def _from_root(code: str, *flags: str, path: str | Path | None = None) -> subprocess.CompletedProcess:
    """``python [flags] -c code`` run in the checkout's root (the root first on sys.path), ``path``
    after it (``PYTHONPATH``: a folder, or several joined by ``os.pathsep``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": str(path)} if path else {})
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("site", [False, True], ids=["no-site", "site"])
def test_kernels_from_the_checkout_root_is_hugging_faces(tmp_path, site):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(FAKE_HF)
    code = """
        import json, sys
        import kernels
        from kernels import get_kernel
        out = {"file": kernels.__file__, "same": sys.modules["kernels"] is kernels, "call": get_kernel("x/y")}
        if not sys.flags.no_site:
            import wiola_kernels, wiola_kernels.rms_norm
            out["ours"] = wiola_kernels.rms_norm.__file__
        print(json.dumps(out))
    """
    run = _from_root(code, *([] if site else ["-S"]), path=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["file"] == str(tmp_path / "kernels" / "__init__.py") and got["same"] and got["call"] == "x/y", got
    if site:  # ours still imports under its own name, from the checkout (the editable install)
        assert Path(got["ours"]) == ROOT / "kernels" / "rms_norm.py", got


def test_kernels_from_the_checkout_root_without_hugging_faces_is_an_empty_namespace():
    """What Python gives for a folder that is not a package: no file, no version, nothing in it (so
    transformers' check of an installed ``kernels`` says no, as it would with the folder absent)."""
    run = _from_root(
        """
        import kernels
        assert kernels.__file__ is None and not hasattr(kernels, "__version__"), kernels.__file__
        assert list(kernels.__path__) == [], list(kernels.__path__)
        from kernels import get_kernel
        """,
        "-S",
    )
    assert run.returncode != 0 and "cannot import name 'get_kernel' from 'kernels'" in run.stderr, run.stderr[-3000:]


def test_kernels_with_the_root_also_on_the_path_through_a_link(tmp_path):
    """The root twice on sys.path, once through a symbolic link: the hand-over does not find this
    folder again under the other name (which imported it again, without end), and still reaches
    Hugging Face's package after both."""
    link = tmp_path / "checkout"
    link.symlink_to(ROOT, target_is_directory=True)
    hf = tmp_path / "hf"
    (hf / "kernels").mkdir(parents=True)
    (hf / "kernels" / "__init__.py").write_text(FAKE_HF)
    code = "import kernels; print(kernels.__file__)"
    run = _from_root(code, "-S", path=os.pathsep.join(map(str, (link, ROOT, hf))))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(hf / "kernels" / "__init__.py"), run.stdout
    run = _from_root(code, "-S", path=os.pathsep.join(map(str, (link, ROOT))))
    assert run.returncode == 0 and run.stdout.strip() == "None", run.stderr[-3000:]
