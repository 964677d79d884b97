"""Fine-tuning teaches something measurable: a small story model, fine-tuned on the generated
instruction examples, writes stories holding every required word far more often than before;
the rise is checked with a one-sided two-proportion test that excludes chance."""

from __future__ import annotations

import json
import math
import re

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


def test_held_out_and_validation_examples_are_not_training_examples(tmp_path) -> None:
    """``instruct_demo``'s scored examples and the corpus's validation lines share no example with
    its training file (independent seeds, here the demo's defaults: 2,000 and 50)."""
    from wiola.train.corpus import write_instruction_corpus
    from wiola.train.instruct import held_out_examples

    write_instruction_corpus(tmp_path, n_train=2000, n_val=50, seed=0)
    train = set((tmp_path / "train.jsonl").read_text().splitlines())
    validation = (tmp_path / "validation.jsonl").read_text().splitlines()
    assert not train & set(validation), "validation lines are training lines"
    held = [json.dumps(example) for example in held_out_examples(50, 0)]
    assert not train & set(held), "held-out examples are training examples"


def test_a_reply_is_scored_up_to_its_eos(monkeypatch) -> None:
    """``follow_rate`` reads a reply up to its end-of-text token: required words written after it
    (another document) do not count."""
    from wiola.tokenizer import load_tokenizer
    from wiola.train.instruct import follow_rate

    tok = load_tokenizer("gpt2-32k")
    tail = [*tok.encode(" A story."), tok.eos_token_id, *tok.encode(" ball park dog")]

    class Writer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1, 1)
            self.config = wiola.WiolaConfig.preset("tiny", max_seq_len=512)

        def generate(self, ids, n, **kwargs):
            return torch.cat([ids, torch.tensor([tail] * ids.shape[0])], 1)

    example = {"messages": [{"role": "user", "content": "Words: ball, park, dog."}], "words": ["ball", "park", "dog"]}
    rate = follow_rate(Writer(), tok, [example])
    assert (rate.hits, rate.n, rate.example) == (0, 1, " A story."), rate


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


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from wiola.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=64)
    path = tmp_path_factory.mktemp("instruct") / "tiny"
    wiola.WiolaModel(config).save_pretrained(path, load_tokenizer("gpt2-32k"))
    return path


