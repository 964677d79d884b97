"""The published-format folder end to end, built here with the real libraries: a byte-level BPE
trained with ``tokenizers``, a ``wiola13m`` model with that vocabulary saved by ``transformers``.

``wiola generate`` from the folder and from a Hub id in an offline cache prints what ``wiola13m``'s
greedy ``generate`` decoded by ``PreTrainedTokenizerFast`` gives; ``wiola eval`` scores it as
``wiola13m`` does; a tokenizer trained with ``wiola tokenizer train`` trains a model; ``wiola
export`` goes back to ``transformers`` and round-trips; nothing we load runs a pickle."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wiola import WiolaConfig, WiolaModel
from wiola.checkpoint import load_checkpoint_tokenizer
from wiola.cli import main
from wiola.tokenizer import HFTokenizer, load_tokenizer, train_tokenizer
from wiola.train.corpus import sample_corpus

# A CPU user's path: the C++ step, not the Triton kernels under the interpreter (which prove the
# kernels in their own tests and would only slow these, here and in the subprocesses).
pytestmark = pytest.mark.usefixtures("plain_cpu")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, Lily"
NEW_TOKENS = 12
REPO = "wiola-tests/published-tiny"
REVISION = hashlib.sha1(b"published-tiny").hexdigest()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE of 2,000 ids with Wiola13M's special tokens, trained on the sample stories
    and this package's source (the stories alone hold too few distinct pairs)."""
    out = tmp_path_factory.mktemp("tokenizer")
    train, _ = sample_corpus(600, 10, 0)
    texts = train + [p.read_text() for p in sorted((ROOT / "wiola").rglob("*.py"))]
    tok = train_tokenizer(texts, 2000, show_progress=False)
    assert tok.vocab_size == 2000
    tok.save(out)
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer_dir) -> Path:
    """A folder as ``oscowlai/Wiola13M`` is laid out: ``wiola13m``'s config and weights, the
    tokenizer files as ``transformers`` saves them."""
    pytest.importorskip("wiola13m")
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaConfig as HFConfig
    from wiola13m import WiolaForCausalLM

    out = tmp_path_factory.mktemp("published")
    hf_tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = HFConfig(
        vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    WiolaForCausalLM(config).eval().save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out


def _greedy_reference(folder: Path) -> str:
    """What a ``transformers`` user gets: ``wiola13m`` greedy generate, decoded by ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaForCausalLM

    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = WiolaForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tok(PROMPT).input_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=3)
        logits = model(out).logits[0, ids.shape[1] - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "a near tie: the greedy path would not be a fair test"
    assert ids[0, 0] == 1, "the tokenizer adds <s> to a prompt"
    return PROMPT + tok.decode(out[0, ids.shape[1] :].tolist()) + "\n"


def test_generate_from_the_published_folder(published, capsys):
    want = _greedy_reference(published)
    for flag in ([], ["--reference"]):
        code = main(["generate", "--checkpoint", str(published), "--prompt", PROMPT, "--max-new-tokens",
                     str(NEW_TOKENS), "--temperature", "0", "--device", "cpu", *flag])  # fmt: skip
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out == want, f"wiola generate {flag}: {captured.out!r} != {want!r}"


def _hub_cache(root: Path, folder: Path) -> Path:
    """``folder`` in the Hub cache layout ``huggingface_hub`` reads: blobs by hash, the snapshot's
    files as links to them, ``refs/main`` naming the commit."""
    repo = root / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    (root / "version.txt").write_text("1")  # transformers 4.x: a current cache (else, offline, it refuses to start)
    return root


HUB_SCRIPT = r"""
import sys, torch
from wiola import WiolaModel
from wiola.cli import main
repo, revision, folder, prompt, n = sys.argv[1:6]
code = main(["generate", "--checkpoint", repo, "--prompt", prompt, "--max-new-tokens", n, "--temperature", "0",
             "--device", "cpu"])
sys.stdout.flush()
ids = torch.arange(1, 40)[None]
a = WiolaModel.from_pretrained(repo, revision=revision).eval()(ids).logits
b = WiolaModel.from_pretrained(folder).eval()(ids).logits
print(f"\nrc={code} same_logits={torch.equal(a, b)}")
missing = main(["generate", "--checkpoint", "wiola-tests/not-downloaded", "--device", "cpu"])
print(f"missing_rc={missing}")
"""


def _generate_from_the_hub(folder: Path, tmp_path: Path) -> str:
    """Run ``HUB_SCRIPT`` offline against a Hub cache holding ``folder``; its generated text."""
    cache = _hub_cache(tmp_path / "hub", folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = str(ROOT)
    args = [REPO, REVISION, str(folder), PROMPT, str(NEW_TOKENS)]
    proc = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    generated, _, tail = proc.stdout.rpartition("\nrc=")
    assert tail.startswith("0 same_logits=True"), proc.stdout
    assert "missing_rc=2" in proc.stdout, proc.stdout
    err = proc.stderr
    assert "'wiola-tests/not-downloaded'" in err and "HF_HUB_OFFLINE is set" in err, err
    assert "To fix: download it once with network" in err, err
    assert "Traceback" not in err, err
    return generated


def test_generate_from_a_hub_id_in_an_offline_cache(published, tmp_path):
    want = _greedy_reference(published)
    assert _generate_from_the_hub(published, tmp_path) == want


def test_our_checkpoint_from_a_hub_id_in_an_offline_cache(tokenizer_dir, tmp_path, capsys):
    """Without wiola13m: our folder with its tokenizer, from the cache, prints what the folder prints."""
    torch.manual_seed(0)
    config = WiolaConfig(vocab_size=2000, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128, init_std=0.2)
    WiolaModel(config).save_pretrained(tmp_path / "ours", load_tokenizer(tokenizer_dir))
    code = main(["generate", "--checkpoint", str(tmp_path / "ours"), "--prompt", PROMPT, "--max-new-tokens",
                 str(NEW_TOKENS), "--temperature", "0", "--device", "cpu"])  # fmt: skip
    want = capsys.readouterr().out
    assert code == 0 and want.startswith(PROMPT) and len(want) > len(PROMPT) + 1
    assert _generate_from_the_hub(tmp_path / "ours", tmp_path) == want


def test_the_checkpoint_gives_its_tokenizer_and_special_ids(published, tokenizer_dir):
    tok = load_checkpoint_tokenizer(published)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (1, 2, 3, 2000)
    assert tok.fingerprint == load_tokenizer(tokenizer_dir).fingerprint
    # config.json's ids win over the tokenizer files', and generation_config.json's over both, as in
    # transformers' generation
    config = json.loads((published / "config.json").read_text())
    other = published.parent / "other-eos"
    shutil.copytree(published, other)
    (other / "config.json").write_text(json.dumps({**config, "eos_token_id": 3, "pad_token_id": 0}))
    tok = load_checkpoint_tokenizer(other)
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 3), "generation_config.json's ids lost to config.json's"
    (other / "generation_config.json").unlink()
    tok = load_checkpoint_tokenizer(other)
    assert (tok.eos_token_id, tok.pad_token_id) == (3, 0)
    (other / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer.json"):
        load_checkpoint_tokenizer(other)


def test_left_padded_batches_take_the_checkpoints_pad_id(published):
    model = WiolaModel.from_pretrained(published).eval()
    assert model.config.pad_token_id == 3 and model.config.eos_token_id == 2
    prompts = torch.tensor([[3, 3, 1, 50, 60], [1, 70, 80, 90, 100]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    first = model.generate(prompts, 1, attention_mask=mask)[:, -1]
    eos = int(first[0])  # row 0 "ends" at once: its later slots must hold the checkpoint's pad id
    assert eos != 3
    out = model.generate(prompts, 4, attention_mask=mask, eos_token_id=eos)
    assert out[0, 5:].tolist() == [eos, 3, 3, 3], out[0, 5:].tolist()
    alone = model.generate(prompts[1:], 4, eos_token_id=eos)
    assert torch.equal(out[1], alone[0]), "left padding changed the other row"


def test_eval_of_the_published_folder_matches_wiola13m(published, tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaForCausalLM

    T, windows = 32, 3
    code = main(["eval", "--checkpoint", str(published), "--data", "sample:100", "--cache-dir", str(tmp_path),
                 "--seq-len", str(T), "--eval-windows", str(windows), "--device", "cpu", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    got = json.loads(captured.out.strip().splitlines()[-1])
    # independently: each validation story as <s> story </s>, windows of T + 1 at stride T, wiola13m's logits
    tok = PreTrainedTokenizerFast.from_pretrained(published)
    _, val = sample_corpus(100, 100, 0)
    stream = [i for story in val for i in [1, *tok(story, add_special_tokens=False).input_ids, 2]]
    x = torch.tensor([stream[k * T : k * T + T + 1] for k in range(windows)])
    model = WiolaForCausalLM.from_pretrained(published).eval()
    with torch.no_grad():
        logits = model(x[:, :-1]).logits.double()
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()
    assert abs(got["loss"] - want) <= 1e-5 * want, (got["loss"], want)


def test_a_trained_tokenizer_trains_a_model(tmp_path, capsys):
    from wiola.train import TrainConfig, train

    out = tmp_path / "tok"
    code = main(
        ["tokenizer", "train", "--data", "sample:300", "--vocab-size", "700", "--out", str(out), "--no-progress"]
    )
    assert code == 0, capsys.readouterr().err
    tok = load_tokenizer(out)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (700, 1, 2, 3, 0)
    cfg = TrainConfig(
        preset="tiny", model=dict(vocab_size=768, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
        tokenizer=str(out), data="sample:300", cache_dir=str(tmp_path / "cache"), seq_len=32, batch_size=2, steps=2,
        warmup=1, eval_every=2, eval_windows=2, log_every=1, out_dir=str(tmp_path / "run"), progress=False,
        plots=False, device="cpu",
    )  # fmt: skip
    result = train(cfg, log=lambda m: None)
    # the cached stream is <s> story </s> per story, in the trained tokenizer's ids
    (cache,) = (tmp_path / "cache" / "tokens").iterdir()
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["tokenizer_fingerprint"] == tok.fingerprint and manifest["dtype"] == "uint16"
    train_docs, _ = sample_corpus(300, 100, 0)
    first = [1, *tok._tok.encode(train_docs[0], add_special_tokens=False).ids, 2]
    import numpy as np

    shard = np.fromfile(cache / "train_0000.bin", dtype=np.uint16)
    assert shard[: len(first)].tolist() == first
    # the checkpoint carries the tokenizer; a changed tokenizer never reuses the cached tokens
    assert (result.checkpoint / "tokenizer.json").is_file()
    assert load_checkpoint_tokenizer(result.checkpoint).fingerprint == tok.fingerprint
    other = tmp_path / "tok2"
    assert main(["tokenizer", "train", "--data", "sample:300", "--vocab-size", "600", "--out", str(other),
                 "--no-progress"]) == 0  # fmt: skip
    train(
        TrainConfig(**{**cfg.to_dict(), "tokenizer": str(other), "out_dir": str(tmp_path / "run2")}), log=lambda m: None
    )
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2


def test_export_round_trip_ours_theirs_ours(tokenizer_dir, tmp_path, capsys):
    """A model of ours whose vocabulary (2,048) is larger than its tokenizer's (2,000)."""
    pytest.importorskip("wiola13m")
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaForCausalLM

    torch.manual_seed(0)
    ours = WiolaModel(WiolaConfig(vocab_size=2048, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128))
    ours.eval().save_pretrained(tmp_path / "ours", load_tokenizer(tokenizer_dir))
    assert main(["export", "--checkpoint", str(tmp_path / "ours"), "--out", str(tmp_path / "theirs")]) == 0
    capsys.readouterr()
    theirs = WiolaForCausalLM.from_pretrained(tmp_path / "theirs").eval()
    hf_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "theirs")
    text = "Once upon a time, Zoë saw a 🦊. <s>\n  It said: “hi!”</s>"
    ids = torch.tensor([hf_tok(text).input_ids])
    assert ids[0].tolist() == load_tokenizer(tokenizer_dir).encode(text)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 3)
    with torch.no_grad():
        want = ours(ids).logits
        there = (theirs(ids).logits - want).abs().max().item()
        theirs.save_pretrained(tmp_path / "back")
        hf_tok.save_pretrained(tmp_path / "back")
        again = WiolaModel.from_pretrained(tmp_path / "back").eval()
        back = (again(ids).logits - want).abs().max().item()
    assert there <= 1e-5, f"ours -> theirs: logits differ by {there:.2e}"
    assert back == 0.0, f"ours -> theirs -> ours: logits differ by {back:.2e}"
    assert load_checkpoint_tokenizer(tmp_path / "back").encode(text) == ids[0].tolist()


