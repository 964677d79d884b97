"""LoRA through peft: adapters change the logits in both model classes (never bypassed, the
fast model's C++ step included), equal the merged weights' logits, save in PEFT's format and
reload with peft.PeftModel.from_pretrained; `wiola finetune --lora-rank` and `wiola merge`."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from numerics import TOL, AbsSums, assert_close, assert_within, bound, rel_err

import wiola
import wiola.fast
from wiola.model import ADAPTER_TARGETS, has_adapters

peft = pytest.importorskip("peft")

CONFIG = wiola.WiolaConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_seq_len=64)
FP32 = TOL[torch.float32]  # merged W + s·BA against W x + s·B(A x): fp32 rounding, relative


def _lora(model, targets=ADAPTER_TARGETS):
    # init_lora_weights=False: B is random too, so the adapter changes the function from the start
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


@pytest.mark.parametrize("cls", [wiola.WiolaModel, wiola.fast.WiolaModel], ids=["reference", "fast"])
@pytest.mark.parametrize(
    "targets", [ADAPTER_TARGETS, ("q_proj",), ("bypass_proj", "down_proj")], ids=["all", "q", "ffn"]
)
def test_adapters_change_logits_and_equal_the_merged_model(cls, targets, tmp_path) -> None:
    torch.manual_seed(0)
    base = cls(CONFIG).eval()
    ids = torch.randint(0, 300, (2, 9))
    lora = _lora(base, targets)
    assert has_adapters(lora) and not has_adapters(base)
    with torch.no_grad():
        b, lo = base(ids).logits, lora(ids).logits
        changed = rel_err(b, lo)  # far above the rounding that separates adapters from merged weights
        assert changed > 100 * FP32, f"{cls.__module__} {targets}: the adapter changed the logits by {changed:.1e} only"
        lora.save_pretrained(str(tmp_path))
        assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
        assert torch.equal(reloaded(ids).logits, lo), "the reloaded adapter differs"
        merged = lora.merge_and_unload()
        assert type(merged) is cls and not has_adapters(merged)
        assert_close(f"{cls.__module__} {targets} merged vs adapters", lo, merged(ids).logits, FP32)


@pytest.mark.parametrize("cls", [wiola.WiolaModel, wiola.fast.WiolaModel], ids=["reference", "fast"])
@pytest.mark.parametrize("ffn", ["swiglu", "gelu"])
def test_adapters_on_the_other_feed_forward_blocks_run_and_train(cls, ffn) -> None:
    """The ablations' SwiGLU and GELU blocks read their projections' weights; an adapted one is
    called instead, so its adapter changes the logits, equals the merged weights, and trains (its
    B gets a gradient from zero, as peft initialises it). Reading ``.weight`` of a LoRA layer
    would give the base weight and leave the adapter out."""
    torch.manual_seed(0)
    base = cls(dataclasses.replace(CONFIG, ffn=ffn)).eval()
    targets = ["up_proj", "down_proj"] + (["gate_proj"] if ffn == "swiglu" else [])
    ids = torch.randint(0, 300, (2, 9))
    lora = _lora(base, targets)
    assert has_adapters(_lora(base, ["gate_proj" if ffn == "swiglu" else "up_proj"])), "an adapted FFN not seen"
    with torch.no_grad():
        b, lo = base(ids).logits, lora(ids).logits
        changed = rel_err(b, lo)
        assert changed > 100 * FP32, f"{cls.__module__} {ffn}: the adapter changed the logits by {changed:.1e} only"
        assert_close(
            f"{cls.__module__} {ffn} merged vs adapters", lo, copy.deepcopy(lora).merge_and_unload()(ids).logits, FP32
        )
    fresh = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=targets))  # B = 0
    fresh(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in fresh.named_parameters() if "lora_B" in n}
    assert len(grads) == 2 * len(targets), sorted(grads)  # two layers
    assert all(g is not None and g.abs().max() > 0 for g in grads.values()), f"{ffn}: an adapter got no gradient"


def test_fast_cpu_step_never_runs_base_weights_under_an_adapter(monkeypatch) -> None:
    """On a plain CPU the fast model decodes one token in C++ from the weights it reads itself:
    with an adapter attached it must not (the PyTorch path runs the adapter), and cached decoding
    equals the merged model's, whose step does run in C++."""
    decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
    if decode_step_cpu.load() is None:
        pytest.skip(f"the C++ step does not build here: {decode_step_cpu.BUILD_ERROR}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = [0]
    original = decode_step_cpu.DecodeStepCPU.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(decode_step_cpu.DecodeStepCPU, "__call__", counted)
    torch.manual_seed(0)
    base = wiola.fast.WiolaModel(CONFIG).eval()
    lora = _lora(base)
    merged = copy.deepcopy(lora).merge_and_unload()
    prompt, token = torch.randint(0, 300, (2, 7)), torch.randint(0, 300, (2, 1))
    steps = {}
    with torch.no_grad():
        for name, model in (("adapters", lora), ("merged", merged), ("base", base)):
            cache = model.new_cache(2, 16)
            model(prompt, cache=cache)
            before = calls[0]
            steps[name] = model(token, cache=cache).logits
            steps[f"{name} C++"] = calls[0] - before
    assert steps["merged C++"] == 1 and steps["base C++"] == 1, "the C++ step did not run where it should"
    assert steps["adapters C++"] == 0, "the C++ step ran for a model with adapters (it reads the base weights)"
    assert rel_err(steps["base"], steps["adapters"]) > 100 * FP32
    # the two sides sum in other orders (the merged W + s·B·A rounded once, the C++ step's blocks):
    # the two-sided fp32 bound on the head's magnitudes of this step, read from a PyTorch pass
    with AbsSums(merged) as sums, wiola.fast.use_kernels(False), torch.no_grad():
        merged(torch.cat([prompt, token], dim=1))
    allowed = bound(CONFIG, prompt.shape[1] + 1, sums.head[:, -1:])
    isa = decode_step_cpu.select_isa()
    assert_within("cached step: adapters vs merged (C++)", steps["adapters"], steps["merged"], allowed, isa)
    out_lora = lora.generate(prompt, 5, temperature=0)
    assert torch.equal(out_lora, merged.generate(prompt, 5, temperature=0))


@pytest.mark.parametrize(
    "targets", [ADAPTER_TARGETS, ("q_proj",), ("bypass_proj", "down_proj")], ids=["all", "q", "ffn"]
)
def test_adapted_row_is_the_same_alone_and_in_a_batch(targets, monkeypatch) -> None:
    """On a plain CPU an adapted fast model decodes on the PyTorch path (the C++ step reads the
    base weights), yet a row's prompt logits (every position; prompts of 5 and 70 tokens, either
    side of the 64 positions a sequence that the step's product takes), each of 4 steps after them
    and its greedy tokens are bitwise the same alone and as row 3 of 8: peft's products run a
    sequence at a time (``wiola.ops.linear.SequenceLinears``) and a step's attention, norms and
    butterfly middle in C++. Before that, the 5-token prompt and every step differed."""
    decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
    if decode_step_cpu.load() is None:
        pytest.skip(f"the C++ step does not build here: {decode_step_cpu.BUILD_ERROR}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a plain CPU: no kernels under the interpreter
    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_seq_len=96)
    lora = _lora(wiola.fast.WiolaModel(config).eval(), targets)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for T in (5, 70):
            ids = torch.randint(0, 300, (8, T), generator=gen)
            steps = torch.randint(0, 300, (8, 4), generator=gen)
            alone, batch = lora.new_cache(1, T + 4), lora.new_cache(8, T + 4)
            one, all_rows = lora(ids[3:4], cache=alone).logits[0], lora(ids, cache=batch).logits[3]
            assert torch.equal(one, all_rows), f"{targets} T {T}: prompt logits alone != row 3 of 8"
            for s in range(4):
                one = lora(steps[3:4, s : s + 1], cache=alone).logits[0]
                all_rows = lora(steps[:, s : s + 1], cache=batch).logits[3]
                assert torch.equal(one, all_rows), f"{targets} T {T}: step {s} alone != row 3 of 8"
            tokens = lora.generate(ids, 4, temperature=0)
            assert torch.equal(lora.generate(ids[3:4], 4, temperature=0)[0], tokens[3]), f"{targets} T {T}: tokens"


def test_adapter_on_the_embedding_is_refused() -> None:
    model = wiola.WiolaModel(CONFIG)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["embed"]))
    with pytest.raises(ValueError, match="adapter on the embedding is not supported"):
        wrapped(torch.tensor([[1, 2]]))


