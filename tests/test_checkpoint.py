"""save_pretrained / from_pretrained: bit-exact round trip, wiola13m import, clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import stat

import pytest
import torch
from f64_reference import forward_row
from safetensors.torch import save_file

from wiola import WiolaConfig, WiolaModel

CFG = WiolaConfig(vocab_size=120, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)


def test_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = WiolaModel(CFG)
    model.save_pretrained(tmp_path)
    loaded = WiolaModel.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 120, (2, 9))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def hf_state(seed: int) -> dict[str, torch.Tensor]:
    """A random state dict under wiola13m's names (the names listed in the issue)."""
    g = torch.Generator().manual_seed(seed)
    d, f, H, D = 32, 64, 4, 8
    rnd = lambda *s: 0.3 * torch.randn(*s, generator=g)
    state = {"model.embed_tokens.weight": rnd(120, d), "model.norm.weight": 1 + rnd(d)}
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + rnd(d),
            p + "post_attention_layernorm.weight": 1 + rnd(d),
            p + "self_attn.gate_fc1.weight": rnd(H, D),
            p + "self_attn.gate_fc2.weight": rnd(H, H),
            p + "self_attn.gate_fc2.bias": rnd(H),
            p + "mlp.up_proj.weight": rnd(2 * f, d),
            p + "mlp.bypass_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f),
        }
        for x in "qkvo":
            state[p + f"self_attn.{x}_proj.weight"] = rnd(d, d)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


HF_CONFIG = {
    "architectures": ["WiolaForCausalLM"],
    "model_type": "wiola",
    "vocab_size": 120,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "spiral_alpha": 0.05,
    "gate_pre_rope": True,
    "use_attention_gate": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def write_hf(tmp_path, state, config=HF_CONFIG, weights="model.safetensors"):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file(state, str(tmp_path / weights))
    else:
        torch.save(state, tmp_path / weights)
    return tmp_path


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_wiola13m_directory_matches_float64(tmp_path, weights):
    state = hf_state(0)
    model = WiolaModel.from_pretrained(write_hf(tmp_path, state, weights=weights)).double()
    assert model.config.d_ff == 64 and model.config.helix_alpha == 0.05
    ids = torch.randint(0, 120, (1, 21))
    ours = {k.replace("model.", "", 1): v for k, v in state.items()}  # independent renaming for the oracle
    renamed = {}
    for k, v in ours.items():
        k = k.replace("embed_tokens", "embed").replace("input_layernorm", "attn_norm")
        k = k.replace("post_attention_layernorm", "ffn_norm").replace("self_attn", "attn").replace("mlp", "ffn")
        k = k.replace("gate_fc1", "gate_w1").replace("gate_fc2", "gate_w2")
        renamed[k] = v
    want = forward_row(renamed, model.config, ids[0].tolist())
    got = model(ids).logits[0]
    assert (got - want).abs().max() <= 1e-10 * want.abs().max()


def test_matches_the_installed_wiola13m_package(tmp_path):
    pytest.importorskip("wiola13m")
    from wiola13m import WiolaConfig as HFConfig
    from wiola13m import WiolaForCausalLM

    torch.manual_seed(0)
    theirs = WiolaForCausalLM(HFConfig(**{k: v for k, v in HF_CONFIG.items() if k != "architectures"})).eval()
    theirs.save_pretrained(tmp_path)
    ours = WiolaModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 120, (2, 30))
    with torch.no_grad():
        diff = (theirs(ids).logits - ours(ids).logits).abs().max().item()
    assert diff < 1e-5, f"logits differ from wiola13m's by {diff:.2e}"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("model.layers.1.mlp.down_proj.weight"), "missing tensor.*layers.1.ffn.down_proj.weight"),
        (
            lambda s: s.__setitem__("model.layers.0.mlp.gate_proj.weight", torch.zeros(2)),
            "unexpected tensor.*gate_proj",
        ),
        (
            lambda s: s.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 31)),
            "layers.0.attn.q_proj.weight.*shape",
        ),
        (lambda s: s.__setitem__("lm_head.weight", torch.zeros(120, 32)), "lm_head.weight differs"),
    ],
    ids=["missing", "extra", "misshaped", "untied-head"],
)
def test_bad_wiola13m_tensors_are_named(tmp_path, mutate, message):
    state = hf_state(1)
    mutate(state)
    with pytest.raises(ValueError, match=message):
        WiolaModel.from_pretrained(write_hf(tmp_path, state))


