"""The CLI's conventions and ``wiola generate``'s batch mode: ``--version``, many prompts from a file or
stdin as one left-padded batch, ``--num-samples``, ``--json``, ``--no-echo``, ``--stop``; bad input
exits 2 with one line ``wiola <command>: error: ...``; Ctrl-C exits 130 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import wiola
from wiola import WiolaConfig, WiolaModel
from wiola.cli import main
from wiola.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Once upon a time there was a little cat. The cat liked to play in the sun with a red ball."] * 20
PROMPTS = ["Once upon a time", "The cat", "A red ball and a little"]


pytestmark = pytest.mark.usefixtures("plain_cpu")  # a plain CPU: the C++ step, not the interpreter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny model with peaked logits and its own small tokenizer, saved in our format."""
    folder = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer(TEXTS, 300, show_progress=False)
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=128, eos_token_id=2)
    model = WiolaModel(cfg).eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1.0)
    model.save_pretrained(folder, tok)
    return folder


def _solo(checkpoint: Path, prompt: str, n: int) -> tuple[list[int], str]:
    from wiola.checkpoint import load_checkpoint_tokenizer

    model = WiolaModel.from_pretrained(checkpoint).eval()
    enc = load_checkpoint_tokenizer(checkpoint)
    ids = torch.tensor([enc.encode(prompt)])
    new = model.generate(ids, n, eos_token_id=enc.eos_token_id)[0, ids.shape[1] :].tolist()
    if enc.eos_token_id in new:
        new = new[: new.index(enc.eos_token_id)]
    return new, enc.decode(new)


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wiola", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )


def test_version():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"wiola {wiola.__version__}"


def test_prompt_file_runs_one_batch_equal_to_each_prompt_alone(checkpoint, tmp_path, capsys):
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n\n")
    args = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "12", "--temperature", "0"]
    assert main([*args, "--prompt-file", str(file), "--json", "--device", "cpu", "--reference"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for r in records:
        ids, text = _solo(checkpoint, r["prompt"], 12)
        assert r["ids"] == ids and r["text"] == text, f"batched row {r['prompt_index']} differs from its solo run"
        assert r["finish_reason"] == ("stop" if len(ids) < 12 else "length")
        assert r["tokens_per_second"] > 0
    assert main([*args, "--prompt-file", str(file), "--no-echo", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines() == [_solo(checkpoint, p, 12)[1] for p in PROMPTS]


def test_stdin_jsonl_and_num_samples(checkpoint):
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2])
    args = ["--checkpoint", str(checkpoint), "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "3"]
    done = _run("generate", *args, "--prompt-file", "-", "--num-samples", "3", "--json", "--device", "cpu", stdin=lines)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["prompt_index"], r["sample"]) for r in records] == [(i, s) for i in range(2) for s in range(3)]
    lines = done.stderr.splitlines()  # not a terminal: no progress bar, only the path and the summary
    assert len(lines) == 2 and lines[0].startswith("CPU decoding:") and "6 samples" in lines[1], lines


def test_prompt_lines_as_json_strings_and_the_lowest_seed(checkpoint):
    """A prompt file's lines may be JSON strings (their quotes are not prompt text); a seed at the
    bottom of the documented range [-2**63, 2**64) is taken."""
    lines = "".join(json.dumps(p) + "\n" for p in PROMPTS[:2])
    args = ["--checkpoint", str(checkpoint), "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu"]
    done = _run("generate", *args, "--prompt-file", "-", "--json", stdin=lines)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["prompt"] for line in done.stdout.splitlines()] == PROMPTS[:2]
    low = _run("generate", *args, "--prompt", PROMPTS[0], "--seed", str(-(2**63)))
    assert low.returncode == 0, low.stderr


