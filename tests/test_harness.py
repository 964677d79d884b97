"""The ``wiola`` model of lm-evaluation-harness (``wiola.train.harness``) on a local custom task
(YAML + JSONL in a temporary folder; no Hub access): every log-likelihood against one computed
directly from the reference model, rolling log-likelihoods, ``generate_until`` against
``model.generate`` with the same stop strings, the int8 form, and ``wiola eval --tasks`` end to
end in a subprocess with the Hub switched off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from numerics import TOL

from wiola import WiolaConfig, WiolaModel
from wiola.tokenizer import encoding_for_vocab

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance

from wiola.train.harness import WiolaLM, cut_at_stop

CPU = platform.processor() or platform.machine()
CONTEXTS = ["Once upon a time", "The dog ran to the", "Lily said", "A"]
CHOICES = [" park", " big red ball", " hello.", " cat and a dog"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A small model with spread-out logits (weights well above the init scale, so greedy choices
    are far from ties) and the 32k tokenizer, saved as a folder."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("tiny", d_model=32, n_layers=2, n_heads=2, max_seq_len=48))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("harness") / "model"
    model.save_pretrained(path)
    return path


def _direct_loglikelihood(model: WiolaModel, enc, context: str, continuation: str) -> tuple[float, bool, float]:
    """The continuation's log-probability from one unpadded reference forward, its greediness and max|logit|."""
    ctx, whole = enc.encode(context), enc.encode(context + continuation)
    cont = whole[len(ctx) :]
    logits = model(torch.tensor([whole[:-1]])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[-len(cont) :]
    target = torch.tensor(cont)
    greedy = bool((lp.argmax(-1) == target).all())
    return float(lp.gather(1, target[:, None]).sum()), greedy, float(logits.abs().max())


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_loglikelihood_equals_the_reference_model(checkpoint, quantize):
    """Batched, left-padded scores equal each pair scored alone by the reference model (int8, int4:
    the reference on the dequantized weights). Bound: log-softmax moves by at most 2·max|Δlogit|
    per token, and the logits agree to fp32's table tolerance of max|logit|."""
    lm = WiolaLM(str(checkpoint), batch_size=3, device="cpu", quantize=quantize)
    lm.model.use_kernels(False)  # the PyTorch path a CPU runs (the Triton interpreter is for kernel tests)
    ref = WiolaModel(lm.model.config)
    ref.load_state_dict(lm.model.state_dict())
    enc = encoding_for_vocab(ref.config.vocab_size)
    pairs = [(c, k) for c in CONTEXTS for k in CHOICES]
    got = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    with torch.no_grad():
        for (context, continuation), (score, greedy) in zip(pairs, got):
            want, want_greedy, scale = _direct_loglikelihood(ref, enc, context, continuation)
            n = len(enc.encode(context + continuation)) - len(enc.encode(context))
            bound = n * 2 * TOL[torch.float32] * scale
            assert abs(score - want) <= bound, (
                f"{context!r}+{continuation!r} ({quantize}, CPU {CPU}): {score} vs {want}"
            )
            assert greedy == want_greedy


def test_a_continuation_is_greedy_only_if_every_token_is_the_argmax(checkpoint):
    """``is_greedy`` of a continuation whose first token is the model's argmax and whose second is
    its argmin is False; the two argmax tokens in a row are True."""
    lm = WiolaLM(str(checkpoint), device="cpu")
    lm.model.use_kernels(False)
    context = [5, 6, 7]
    with torch.no_grad():
        first = int(lm.model(torch.tensor([context])).logits[0, -1].argmax())
        second = lm.model(torch.tensor([[*context, first]])).logits[0, -1]
    mixed, both = [first, int(second.argmin())], [first, int(second.argmax())]
    got = lm._loglikelihood_tokens([(("", ""), context, mixed), (("", ""), context, both)], disable_tqdm=True)
    assert [greedy for _, greedy in got] == [False, True], got


def test_scoring_bar_only_on_a_terminal_with_progress(checkpoint, capsys, monkeypatch):
    """The ``wiola loglikelihood`` bar follows ``draws_bars``: none off a terminal (stderr is a
    pipe here) even when lm-eval leaves its bars on, none with progress off, one on a terminal."""
    import sys

    pairs = _instances("loglikelihood", [(c, k) for c in CONTEXTS[:2] for k in CHOICES])

    def bar_drawn(**kwargs: object) -> bool:
        lm = WiolaLM(str(checkpoint), batch_size=3, device="cpu", **kwargs)
        lm.model.use_kernels(False)
        capsys.readouterr()
        lm.loglikelihood(pairs, disable_tqdm=False)
        return "wiola loglikelihood" in capsys.readouterr().err

    assert not bar_drawn(), "a bar was drawn into a pipe"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not bar_drawn(progress=False), "a bar was drawn with progress off"
    assert bar_drawn(), "no bar on a terminal: the test cannot see one"


def test_wiola13m_folder_scores_as_ours(checkpoint, tmp_path):
    """The same weights and tokenizer written in the published package's format score the same."""
    from wiola.checkpoint import export_wiola13m
    from wiola.tokenizer import TiktokenTokenizer

    model = WiolaModel.from_pretrained(checkpoint)
    export_wiola13m(model, tmp_path / "w13", TiktokenTokenizer(encoding_for_vocab(model.config.vocab_size)))
    pairs = _instances("loglikelihood", [(c, k) for c in CONTEXTS[:2] for k in CHOICES])
    ours, theirs = WiolaLM(str(checkpoint), device="cpu"), WiolaLM(str(tmp_path / "w13"), device="cpu")
    for lm in (ours, theirs):
        lm.model.use_kernels(False)
    assert ours.loglikelihood(pairs, disable_tqdm=True) == theirs.loglikelihood(pairs, disable_tqdm=True)


def test_loglikelihood_rolling_sums_windows(checkpoint):
    """A text longer than max_seq_len: the rolling score equals the reference's windows (each
    predicts the next up to max_length tokens from the max_length tokens before their end, the
    first token predicted from <|endoftext|>)."""
    lm = WiolaLM(str(checkpoint), batch_size=2, device="cpu")
    lm.model.use_kernels(False)
    enc = encoding_for_vocab(lm.model.config.vocab_size)
    text = " ".join(["Once upon a time there was a little dog who liked to run."] * 12)
    ids = enc.encode(text)
    assert len(ids) > 2 * lm.max_length
    assert lm.prefix_token_id == lm.eot_token_id, "GPT-2's encodings begin documents with <|endoftext|>"
    want, scale = _rolling_reference(WiolaModel.from_pretrained(checkpoint), lm.eot_token_id, ids, lm.max_length)
    (got,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    assert abs(got - want) <= len(ids) * 2 * TOL[torch.float32] * scale, f"{got} vs {want} (CPU {CPU})"


@torch.no_grad()
def _rolling_reference(model: WiolaModel, prefix: int, ids: list[int], L: int) -> tuple[float, float]:
    """Σ log p(ids) in disjoint windows of ``L`` predictions, each from the ``L`` tokens before
    its end, the first predicted from ``prefix``; and max|logit|."""
    full = [prefix, *ids]  # full[i] predicts ids[i]
    want, scale, a = 0.0, 0.0, 0
    while a < len(ids):
        e = min(len(ids), a + L)
        logits = model(torch.tensor([full[max(0, e - L) : e]])).logits[0, -(e - a) :].double()
        want += float(torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[a:e])[:, None]).sum())
        scale = max(scale, float(logits.abs().max()))
        a = e
    return want, scale


