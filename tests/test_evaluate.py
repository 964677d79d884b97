"""Evaluation numbers against direct float64 computations; gate statistics; the PNG figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from token_splits import record_tokenised_splits

import wiola.ops as ops
from wiola import WiolaConfig, WiolaModel
from wiola.ops.rope import positions_from_mask, rope_tables
from wiola.tokenizer import TiktokenTokenizer, get_encoding
from wiola.train.corpus import generate_stories
from wiola.train.evaluate import evaluate, gate_statistics, token_byte_lengths
from wiola.train.plots import plot_gate_heatmap, plot_loss_curve
from wiola.train.token_cache import TokenSplit

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(d_model=32, n_layers=3, n_heads=4, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def enc(offline_tokenizer):
    from wiola.tokenizer import get_encoding

    return get_encoding("gpt2-32k")


def _model(seed: int = 0, **overrides) -> WiolaModel:
    torch.manual_seed(seed)
    model = WiolaModel(WiolaConfig.preset("tiny", **{**SMALL, **overrides}))
    with torch.no_grad():  # spread the gates: at init every gate is ~0.5 and layer mix-ups would go unseen
        for layer in model.layers:
            if model.config.gate:
                layer.attn.gate_w1.weight.normal_(0, 1.0)
                layer.attn.gate_w2.weight.normal_(0, 1.5)
                layer.attn.gate_w2.bias.normal_(0, 1.5)
    return model.eval()


def test_evaluate_matches_float64_per_window(enc) -> None:
    stories = generate_stories(6, seed=3)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    split = TokenSplit([tokens[:300], tokens[300:]], documents=len(stories), text_bytes=0)
    T, n_windows = 24, 13
    model = _model()
    got = evaluate(model, split, token_byte_lengths(TiktokenTokenizer(enc)), T, batch_size=5, max_windows=n_windows)

    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for k in range(n_windows):
            window = torch.from_numpy(tokens[k * T : k * T + T + 1].astype(np.int64))[None]
            logits = model(window).logits[0, :-1].double()
            nats += float(F.cross_entropy(logits, window[0, 1:], reduction="sum"))
            n_bytes += len(enc.decode_bytes([t for t in window[0, 1:].tolist() if t != enc.eot_token]))
    n_tokens = n_windows * T
    assert got.tokens == n_tokens and got.bytes == n_bytes and got.windows == n_windows, f"counts {got}"
    assert abs(got.loss - nats / n_tokens) <= 1e-6 * nats / n_tokens, f"loss {got.loss} vs {nats / n_tokens}"
    assert abs(got.perplexity - math.exp(nats / n_tokens)) <= 1e-5 * got.perplexity, "perplexity"
    ref_bpb = nats / math.log(2) / n_bytes
    assert abs(got.bits_per_byte - ref_bpb) <= 1e-6 * ref_bpb, f"bits per byte {got.bits_per_byte} vs {ref_bpb}"
    assert model.training is False
    model.train()
    evaluate(model, split, token_byte_lengths(TiktokenTokenizer(enc)), T, max_windows=2)
    assert model.training, "evaluate must restore training mode"


def test_evaluate_honours_the_precision(enc) -> None:
    """``precision="bf16"`` scores under bf16 autocast (on a CPU too), as training does; ``"auto"``
    on a CPU is fp32."""
    stories = generate_stories(6, seed=3)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    split = TokenSplit([tokens], documents=len(stories), text_bytes=0)
    T, n_windows = 24, 13
    model = _model()
    with torch.no_grad():
        model.embed.weight.mul_(25)  # large logits: bf16 rounding then moves the loss measurably
    got = {
        p: evaluate(
            model,
            split,
            token_byte_lengths(TiktokenTokenizer(enc)),
            T,
            batch_size=5,
            max_windows=n_windows,
            precision=p,
        ).loss
        for p in ("auto", "fp32", "bf16")
    }
    nats = 0.0
    with torch.no_grad():
        for k in range(n_windows):
            window = torch.from_numpy(tokens[k * T : k * T + T + 1].astype(np.int64))[None]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(window).logits[0, :-1]
            nats += float(F.cross_entropy(logits.double(), window[0, 1:], reduction="sum"))
    ref = nats / (n_windows * T)
    assert got["auto"] == got["fp32"], "precision 'auto' on a CPU is fp32"
    # bf16 autocast vs the same under a float64 loss: ~2e-7 relative; bf16 vs fp32: ~3e-5.
    assert abs(got["bf16"] - ref) <= 2e-6 * ref, f"bf16 loss {got['bf16']} vs bf16 reference {ref}"
    assert abs(got["bf16"] - got["fp32"]) >= 1e-5 * ref, "precision='bf16' scored in fp32"


def _window_nats(model: WiolaModel, tokens: np.ndarray, T: int) -> list[torch.Tensor]:
    """Each target's nats (float64), window by window as ``eval_batches`` cuts ``tokens``: full
    windows of ``T + 1`` tokens at stride ``T``, then the targets left as one shorter window."""
    out = []
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, T):
            window = torch.from_numpy(tokens[start : start + T + 1].astype(np.int64))[None]
            logits = model(window).logits[0, :-1].double()
            out.append(F.cross_entropy(logits, window[0, 1:], reduction="none"))
    return out


def test_evaluate_scores_the_last_partial_window(enc) -> None:
    """A stream whose targets are not a multiple of ``T``: all windows score every target once
    (the last 9 as a shorter window), the loss is the mean over targets, and the bytes are
    those targets' bytes; ``max_windows`` of the full ones leaves the tail out."""
    stories = generate_stories(6, seed=3)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    T = 24
    tokens = tokens[: 13 * T + 1 + 9]
    split = TokenSplit([tokens[:100], tokens[100:]], documents=len(stories), text_bytes=0)
    model = _model()
    lengths = token_byte_lengths(TiktokenTokenizer(enc))
    got = evaluate(model, split, lengths, T, batch_size=5)
    nats = torch.cat(_window_nats(model, tokens, T))
    n_bytes = len(enc.decode_bytes([t for t in tokens[1:].tolist() if t != enc.eot_token]))
    assert (got.tokens, got.bytes, got.windows) == (len(tokens) - 1, n_bytes, 14), f"counts {got}"
    want = float(nats.mean())
    assert abs(got.loss - want) <= 1e-6 * want, f"loss {got.loss} vs {want}: not the mean over the targets"
    ref_bpb = float(nats.sum()) / math.log(2) / n_bytes
    assert abs(got.bits_per_byte - ref_bpb) <= 1e-6 * ref_bpb, f"bits per byte {got.bits_per_byte} vs {ref_bpb}"
    full = evaluate(model, split, lengths, T, batch_size=5, max_windows=13)
    assert (full.tokens, full.windows) == (13 * T, 13), f"the first 13 windows are the full ones: {full}"