def test_echo_and_stop_text_of_one_prompt(checkpoint, capsys):
    ids, text = _solo(checkpoint, PROMPTS[0], 20)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    args = ["generate", "--checkpoint", str(checkpoint), "--prompt", PROMPTS[0], "--max-new-tokens", "20"]
    assert main([*args, "--temperature", "0", "--device", "cpu", "--stop", stop]) == 0
    assert capsys.readouterr().out == PROMPTS[0] + text[: text.index(stop)] + "\n"
    assert main([*args, "--temperature", "0", "--device", "cpu", "--no-echo"]) == 0
    assert capsys.readouterr().out == text + "\n"
    zero = [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "0",
        "--device",
        "cpu",
    ]
    assert main(zero) == 0, "--max-new-tokens 0 (>= 0 is allowed): the prompt alone"
    captured = capsys.readouterr()
    assert captured.out == PROMPTS[0] + "\n" and "[0 tokens in " in captured.err, captured
    assert main([*zero, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["ids"], record["text"], record["finish_reason"]) == ([], "", "length"), record


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-file", "missing.txt"], "--prompt-file missing.txt does not exist"),
        (["--prompt-file", "BAD"], "line 2 is not JSON"),
        (["--prompt-file", "EMPTY"], "holds no prompt"),
        (["--prompt", ""], "the prompt is empty"),
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--max-new-tokens", "500"], "past max_seq_len=128"),
        (["--max-new-tokens", "ten"], "argument --max-new-tokens: invalid int value"),
        (["--quantize", "int3"], "argument --quantize: invalid choice"),
        (["--seed", str(2**64)], f"argument --seed: {2**64} is outside [-2**63, 2**64)"),
        (["--seed", "x"], "argument --seed: 'x' is not an integer"),
        (["--prompt", "a", "--prompt-file", "BAD"], "argument --prompt-file: not allowed with argument --prompt"),
    ],
)
def test_bad_input_exits_2_with_one_line(checkpoint, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "BAD").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "EMPTY").write_text("\n  \n")
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu", *args])
    except SystemExit as e:  # argparse's rejections
        code = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, lines
    assert captured.out == "", f"stdout before the refusal: {captured.out!r}"
    assert lines[-1].startswith("wiola generate: error: ") and message in lines[-1], lines
    assert not any(line.startswith(("usage:", "Traceback")) for line in lines), lines


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    """SIGINT while decoding: exit 130 and one line, no traceback. The eos row of the tied
    embedding is zero, so its logit is 0 and greedy decoding picks it only if all 299 others are
    negative: the model runs all 4,000 tokens (about 20 s), and the signal, sent 0.5 s after the
    echoed prompt (flushed before decoding starts), lands mid-generation. The streamed text itself
    may be held back for a long time (incomplete UTF-8 characters), so it is not waited for."""
    folder = tmp_path / "long"
    tok = train_tokenizer(TEXTS, 300, show_progress=False)
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig(vocab_size=300, d_model=128, n_layers=4, n_heads=4, d_ff=256, max_seq_len=4096))
    with torch.no_grad():
        model.embed.weight[tok.eos_token_id].zero_()
    model.save_pretrained(folder, tok)
    # A process started in the background of a shell without job control (nohup, `cmd &` in a
    # script: how a CI runner may start the suite) inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler. The child restores Python's handler first, as at a terminal.
    args = ["generate", "--checkpoint", str(folder), "--max-new-tokens", "4000", "--device", "cpu",
            "--reference", "--temperature", "0", "--prompt", "Once"]  # fmt: skip
    as_at_a_terminal = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['wiola', *sys.argv[1:]]; runpy.run_module('wiola', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", as_at_a_terminal, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"},
    )  # fmt: skip
    try:
        assert proc.stdout.read(len("Once")) == b"Once", "the prompt was not echoed"
        time.sleep(0.5)
        assert proc.poll() is None, f"generation ended before the signal: {proc.communicate()[1].decode()}"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and err.decode().strip().splitlines()[-1] == "wiola generate: interrupted"