def _snapshot(folder) -> dict:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "steps must be positive, got 0"),
        (["--batch-size", "0"], "batch.size must be positive, got 0"),
        (["--lr", "0"], "lr must be a positive number, got 0.0"),
        (["--lora-rank", "0"], "--lora-rank must be positive, got 0"),
        (["--samples", "0"], "--samples must be positive, got 0"),
        (["--examples", "0"], "--examples must be positive, got 0"),
        (["--init", "{tmp}/missing"], "--init: checkpoint directory '.*missing' does not exist"),
        (["--init", "{tmp}/lora"], "--init: .*lora holds LoRA adapters"),
        (["--out", "{tmp}/afile"], "--out '.*afile' is a file, not a folder"),
        (["--out", "{tmp}/holder"], "--out '.*holder.data' is a file, not a folder"),
        (["--out", "{init}"], "--out '.*tiny' is the --init checkpoint itself"),
        (["--out", "{init}/demo"], "--out '.*demo' lies inside the --init checkpoint"),
        (["--out", "{tmp}/previous"], r"--out '.*previous' already holds data, model \(a previous demo's, or files"),
        (["--out", "{tmp}/amodel"], r"--out '.*amodel' holds a model \(config.json\)"),
        (["--out", "{tmp}/arun"], "--out '.*arun' holds a training run"),
    ],
)
def test_instruct_demo_checks_flags_init_and_out_before_any_work(
    tmp_path, tiny_checkpoint, monkeypatch, capsys, flags, message
) -> None:
    """Every bad flag, --init and --out is one line and exit 2 before the corpus is written or
    the model measured (which costs minutes with the defaults)."""
    from wiola.cli import main

    def measured(*args, **kwargs):
        raise AssertionError("the model was measured before the settings were checked")

    monkeypatch.setattr("wiola.train.instruct.follow_rate", measured)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "holder").mkdir()
    (tmp_path / "holder" / "data").write_text("x")  # out/data: a file where the corpus would go
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text('{"base_model_name_or_path": "x", "peft_type": "LORA"}')
    (tmp_path / "previous" / "data").mkdir(parents=True)  # a user's training file and model, or a last demo's
    (tmp_path / "previous" / "data" / "train.jsonl").write_text("mine\n")
    (tmp_path / "previous" / "model").mkdir()
    (tmp_path / "previous" / "model" / "config.json").write_text("{}")
    (tmp_path / "amodel").mkdir()
    (tmp_path / "amodel" / "config.json").write_text("{}")
    (tmp_path / "arun" / "checkpoints").mkdir(parents=True)
    flags = [f.format(tmp=tmp_path, init=tiny_checkpoint) for f in flags]
    args = {"--init": str(tiny_checkpoint), "--out": str(tmp_path / "out"), "--samples": "4", "--examples": "4"}
    args |= {"--steps": "1", **dict(zip(flags[::2], flags[1::2]))}
    before = _snapshot(tmp_path), _snapshot(tiny_checkpoint)
    code = main(["instruct-demo", *(x for pair in args.items() for x in pair), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("wiola instruct-demo: error: "), err
    assert re.search(message, err), err
    assert (_snapshot(tmp_path), _snapshot(tiny_checkpoint)) == before, "something was written"


def test_instruct_demo_replaces_a_previous_out_only_when_asked(tmp_path, tiny_checkpoint) -> None:
    """An --out holding data/ or model/ passes the checks with --overwrite (the CLI's default
    folder always does: it holds the previous demo), an empty one without it."""
    from wiola.train.finetune import FinetuneConfig
    from wiola.train.instruct import check_demo_settings

    out = tmp_path / "previous"
    cfg = FinetuneConfig(init=str(tiny_checkpoint), data=str(out / "data" / "train.jsonl"), out=str(out / "model"))
    (out / "data").mkdir(parents=True)
    assert check_demo_settings(cfg, out, n_train=4, samples=4, n_words=1) == tiny_checkpoint  # empty data/
    (out / "data" / "train.jsonl").write_text("mine\n")
    with pytest.raises(ValueError, match="already holds data"):
        check_demo_settings(cfg, out, n_train=4, samples=4, n_words=1)
    assert check_demo_settings(cfg, out, n_train=4, samples=4, n_words=1, overwrite=True) == tiny_checkpoint


def test_instruct_demo_ends_naming_what_it_wrote(tmp_path) -> None:
    from wiola.tokenizer import load_tokenizer
    from wiola.train.instruct import instruct_demo

    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=256)
    wiola.WiolaModel(config).save_pretrained(tmp_path / "init", load_tokenizer("gpt2-32k"))
    lines: list[str] = []
    out = tmp_path / "demo"
    instruct_demo(
        tmp_path / "init", out, n_train=4, samples=2, steps=1, batch_size=2, n_words=1, progress=False, log=lines.append
    )
    assert lines[-1] == (
        f"wrote {out / 'results.json'} (both rates and the test), the training examples in {out / 'data'}, "
        f"the fine-tuned model in {out / 'model'}"
    )
    assert (out / "results.json").is_file() and (out / "data").is_dir() and (out / "model").is_dir()


def test_follow_rate_counts_its_progress_per_batch(tiny_checkpoint) -> None:
    """The measurement (minutes at the demo's defaults) reports each batch's examples as they finish."""
    from wiola.train.corpus import instruction_examples
    from wiola.train.finetune import load_finetuned
    from wiola.train.instruct import follow_rate

    class Counter:
        def __init__(self) -> None:
            self.counts: list[int] = []

        def update(self, n: int = 1) -> None:
            self.counts.append(n)

    model, tokenizer = load_finetuned(tiny_checkpoint)
    counter = Counter()
    rate = follow_rate(
        model, tokenizer, instruction_examples(5, 0, 1), max_new_tokens=2, batch_size=2, progress=counter
    )
    assert rate.n == 5 and counter.counts == [2, 2, 1]