def test_wiola13m_refuses_our_own_folder_rather_than_loading_random_weights(tokenizer_dir, tmp_path):
    """Our folder holds our tensor names: transformers (4.x, wiola13m's) refuses its weights file
    (its metadata is not transformers' "pt") instead of building a model of fresh random weights
    with a warning; ``export_wiola13m`` writes what it reads."""
    pytest.importorskip("wiola13m")
    from wiola13m import WiolaForCausalLM

    torch.manual_seed(0)
    WiolaModel(WiolaConfig.preset("13m", vocab_size=2000)).save_pretrained(
        tmp_path / "ours", load_tokenizer(tokenizer_dir)
    )
    with pytest.raises((OSError, ValueError), match="metadata"):  # the versions word it differently
        WiolaForCausalLM.from_pretrained(tmp_path / "ours")
    assert WiolaModel.from_pretrained(tmp_path / "ours").config.vocab_size == 2000  # ours reads it as before


def test_export_converts_a_tiktoken_checkpoint(tmp_path, capsys):
    pytest.importorskip("wiola13m")
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaForCausalLM

    torch.manual_seed(0)
    ours = WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).eval()
    tok = load_tokenizer("gpt2-32k")
    ours.save_pretrained(tmp_path / "ours", tok)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tokenizer"] == "gpt2-32k"
    assert main(["export", "--checkpoint", str(tmp_path / "ours"), "--out", str(tmp_path / "theirs")]) == 0
    hf_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "theirs")
    text = "Hello   world!\n\n  It's 2024 — naïve café 🦊<|endoftext|>tail  "
    assert hf_tok(text).input_ids == tok.encode(text) and hf_tok.eos_token_id == 31999
    assert hf_tok.decode(tok.encode(text)) == text
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        diff = (WiolaForCausalLM.from_pretrained(tmp_path / "theirs")(ids).logits - ours(ids).logits).abs().max()
    assert diff <= 1e-5, f"logits differ by {diff:.2e}"


