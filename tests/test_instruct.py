"""Fine-tuning teaches something measurable: a small story model, fine-tuned on the generated
instruction examples, writes stories holding every required word far more often than before;
the rise is checked with a one-sided two-proportion test that excludes chance."""

from __future__ import annotations

import json
import math

import pytest
import torch

import wiola
from wiola.tokenizer import train_tokenizer
from wiola.train.corpus import REQUIRED_WORDS, generate_stories, instruction_examples, story_words
from wiola.train.instruct import instruct_demo, two_proportion_z, wilson


def test_wilson_and_two_proportion_against_known_values() -> None:
    # Wilson 95 % for 8/10: 0.4902-0.9433 (Newcombe 1998, table I); for 0/20: 0-0.1611
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 20)[0] == 0 and round(wilson(0, 20)[1], 4) == 0.1611
    z, p = two_proportion_z(10, 100, 30, 100)  # pooled p = 0.2, se = sqrt(0.2*0.8*0.02) = 0.05657
    assert math.isclose(z, 0.2 / math.sqrt(0.0032), rel_tol=1e-12) and math.isclose(p, 0.5 * math.erfc(z / 2**0.5))
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_instruction_examples_ask_for_words_the_story_holds() -> None:
    examples = instruction_examples(50, seed=7)
    assert examples == instruction_examples(50, seed=7)
    for ex in examples:
        user, story = ex["messages"][0]["content"], ex["messages"][1]["content"]
        assert set(ex["words"]) <= story_words(story) and set(ex["words"]) <= set(REQUIRED_WORDS)
        assert all(w in user for w in ex["words"])
        assert ("dialogue" in ex["features"]) == ('"' in story)


@pytest.mark.slow
def test_fine_tuning_raises_the_word_following_rate(tmp_path) -> None:
    """CI-sized: a 1024-token BPE and a 2-layer model pre-trained briefly on the stories (through
    the same loop, completion format), then fine-tuned on instructions naming one required
    word. The rise must be one that chance (the pre-trained model's own rate, which a story
    model reaches by writing any story) explains with probability below 5 % (one-sided
    two-proportion z-test over 150 held-out instructions each). Measured on an Intel Xeon:
    13/150 -> 25/150 (p = 0.019) under torch 2.13, p < 0.01 under torch 2.11; with 150
    fine-tuning steps the same test gave p = 0.0045 and p = 0.12, too close to chance to assert."""
    from wiola.train.finetune import FinetuneConfig, finetune

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this model is too small to gain from a second thread; a busy CPU loses
    try:
        torch.manual_seed(0)
        stories = generate_stories(600, seed=11)
        tokenizer = train_tokenizer(stories, 1024, show_progress=False)
        config = wiola.WiolaConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=320)
        wiola.WiolaModel(config).save_pretrained(tmp_path / "scratch", tokenizer)
        lines = "".join(json.dumps({"prompt": "", "completion": s}) + "\n" for s in stories)
        (tmp_path / "stories.jsonl").write_text(lines)
        pre = FinetuneConfig(
            init=str(tmp_path / "scratch"),
            data=str(tmp_path / "stories.jsonl"),
            format="completion",
            out=str(tmp_path / "pretrained"),
            steps=150,
            batch_size=8,
            lr=3e-3,
            progress=False,
            log_every=50,
        )
        finetune(pre, log=lambda _: None)
        result = instruct_demo(
            tmp_path / "pretrained",
            tmp_path / "instruct",
            n_train=600,
            samples=150,
            steps=400,
            lr=5e-3,
            n_words=1,
            progress=False,
            log=lambda _: None,
        )
    finally:
        torch.set_num_threads(threads)
    before, after = result["before"], result["after"]
    message = (
        f"before {before['hits']}/{before['n']}, after {after['hits']}/{after['n']}, p={result['p_one_sided']:.2g}"
    )
    assert after["hits"] > before["hits"] and result["p_one_sided"] < 0.05, message
