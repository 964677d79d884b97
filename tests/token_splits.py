"""A recorder of the splits ``wiola.train.token_cache`` tokenises, for tests that check which
splits a command tokenises (evaluation tokenises the validation split alone)."""

from __future__ import annotations

import pytest


def record_tokenised_splits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The splits (``"train"``, ``"val"``) ``token_cache`` tokenises from here on, in order."""
    from wiola.train import token_cache

    seen: list[str] = []
    real = token_cache._tokenize_split

    def recording(*a, **k):
        seen.append(k["desc"].split()[1])
        return real(*a, **k)

    monkeypatch.setattr(token_cache, "_tokenize_split", recording)
    return seen