@pytest.fixture(scope="module")
def gpt2_checkpoints(tmp_path_factory, offline_tokenizer) -> tuple[Path, Path]:
    """Two tiny models with GPT-2's 32k tokenizer, which has no pad token, so finished rows hold
    eos. In the first the blocks' outputs (o_proj, down_proj of std 1) outweigh the tied embedding,
    so greedy text changes words instead of repeating the prompt's last one. The second is the
    first with eos's embedding row a little over that of a token the first writes after "The cat"
    (not its first, not one it wrote before), chosen so that greedy decoding writes some text and
    then eos."""
    from wiola.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2-32k")
    assert tok.pad_token_id is None and tok.eos_token_id is not None
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=32000, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=128)
    model = WiolaModel(cfg).eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1.0)
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.normal_(0, 1.0)
    plain, ends = tmp_path_factory.mktemp("gpt2") / "plain", tmp_path_factory.mktemp("gpt2") / "ends"
    model.save_pretrained(plain, tok)
    ids = torch.tensor([tok.encode("The cat")])
    new = model.generate(ids, 8)[0, ids.shape[1] :].tolist()
    eos, saved = tok.eos_token_id, model.embed.weight[tok.eos_token_id].clone()
    # Whatever the random weights of this torch's generator write: the first new token j >= 1 that
    # the earlier ones are not, and a scale at which eos's row, that token's scaled, first wins
    # after some visible text (checked by decoding, since a scale can also win an earlier step).
    for j, scale in ((j, a) for j in range(1, len(new)) if new[j] not in new[:j] for a in (1.02, 1.005, 1.1)):
        with torch.no_grad():
            model.embed.weight[eos] = scale * model.embed.weight[new[j]]
        got = model.generate(ids, 8)[0, ids.shape[1] :].tolist()
        if eos in got and tok.decode(got[: got.index(eos)]).strip():
            model.save_pretrained(ends, tok)
            return plain, ends
        with torch.no_grad():
            model.embed.weight[eos] = saved
    raise AssertionError(f"no eos row ends greedy decoding after some text: {new}")


def _reference_text(checkpoint: Path, prompt: str, n: int) -> tuple[list[int], str]:
    """The reference model's greedy new ids and text (up to eos, which is left out)."""
    ids, text = _solo(checkpoint, prompt, n)
    assert "<|endoftext|>" not in text
    return ids, text


def test_stop_text_is_cut_with_a_tokenizer_without_pad(gpt2_checkpoints, tmp_path, capsys):
    """--stop with GPT-2's tokenizer (finished rows padded with eos): the text ends before the stop
    string in --json, streamed and batch output alike."""
    checkpoint = gpt2_checkpoints[0]
    prompts = ["The cat", "A red ball"]
    _, text = _reference_text(checkpoint, prompts[0], 16)
    # a stop string of two characters whose first occurrence is where it is taken from, past some
    # visible text (whatever the random weights of this torch's generator write)
    k = next((k for k in range(1, len(text) - 1) if text[:k].strip() and text.index(text[k : k + 2]) == k), None)
    assert k is not None, f"no stop string to take from {text!r}"
    stop = text[k : k + 2]
    want = text[:k]
    args = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "16", "--temperature", "0",
            "--device", "cpu", "--reference", "--stop", stop]  # fmt: skip
    assert main([*args, "--prompt", prompts[0], "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["text"], record["finish_reason"]) == (want, "stop"), record
    assert main([*args, "--prompt", prompts[0]]) == 0
    assert capsys.readouterr().out == prompts[0] + want + "\n"
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts) + "\n")
    assert main([*args, "--prompt-file", str(file), "--no-echo"]) == 0
    other = _reference_text(checkpoint, prompts[1], 16)[1]
    other = other[: other.index(stop)] if stop in other else other
    assert capsys.readouterr().out.splitlines() == [want, other]