@pytest.mark.slow
def test_cli_lora_finetune_saves_peft_format_and_merges(tmp_path) -> None:
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer
    from wiola.train.finetune import load_finetuned

    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
    base = wiola.WiolaModel(config)
    base.save_pretrained(tmp_path / "base", load_tokenizer("gpt2-32k"))
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(chat) + "\n")
    args = ["finetune", "--init", str(tmp_path / "base"), "--data", str(tmp_path / "d.jsonl"), "--no-progress"]
    args += ["--out", str(tmp_path / "lora"), "--steps", "3", "--batch-size", "1", "--lr", "1e-2"]
    assert main([*args, "--lora-rank", "2", "--lora-targets", "q_proj,v_proj,down_proj"]) == 0
    saved = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert saved["r"] == 2 and sorted(saved["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert saved["lora_alpha"] == 4, "--lora-alpha defaults to 2 x rank (SPEC)"
    lora, tok = load_finetuned(tmp_path / "lora")
    assert isinstance(lora, peft.PeftModel) and tok.chat_template is not None
    # only the adapters trained: the base weights under them are the checkpoint's
    state = lora.get_base_model().state_dict()
    assert torch.equal(state["layers.0.attn.q_proj.base_layer.weight"], base.layers[0].attn.q_proj.weight)
    assert main(["merge", "--adapter", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    merged = wiola.WiolaModel.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        lo = lora(ids).logits
        assert (lo - base.eval()(ids).logits).abs().max() > 0, "training left the adapters at zero"
        assert_close("merged checkpoint vs adapters", lo, merged(ids).logits, FP32)
    assert main([*args, "--lora-rank", "2", "--lora-targets", "embed"]) == 2
    assert main([*args, "--lora-rank", "2", "--lora-targets", " q_proj, v_proj,", "--overwrite"]) == 0  # as written
    saved = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"], saved["target_modules"]


def test_cli_lora_finetune_repeats_with_its_seed(tmp_path) -> None:
    """The adapters' random init is the seed's too: two runs with one --seed save bitwise-equal
    adapters (whatever the process's random state before), another seed other ones."""
    from safetensors.torch import load_file

    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_seq_len=64)
    wiola.WiolaModel(config).save_pretrained(tmp_path / "base", load_tokenizer("gpt2-32k"))
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(chat) + "\n")
    args = ["finetune", "--init", str(tmp_path / "base"), "--data", str(tmp_path / "d.jsonl"), "--no-progress"]
    args += ["--steps", "2", "--batch-size", "1", "--lora-rank", "2", "--lora-targets", "q_proj,v_proj"]
    saved = {}
    for out, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        torch.rand(7)  # the process's random state moves between runs
        assert main([*args, "--out", str(tmp_path / out), "--seed", seed]) == 0
        saved[out] = load_file(str(tmp_path / out / "adapter_model.safetensors"))
    assert saved["a"].keys() == saved["b"].keys() and all(torch.equal(saved["a"][k], saved["b"][k]) for k in saved["a"])
    assert any(not torch.equal(saved["a"][k], saved["c"][k]) for k in saved["a"])


def test_quantizing_a_model_with_adapters_is_refused() -> None:
    from wiola.fast.quantize import quantize

    model = _lora(wiola.fast.WiolaModel(CONFIG)).get_base_model().eval().requires_grad_(False)
    assert has_adapters(model)
    with pytest.raises(ValueError, match="has adapters attached .* fold them into its weights first"):
        quantize(model, "int8")


def test_rows_run_the_adapter_not_the_base_weights(monkeypatch) -> None:
    """``wiola.fast.rows.Rows`` (the server's batch) binds the C++ step only where it applies: with
    an adapter attached it steps on PyTorch, and a row's greedy tokens are the adapted model's
    own ``generate``."""
    from wiola.fast.rows import RowRequest, Rows

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    lora = _lora(wiola.fast.WiolaModel(CONFIG).eval())
    prompt = torch.randint(0, 300, (1, 5))
    with torch.no_grad():
        rows = Rows(lora, max_rows=2)
        assert rows.backend == "PyTorch", "the C++ step would read the base weights under an adapter"
        row, tokens = rows.join(RowRequest(prompt=prompt[0].tolist(), max_new_tokens=6)), []
        while row in rows.live:
            tokens += [t.token for t in rows.step() if t.row == row]
        expected = lora.generate(prompt, 6)[0, 5:].tolist()
    assert tokens == expected, f"Rows under an adapter: {tokens} != generate's {expected}"


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory):
    """A base (d_model 32, gpt2-32k) and a LoRA folder on it as `wiola finetune --lora-rank` writes one."""
    from wiola.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
    base = wiola.WiolaModel(config)
    base.save_pretrained(root / "base", load_tokenizer("gpt2-32k"))
    lora = _lora(base)
    lora.peft_config["default"].base_model_name_or_path = str(root / "base")
    lora.save_pretrained(str(root / "lora"), save_embedding_layers=False)
    return root


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"wiola {command}: error: "), err
    return err[0]