def test_foreign_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WiolaModel.from_pretrained(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileNotFoundError, match="notes.txt' is a file, not a checkpoint directory"):
        WiolaModel.from_pretrained(tmp_path / "notes.txt")
    (tmp_path / "notes.txt").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        WiolaModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    with pytest.raises(ValueError, match="'llama' model"):
        WiolaModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        WiolaModel.from_pretrained(tmp_path)
    wiola13m = {"model_type": "wiola", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2}  # fmt: skip
    for extra, match in (
        ({"eos_token_id": [2, 5]}, r"config.json: eos_token_id \[2, 5\] is a list; Wiola takes one eos id"),
        ({"pad_token_id": 99}, r"config.json: .*pad_token_id"),  # a bad field names the file it is in
    ):
        (tmp_path / "config.json").write_text(json.dumps({**wiola13m, **extra}))
        with pytest.raises(ValueError, match=match):
            WiolaModel.from_pretrained(tmp_path)
    WiolaModel(CFG).save_pretrained(tmp_path)
    blob = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="model.safetensors is corrupt"):
        WiolaModel.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        WiolaModel.from_pretrained(tmp_path)


def test_what_a_checkpoint_cannot_hold_is_named(tmp_path):
    """A weight stored as integers, a wiola13m config with an untied head, and a ``revision`` for
    a local folder (it applies to Hub ids) are refused by name, not loaded."""
    from safetensors.torch import load_file

    from wiola.checkpoint import export_wiola13m

    WiolaModel(CFG).save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match=r"revision='v2' applies to Hub ids, but .* is a local path"):
        WiolaModel.from_pretrained(tmp_path / "ours", revision="v2")
    stored = load_file(str(tmp_path / "ours" / "model.safetensors"))
    stored["norm.weight"] = torch.full_like(stored["norm.weight"], 3, dtype=torch.int64)
    save_file(stored, str(tmp_path / "ours" / "model.safetensors"), metadata={"format": "wiola"})
    with pytest.raises(ValueError, match=r"tensor 'norm.weight' has dtype torch.int64, expected a float type"):
        WiolaModel.from_pretrained(tmp_path / "ours")
    export_wiola13m(WiolaModel(CFG), tmp_path / "theirs")
    raw = json.loads((tmp_path / "theirs" / "config.json").read_text())
    (tmp_path / "theirs" / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"the head is not tied to the embedding \(tie_word_embeddings=false\)"):
        WiolaModel.from_pretrained(tmp_path / "theirs")


def test_a_wiola13m_export_keeps_the_models_special_ids_over_the_tokenizers(tmp_path):
    """``export_wiola13m`` with a tokenizer: the model config's eos/pad ids (a checkpoint's, which
    win in generation) are written and read back, not the tokenizer's; the tokenizer's fill the
    ids the config lacks."""
    from wiola.checkpoint import export_wiola13m
    from wiola.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2-32k")  # eos 31999, no pad
    config = dataclasses.replace(CFG, vocab_size=32000, eos_token_id=5, pad_token_id=6)
    export_wiola13m(WiolaModel(config), tmp_path / "ids", tok)
    written = json.loads((tmp_path / "ids" / "config.json").read_text())
    assert (written["eos_token_id"], written["pad_token_id"]) == (5, 6), written
    loaded = WiolaModel.from_pretrained(tmp_path / "ids").config
    assert (loaded.eos_token_id, loaded.pad_token_id) == (5, 6)
    export_wiola13m(
        WiolaModel(dataclasses.replace(config, eos_token_id=None, pad_token_id=None)), tmp_path / "tok", tok
    )
    assert json.loads((tmp_path / "tok" / "config.json").read_text())["eos_token_id"] == 31999


