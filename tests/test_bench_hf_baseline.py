"""bench/hf_baseline.py: the wiola13m baseline says which transformers it needs, not a traceback
from inside transformers."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest

from bench import hf_baseline


def _fake_metadata(requires, versions):
    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    def reqs(name):
        if requires is None:
            raise metadata.PackageNotFoundError(name)
        return requires

    return SimpleNamespace(requires=reqs, version=version, PackageNotFoundError=metadata.PackageNotFoundError)


DECLARED = ["torch>=2.1", "transformers<4.46,>=4.40", 'datasets>=2.14; extra == "train"']


def test_transformers_outside_the_declared_range_names_both_versions(monkeypatch):
    monkeypatch.setattr(
        hf_baseline, "metadata", _fake_metadata(DECLARED, {"wiola13m": "1.0.1", "transformers": "5.2.0"})
    )
    with pytest.raises(
        ImportError, match=r"wiola13m 1\.0\.1 needs transformers<4\.46,>=4\.40; .* transformers 5\.2\.0"
    ):
        hf_baseline.check_wiola13m_requirements()


def test_transformers_missing_is_named(monkeypatch):
    monkeypatch.setattr(hf_baseline, "metadata", _fake_metadata(DECLARED, {"wiola13m": "1.0.1"}))
    with pytest.raises(ImportError, match="transformers is not installed"):
        hf_baseline.check_wiola13m_requirements()


@pytest.mark.parametrize("have", ["4.40.0", "4.45.2"])
def test_transformers_inside_the_range_passes(monkeypatch, have):
    monkeypatch.setattr(hf_baseline, "metadata", _fake_metadata(DECLARED, {"wiola13m": "1.0.1", "transformers": have}))
    hf_baseline.check_wiola13m_requirements()


def test_no_wiola13m_metadata_leaves_it_to_the_import(monkeypatch):
    monkeypatch.setattr(hf_baseline, "metadata", _fake_metadata(None, {"transformers": "5.2.0"}))
    hf_baseline.check_wiola13m_requirements()  # nothing to check against: `import wiola13m` decides