def test_streamed_text_ends_before_eos(gpt2_checkpoints, capsys):
    """One prompt, streamed: the text stops at eos and eos's own text (<|endoftext|>) is not printed,
    as in --json and batch output."""
    checkpoint = gpt2_checkpoints[1]
    from wiola.checkpoint import load_checkpoint_tokenizer

    eos = load_checkpoint_tokenizer(checkpoint).eos_token_id
    model = WiolaModel.from_pretrained(checkpoint).eval()
    ids = torch.tensor([load_checkpoint_tokenizer(checkpoint).encode("The cat")])
    assert eos in model.generate(ids, 8)[0, ids.shape[1] :].tolist(), "the model does not emit eos"
    _, text = _reference_text(checkpoint, "The cat", 8)
    assert text.strip(), "eos came first: no text to compare"
    args = ["generate", "--checkpoint", str(checkpoint), "--prompt", "The cat", "--max-new-tokens", "8"]
    for path in (["--reference"], []):
        assert main([*args, "--temperature", "0", "--device", "cpu", *path]) == 0
        out = capsys.readouterr().out
        assert out == "The cat" + text + "\n", f"{path}: {out!r}"
    assert main([*args, "--temperature", "0", "--device", "cpu", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["text"] == text and row["finish_reason"] == "stop" and len(row["ids"]) < 8, row  # ended at eos


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--top-k", "-3", "--top-k -3: top_k must be a positive int"),
        ("--temperature", "-1", "--temperature -1.0: temperature must be >= 0"),
        ("--temperature", "inf", "--temperature inf: temperature must be >= 0 and finite"),
        ("--temperature", "nan", "--temperature nan: temperature must be >= 0 and finite"),
        ("--top-p", "1.5", "--top-p 1.5: top_p must be in (0, 1]"),
        ("--top-p", "nan", "--top-p nan: top_p must be in (0, 1]"),
        ("--stop", "", "--stop: a stop text must not be empty"),
    ],
)
def test_bad_sampling_flags_exit_2_before_the_model_loads(checkpoint, monkeypatch, capsys, flag, value, message):
    """A sampling flag that means nothing is refused before the model loads or the prompt is
    echoed: exit 2, one line naming the flag, nothing on stdout."""
    import wiola.cli.generate as generate

    def loads(*_):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate, "load_model", loads)
    code = main(["generate", "--checkpoint", str(checkpoint), "--device", "cpu", flag, value])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.startswith(f"wiola generate: error: {message}"), captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err


def test_infinite_temperature_is_refused_by_the_api(checkpoint):
    """temperature=inf would sample uniformly past top-k; the shared check refuses it (and NaN)."""
    model = WiolaModel.from_pretrained(checkpoint).eval()
    ids = torch.tensor([[5, 6, 7]])
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
            model.generate(ids, 2, temperature=value, top_k=5)


# ------------------------------------------------ tokenizers that do not match the model; quantized
@pytest.fixture(scope="module", params=["bpe", "tiktoken"])
def padded_checkpoint(request, tmp_path_factory) -> tuple[Path, object]:
    """A model with 64 embedding rows past its tokenizer's ids (a 300-id BPE; GPT-2's 32k tiktoken,
    whose decode raises on such an id), those rows scaled up so that their logits are the largest:
    greedy decoding picks one first, whatever the random weights."""
    from wiola.tokenizer import load_tokenizer

    if request.param == "bpe":
        tok, scale = train_tokenizer(TEXTS, 300, show_progress=False), 10
    else:
        request.getfixturevalue("offline_tokenizer")
        tok, scale = load_tokenizer("gpt2-32k"), 20
    n = tok.vocab_size
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig(vocab_size=n + 64, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=128))
    with torch.no_grad():
        model.embed.weight[n:] *= scale
    folder = tmp_path_factory.mktemp(f"padded_{request.param}")
    model.save_pretrained(folder, tok)
    return folder, tok