def test_evaluate_a_split_shorter_than_one_window(enc) -> None:
    """A validation split of fewer than ``T + 1`` tokens is one shorter window: every target scored."""
    tokens = np.array([enc.eot_token, *enc.encode_ordinary(generate_stories(1, seed=4)[0])], dtype=np.uint16)[:11]
    split = TokenSplit([tokens], documents=1, text_bytes=0)
    model = _model()
    got = evaluate(model, split, token_byte_lengths(TiktokenTokenizer(enc)), 24, batch_size=5)
    (nats,) = _window_nats(model, tokens, 24)
    assert (got.tokens, got.windows) == (10, 1), f"counts {got}"
    assert abs(got.loss - float(nats.mean())) <= 1e-6 * float(nats.mean()), f"loss {got.loss} vs {float(nats.mean())}"


def test_a_perplexity_past_a_float_is_inf_and_null_in_json(enc) -> None:
    """A loss past ``MAX_EXP`` nats (a diverged model) has perplexity inf, not a capped number:
    printed as ``inf``, ``None`` (JSON null) in ``to_dict``; a large finite one prints in 4 digits."""
    from wiola.train.evaluate import MAX_EXP, EvalResult

    tokens = np.array([enc.eot_token, *enc.encode_ordinary(generate_stories(1, seed=4)[0])], dtype=np.uint16)[:25]
    model = _model()
    with torch.no_grad():
        model.embed.weight.mul_(1e5)  # logits of order 1e3-1e4 (the tied head): losses of thousands of nats
    got = evaluate(
        model, TokenSplit([tokens], documents=1, text_bytes=0), token_byte_lengths(TiktokenTokenizer(enc)), 24
    )
    assert got.loss > MAX_EXP and got.perplexity == math.inf, f"loss {got.loss}: perplexity {got.perplexity}"
    assert json.loads(json.dumps(got.to_dict(), allow_nan=False))["perplexity"] is None
    assert "perplexity inf " in str(got)
    big = EvalResult(loss=20.0, perplexity=math.exp(20.0), bits_per_byte=1.0, tokens=1, bytes=1, windows=1)
    assert big.perplexity_text() == "4.852e+08" and big.to_dict()["perplexity"] == math.exp(20.0)