class _Trap:
    """A pickle that touches ``marker`` when unpickled: what a booby-trapped file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_planted_pickles_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Trap(marker)))
    assert marker.exists(), "the trap is real: unpickling it runs code"
    marker.unlink()
    # pytorch_model.bin in a checkpoint folder
    folder = tmp_path / "bin"
    WiolaModel(WiolaConfig.preset("tiny", n_layers=1)).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({"embed.weight": torch.zeros(2), "x": _Trap(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"refusing to load .*pytorch_model.bin.*nothing in it was run"):
        WiolaModel.from_pretrained(folder)
    # optimizer.pt of a training checkpoint (wiola train --resume reads it here)
    from wiola.train.run_folder import OPTIMIZER_FILE, read_optimizer_state

    torch.save({"optimizer": {}, "scheduler": {}, "rng": _Trap(marker)}, tmp_path / OPTIMIZER_FILE)
    with pytest.raises(ValueError, match=r"refusing to load .*optimizer.pt.*nothing in it was run"):
        read_optimizer_state(tmp_path)
    assert not marker.exists(), "a loader ran the planted pickle"


def test_training_starts_from_the_published_folder_and_resumes(published, tmp_path):
    """``--init``: a new run from the folder's weights, config and tokenizer; its first loss is
    wiola13m's on the same windows; the run then resumes like any other."""
    from transformers import PreTrainedTokenizerFast
    from wiola13m import WiolaForCausalLM

    from wiola.train import TrainConfig, train

    T, B = 32, 2
    cfg = TrainConfig(
        init=str(published), data="sample:100", cache_dir=str(tmp_path / "cache"), seq_len=T, batch_size=B, steps=2,
        shuffle=False, warmup=1, eval_every=100, log_every=1, out_dir=str(tmp_path / "run"), progress=False,
        plots=False, device="cpu", precision="fp32",
    )  # fmt: skip
    first = train(cfg, log=lambda m: None)
    tok = PreTrainedTokenizerFast.from_pretrained(published)
    stories, _ = sample_corpus(100, 100, 0)
    stream: list[int] = []
    for story in stories:
        stream += [1, *tok(story, add_special_tokens=False).input_ids, 2]
        if len(stream) > B * T + 1:
            break
    x = torch.tensor([stream[k * T : k * T + T + 1] for k in range(B)])
    with torch.no_grad():
        logits = WiolaForCausalLM.from_pretrained(published).eval()(x[:, :-1]).logits.double()
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()
    assert first.losses[0][0] == 1 and abs(first.losses[0][1] - want) <= 1e-5 * want, (first.losses[0], want)
    ckpt = first.checkpoint
    assert load_checkpoint_tokenizer(ckpt).fingerprint == load_checkpoint_tokenizer(published).fingerprint
    assert WiolaModel.from_pretrained(ckpt).config.pad_token_id == 3
    again = train(TrainConfig(**{**cfg.to_dict(), "steps": 3}), resume=tmp_path / "run", log=lambda m: None)
    assert again.step == 3 and again.checkpoint.name == "step_0000003"