def test_generated_ids_past_the_tokenizer_are_left_out_with_a_warning(padded_checkpoint, capsys):
    """Ids the model generates past its tokenizer's (padded rows) have no text: they stay in --json's
    ids, are left out of the text (not a tiktoken KeyError), and one warning line says so."""
    folder, tok = padded_checkpoint
    args = ["generate", "--checkpoint", str(folder), "--prompt", PROMPTS[0], "--max-new-tokens", "12",
            "--temperature", "0", "--device", "cpu"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    (record,) = [json.loads(line) for line in captured.out.splitlines()]
    past = [i for i in record["ids"] if i >= tok.vocab_size]
    assert past, f"no id past the tokenizer's: the test shows nothing ({record['ids']})"
    assert record["text"] == tok.decode([i for i in record["ids"] if i < tok.vocab_size])
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, captured.err
    want = f"warning: {len(past)} generated token(s) (first id {past[0]}) lie past the {tok.vocab_size:,} ids of "
    assert warnings[0].startswith(want), warnings
    assert warnings[0].endswith("so have no text and are left out of it: does this tokenizer belong to this model?")
    assert main(args) == 0  # streamed: the same text
    captured = capsys.readouterr()
    assert captured.out == PROMPTS[0] + record["text"] + "\n" and want in captured.err, captured


def test_an_id_equal_to_the_tokenizers_size_is_past_it(checkpoint, capsys):
    """The first id past a tokenizer of V ids is V itself: it has no text and is warned of."""
    import argparse

    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.cli.generate import _report

    tok = load_checkpoint_tokenizer(checkpoint)
    V = tok.vocab_size
    args = argparse.Namespace(stop=None, num_samples=1, json=True, no_echo=True)
    assert _report(args, ["p"], [[5]], [[7, V, 8, V - 1]], tok, 1.0, None) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["text"] == tok.decode([7, 8, V - 1]), captured.out
    assert f"warning: 1 generated token(s) (first id {V}) lie past the {V:,} ids" in captured.err, captured.err


def test_a_tokenizer_larger_than_the_model_is_refused(checkpoint, offline_tokenizer, capsys):
    """--tokenizer with more ids than the model has rows: exit 2 before generating, in check_ids'
    words, even for a prompt whose ids happen to fit (the model's ids would be decoded as another
    tokenizer's text)."""
    code = main(["generate", "--checkpoint", str(checkpoint), "--tokenizer", "gpt2-32k", "--prompt", "a",
                 "--max-new-tokens", "4", "--device", "cpu"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err == (
        "wiola generate: error: tokenizer 'gpt2-32k' has 32,000 ids, more than the model's vocabulary of 300: "
        "this tokenizer does not belong to this model\n"
    ), captured.err


def test_reference_on_a_quantized_checkpoint_is_refused_naming_the_flag(checkpoint, tmp_path, monkeypatch, capsys):
    """A quantized checkpoint runs on wiola.fast only: --reference is refused before anything loads."""
    import wiola.model
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    model = FastModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    quantize(model, "int8").save_pretrained(tmp_path / "q8", load_checkpoint_tokenizer(checkpoint))
    monkeypatch.setattr(wiola.model, "load_pretrained", lambda *_, **__: pytest.fail("loaded before the check"))
    code = main(["generate", "--checkpoint", str(tmp_path / "q8"), "--reference", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err == (
        f"wiola generate: error: drop --reference: {tmp_path / 'q8'} holds int8-quantized weights, which run on "
        "the fast model\n"
    ), captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: --device cuda is not refused")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_device_cuda_without_cuda_is_one_line(checkpoint, capsys, command):
    """--device cuda where torch has no CUDA: one line naming the flag, exit 2, before the model
    loads (not torch's assertion from inside moving the model)."""
    extra = ["--prompt", "hi", "--max-new-tokens", "2"] if command == "generate" else ["--port", "0"]
    assert main([command, "--checkpoint", str(checkpoint), "--device", "cuda", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"wiola {command}: error: --device cuda: CUDA is not available here (use --device cpu)\n", err


def test_streamed_text_of_a_cleaning_tokenizer_is_its_decoding(tmp_path, capsys):
    """A tokenizer that cleans up spaces before punctuation rewrites the end of its decoding as
    tokens arrive (" n't" -> "n't"): the streamed chunks and what is printed at the end join to
    ``decode`` of every token (the stream holds back its ``decode_reach``)."""
    from wiola.cli.generate import _Printer
    from wiola.tokenizer import load_tokenizer, train_tokenizer

    train_tokenizer(["Once upon a time , there was a cat . It is n't here ! "] * 30, 300, show_progress=False).save(
        tmp_path
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    enc = load_tokenizer(tmp_path)
    ids = enc.encode_batch(["a . . . . It is n't here , ok ."])[0]
    assert enc.decode(ids) == "a.... It isn't here, ok."
    printer = _Printer(enc, [], None)
    for token in ids:
        printer(torch.tensor([token]))
    assert capsys.readouterr().out + printer.rest() == enc.decode(ids)