def test_position_losses_count_the_last_partial_window(enc) -> None:
    """``position_losses`` scores the windows ``evaluate`` scores: the shorter last window's
    targets count at their positions, every target once."""
    from wiola.train.evaluate import position_losses

    stories = generate_stories(4, seed=5)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    T = 16
    tokens = tokens[: 7 * T + 1 + 5]
    split = TokenSplit([tokens], documents=len(stories), text_bytes=0)
    model = _model()
    got = position_losses(model, split, T, 4, batch_size=3)
    per_window = _window_nats(model, tokens, T)
    sums, counts = torch.zeros(T, dtype=torch.float64), torch.zeros(T)
    for nats in per_window:
        sums[: len(nats)] += nats
        counts[: len(nats)] += 1
    assert [b["tokens"] for b in got] == [32, 29, 28, 28], got  # 7 windows, then 5 targets
    for b in got:
        want = float(sums[b["start"] : b["end"]].sum() / counts[b["start"] : b["end"]].sum())
        assert abs(b["loss"] - want) <= 1e-6 * want, f"bucket {b} vs {want}"
    # buckets that do not divide the window: the last one ends at the window's end
    uneven = position_losses(model, split, T, 6, batch_size=3)
    assert [(b["start"], b["end"]) for b in uneven] == [(0, 6), (6, 12), (12, 16)], uneven
    assert sum(b["tokens"] for b in uneven) == sum(b["tokens"] for b in got)


def test_bits_per_byte_of_a_metaspace_tokenizer_count_the_text() -> None:
    """With a Llama-2-style tokenizer (``▁`` a space, ``<0xNN>`` byte tokens, a decoder that drops
    the ``▁`` put before a document's first word) the scored bytes of a stream of framed documents
    are the documents' UTF-8 bytes: emoji, accents and leading spaces included."""
    from test_tokenizer import METASPACE_TEXTS, metaspace_tokenizer

    t = metaspace_tokenizer("llama2")
    docs = METASPACE_TEXTS * 3
    tokens = np.array(
        [i for d in docs for i in [*t.document_prefix, *t.encode_batch([d])[0], *t.document_suffix]], dtype=np.uint16
    )
    text_bytes = sum(len(d.encode()) for d in docs)
    split = TokenSplit([tokens], documents=len(docs), text_bytes=text_bytes)
    lengths = token_byte_lengths(t)
    assert lengths.shape == (2, t.vocab_size), "a document's first token counts apart"
    assert token_byte_lengths(TiktokenTokenizer(get_encoding("gpt2-32k"))).shape == (32000,)
    T = 16
    assert (len(tokens) - 1) % T, "the stream should end in a shorter window"
    model = _model(vocab_size=t.vocab_size)
    got = evaluate(model, split, lengths, T, batch_size=4)
    assert (got.tokens, got.bytes) == (len(tokens) - 1, text_bytes), f"{got} vs {text_bytes} bytes of text"
    want = float(torch.cat(_window_nats(model, tokens, T)).sum()) / math.log(2) / text_bytes
    assert abs(got.bits_per_byte - want) <= 1e-6 * want, f"bits per byte {got.bits_per_byte} vs {want}"