def test_config_of_another_shape_is_caught(tmp_path):
    WiolaModel(CFG).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["d_ff"] = 48
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="ffn.*shape"):
        WiolaModel.from_pretrained(tmp_path)


def test_export_to_wiola13m_names_and_back():
    from wiola.checkpoint import convert_wiola13m_state, to_wiola13m_state

    model = WiolaModel(CFG)
    theirs = to_wiola13m_state(model.state_dict(), CFG.n_layers)
    assert set(theirs) == set(hf_state(0))  # exactly the names the published package uses
    back = convert_wiola13m_state(theirs, CFG.n_layers)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ checks before allocating
HUGE_VOCAB_SCRIPT = """
import json, resource, sys
from pathlib import Path
from wiola import WiolaModel
from wiola.fast import WiolaModel as Fast

folder = Path(sys.argv[1])
meta = json.loads((folder / "config.json").read_text())
meta["config"]["vocab_size"] = 2_000_000_000  # x d_model 32 x 4 bytes: a 256 GB embedding
(folder / "config.json").write_text(json.dumps(meta))
resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # any attempt to allocate it fails loudly
for cls in (WiolaModel, Fast):
    try:
        cls.from_pretrained(folder)
    except ValueError as e:
        print(cls.__module__, "ValueError:", e)
"""


def test_a_config_larger_than_its_weights_is_refused_before_allocating(tmp_path):
    """config.json says vocab_size 2,000,000,000 beside a 120-row embedding: the meta-device model's
    shapes are compared with the safetensors header and the load fails naming the tensor, under an
    address-space limit far below what building the model would allocate."""
    import subprocess
    import sys

    WiolaModel(CFG).save_pretrained(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", HUGE_VOCAB_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["wiola.model", "wiola.fast"], run.stdout + run.stderr[-2000:]
    for line in lines:
        assert "'embed.weight' has shape (120, 32), but config.json makes it (2000000000, 32)" in line, line


def test_header_mismatch_is_named_before_the_tensors_are_read(tmp_path, monkeypatch):
    """A mismatched shape is found from the safetensors header: the tensors are never loaded."""
    import wiola.checkpoint as checkpoint

    WiolaModel(CFG).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["n_heads"], meta["config"]["d_model"] = 2, 48
    (tmp_path / "config.json").write_text(json.dumps(meta))

    def never(*args, **kwargs):
        raise AssertionError("the tensors were read before the shapes were checked")

    monkeypatch.setattr(checkpoint, "_read_tensors", never)
    with pytest.raises(ValueError, match=r"'embed.weight' has shape \(120, 32\), but config.json makes it \(120, 48\)"):
        WiolaModel.from_pretrained(tmp_path)


def test_wiola13m_config_larger_than_its_weights_is_refused(tmp_path, monkeypatch):
    import wiola.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "_read_tensors", lambda *a: pytest.fail("tensors read before the check"))
    folder = write_hf(tmp_path, hf_state(2), config={**HF_CONFIG, "vocab_size": 10**9})
    with pytest.raises(ValueError, match=r"'embed.weight' has shape \(120, 32\), but config.json makes it"):
        WiolaModel.from_pretrained(folder)