# ------------------------------------------------------------------ shards, generation config, adapters on a Hub base
SHARDED_SCRIPT = r"""
import sys, torch
from wiola import WiolaModel
repo, folder = sys.argv[1:3]
ids = torch.arange(1, 40)[None]
a = WiolaModel.from_pretrained(repo).eval()(ids).logits
b = WiolaModel.from_pretrained(folder).eval()(ids).logits
print(f"same_logits={torch.equal(a, b)}")
"""


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_a_sharded_wiola13m_checkpoint_loads_as_the_single_file(published, tmp_path, safe):
    """``save_pretrained(max_shard_size=...)`` writes shards and an index (either kind): the model
    is the one the single file gives, bit for bit, and wiola13m's; from a Hub id in an offline cache
    too. Without a shard the load names it."""
    from wiola13m import WiolaForCausalLM

    theirs = WiolaForCausalLM.from_pretrained(published).eval()
    sharded = tmp_path / "sharded"
    theirs.save_pretrained(sharded, max_shard_size="200KB", safe_serialization=safe)
    stem = "model" if safe else "pytorch_model"
    shards = sorted(sharded.glob(f"{stem}-*-of-*"))
    assert len(shards) > 2 and (sharded / f"{stem}{'.safetensors' if safe else '.bin'}.index.json").is_file()
    assert not (sharded / "model.safetensors").exists() and not (sharded / "pytorch_model.bin").exists()
    ids = torch.randint(0, 2000, (2, 23))
    with torch.no_grad():
        want = WiolaModel.from_pretrained(published).eval()(ids).logits
        got = WiolaModel.from_pretrained(sharded).eval()(ids).logits
        there = theirs(ids).logits
    assert torch.equal(got, want), "the shards load other weights than the single file"
    assert (got - there).abs().max() <= 1e-5, "logits differ from wiola13m's"
    cache = _hub_cache(tmp_path / "hub", sharded)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, REPO, str(sharded)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "same_logits=True" in proc.stdout, proc.stdout + proc.stderr
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard\\(s\\) missing from .*: {shards[1].name}"):
        WiolaModel.from_pretrained(sharded)