@torch.no_grad()
def _replay_gates(model: WiolaModel, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The forward pass rebuilt from the model's modules and the wiola.ops functions."""
    cfg = model.config
    B, T = ids.shape
    H, D = cfg.n_heads, cfg.head_dim
    cos, sin = rope_tables(positions_from_mask(mask, B, T), model.rope_freqs)
    bool_mask = None if mask is None else mask.bool()
    h = model.embed(ids)
    means = []
    for layer in model.layers:
        a = layer.attn
        x = ops.rms_norm(h, layer.attn_norm.weight, cfg.norm_eps)
        q, k, v = (F.linear(x, w).view(B, T, H, D) for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
        g, _, _ = ops.gate(q, a.gate_w1.weight, a.gate_w2.weight, a.gate_w2.bias, attention_mask=bool_mask)
        real = torch.ones(B, T) if mask is None else mask.float()
        means.append((g.double() * real[..., None]).sum((0, 1)) / real.sum())
        o = ops.attention(q, k, v, g, cos, sin, bool_mask)
        h = h + F.linear(o.reshape(B, T, H * D), a.o_proj.weight)
        f = layer.ffn
        h = h + ops.butterfly(ops.rms_norm(h, layer.ffn_norm.weight, cfg.norm_eps), f.up_proj.weight,
                              f.bypass_proj.weight, f.down_proj.weight)  # fmt: skip
    return torch.stack(means)


@pytest.mark.parametrize("padded", [False, True], ids=["B3-T17-H4", "B3-T17-H4-right-padded"])
def test_gate_statistics_match_replay(padded) -> None:
    model = _model(seed=1)
    torch.manual_seed(5)
    ids = torch.randint(0, 32000, (3, 17))
    mask = None
    if padded:
        mask = torch.ones(3, 17, dtype=torch.int64)
        mask[1, 11:] = 0
        mask[2, 5:] = 0
    got = gate_statistics(model, ids, mask)
    assert got.shape == (3, 4) and got.dtype == torch.float64
    ref = _replay_gates(model, ids, mask)
    err = float((got - ref).abs().max())
    assert err <= 1e-6, f"gate means: max abs error {err:.2e}"
    assert float(got.std()) > 0.05, "gates barely vary: the test would not catch a layer or head mix-up"
    assert "ops" not in vars(model), "gate_statistics left its spy on the model"


def test_gate_statistics_layer0_float64_from_spec() -> None:
    model = _model(seed=2)
    torch.manual_seed(6)
    ids = torch.randint(0, 32000, (2, 9))
    cfg = model.config
    H, D = cfg.n_heads, cfg.head_dim
    e = model.embed.weight.double()[ids]  # (B, T, d)
    x = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * model.layers[0].attn_norm.weight.double()
    q = (x @ model.layers[0].attn.q_proj.weight.double().T).view(2, 9, H, D)
    m = q.mean(dim=2)  # (B, T, D) mean over heads
    c = m.cumsum(1) / torch.arange(1, 10, dtype=torch.float64)[None, :, None]
    a = model.layers[0].attn
    g = torch.sigmoid(F.silu(c @ a.gate_w1.weight.double().T) @ a.gate_w2.weight.double().T + a.gate_w2.bias.double())
    ref = g.mean(dim=(0, 1)).detach()
    got = gate_statistics(model, ids)[0]
    assert float((got - ref).abs().max()) <= 1e-5, f"layer 0 gate means {got.tolist()} vs {ref.tolist()}"


def test_gate_statistics_without_gate_are_ones() -> None:
    model = _model(gate=False)
    got = gate_statistics(model, torch.randint(0, 100, (1, 5)))
    assert torch.equal(got, torch.ones(3, 4, dtype=torch.float64)), "a gate-less model has every gate at 1"


# ------------------------------------------------------------------------------------------ plots
def _png(path) -> np.ndarray:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG"
    return mpimg.imread(path)


def test_gate_heatmap_png(tmp_path) -> None:
    low = _png(plot_gate_heatmap(np.full((4, 4), 0.1), tmp_path / "low.png"))
    high = _png(plot_gate_heatmap(np.full((4, 4), 0.9), tmp_path / "high.png"))
    assert low.shape == high.shape and low.shape[0] > 100, f"heat map size {low.shape}"
    h, w = low.shape[:2]
    # The cells' colour follows the value: the centre of the map differs between 0.1 and 0.9.
    centre = (slice(h // 3, h // 2), slice(w // 4, w // 2))
    assert np.abs(low[centre][..., :3].mean() - high[centre][..., :3].mean()) > 0.1, "heat map colours ignore values"
    with pytest.raises(ValueError, match="2-D"):
        plot_gate_heatmap(np.zeros(4), tmp_path / "bad.png")


def test_loss_curve_png(tmp_path) -> None:
    records = [{"kind": "train", "step": s, "loss": 8.0 / s} for s in range(1, 40)]
    records += [{"kind": "eval", "step": s, "loss": 7.0 / s} for s in (10, 20, 30)]
    records += [{"kind": "reference", "step": 0, "name": "unigram entropy", "value": 5.0}]
    img = _png(plot_loss_curve(records, tmp_path / "loss.png"))
    assert img.shape[0] > 200 and img.shape[1] > 300, f"loss curve size {img.shape}"
    assert not list(tmp_path.glob(".*tmp*")), "temporary PNG left behind"


# ------------------------------------------------- wiola eval: the data it scores, the split alone
EVAL_RUN_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_seq_len": 32}


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory, offline_tokenizer):
    """A one-step run trained from its folder with relative paths: ``run/`` beside ``train.txt``,
    ``val.txt``, ``all.txt`` (12 documents, every 4th held out) and ``empty.txt``."""
    from wiola.train import TrainConfig, train
    from wiola.train.sources import EOT_TEXT

    root = tmp_path_factory.mktemp("relative_run")
    for name, n, seed in (("train.txt", 20, 1), ("val.txt", 5, 2), ("all.txt", 12, 3)):
        (root / name).write_text(f"\n{EOT_TEXT}\n".join(generate_stories(n, seed=seed)))
    (root / "empty.txt").write_text("")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        cfg = TrainConfig(
            preset="tiny", model=EVAL_RUN_MODEL, data="train.txt", val_data="val.txt", val_fraction=0.25,
            cache_dir="cache", seq_len=16, batch_size=2, steps=1, eval_windows=2, out_dir="run", progress=False,
            plots=False, device="cpu",
        )  # fmt: skip
        train(cfg, log=lambda m: None)
    return root


def _eval_json(capsys, *argv: str) -> dict:
    from wiola.cli import main

    code = main(["eval", *argv, "--json", "--no-progress", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def _full_path_numbers(run, source, cache, windows: int) -> dict:
    """The numbers of the run's checkpoint on ``source``'s validation split as ``wiola eval`` computed
    them before it tokenised that split alone: ``prepare_data`` of both splits, then ``evaluate``."""
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.train.run_folder import find_checkpoint
    from wiola.train.token_cache import prepare_data

    checkpoint = find_checkpoint(run)
    tokenizer = load_checkpoint_tokenizer(checkpoint)
    data = prepare_data(source, tokenizer, cache, progress=False, log=lambda m: None)
    model = WiolaModel.from_pretrained(checkpoint, device="cpu").eval()
    return evaluate(
        model, data.val, token_byte_lengths(tokenizer), 16, batch_size=8, max_windows=windows, precision="auto"
    ).to_dict()


def test_eval_data_of_a_run_scored_from_another_folder(relative_run, tmp_path, monkeypatch, capsys) -> None:
    from wiola.train.run_folder import find_checkpoint, read_trainer_state
    from wiola.train.sources import resolve_source

    saved = read_trainer_state(find_checkpoint(relative_run / "run"))["train_config"]
    assert (saved["data"], saved["val_data"]) == (str(relative_run / "train.txt"), str(relative_run / "val.txt"))
    monkeypatch.chdir(tmp_path)
    seen = record_tokenised_splits(monkeypatch)
    got = _eval_json(capsys, "--checkpoint", str(relative_run / "run"), "--eval-windows", "3")
    assert seen == [], f"tokenised {seen}: the run's token cache was not reused"
    assert [p.name for p in (relative_run / "cache" / "tokens").iterdir() if ".val" in p.name] == []
    source = resolve_source(relative_run / "train.txt", relative_run / "val.txt")
    expected = _full_path_numbers(relative_run / "run", source, tmp_path / "full", 3)
    assert {k: got[k] for k in expected} == expected, "wiola eval's numbers differ from the full pipeline's"


@pytest.mark.parametrize(
    "flags, data, val_data",
    [
        (["--val-data", "val.txt"], "train.txt", "val.txt"),
        (["--data", "empty.txt", "--val-data", "val.txt"], "train.txt", "val.txt"),
        (["--data", "all.txt"], "all.txt", None),
    ],
    ids=["val-data-alone", "empty-train-file", "held-out-share"],
)
def test_eval_data_tokenises_the_validation_split_alone(
    relative_run, tmp_path, monkeypatch, capsys, flags, data, val_data
) -> None:
    from wiola.train.sources import resolve_source

    monkeypatch.chdir(relative_run)
    seen = record_tokenised_splits(monkeypatch)
    got = _eval_json(capsys, "--checkpoint", "run", "--cache-dir", str(tmp_path / "c"), *flags)
    assert seen == ["val"], f"tokenised {seen}, not the validation split alone"
    source = resolve_source(relative_run / data, val_data and relative_run / val_data, val_fraction=0.25)
    expected = _full_path_numbers(relative_run / "run", source, tmp_path / "full", None)
    assert got["windows"] > 3 and {k: got[k] for k in expected} == expected, "numbers differ from the full pipeline's"


def test_eval_data_paths_of_the_training_config_that_are_gone(relative_run, tmp_path, monkeypatch, capsys) -> None:
    """An older run saved its paths as typed: read from elsewhere they name nothing, and the error
    says where they came from and what to pass; its validation files alone are enough."""
    import shutil

    from wiola.cli import main
    from wiola.train.run_folder import find_checkpoint
    from wiola.train.sources import resolve_source

    checkpoint = tmp_path / "old"
    shutil.copytree(find_checkpoint(relative_run / "run"), checkpoint)
    state = json.loads((checkpoint / "trainer.json").read_text())
    state["train_config"].update(data="train.txt", val_data=None)
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    monkeypatch.chdir(tmp_path)
    seen = record_tokenised_splits(monkeypatch)
    assert main(["eval", "--checkpoint", str(checkpoint), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"data path 'train.txt' (from the training config of checkpoint {checkpoint}" in err, err
    assert "pass --data PATH" in err and seen == [], err
    state["train_config"].update(val_data=str(relative_run / "val.txt"))
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    got = _eval_json(capsys, "--checkpoint", str(checkpoint), "--cache-dir", str(tmp_path / "c"))
    assert seen == ["val"], f"tokenised {seen}, not the validation split alone"
    source = resolve_source(relative_run / "train.txt", relative_run / "val.txt")
    expected = _full_path_numbers(relative_run / "run", source, tmp_path / "full", None)
    assert {k: got[k] for k in expected} == expected, "numbers differ from the full pipeline's"


def test_eval_says_the_shorter_last_window(relative_run, tmp_path, capsys) -> None:
    """The summary line names the windows scored: the full ones and, where targets are left
    after them, the shorter last one (the tokens scored add up to the split's targets)."""
    from wiola.cli import main

    argv = ["eval", "--checkpoint", str(relative_run / "run"), "--val-data", str(relative_run / "val.txt")]
    argv += ["--seq-len", "16", "--cache-dir", str(tmp_path / "c"), "--no-progress", "--device", "cpu"]
    assert main([*argv, "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    full, short = divmod(tokens, 16)
    assert short, f"{tokens} targets: a multiple of 16, the test shows no shorter window"
    assert main(argv) == 0
    assert f"{full} windows of 16 tokens and one of {short} (" in capsys.readouterr().out


def test_eval_data_too_long_seq_len_is_refused_before_tokenising(relative_run, tmp_path, monkeypatch, capsys) -> None:
    from wiola.cli import main

    seen = record_tokenised_splits(monkeypatch)
    cache = tmp_path / "c"
    argv = ["eval", "--checkpoint", str(relative_run / "run"), "--val-data", str(relative_run / "val.txt")]
    assert main([*argv, "--seq-len", "32", "--cache-dir", str(cache), "--no-progress", "--device", "cpu"]) == 2
    assert "windows of 33 tokens exceed max_seq_len=32" in capsys.readouterr().err
    assert seen == [] and not cache.exists(), "the data was tokenised before --seq-len was checked"


# ----------------------------------- wiola eval/gates: flags checked first, quantized and Hub checkpoints
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A model of 300 ids saved with its own 300-id BPE, beside training and validation text files
    (the flags that score them: ``data``)."""
    from types import SimpleNamespace

    from wiola.tokenizer import train_tokenizer
    from wiola.train.sources import EOT_TEXT

    root = tmp_path_factory.mktemp("small_model")
    stories = generate_stories(40, seed=1)
    tok = train_tokenizer(stories, 300, show_progress=False)
    (root / "train.txt").write_text(f"\n{EOT_TEXT}\n".join(stories[:30]))
    (root / "val.txt").write_text(f"\n{EOT_TEXT}\n".join(stories[30:]))
    torch.manual_seed(0)
    config = WiolaConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
    WiolaModel(config).save_pretrained(root / "model", tok)
    data = ["--data", str(root / "train.txt"), "--val-data", str(root / "val.txt")]
    return SimpleNamespace(root=root, model=root / "model", tok=tok, config=config, data=data)


def _one_line_error(capsys, argv: list[str], message: str, after_work: bool = False) -> None:
    """``wiola ARGV`` exits 2 with one ``wiola <command>: error:`` line holding ``message`` and nothing
    on stdout; the only line on stderr, unless ``after_work`` (then the last, after the work's log)."""
    from wiola.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    err = captured.err if not after_work else captured.err.splitlines(keepends=True)[-1]
    assert err.startswith(f"wiola {argv[0]}: error: ") and message in err and err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err, captured.err


def test_eval_and_gates_flags_are_checked_before_anything_loads(small_model, tmp_path, monkeypatch, capsys) -> None:
    """Each mode's flags are refused by name in the other mode (none is silently ignored), --limit
    and --num-fewshot are checked, and an --output/--out where no file can be written is refused,
    all before a model or lm-eval loads."""
    import os

    import wiola.cli.evaluate as evaluate

    monkeypatch.setattr(evaluate, "_load_for_eval", lambda *_: pytest.fail("loaded before the flags were checked"))
    monkeypatch.setattr(evaluate, "run_tasks", lambda *_: pytest.fail("lm-eval ran before the flags were checked"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "file").write_text("x")
    tasks = ["--tasks", "some_task"]
    cases = [
        ([*tasks, "--limit", "0"], "--limit must be > 0 (documents per task, or a fraction of them when < 1), got 0"),
        ([*tasks, "--limit", "-1"], "--limit must be > 0 (documents per task, or a fraction of them when < 1), got -1"),
        ([*tasks, "--limit", "nan"], "--limit must be > 0"),
        ([*tasks, "--limit", "2.5"], "--limit 2.5: a number of documents is whole (a fraction is < 1)"),
        ([*tasks, "--num-fewshot", "-1"], "--num-fewshot must be >= 0, got -1"),
        ([*tasks, "--data", "x.txt"], "--data does not go with --tasks: the tasks bring their own documents"),
        ([*tasks, "--val-data", "x.txt"], "--val-data does not go with --tasks"),
        ([*tasks, "--cache-dir", "c"], "--cache-dir does not go with --tasks"),
        ([*tasks, "--eval-windows", "3"], "--eval-windows does not go with --tasks"),
        ([*tasks, "--precision", "bf16"], "--precision does not go with --tasks: tasks score in fp32"),
        ([*tasks, "--output", str(folder)], f"--output {str(folder)!r} is a folder; give the file's path"),
        ([*tasks, "--output", str(tmp_path / "file" / "r.json")], "the folder of --output"),
        (["--limit", "3"], "--limit goes with --tasks"),
        (["--num-fewshot", "1"], "--num-fewshot goes with --tasks"),
        (["--include-path", str(folder)], "--include-path goes with --tasks"),
        (["--output", str(tmp_path / "r.json")], "--output goes with --tasks"),
        (["--quantize", "int8"], "--quantize goes with --tasks"),
    ]
    for flags, message in cases:
        _one_line_error(capsys, ["eval", "--checkpoint", str(small_model.model), *flags], message)
    _one_line_error(capsys, ["gates", "--checkpoint", str(small_model.model), "--out", str(folder)], "is a folder")
    if os.path.isdir("/proc/self"):  # passes the permission checks as root, yet takes no new file
        for argv in (["eval", *tasks, "--output", "/proc/r.json"], ["gates", "--out", "/proc/g.png"]):
            _one_line_error(capsys, [*argv, "--checkpoint", str(small_model.model)], "'/proc'")
    assert list(folder.iterdir()) == [] and not (tmp_path / "r.json").exists()


def test_gates_png_that_fails_to_write_is_one_line(small_model, tmp_path, monkeypatch, capsys) -> None:
    """A write that fails after the work (a disk that turned read-only) is the one-line error too."""
    import errno

    import wiola.train.plots

    def fails(*_, **__):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(wiola.train.plots, "plot_gate_heatmap", fails)
    png = tmp_path / "g.png"
    argv = ["gates", "--checkpoint", str(small_model.model), *small_model.data, "--cache-dir", str(tmp_path / "c")]
    argv += ["--seq-len", "16", "--windows", "2", "--out", str(png), "--device", "cpu", "--no-progress"]
    _one_line_error(capsys, argv, f"--out {str(png)!r} could not be written: Read-only file system", after_work=True)


def test_gates_of_a_hub_id_writes_to_the_working_folder(small_model, tmp_path, monkeypatch, capsys) -> None:
    """A Hub id's folder is a snapshot in the Hugging Face cache: the default PNG goes to the working
    folder, not into the cache, and the plot is titled with the repo id, not the commit hash."""
    import shutil

    import wiola.checkpoint
    import wiola.train.plots
    from wiola.cli import main

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("ab" * 20)
    shutil.copytree(small_model.model, snapshot)
    real_resolve, real_plot = wiola.checkpoint.resolve_checkpoint, wiola.train.plots.plot_gate_heatmap
    monkeypatch.setattr(
        wiola.checkpoint,
        "resolve_checkpoint",
        lambda n, r=None: snapshot if str(n) == "org/tiny" else real_resolve(n, r),
    )
    titles = []

    def plot(gates, path, title):
        titles.append(title)
        return real_plot(gates, path, title=title)

    monkeypatch.setattr(wiola.train.plots, "plot_gate_heatmap", plot)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = ["gates", "--checkpoint", "org/tiny", *small_model.data, "--cache-dir", str(tmp_path / "c")]
    code = main([*argv, "--seq-len", "16", "--windows", "2", "--device", "cpu", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (work / "gates.png").read_bytes()[:4] == b"\x89PNG" and "gate heat map: gates.png" in captured.out
    assert not (snapshot / "gates.png").exists(), "wrote into the Hub cache's snapshot"
    assert titles == ["mean gate per layer × head (org/tiny)"], titles


def test_eval_and_gates_of_a_quantized_checkpoint_run_on_wiola_fast(small_model, tmp_path, plain_cpu, capsys) -> None:
    """A checkpoint saved quantized loads only as wiola.fast: eval and gates pick it without
    --fast, and int8 scores within 1% of the fp32 weights it was made from."""
    from wiola.cli import main
    from wiola.fast import WiolaModel as FastModel
    from wiola.fast.quantize import quantize

    model = FastModel.from_pretrained(small_model.model).eval().requires_grad_(False)
    quantize(model, "int8").save_pretrained(tmp_path / "q8", small_model.tok)
    argv = [
        *small_model.data,
        "--cache-dir",
        str(tmp_path / "c"),
        "--seq-len",
        "16",
        "--device",
        "cpu",
        "--no-progress",
    ]
    losses = {}
    for name, folder in (("fp32", small_model.model), ("int8", tmp_path / "q8")):
        code = main(["eval", "--checkpoint", str(folder), *argv, "--eval-windows", "4", "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        losses[name] = json.loads(captured.out.strip().splitlines()[-1])["loss"]
    assert abs(losses["int8"] - losses["fp32"]) <= 0.01 * losses["fp32"], losses
    code = main(
        ["gates", "--checkpoint", str(tmp_path / "q8"), *argv, "--windows", "2", "--out", str(tmp_path / "g.png")]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (tmp_path / "g.png").is_file() and "    1  " in captured.out, captured.out


def test_eval_and_gates_refuse_a_tokenizer_larger_than_the_model(small_model, tmp_path, capsys) -> None:
    """A tokenizer with more ids than the model's embedding rows is refused before any text is
    tokenised with it (the token cache stays empty), in check_ids' words."""
    import dataclasses

    torch.manual_seed(0)
    config = dataclasses.replace(small_model.config, vocab_size=280)
    WiolaModel(config).save_pretrained(tmp_path / "m280", small_model.tok)
    cache = tmp_path / "c"
    message = "has 300 ids, more than the model's vocabulary of 280: this tokenizer does not belong to this model"
    for command in ("eval", "gates"):
        argv = [command, "--checkpoint", str(tmp_path / "m280"), *small_model.data, "--cache-dir", str(cache)]
        _one_line_error(capsys, [*argv, "--seq-len", "16", "--device", "cpu", "--no-progress"], message)
    assert not cache.exists() or not any(cache.rglob("*")), "the data was tokenised before the check"


@pytest.mark.parametrize(
    "names, message",
    [
        ("qa_mc,,other", "--tasks 'qa_mc,,other' has an empty name between its commas"),
        ("qa_mc,", "--tasks 'qa_mc,' has an empty name between its commas"),
        ("qa_mc,other,qa_mc", "--tasks names qa_mc more than once"),
        (" , ", "--tasks names no task"),
    ],
)
def test_eval_tasks_names_are_checked_before_lm_eval(small_model, monkeypatch, capsys, names, message) -> None:
    """An empty name between commas or a task named twice is refused (exit 2), not dropped or
    merged without a word, before lm-eval loads a task."""
    pytest.importorskip("lm_eval")
    import wiola.train.harness

    monkeypatch.setattr(wiola.train.harness, "task_manager", lambda *_: pytest.fail("tasks loaded before the check"))
    _one_line_error(capsys, ["eval", "--checkpoint", str(small_model.model), "--tasks", names], message)


@pytest.mark.parametrize("bad", [{"max_windows": 0}, {"max_windows": -1}, {"batch_size": 0}, {"seq_len": 0}])
def test_nothing_to_score_is_refused(bad) -> None:
    """``max_windows`` 0 (or a batch or length of 0) scores nothing: refused, never a loss of 0."""
    config = WiolaConfig.preset("tiny")
    split = TokenSplit([np.arange(200, dtype=np.uint16) % config.vocab_size], 1, 200)
    args = {"seq_len": 16, **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        evaluate(WiolaModel(config), split, torch.ones(config.vocab_size, dtype=torch.int64), **args)