def test_a_run_folder_resolves_to_its_latest_checkpoint(tmp_path):
    from wiola.checkpoint import LATEST_FILE, resolve_checkpoint

    torch.manual_seed(3)
    model = WiolaModel(CFG)
    checkpoints = tmp_path / "run" / "checkpoints"
    model.save_pretrained(checkpoints / "step_0000007")
    with pytest.raises(FileNotFoundError, match="config.json"):  # no pointer yet: not a checkpoint
        WiolaModel.from_pretrained(tmp_path / "run")
    (checkpoints / LATEST_FILE).write_text("step_0000007\n")
    assert resolve_checkpoint(tmp_path / "run") == checkpoints / "step_0000007"
    assert resolve_checkpoint(checkpoints / "step_0000007") == checkpoints / "step_0000007"
    loaded = WiolaModel.from_pretrained(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    (checkpoints / LATEST_FILE).write_text("step_0000009\n")
    with pytest.raises(FileNotFoundError, match="names step_0000009, which does not exist"):
        resolve_checkpoint(tmp_path / "run")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_saved_files_get_the_mode_open_gives(tmp_path, umask):
    """config.json and model.safetensors get 0o666 less the umask, as files open() creates (a
    temporary file of tempfile.mkstemp is 0o600 whatever the umask, and the rename kept that)."""
    from wiola.checkpoint import export_wiola13m

    old = os.umask(umask)
    try:
        WiolaModel(CFG).save_pretrained(tmp_path / "ours")
        export_wiola13m(WiolaModel(CFG), tmp_path / "theirs")
    finally:
        os.umask(old)
    for path in [
        tmp_path / folder / name for folder in ("ours", "theirs") for name in ("config.json", "model.safetensors")
    ]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o666 & ~umask, f"{path.relative_to(tmp_path)}: mode {mode:o}, want {0o666 & ~umask:o}"
    assert not [p.name for p in (tmp_path / "ours").iterdir() if p.name.startswith(".")], "temporary file left"


@pytest.mark.parametrize(
    "error",
    [
        "Error while serializing: I/O error: No space left on device (os error 28)",  # safetensors' own error
        OSError(28, "No space left on device", "the-temporary-file"),
    ],
    ids=["SafetensorError", "OSError"],
)
def test_a_full_disk_while_saving_is_an_oserror_naming_the_file(tmp_path, monkeypatch, error):
    """A write that fails (a full disk) is an OSError naming the file it was to replace, with
    the errno (a SafetensorError is none): the files saved before stay as they were, and no
    temporary file is left."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    WiolaModel(CFG).save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"cut short")
        raise SafetensorError(error) if isinstance(error, str) else error

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    expected = f"cannot write {tmp_path / 'model.safetensors'}: " + (
        error if isinstance(error, str) else error.strerror
    )
    with pytest.raises(OSError, match=f"^{re.escape(expected)}$") as caught:
        WiolaModel(CFG).save_pretrained(tmp_path)
    assert caught.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


class _Planted:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"garbage", "is corrupt or not a PyTorch checkpoint"),
        (b"", "is corrupt or not a PyTorch checkpoint"),
        (pickle.dumps([1, 2, 3])[:-3], "is corrupt or not a PyTorch checkpoint"),  # a pickle cut short
        ("planted-zip", r"refusing to load .*\(posix.system\).*nothing in it was run"),
        (pickle.dumps({"a": _Planted()}), r"refusing to load .*\(posix.system\).*nothing in it was run"),
    ],
    ids=["garbage", "empty", "cut-pickle", "planted-zip", "planted-pickle"],
)
def test_a_corrupt_bin_is_told_apart_from_a_planted_pickle(tmp_path, content, message):
    """Bytes that are no torch.save file are called corrupt; only a pickle naming code is called
    unsafe. Neither message passes on torch's advice to load with weights_only=False."""
    WiolaModel(CFG).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    if content == "planted-zip":
        torch.save({"embed.weight": torch.zeros(2), "x": _Planted()}, tmp_path / "pytorch_model.bin")
    else:
        (tmp_path / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(ValueError, match=message) as caught:
        WiolaModel.from_pretrained(tmp_path)
    assert "weights_only" not in str(caught.value), str(caught.value)


def test_an_adapter_folder_says_to_merge(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base"}))
    with pytest.raises(FileNotFoundError, match=r"holds LoRA adapters .*wiola merge --adapter"):
        WiolaModel.from_pretrained(tmp_path)


def test_dtype_by_name_or_as_stored(tmp_path):
    """``from_pretrained(dtype=...)`` takes a torch dtype, its name as ``transformers`` callers write
    it, or "auto" (the dtype the weights are stored in); anything else is named before reading."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("tiny")).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    for dtype, want in (("auto", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                        ("fp32", torch.float32), (None, torch.float32), (torch.float64, torch.float64)):  # fmt: skip
        loaded = WiolaModel.from_pretrained(tmp_path, dtype=dtype)
        assert all(p.dtype == want for p in loaded.parameters()), dtype
        if want != torch.float16:  # bf16 values are exact in bf16, fp32 and fp64 (not in fp16's narrower range)
            assert torch.equal(loaded.embed.weight.float(), model.embed.weight.float()), dtype
    for bad in ("int8", torch.int8, 3):
        with pytest.raises(ValueError, match="dtype"):
            WiolaModel.from_pretrained(tmp_path / "missing", dtype=bad)  # named before the folder is looked for


# ------------------------------------------------------------------ generation config, shards, config.json
@pytest.mark.parametrize("flavour", ["wiola", "wiola13m"])
def test_generation_config_ids_win_over_config_json(tmp_path, flavour):
    """transformers generates with generation_config.json's bos/eos/pad ids, not config.json's:
    each id the file holds (null too) becomes the config's; one it lacks stays config.json's."""
    if flavour == "wiola":
        WiolaModel(CFG).save_pretrained(tmp_path)
        plain = WiolaModel.from_pretrained(tmp_path).config
    else:
        write_hf(tmp_path, hf_state(0), config={**HF_CONFIG, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})
        plain = WiolaModel.from_pretrained(tmp_path).config
        assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id) == (1, 2, 3)
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"_from_model_config": True, "eos_token_id": 5, "pad_token_id": 7}))
    model = WiolaModel.from_pretrained(tmp_path)
    got = model.config
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (plain.bos_token_id, 5, 7)
    assert dataclasses.replace(got, eos_token_id=plain.eos_token_id, pad_token_id=plain.pad_token_id) == plain
    # generate stops a row at the generation config's eos and pads it with its pad id
    ids = torch.tensor([[10, 11, 12]])
    first = int(model.eval().generate(ids, 1, eos_token_id=None)[0, -1])
    generation.write_text(json.dumps({"eos_token_id": first, "pad_token_id": 7}))
    out = WiolaModel.from_pretrained(tmp_path).eval().generate(ids, 4)
    assert out[0, 3:].tolist() == [first, 7, 7, 7], out[0, 3:].tolist()
    generation.write_text(json.dumps({"eos_token_id": None}))  # an explicit null: no eos, as there
    assert WiolaModel.from_pretrained(tmp_path).config.eos_token_id is None
    for content, match in (
        ({"eos_token_id": [2, 5]}, r"generation_config.json: eos_token_id \[2, 5\] is a list; Wiola takes one eos id"),
        ({"pad_token_id": 999}, r"generation_config.json: pad_token_id 999 is outside \[0, vocab_size=120\)"),
        ([5], r"generation_config.json does not hold a JSON object"),
    ):
        generation.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=match):
            WiolaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", [None, [1], "settings"], ids=["missing", "list", "string"])
def test_our_config_json_without_its_settings_is_named(tmp_path, content):
    WiolaModel(CFG).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    if content is None:
        del meta["config"]
        match = r"config.json lacks the key 'config', the model's settings"
    else:
        meta["config"] = content
        match = r"config.json: 'config' must be a JSON object of the model's settings .*, not " + re.escape(
            json.dumps(content)
        )
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        WiolaModel.from_pretrained(tmp_path)


def write_shards(folder, state, kind, shards=3):
    """``state`` as transformers' ``save_pretrained(max_shard_size=...)`` lays it out: ``shards``
    files and an index whose weight_map names the shard of each tensor."""
    names = sorted(state)
    single = "model.safetensors" if kind == "safetensors" else "pytorch_model.bin"
    stem, ext = single.rsplit(".", 1)
    weight_map = {}
    for i in range(shards):
        shard = f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}"
        part = {name: state[name].clone() for name in names[i::shards]}
        save_file(part, str(folder / shard)) if kind == "safetensors" else torch.save(part, folder / shard)
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / f"{single}.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
@pytest.mark.parametrize("flavour", ["wiola", "wiola13m"])
def test_sharded_checkpoints_load_as_the_single_file_does(tmp_path, kind, flavour):
    torch.manual_seed(0)
    if flavour == "wiola":
        WiolaModel(CFG).save_pretrained(tmp_path / "one")
        state = WiolaModel.from_pretrained(tmp_path / "one").state_dict()
        config = (tmp_path / "one" / "config.json").read_text()
    else:
        state = hf_state(4)
        state.pop("lm_head.weight")  # tied: transformers stores the embedding once
        (tmp_path / "one").mkdir()
        write_hf(tmp_path / "one", state)
        config = json.dumps(HF_CONFIG)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "config.json").write_text(config)
    write_shards(tmp_path / "shards", state, kind)
    one, sharded = WiolaModel.from_pretrained(tmp_path / "one"), WiolaModel.from_pretrained(tmp_path / "shards")
    ids = torch.randint(0, 120, (2, 11))
    assert torch.equal(one(ids).logits, sharded(ids).logits)


def test_a_sharded_checkpoint_is_checked_before_its_tensors_are_read(tmp_path, monkeypatch):
    """Every shard the index names must be there; each tensor in the shard the index says; the
    shapes are read from each shard's header and checked before any tensor is loaded."""
    import wiola.checkpoint as checkpoint

    WiolaModel(CFG).save_pretrained(tmp_path / "one")
    state = WiolaModel.from_pretrained(tmp_path / "one").state_dict()
    folder = tmp_path / "shards"
    folder.mkdir()
    meta = json.loads((tmp_path / "one" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(meta))
    write_shards(folder, state, "safetensors")
    index = folder / "model.safetensors.index.json"
    good = index.read_text()
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_read_tensors", lambda *a: pytest.fail("tensors read before the check"))
        meta["config"]["d_model"], meta["config"]["n_heads"] = 48, 2
        (folder / "config.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=r"index.json: tensor 'embed.weight' has shape \(120, 32\), but config"):
            WiolaModel.from_pretrained(folder)
        (folder / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
        (folder / "model-00002-of-00003.safetensors").rename(folder / "away")
        with pytest.raises(
            FileNotFoundError, match=r"index.json names shard\(s\) missing from .*: model-00002-of-00003"
        ):
            WiolaModel.from_pretrained(folder)
        (folder / "away").rename(folder / "model-00002-of-00003.safetensors")
        moved = json.loads(good)
        moved["weight_map"]["embed.weight"] = "model-00003-of-00003.safetensors"
        index.write_text(json.dumps(moved))
        with pytest.raises(ValueError, match=r"puts tensor 'embed.weight' in model-00003-of-00003.safetensors, but"):
            WiolaModel.from_pretrained(folder)
        index.write_text(json.dumps({**moved, "weight_map": {**moved["weight_map"], "embed.weight": "../x"}}))
        with pytest.raises(ValueError, match=r"tensor 'embed.weight' is mapped to '../x', not a file beside the index"):
            WiolaModel.from_pretrained(folder)
        index.write_text(json.dumps({"metadata": {}}))
        with pytest.raises(ValueError, match=r"index.json holds no \"weight_map\""):
            WiolaModel.from_pretrained(folder)
    index.write_text(good)
    loaded = WiolaModel.from_pretrained(folder).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # a tensor stored in two shards (the index naming either) is refused, not read from one of them
    from safetensors.torch import load_file

    weight_map = json.loads(good)["weight_map"]
    name = "norm.weight"
    other = next(shard for shard in sorted(set(weight_map.values())) if shard != weight_map[name])
    part = load_file(str(folder / other))
    save_file({**part, name: torch.full_like(state[name], 42.0)}, str(folder / other))
    for named in (weight_map[name], other):
        index.write_text(json.dumps({"weight_map": {**weight_map, name: named}}))
        with pytest.raises(ValueError, match=rf"tensor '{name}' is in two shards"):
            WiolaModel.from_pretrained(folder)


def test_a_hub_download_fetches_every_shard_and_the_generation_config():
    """``snapshot_download(allow_patterns=HUB_FILES)`` keeps every file a checkpoint is read from,
    in one file or in shards, and leaves out what it never reads."""
    from huggingface_hub.utils import filter_repo_objects

    from wiola.checkpoint import HUB_FILES

    needed = [
        "config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin",
        "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    ]  # fmt: skip
    unread = ["README.md", "model.onnx", "tf_model.h5", "flax_model.msgpack", "training_args.bin"]
    assert list(filter_repo_objects(needed + unread, allow_patterns=HUB_FILES)) == needed


def test_export_and_finetune_do_not_point_to_a_tokenizer_flag_they_lack(tmp_path, capsys):
    """A wiola13m folder without tokenizer.json: the error says what to do, and names --tokenizer
    only to a caller that has that flag."""
    from wiola.checkpoint import load_checkpoint_tokenizer
    from wiola.cli import main

    (tmp_path / "hf").mkdir()
    folder = write_hf(tmp_path / "hf", hf_state(0))
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for args in (
        ["export", "--checkpoint", str(folder), "--out", str(tmp_path / "x")],
        ["finetune", "--init", str(folder), "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "x")],
    ):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "holds no tokenizer.json: its tokenizer is unknown; copy the tokenizer files" in err, err
        assert "--tokenizer" not in err, err
    with pytest.raises(FileNotFoundError, match=r"next to the weights, or name one with --tokenizer$"):
        load_checkpoint_tokenizer(folder, tokenizer_flag="--tokenizer")
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("or name one with --tokenizer"), "generate has the flag"


def test_export_leaves_adapters_alone_and_overwrite_leaves_no_old_file(tmp_path, capsys):
    """``wiola export`` into a LoRA folder (its tokenizer_config.json holds the chat template) is
    refused without --overwrite, nothing in it changed; --overwrite over a transformers checkpoint
    in shards deletes every file of it (its generation config too) and writes the export's own
    generation_config.json, the ids of its config.json."""
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer

    ckpt = tmp_path / "ckpt"
    small = dict(vocab_size=32000, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_seq_len=64)
    config = WiolaConfig(**small, eos_token_id=9, pad_token_id=3)  # bos None: generation_config.json leaves it out
    WiolaModel(config).save_pretrained(ckpt, load_tokenizer("gpt2-32k"))
    adapters = tmp_path / "lora"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(ckpt)}))
    (adapters / "adapter_model.safetensors").write_bytes(b"weights")
    (adapters / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    before = {p.name: p.read_bytes() for p in adapters.iterdir()}
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(adapters)]) == 2
    err = capsys.readouterr().err
    assert "already holds a model (adapter_config.json, adapter_model.safetensors, tokenizer_config.json)" in err, err
    assert {p.name: p.read_bytes() for p in adapters.iterdir()} == before
    out = tmp_path / "out"
    out.mkdir()
    stale = ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "config.json"]  # fmt: skip
    for name in stale:
        (out / name).write_text("old")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "pad_token_id": 7}))
    (out / "notes.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    left = sorted(p.name for p in out.iterdir())
    want = ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "special_tokens_map.json"]
    assert left == [*want, "tokenizer.json", "tokenizer_config.json"], left
    exported = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"_from_model_config": True, "eos_token_id": 9, "pad_token_id": 3}, generation
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (None, 9, 3)
    assert WiolaModel.from_pretrained(out).config == WiolaModel.from_pretrained(ckpt).config


