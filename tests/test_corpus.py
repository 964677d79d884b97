"""The generated sample corpus: deterministic, varied, story-shaped, a few hundred KB."""

from __future__ import annotations

import hashlib
import re

import pytest

from wiola.train.corpus import EOT, generate_stories, sample_corpus, write_sample_corpus


def _digest(stories: list[str]) -> str:
    return hashlib.sha256("\x00".join(stories).encode()).hexdigest()


def test_same_seed_same_text_and_seeds_differ() -> None:
    a, b, c = generate_stories(50, seed=7), generate_stories(50, seed=7), generate_stories(50, seed=8)
    assert _digest(a) == _digest(b), "stories: the same seed gave different text"
    assert sum(x == y for x, y in zip(a, c)) == 0, "stories: seeds 7 and 8 share a story"


def test_prefix_property() -> None:
    # A longer corpus starts with the shorter one: the generator draws stories one after another.
    assert generate_stories(30, seed=3) == generate_stories(60, seed=3)[:30], "stories: prefix differs"


def test_default_corpus_size_and_variety() -> None:
    train, val = sample_corpus()
    train_kb = sum(len(s.encode()) for s in train) / 1e3
    val_kb = sum(len(s.encode()) for s in val) / 1e3
    assert 300 <= train_kb <= 900, f"train corpus: {train_kb:.0f} KB, expected a few hundred KB"
    assert 30 <= val_kb <= 90, f"validation corpus: {val_kb:.0f} KB"
    assert len(set(train)) == len(train), "train corpus: duplicate stories"
    assert not set(train) & set(val), "validation stories also occur in the training split"
    words = re.findall(r"[A-Za-z']+", " ".join(train))
    assert len(set(words)) >= 300, f"vocabulary of {len(set(words))} words is too small to be varied"
    # Several plots occur: their signature sentences all appear.
    for marker in (
        "could not find",
        "play with your",
        "was afraid of",
        "Help!",
        "fell down",
        "was raining",
        "birthday",
        "at the same time",
    ):
        n = sum(marker in s for s in train)
        assert n >= 30, f"plot marker {marker!r} occurs in only {n} stories"


def test_stories_are_story_shaped() -> None:
    for i, story in enumerate(generate_stories(200, seed=11)):
        paragraphs = story.split("\n\n")
        assert 2 <= len(paragraphs) <= 3, f"story {i}: {len(paragraphs)} paragraphs"
        assert story[0].isupper() and story.rstrip()[-1] in '.!"', f"story {i}: bad start/end {story[:20]!r}"
        assert story.count('"') % 2 == 0, f"story {i}: unbalanced quotes"
        assert '"' in story, f"story {i}: no dialogue"
        assert EOT not in story and "  " not in story, f"story {i}: separator or double space inside"
        # The hero is named in the first sentence and again later.
        name = re.search(r"named (\w+)", paragraphs[0])
        assert name and story.count(name.group(1)) >= 3, f"story {i}: hero not carried through"


def test_write_sample_corpus(tmp_path) -> None:
    out = write_sample_corpus(tmp_path / "corpus", n_train=20, n_val=5, seed=2)
    train, val = sample_corpus(20, 5, seed=2)
    for name, stories in (("train.txt", train), ("validation.txt", val)):
        text = (out / name).read_text(encoding="utf-8")
        assert [s.strip() for s in text.split(EOT)] == stories, f"{name}: stories do not round-trip"


def test_negative_count_raises() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        generate_stories(-1)