def test_the_generation_config_gives_the_ids_wiola13m_generates_with(published, tmp_path):
    """A folder whose generation_config.json gives other eos and pad ids than config.json: the ids
    wiola13m's generate uses are ours, in the model's config and the tokenizer; the greedy tokens
    stop where wiola13m's stop."""
    from wiola13m import WiolaForCausalLM

    theirs = WiolaForCausalLM.from_pretrained(published).eval()
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        free = theirs.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 6])  # the third new token: the row must end there
    theirs.generation_config.eos_token_id, theirs.generation_config.pad_token_id = eos, 9
    folder = tmp_path / "gen"
    theirs.save_pretrained(folder)
    shutil.copy(published / "tokenizer.json", folder)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    reloaded = WiolaForCausalLM.from_pretrained(folder).eval()
    ours = WiolaModel.from_pretrained(folder).eval()
    g = reloaded.generation_config
    assert (ours.config.bos_token_id, ours.config.eos_token_id, ours.config.pad_token_id) == (
        g.bos_token_id, g.eos_token_id, g.pad_token_id) == (1, eos, 9)  # fmt: skip
    tok = load_checkpoint_tokenizer(folder)
    assert (tok.eos_token_id, tok.pad_token_id) == (eos, 9)
    with torch.no_grad():
        there = reloaded.generate(ids, max_new_tokens=6, do_sample=False)
    here = ours.generate(ids, 6)
    assert there[0].tolist() == here[0, : there.shape[1]].tolist() and int(there[0, -1]) == eos
    assert here[0, there.shape[1] :].tolist() == [9] * (here.shape[1] - there.shape[1])


def test_export_writes_the_generation_config_wiola13m_writes(tokenizer_dir, tmp_path, capsys):
    """``wiola export`` writes generation_config.json as wiola13m's own save_pretrained writes it
    for that config.json; wiola13m generates with the ids of the model exported."""
    pytest.importorskip("wiola13m")
    from wiola13m import WiolaForCausalLM

    ours = WiolaModel(WiolaConfig(vocab_size=2000, d_model=64, n_layers=1, n_heads=4, d_ff=128, max_seq_len=64))
    ours.save_pretrained(tmp_path / "ours", load_tokenizer(tokenizer_dir))
    assert main(["export", "--checkpoint", str(tmp_path / "ours"), "--out", str(tmp_path / "theirs")]) == 0
    theirs = WiolaForCausalLM.from_pretrained(tmp_path / "theirs")
    theirs.save_pretrained(tmp_path / "again")
    read = lambda folder: json.loads((tmp_path / folder / "generation_config.json").read_text())
    want = {k: v for k, v in read("again").items() if k != "transformers_version"}
    assert (
        read("theirs") == want == {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    )
    g = theirs.generation_config
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id) == (1, 2, 3)