def test_save_pretrained_names_a_tokenizer_of_another_type_before_writing(tmp_path) -> None:
    """A tiktoken ``Encoding`` (what ``get_encoding`` gives) is not a ``wiola.tokenizer.Tokenizer``:
    a ``TypeError`` saying what to pass, and no folder left behind."""
    from wiola.tokenizer import get_encoding

    model = WiolaModel(WiolaConfig(vocab_size=32000, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=32))
    with pytest.raises(
        TypeError, match=r"tokenizer must be a wiola\.tokenizer\.Tokenizer .*got tiktoken\.core\.Encoding"
    ):
        model.save_pretrained(tmp_path / "out", get_encoding("gpt2-32k"))
    assert not (tmp_path / "out").exists()


def test_a_wiola13m_config_without_intermediate_size_means_twice_hidden_size(tmp_path) -> None:
    """wiola13m's default ``d_inner`` is ``2 * hidden_size``: a config.json that leaves
    ``intermediate_size`` out loads the same weights."""
    from wiola.checkpoint import export_wiola13m

    torch.manual_seed(0)
    config = WiolaConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=32)
    model = WiolaModel(config)
    export_wiola13m(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("intermediate_size")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = WiolaModel.from_pretrained(tmp_path)
    assert loaded.config.d_ff == 64
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