def test_cli_lora_rank_above_the_narrowest_projection_is_refused(adapter_folder, tmp_path, capsys) -> None:
    """--lora-rank 33 on a d_model 32 model is no low-rank update (its adapters outweigh the
    weights): exit 2 naming the flag and the width, nothing written."""
    from wiola.cli import main

    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(chat) + "\n")
    args = ["finetune", "--init", str(adapter_folder / "base"), "--data", str(tmp_path / "d.jsonl")]
    args += ["--out", str(tmp_path / "o"), "--steps", "1", "--no-progress"]
    assert main([*args, "--lora-rank", "33"]) == 2
    assert "--lora-rank 33 exceeds the smallest adapted projection (32)" in _one_error_line(capsys, "finetune")
    assert main([*args, "--lora-rank", "49", "--lora-targets", "up_proj"]) == 2  # d -> 2 d_ff: 32 wide on one side
    assert "--lora-rank 49 exceeds the smallest adapted projection (32)" in _one_error_line(capsys, "finetune")
    assert not (tmp_path / "o").exists()
    assert main([*args, "--lora-rank", "32"]) == 0, "a rank equal to the narrowest projection is taken"
    assert json.loads((tmp_path / "o" / "adapter_config.json").read_text())["r"] == 32


def test_cli_adapter_folder_without_weights_is_one_line_without_the_hub(adapter_folder, tmp_path, monkeypatch, capsys):
    """A LoRA folder whose adapter_model.safetensors is gone: merge and chat exit 2 with one line
    naming the file, and peft (which would look for it on the Hub) is never asked."""
    import shutil

    from wiola.cli import main

    def no_hub(*_, **__):
        raise AssertionError("peft was asked to load adapters whose weights file is missing")

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", no_hub)
    shutil.copytree(adapter_folder / "lora", tmp_path / "lora")
    (tmp_path / "lora" / "adapter_model.safetensors").unlink()
    missing = f"{tmp_path / 'lora'} holds adapter_config.json but no adapter_model.safetensors"
    assert main(["merge", "--adapter", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 2
    assert missing in _one_error_line(capsys, "merge")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n"))
    assert main(["chat", "--checkpoint", str(tmp_path / "lora")]) == 2
    assert missing in _one_error_line(capsys, "chat")
    assert not (tmp_path / "merged").exists()


def test_cli_adapters_on_a_base_of_another_shape_are_one_line(adapter_folder, tmp_path, capsys) -> None:
    """Adapters trained on a d_model 32 base, merged onto a d_model 16 one (--base): exit 2 with
    one line naming the first projection that differs and both widths, not torch's list of every
    mismatched tensor; the same for a base with fewer layers (a projection it lacks)."""
    from wiola.cli import main
    from wiola.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("gpt2-32k")
    narrow = wiola.WiolaConfig(vocab_size=32000, d_model=16, n_layers=2, n_heads=2, d_ff=48, max_seq_len=64)
    wiola.WiolaModel(narrow).save_pretrained(tmp_path / "narrow", tokenizer)
    shallow = dataclasses.replace(narrow, d_model=32, n_heads=4, n_layers=1)
    wiola.WiolaModel(shallow).save_pretrained(tmp_path / "shallow", tokenizer)
    adapters = str(adapter_folder / "lora")
    assert main(["merge", "--adapter", adapters, "--out", str(tmp_path / "m"), "--base", str(tmp_path / "narrow")]) == 2
    line = _one_error_line(capsys, "merge")
    assert "were trained on a base of another shape: layers.0.attn." in line, line
    assert "has 32 inputs there, 16 in the base" in line, line
    assert (
        main(["merge", "--adapter", adapters, "--out", str(tmp_path / "m"), "--base", str(tmp_path / "shallow")]) == 2
    )
    assert "adapt layers.1." in _one_error_line(capsys, "merge") and not (tmp_path / "m").exists()


def test_cli_quantized_base_or_init_is_one_line_naming_the_way(adapter_folder, tmp_path, capsys) -> None:
    """Merging into, or fine-tuning, an int8 checkpoint: exit 2, one line saying to use the
    full-precision checkpoint and quantize the result, before anything is loaded or written."""
    from wiola.cli import main
    from wiola.fast import WiolaModel as Fast
    from wiola.fast.quantize import quantize
    from wiola.tokenizer import load_tokenizer

    base = Fast.from_pretrained(adapter_folder / "base").eval().requires_grad_(False)
    quantize(base, "int8").save_pretrained(tmp_path / "int8", load_tokenizer("gpt2-32k"))
    adapters = str(adapter_folder / "lora")
    assert main(["merge", "--adapter", adapters, "--out", str(tmp_path / "m"), "--base", str(tmp_path / "int8")]) == 2
    line = _one_error_line(capsys, "merge")
    assert "holds int8-quantized weights, which only decode: merge the adapters into its full-precision" in line
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    args = ["finetune", "--init", str(tmp_path / "int8"), "--data", str(data), "--out", str(tmp_path / "f")]
    assert main([*args, "--steps", "1", "--no-progress"]) == 2
    assert "holds int8-quantized weights, which only decode: fine-tune its full-precision" in _one_error_line(
        capsys, "finetune"
    )
    assert not (tmp_path / "m").exists() and not (tmp_path / "f").exists()


def test_cli_merge_overwrite_leaves_no_file_of_the_old_model(adapter_folder, tmp_path, capsys) -> None:
    """merge --overwrite over a transformers checkpoint in shards (either kind) with its generation
    config and over an ONNX export: none of their files stays beside the merged model (the stale
    generation_config.json would change its eos id), a file of the user's does."""
    from wiola.cli import main

    adapters = str(adapter_folder / "lora")
    stale = [
        "config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-00002-of-00002.bin", "model.onnx",
        "model.onnx.data", "wiola_onnx.json", "run_onnx.py", "special_tokens_map.json", "tokenizer.json",
    ]  # fmt: skip
    out = tmp_path / "merged"
    out.mkdir()
    for name in stale:
        (out / name).write_text(f"the old {name}")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    (out / "notes.txt").write_text("mine")
    assert main(["merge", "--adapter", adapters, "--out", str(out)]) == 2
    assert "already holds a model or adapters (config.json, model.safetensors.index.json" in _one_error_line(
        capsys, "merge"
    )
    assert main(["merge", "--adapter", adapters, "--out", str(out), "--overwrite"]) == 0
    left = sorted(p.name for p in out.iterdir())
    assert left == ["config.json", "model.safetensors", "notes.txt"], left
    base = wiola.WiolaModel.from_pretrained(adapter_folder / "base").config
    assert wiola.WiolaModel.from_pretrained(out).config == base


LORA_HUB_SCRIPT = r"""
import json, sys
from wiola.cli import main
from wiola.train.finetune import load_finetuned
repo, data, out = sys.argv[1:4]
code = main(["finetune", "--init", repo, "--data", data, "--out", out, "--lora-rank", "2", "--steps", "1",
             "--batch-size", "1", "--no-progress"])
saved = json.loads(open(out + "/adapter_config.json").read())
print(f"rc={code} base={saved['base_model_name_or_path']} revision={saved['revision']}")
model, tokenizer = load_finetuned(out)
print(f"loaded={type(model).__name__}")
print(f"merge_rc={main(['merge', '--adapter', out, '--out', out + '-merged'])}")
"""


def test_lora_adapters_on_a_hub_base_name_it_by_its_id_and_commit(tmp_path):
    """``wiola finetune --init org/name --lora-rank``: the adapters record the Hub id and the commit
    of the snapshot trained on (peft's revision), not a path into the local cache, and load and
    merge on it later from the cache offline."""
    from test_published import REPO, REVISION, ROOT, _hub_cache

    from wiola.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = wiola.WiolaConfig(vocab_size=32000, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_seq_len=64)
    wiola.WiolaModel(config).save_pretrained(tmp_path / "base", load_tokenizer("gpt2-32k"))
    cache = _hub_cache(tmp_path / "hub", tmp_path / "base")
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(chat) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    env["PYTHONPATH"] = str(ROOT)
    args = [REPO, str(tmp_path / "d.jsonl"), str(tmp_path / "lora")]
    proc = subprocess.run(
        [sys.executable, "-c", LORA_HUB_SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert f"rc=0 base={REPO} revision={REVISION}" in proc.stdout, proc.stdout
    assert "loaded=PeftModel" in proc.stdout and "merge_rc=0" in proc.stdout, proc.stdout + proc.stderr
    merged = wiola.WiolaModel.from_pretrained(tmp_path / "lora-merged")
    assert merged.config == wiola.WiolaModel.from_pretrained(tmp_path / "base").config