def test_a_bos_tokenizer_scores_text_after_bos_and_never_bos_itself(checkpoint):
    """A tokenizer that frames prompts with ``<s>`` (``wiola tokenizer train``'s): documents were
    trained as ``<s>`` + text, so the rolling windows and an empty context are scored after
    ``<s>`` (``prefix_token_id``), and ``tok_encode`` adds no ``<s>`` that would be scored as
    part of a text; ``add_special_tokens=True`` asks for it."""
    from wiola.fast import WiolaModel as FastModel

    model = FastModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    model.use_kernels(False)
    tok = _small_tokenizer()
    lm = WiolaLM("", model=model, tokenizer=tok, batch_size=2)
    bos = tok.bos_token_id
    assert [lm.prefix_token_id] == tok.document_prefix == [1] and lm.eot_token_id == tok.eos_token_id == 2
    text = " ".join(CONTEXTS + CHOICES) * 3
    ids = tok.encode_batch([text])[0]
    assert lm.tok_encode(text) == ids and lm.tok_encode(text, add_special_tokens=True) == [bos, *ids]
    assert lm.tok_encode("<s>x") == [bos, *tok.encode_batch(["x"])[0]], "special-token text is its token"
    ref = WiolaModel.from_pretrained(checkpoint)
    assert len(ids) > 2 * lm.max_length
    want, scale = _rolling_reference(ref, bos, ids, lm.max_length)
    (got,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    assert abs(got - want) <= len(ids) * 2 * TOL[torch.float32] * scale, f"rolling {got} vs {want} (CPU {CPU})"
    continuation = tok.encode_batch(["Once upon a time"])[0]
    want, scale = _rolling_reference(ref, bos, continuation, lm.max_length)
    ((got, _),) = lm.loglikelihood(_instances("loglikelihood", [("", "Once upon a time")]))
    assert abs(got - want) <= len(continuation) * 2 * TOL[torch.float32] * scale, f"empty context {got} vs {want}"


def test_generate_until_equals_model_generate(checkpoint):
    lm = WiolaLM(str(checkpoint), batch_size=3, device="cpu")
    lm.model.use_kernels(False)
    ref = WiolaModel.from_pretrained(checkpoint)
    enc = encoding_for_vocab(ref.config.vocab_size)
    kwargs = {"until": [".", "\n"], "max_gen_toks": 12, "do_sample": False}
    got = lm.generate_until(_instances("generate_until", [(c, kwargs) for c in CONTEXTS]))
    for context, text in zip(CONTEXTS, got):
        prompt = torch.tensor([enc.encode(context)])
        new = ref.generate(prompt, 12, temperature=0, eos_token_id=lm.eot_token_id)[0, prompt.shape[1] :].tolist()
        new = new[: new.index(lm.eot_token_id)] if lm.eot_token_id in new else new
        assert text == cut_at_stop(enc.decode(new), [".", "\n"]), context
        assert "." not in text and "\n" not in text


def test_cut_at_stop():
    assert cut_at_stop("a cat. a dog\n", [".", "\n"]) == "a cat"
    assert cut_at_stop("abc", []) == "abc" and cut_at_stop("abc", [""]) == "abc"


def _task_folder(root: Path) -> Path:
    data = root / "data.jsonl"
    rows = [
        {"context": c, "choices": CHOICES, "label": i % len(CHOICES), "text": c + "."} for i, c in enumerate(CONTEXTS)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"

    def task(name: str, spec: str) -> None:  # one lm-eval task YAML over the shared data file
        (tasks / f"{name}.yaml").write_text(f"task: wiola_local_{name}\n" + common + textwrap.dedent(spec))

    task(
        "mc",
        """\
        output_type: multiple_choice
        doc_to_text: "{{context}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{label}}"
        metric_list:
          - metric: acc
        """,
    )
    task(
        "gen",
        """\
        output_type: generate_until
        doc_to_text: "{{context}}"
        doc_to_target: "{{text}}"
        generation_kwargs:
          until: ["."]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
        """,
    )
    task(
        "ppl",
        """\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
        """,
    )
    return tasks


@pytest.mark.slow
def test_wiola_eval_tasks_end_to_end(checkpoint, tmp_path):
    """``wiola eval --tasks`` in a fresh process, offline: three local tasks (one per request type)."""
    tasks = _task_folder(tmp_path)
    out = tmp_path / "results.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("TRITON_INTERPRET", None)  # as a user's CPU runs it: PyTorch path and the C++ decoding step
    cmd = [sys.executable, "-m", "wiola", "eval", "--checkpoint", str(checkpoint), "--device", "cpu",
           "--tasks", "wiola_local_mc,wiola_local_gen,wiola_local_ppl", "--include-path", str(tasks),
           "--output", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert 0 <= results["wiola_local_mc"]["acc,none"] <= 1
    assert "exact_match,none" in results["wiola_local_gen"]
    assert results["wiola_local_ppl"]["word_perplexity,none"] > 1
    assert "wiola_local_mc" in done.stdout
    assert "wiola loglikelihood" not in done.stderr, "the scoring bar was drawn into a pipe"


def test_eval_tasks_bad_input(checkpoint, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "wiola", "eval", "--checkpoint", str(checkpoint), "--tasks", "no_such_task_x",
           "--include-path", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and "wiola eval: error: unknown lm-eval task(s) ['no_such_task_x']" in done.stderr


def test_lm_eval_stays_lazy():
    code = "import sys, wiola, wiola.cli, wiola.cli.evaluate; assert 'lm_eval' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_registered_and_model_args(checkpoint):
    from lm_eval.api.registry import get_model

    assert get_model("wiola") is WiolaLM
    lm = WiolaLM.create_from_arg_string(f"pretrained={checkpoint},max_length=32", {"batch_size": 4, "device": "cpu"})
    assert lm.batch_size == 4 and lm.max_length == 32
    with pytest.raises(ValueError, match=r"unknown model_args \['temperature'\]"):
        WiolaLM.create_from_arg_string(f"pretrained={checkpoint},temperature=1")
    with pytest.raises(ValueError, match="max_length must be in"):
        WiolaLM(str(checkpoint), max_length=4096)


# ------------------------------------------- limits: long continuations, max_gen_toks, tokenizers, bars
def _small_tokenizer():
    """A byte-level BPE of 300 ids (with an end-of-text token), far fewer than the models' 32,000."""
    from wiola.tokenizer import train_tokenizer

    return train_tokenizer([" ".join(CONTEXTS + CHOICES)] * 20, 300, show_progress=False)


def test_a_continuation_longer_than_max_length_is_refused_before_scoring(checkpoint, monkeypatch):
    """One forward cannot score it whole (lm-eval's HF model fails on it with a shape error): a
    ValueError naming both lengths, before any forward runs."""
    lm = WiolaLM(str(checkpoint), batch_size=2, device="cpu", max_length=8)
    lm.model.use_kernels(False)
    monkeypatch.setattr(lm.model, "forward", lambda *_, **__: pytest.fail("scored before the lengths were checked"))
    long = " and the dog ran" * 4
    n = len(lm.tok_encode(long))
    assert n > 8
    with pytest.raises(ValueError, match=f"a continuation of {n} tokens, longer than max_length=8"):
        lm.loglikelihood(_instances("loglikelihood", [("Once", " park"), ("Once", long)]), disable_tqdm=True)


def test_default_max_gen_toks_fits_a_short_model(checkpoint, capsys):
    """lm-eval's default of 256 new tokens on a model of max_seq_len 48: at most 24 new tokens after
    the last 24 of the context (as model.generate of that), said once on stderr."""
    lm = WiolaLM(str(checkpoint), batch_size=2, device="cpu")
    lm.model.use_kernels(False)
    assert lm.max_length == 48
    ref = WiolaModel.from_pretrained(checkpoint)
    enc = encoding_for_vocab(ref.config.vocab_size)
    context = " ".join(CONTEXTS * 4)
    got = lm.generate_until(_instances("generate_until", [(c, {"until": []}) for c in (context, "Lily said")]))
    for c, text in zip((context, "Lily said"), got):
        prompt = torch.tensor([enc.encode(c)[-24:]])
        new = ref.generate(prompt, 24, temperature=0, eos_token_id=lm.eot_token_id)[0, prompt.shape[1] :].tolist()
        new = new[: new.index(lm.eot_token_id)] if lm.eot_token_id in new else new
        assert text == enc.decode(new), c
    err = capsys.readouterr().err
    assert err.count("max_gen_toks 256 leaves no context within max_length=48: generating at most 24") == 1, err


def test_a_tokenizer_larger_than_the_model_is_refused(checkpoint, tmp_path):
    """Both ways in: a checkpoint saved with it, and model=/tokenizer= given."""
    model = WiolaModel(WiolaConfig.preset("tiny", vocab_size=280, d_model=32, n_layers=1, n_heads=2, max_seq_len=48))
    tok = _small_tokenizer()
    model.save_pretrained(tmp_path / "m", tok)
    message = "has 300 ids, more than the model's vocabulary of 280: this tokenizer does not belong to this model"
    with pytest.raises(ValueError, match=message):
        WiolaLM(str(tmp_path / "m"), device="cpu")
    with pytest.raises(ValueError, match=message):
        WiolaLM("", model=model, tokenizer=tok)


def test_generated_ids_past_the_tokenizer_are_left_out_with_a_warning(checkpoint, capsys):
    """A tokenizer of fewer ids than the model (padded rows) scores fine; the ids the model
    generates past it have no text, are left out of it, and a warning says so, once."""
    from wiola.fast import WiolaModel as FastModel

    model = FastModel.from_pretrained(checkpoint).eval().requires_grad_(False)
    model.use_kernels(False)
    tok = _small_tokenizer()
    lm = WiolaLM("", model=model, tokenizer=tok, batch_size=2)
    requests = _instances("generate_until", [(c, {"until": [], "max_gen_toks": 6}) for c in CONTEXTS[:2]])
    got = lm.generate_until(requests)
    ref = WiolaModel.from_pretrained(checkpoint)
    past = []
    for c, text in zip(CONTEXTS[:2], got):
        prompt = torch.tensor([tok.encode_batch([c])[0]])  # lm-eval's contexts come without <s>
        new = ref.generate(prompt, 6, temperature=0, eos_token_id=lm.eot_token_id)[0, prompt.shape[1] :].tolist()
        new = new[: new.index(lm.eot_token_id)] if lm.eot_token_id in new else new
        past += [t for t in new if t >= 300]
        assert text == tok.decode([t for t in new if t < 300]), c
    assert past, "the model generated no id past the tokenizer's: the test shows nothing"
    err = capsys.readouterr().err
    assert err.count("warning: the model generated token ids past the 300 of tokenizer") == 1, err


def test_eval_tasks_json_seq_len_and_no_bars(checkpoint, tmp_path, monkeypatch, capsys):
    """With --tasks: --json prints lm-eval's results as JSON (stdout holds nothing else), --seq-len
    is the harness's max_length, a whole --limit reaches lm-eval as an int, --output makes its
    folder, and no bar is drawn into a pipe (ours, lm-eval's request building, its "Tokenizing inputs")."""
    import lm_eval

    from wiola.cli import main

    tasks = _task_folder(tmp_path)
    seen = {}
    real = lm_eval.simple_evaluate

    def spy(**kwargs):
        seen.update(max_length=kwargs["model"].max_length, limit=kwargs["limit"])
        return real(**kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", spy)
    code = main(["eval", "--checkpoint", str(checkpoint), "--device", "cpu", "--tasks", "wiola_local_mc",
                 "--include-path", str(tasks), "--limit", "2", "--seq-len", "8", "--json",
                 "--output", str(tmp_path / "new" / "r.json")])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads(captured.out)["results"]
    assert json.loads((tmp_path / "new" / "r.json").read_text())["results"] == results
    assert 0 <= results["wiola_local_mc"]["acc,none"] <= 1
    assert seen == {"max_length": 8, "limit": 2} and type(seen["limit"]) is int, seen
    for bar in ("it/s]", "Tokenizing inputs", "wiola loglikelihood"):
        assert bar not in captured.err, f"{bar!r} drawn into a pipe:\n{captured.err}"
    for seq_len in ("1", "49"):
        assert main(["eval", "--checkpoint", str(checkpoint), "--device", "cpu", "--tasks", "wiola_local_mc",
                     "--include-path", str(tasks), "--seq-len", seq_len]) == 2  # fmt: skip
        err = capsys.readouterr().err
        want = (
            f"--seq-len {seq_len}: with --tasks it is the context one forward sees and must be in [2, max_seq_len=48]"
        )
        assert err == f"wiola eval: error: {want}\n", err


def test_lm_eval_bars_are_put_back(monkeypatch):
    import lm_eval.api.task as task_module

    from wiola.train.harness import lm_eval_bars

    bar = task_module.tqdm
    with lm_eval_bars(progress=False):
        assert task_module.tqdm is not bar and task_module.tqdm(range(3)).disable
    assert task_module.tqdm is bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with lm_eval_bars(progress=True):
        assert task_module.tqdm is bar, "a terminal with progress on keeps lm-eval's bars"


def test_eval_task_whose_dataset_is_on_the_hub_offline(checkpoint, tmp_path):
    """A task whose dataset is not cached, the Hub unreachable: one line saying what to do, no traceback."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hub.yaml").write_text(textwrap.dedent("""\
        task: wiola_hub_only
        dataset_path: wiola-tests/not-cached
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{context}}"
        doc_to_target: "{{choice}}"
        metric_list:
          - metric: acc
        """))  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "wiola", "eval", "--checkpoint", str(checkpoint), "--device", "cpu",
           "--tasks", "wiola_hub_only", "--include-path", str(tasks), "--limit", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith("wiola eval: error: a task's dataset must come from the Hugging Face Hub"), last
    assert "(HF_DATASETS_OFFLINE is set)" in last and "wiola-tests/not-cached" in last, last
    assert last.endswith("Run once with network (the dataset is then cached) or use --include-path with a local task")
