"""This package and Hugging Face's ``kernels`` installed side by side: our Triton kernels install as
``wiola_kernels`` (docs/SPEC.md, "Package names"), so neither wheel overwrites or uninstalls the
other's files. Each case makes a fresh virtualenv (``--system-site-packages``, so torch and triton
come from the running interpreter), installs both packages in one order (this one editable or as a
wheel), and from a folder outside the repository imports ``kernels`` (Hugging Face's: it has
``get_kernel``) and runs ours: the fast model on the Triton kernels (interpreter on a CPU) against
the reference. Then uninstalling Hugging Face's package leaves ours whole.

The Hugging Face wheel comes from ``WIOLA_HF_KERNELS_WHEEL`` (``.ci/run`` downloads
``kernels==0.17.2`` with ``pip download --no-deps``); without it the tests skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HF_WHEEL = os.environ.get("WIOLA_HF_KERNELS_WHEEL", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not HF_WHEEL or not Path(HF_WHEEL).is_file(),
        reason="WIOLA_HF_KERNELS_WHEEL does not name Hugging Face's kernels wheel "
        "(pip download --no-deps kernels==0.17.2; .ci/run does)",
    ),
]

# Run in the virtualenv from a folder outside the repository: which packages import, from where,
# and whether ours compute the reference's function.
CHECK = """
import json, sys
import kernels
assert callable(getattr(kernels, "get_kernel", None)), f"`kernels` is not Hugging Face's: {kernels.__file__}"
import torch
import wiola, wiola_kernels
from wiola import WiolaConfig, WiolaModel
from wiola.fast import WiolaModel as Fast, ops
from wiola_kernels.rms_norm import rms_norm
assert ops.KERNELS.keys() >= {"rms_norm", "gate", "attention", "butterfly"}, ops.MISSING
torch.manual_seed(0)
ref = WiolaModel(WiolaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16))
fast = Fast(ref.config)
fast.load_state_dict(ref.state_dict())
ids = torch.randint(0, 64, (2, 8))
with torch.no_grad():
    want, got = ref(ids).logits, fast(ids).logits
print(json.dumps({
    "kernels": kernels.__file__, "wiola": wiola.__file__, "wiola_kernels": wiola_kernels.__file__,
    "rms_norm": rms_norm.__module__, "err": float((want - got).abs().max() / want.abs().max()),
}))
"""


def _sh(*cmd: str | Path, cwd: Path) -> str:
    run = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
    )
    return run.stdout


def _see_running_packages(py: Path) -> None:
    """Let the new virtualenv import torch, triton, pip and setuptools from the running interpreter.
    ``--system-site-packages`` alone gives the base installation's, not those of a virtualenv the
    tests run in (as in CI), so a ``.pth`` file lists the running site-packages too (after the new
    virtualenv's own: what is installed there wins). The build runs without isolation on the running
    setuptools, which must build wheels by itself (>= 70.1, the ``dev`` extra's floor)."""
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    assert (major, minor) >= (70, 1), f"setuptools {setuptools.__version__} < 70.1: pip install 'setuptools>=70.1'"
    purelib = _sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=py.parent).strip()
    running = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "_running_interpreter.pth").write_text("".join(f"{p}\n" for p in sorted(running)))


def _source_copy(dest: Path) -> None:
    """The files a build reads, copied so the build's egg-info and build/ stay out of the checkout."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.so")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ("wiola", "kernels"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=skip)


@pytest.mark.parametrize("hf_first", [False, True], ids=["ours-then-hf", "hf-then-ours"])
@pytest.mark.parametrize("editable", [True, False], ids=["editable", "wheel"])
def test_both_kernels_packages_install_import_and_work(tmp_path, editable, hf_first):
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    venv = tmp_path / "venv"
    _sh(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path)
    py = venv / "bin" / "python"
    _see_running_packages(py)
    ours = ["-e", str(src)] if editable else [str(src)]
    installs = [[HF_WHEEL], ours]
    for args in installs if hf_first else installs[::-1]:
        _sh(py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args, cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "TRITON_INTERPRET": "1",
        "PYTHONNOUSERSITE": "1",
    }

    def check() -> dict:
        run = subprocess.run(
            [str(py), "-c", textwrap.dedent(CHECK)], cwd=outside, env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, f"the check failed in the virtualenv:\n{run.stderr[-4000:]}"
        return json.loads(run.stdout.strip().splitlines()[-1])

    site = venv / "lib"
    home = src if editable else site
    got = check()
    assert Path(got["kernels"]).is_relative_to(site), f"`kernels` imported from {got['kernels']}, not the virtualenv"
    for name in ("wiola", "wiola_kernels"):
        assert Path(got[name]).is_relative_to(home), f"{name} imported from {got[name]}, not from {home}"
    assert got["rms_norm"] == "wiola_kernels.rms_norm"
    # fp32 logits through the Triton kernels: rounding-level agreement (tests/test_fast.py has the bounds)
    assert got["err"] <= 1e-5, f"fast logits differ from the reference by {got['err']:.2e} (relative)"

    _sh(py, "-m", "pip", "uninstall", "-y", "-q", "kernels", cwd=tmp_path)
    for name in ("wiola", "wiola_kernels"):
        assert Path(got[name]).exists(), f"uninstalling Hugging Face's kernels removed {got[name]}"
    # Gone from the virtualenv (the running interpreter's own copy, which transformers may require,
    # can still be found after it: not this test's business).
    where = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else '')"
    left = _sh(py, "-c", where, cwd=outside).strip()
    assert not left or not Path(left).is_relative_to(site), f"Hugging Face's kernels is still installed: {left}"
    _sh(py, "-c", "import wiola_kernels.attention, wiola_kernels.aot, wiola.fast", cwd=outside)
