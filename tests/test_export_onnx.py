"""``wiola export --format onnx``: the exported step runs in ONNX Runtime's Python API and decodes
the greedy tokens of the model it came from (fp32: the reference; int8/int4/bf16: our quantized model,
whose oracle is the PyTorch path on the dequantized weights), the folder runs without torch, and
what cannot be exported is refused by name."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from numerics import AbsSums, assert_within, bound, left_padded_prompt, reference_on

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")

from wiola import WiolaConfig, WiolaModel  # noqa: E402
from wiola.cli import main as cli_main  # noqa: E402
from wiola.export.onnx import OPSET, export_onnx  # noqa: E402
from wiola.export.runner import META_FILE, MODEL_FILE, OnnxModel, read_meta  # noqa: E402
from wiola.fast import WiolaModel as FastModel  # noqa: E402
from wiola.fast.quantize import GROUP, quantize  # noqa: E402
from wiola.tokenizer import train_tokenizer  # noqa: E402

# Large init: peaked distributions, so greedy choices are far from ties (an exact comparison
# of tokens then tests the function, not the summation order of two libraries).
SMALL = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64, init_std=0.2)
MODES = ("fp32", "int8", "int4", "bf16", "int8-matmul", "int4-matmul")


def _model() -> FastModel:
    torch.manual_seed(0)
    return FastModel(WiolaConfig(**SMALL)).eval().requires_grad_(False)


def _quantized(mode: str) -> FastModel:
    model = _model()
    return model if mode == "fp32" else quantize(model, mode.removesuffix("-matmul"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for mode in MODES:
        folder = tmp_path_factory.mktemp(mode)
        export_onnx(_quantized(mode), folder, int8_matmul=mode.endswith("-matmul"))
        out[mode] = folder
    return out


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4", "bf16"])
@pytest.mark.parametrize("B, pad", [(1, 0), (4, 5)])
def test_greedy_tokens_equal_the_oracle(exports: dict[str, Path], mode: str, B: int, pad: int) -> None:
    ref = reference_on(_quantized(mode))
    ids, mask = left_padded_prompt(SMALL["vocab_size"], B, 12, pad)
    want = ref.generate(ids, 40, attention_mask=mask)
    got = OnnxModel(exports[mode]).generate(ids.numpy(), 40, attention_mask=mask.numpy())
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("overrides", [{"gate": False}, {"gate_pre_rope": False}], ids=["no-gate", "gate-after-rope"])
def test_gate_variants_export(tmp_path: Path, overrides: dict) -> None:
    torch.manual_seed(1)
    model = WiolaModel(WiolaConfig(**{**SMALL, **overrides})).eval().requires_grad_(False)
    export_onnx(model, tmp_path)
    ids, mask = left_padded_prompt(SMALL["vocab_size"], 3, 10, 4)
    want = model.generate(ids, 20, attention_mask=mask)
    got = OnnxModel(tmp_path).generate(ids.numpy(), 20, attention_mask=mask.numpy())
    np.testing.assert_array_equal(got, want.numpy())


def _onnx_vs_oracle(folder: Path, mode: str, label: str) -> None:
    """Every real position's logits, stepped through the export, within the fp32 error bound of
    the PyTorch full pass on the (dequantized) weights."""
    ref = reference_on(_quantized(mode))
    ids, mask = left_padded_prompt(SMALL["vocab_size"], 3, 16, 6)
    with AbsSums(ref) as sums:
        want = ref(ids, attention_mask=mask).logits
    logits: list[np.ndarray] = []
    OnnxModel(folder).driver.generate(ids.numpy(), 0, attention_mask=mask.numpy(), logits_out=logits)
    got = torch.from_numpy(np.stack(logits, axis=1))
    real = mask.bool()
    allowed = bound(ref.config, ids.shape[1], sums.head)[real]
    assert_within(f"{label} logits", want[real], got[real], allowed, "ONNX Runtime CPU")


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4", "bf16"])
def test_logits_equal_the_full_pass(exports: dict[str, Path], mode: str) -> None:
    _onnx_vs_oracle(exports[mode], mode, mode)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int8_matmul_runs_int8_products_close_to_the_oracle(exports: dict[str, Path], scheme: str) -> None:
    """Every MatMulNBits node of the export (accuracy level 4), run alone in ONNX Runtime on its own
    initializers, against the oracle's (dequantized) matrix of the same name, in float64:

    - activations that int8 holds exactly (integers up to 127 times a power of two, each 16
      inputs holding ±127): level 4's rounding of them is exact, so the product is the oracle's
      up to fp32 rounding, ``λ·√K·u·Σ|w·x|`` (one fp32 side against float64, ``tests/numerics.py``);
    - random activations: each is rounded to int8 on its block's scale ``s_b = max|x_b| / 127``
      (the node's ``block_size`` inputs; ONNX Runtime's MLAS, ``QuantizeARow_CompInt8``), an error
      of at most ``s_b / 2`` an input, so an output moves by at most ``Σ_b (s_b / 2)·Σ_{k∈b}|w_k|``
      beyond the fp32 bound; and somewhere by more than the fp32 bound alone (the rounding is in
      effect: level 4, not the oracle's function).

    The graph around these nodes is the level-0 export's (``_same_graph_but_the_level``), whose
    logits are within the fp32 bound of the oracle."""
    graph = onnx.load(str(exports[f"{scheme}-matmul"] / MODEL_FILE), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    assert len(nbits) == 1 + 7 * SMALL["n_layers"]  # the head and every layer's seven matrices
    attrs = {(a.name, a.i) for n in nbits for a in n.attribute if a.name in ("bits", "block_size", "accuracy_level")}
    assert {a for a in attrs if a[0] == "accuracy_level"} == {("accuracy_level", 4)}, attrs
    if scheme == "int4":
        assert attrs == {("bits", 4), ("block_size", GROUP), ("accuracy_level", 4)}, attrs
    biggest_float = max(
        (int(np.prod(t.dims)) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT), default=0
    )
    assert biggest_float < SMALL["d_model"] * SMALL["vocab_size"] // 4, "an fp32 copy of a matrix is stored"
    matrices = _oracle_matrices(reference_on(_quantized(scheme)))
    assert sorted(n.input[1] for n in nbits) == sorted(matrices)
    gen = torch.Generator().manual_seed(0)
    for node in nbits:
        _nbits_node_within_its_bound(graph, node, matrices[node.input[1]], gen)


def _oracle_matrices(ref: WiolaModel) -> dict[str, torch.Tensor]:
    """The oracle's matrices by the export's initializer names (``embed.weight``,
    ``matrices.{layer}.{projection}.weight``), float64."""
    out = {"embed.weight": ref.embed.weight.detach().double()}
    for i, layer in enumerate(ref.layers):
        for part, names in (
            ("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("ffn", ("up_proj", "bypass_proj", "down_proj")),
        ):
            for name in names:
                out[f"matrices.{i}.{name}.weight"] = layer.get_submodule(f"{part}.{name}").weight.detach().double()
    return out


def _nbits_node_within_its_bound(graph: onnx.GraphProto, node: onnx.NodeProto, w: torch.Tensor, gen) -> None:
    """``node`` alone in ONNX Runtime against ``x · wᵀ`` (``w`` the oracle's matrix, float64): see
    ``test_int8_matmul_runs_int8_products_close_to_the_oracle``."""
    import onnxruntime as ort
    from numerics import LAMBDA, U32

    attrs = {a.name: a.i for a in node.attribute}
    K, N, block = attrs["K"], attrs["N"], attrs["block_size"]
    assert w.shape == (N, K), f"{node.input[1]}: oracle {tuple(w.shape)} != (N, K) = ({N}, {K})"
    inits = {t.name: t for t in graph.initializer}
    helper = onnx.helper
    one = helper.make_graph(
        [helper.make_node("MatMulNBits", ["A", *node.input[1:]], ["Y"], domain="com.microsoft", **attrs)],
        "one_product",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["M", N])],
        [inits[name] for name in node.input[1:]],
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model = helper.make_model(one, opset_imports=opsets).SerializeToString()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    M, name = 8, f"{node.input[1]} (MatMulNBits bits={attrs['bits']}, block {block}, level {attrs['accuracy_level']})"

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        got = torch.from_numpy(session.run(None, {"A": x.numpy()})[0]).double()
        x = x.double()
        return got, x @ w.T, LAMBDA * math.sqrt(K) * U32 * (x.abs() @ w.abs().T)

    # Exactly int8: j·2^e with |j| <= 127 and ±127 first in every 16 inputs (so in every block).
    j = torch.randint(-127, 128, (M, K), generator=gen)
    j[:, ::16] = 127 * (2 * torch.randint(0, 2, (M, K // 16), generator=gen) - 1)
    got, want, fp32 = run((j * 2.0 ** torch.randint(-8, 3, (M, 1), generator=gen)).float())
    assert_within(f"{name}, int8-exact activations", want, got, fp32, "ONNX Runtime CPU")

    x = torch.randn(M, K, generator=gen)
    got, want, fp32 = run(x)
    half_step = x.double().abs().view(M, K // block, block).amax(-1) / 127 / 2  # (M, blocks): s_b / 2
    rounding = half_step @ w.abs().view(N, K // block, block).sum(-1).T  # Σ_b (s_b / 2)·Σ_{k∈b} |w_k|
    assert_within(f"{name}, int8-rounded activations", want, got, rounding + fp32, "ONNX Runtime CPU")
    assert float(((got - want).abs() / fp32).max()) > 1, f"{name}: no activation was rounded (not level 4?)"


def _weight_bytes(folder: Path) -> int:
    graph = onnx.load(str(folder / MODEL_FILE)).graph
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in graph.initializer)


def test_int8_matmul_at_accuracy_level_0_is_exact(exports: dict[str, Path], tmp_path: Path) -> None:
    """MatMulNBits with fp32 products (level 0, for comparisons): the oracle's greedy tokens, its
    logits within the fp32 bound; the graph is the level-4 export's but for the level."""
    export_onnx(_quantized("int8"), tmp_path, int8_matmul=True, accuracy_level=0)
    graph = onnx.load(str(tmp_path / MODEL_FILE)).graph
    levels = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {0}
    _same_graph_but_the_level(tmp_path, exports["int8-matmul"])
    _onnx_vs_oracle(tmp_path, "int8", "int8 MatMulNBits level 0")
    ids, mask = left_padded_prompt(SMALL["vocab_size"], 3, 12, 4)
    want = reference_on(_quantized("int8")).generate(ids, 30, attention_mask=mask)
    got = OnnxModel(tmp_path).generate(ids.numpy(), 30, attention_mask=mask.numpy())
    np.testing.assert_array_equal(got, want.numpy())
    with pytest.raises(ValueError, match="accuracy_level must be one of"):
        export_onnx(_quantized("int8"), tmp_path / "x", int8_matmul=True, accuracy_level=7)


def test_int4_matmul_at_accuracy_level_0_is_within_the_bound(exports: dict[str, Path], tmp_path: Path) -> None:
    """4-bit MatMulNBits with fp32 products (level 0): the oracle's function, up to fp32 rounding;
    the graph is the level-4 export's but for the level."""
    export_onnx(_quantized("int4"), tmp_path, int8_matmul=True, accuracy_level=0)
    _same_graph_but_the_level(tmp_path, exports["int4-matmul"])
    _onnx_vs_oracle(tmp_path, "int4", "int4 MatMulNBits level 0")


def _same_graph_but_the_level(level_0: Path, level_4: Path) -> None:
    """The two exports' nodes (but for MatMulNBits' ``accuracy_level``), initializers, inputs and
    outputs are the same: what the level-0 export's logits show of the graph holds for the
    level-4 one, whose products are checked alone
    (``test_int8_matmul_runs_int8_products_close_to_the_oracle``)."""

    def parts(folder: Path) -> dict[str, list[bytes]]:
        graph = onnx.load(str(folder / MODEL_FILE)).graph
        nodes = []
        for node in graph.node:
            bare = onnx.NodeProto()
            bare.CopyFrom(node)
            kept = [a for a in bare.attribute if a.name != "accuracy_level"]
            del bare.attribute[:]
            bare.attribute.extend(kept)
            nodes.append(bare.SerializeToString())
        return {
            "nodes": nodes,
            "initializers": sorted(t.SerializeToString() for t in graph.initializer),
            "inputs": [v.SerializeToString() for v in graph.input],
            "outputs": [v.SerializeToString() for v in graph.output],
        }

    a, b = parts(level_0), parts(level_4)
    for key in a:
        assert a[key] == b[key], f"the level-0 and level-4 exports' {key} differ"


def test_quantized_exports_are_smaller_and_recorded(exports: dict[str, Path]) -> None:
    size = {mode: _weight_bytes(folder) for mode, folder in exports.items()}
    assert size["int8"] < 0.3 * size["fp32"] and size["int8-matmul"] < 0.3 * size["fp32"]
    assert size["int4"] < 0.17 * size["fp32"] and size["int4-matmul"] < 0.17 * size["fp32"]  # 5 of 32 bits
    assert 0.45 * size["fp32"] < size["bf16"] < 0.55 * size["fp32"]
    for mode, folder in exports.items():
        meta = read_meta(folder)
        assert meta["quantization"] == (None if mode == "fp32" else mode.removesuffix("-matmul"))
        assert meta["int8_matmul"] == mode.endswith("-matmul")
        assert (meta["n_layers"], meta["head_dim"], meta["max_seq_len"]) == (2, 16, 64)


def test_the_folder_runs_without_torch(tmp_path: Path) -> None:
    """``run_onnx.py`` (the copy in the export) with torch and wiola made unimportable."""
    tok = train_tokenizer(
        ["Once upon a time there was a little cat. The cat sat on a mat."] * 50, 300, show_progress=False
    )
    model = _model()
    export_onnx(model, tmp_path, tok)
    prompt = "Once upon a time"
    ids = torch.tensor([tok.encode(prompt)])
    want = prompt + tok.decode(reference_on(model).generate(ids, 12)[0, ids.shape[1] :].tolist())  # as wiola generate
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None
        sys.modules["wiola"] = None
        sys.path.insert(0, {str(tmp_path)!r})
        import run_onnx
        sys.exit(run_onnx.main([{str(tmp_path)!r}, "--prompt", {prompt!r}, "--max-new-tokens", "12"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == want
    too_long = script.replace('"12"]', '"600"]')
    done = subprocess.run([sys.executable, "-c", too_long], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "run_onnx: error:" in done.stderr and "past max_seq_len=64" in done.stderr


def test_the_runner_decodes_as_wiola_a_cleaning_tokenizer_and_names_a_damaged_one(tmp_path: Path) -> None:
    """The standalone runner's copy of the clean-up table is wiola.tokenizer's, and with
    ``clean_up_tokenization_spaces`` it decodes as the tokenizer does (as ``wiola generate``
    prints); a damaged ``tokenizer.json`` is a ``ValueError`` (run_onnx.py: one line, exit 2)."""
    from wiola.export import runner
    from wiola.tokenizer import CLEAN_UP_REPLACEMENTS, load_tokenizer

    assert runner.CLEAN_UP_REPLACEMENTS == CLEAN_UP_REPLACEMENTS
    train_tokenizer(["Once upon a time , there was a cat . It is n't here ! "] * 30, 300, show_progress=False).save(
        tmp_path / "tok"
    )
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    tok = load_tokenizer(tmp_path / "tok")
    export_onnx(_model(), tmp_path / "x", tok)
    ids = tok.encode_batch(["a . . It is n't here , ok ! 's"])[0]
    assert OnnxModel(tmp_path / "x").decode(ids) == tok.decode(ids) == "a.. It isn't here, ok!'s"
    (tmp_path / "x" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizers file"):
        OnnxModel(tmp_path / "x").decode(ids)


def test_cli_exports_a_checkpoint_with_its_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = train_tokenizer(["The dog ran to the park and the sun was warm."] * 50, 300, show_progress=False)
    model = _model()
    model.save_pretrained(tmp_path / "ckpt", tok)
    assert cli_main(["export", "--format", "onnx", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x"), "--quantize", "int8"]) == 0  # fmt: skip
    assert "int8" in capsys.readouterr().out
    exported = OnnxModel(tmp_path / "x")
    assert exported.meta["bos_token_id"] == tok.bos_token_id and exported.meta["eos_token_id"] == tok.eos_token_id
    ids = torch.tensor([tok.encode("The dog")])
    want = reference_on(quantize(copy.deepcopy(model), "int8")).generate(ids, 10, eos_token_id=tok.eos_token_id)
    got = exported.generate(ids.numpy(), 10)
    np.testing.assert_array_equal(got[:, : want.shape[1]], want.numpy())


def test_what_cannot_be_exported_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="int8_matmul needs an int8- or int4-quantized model.*not quantized"):
        export_onnx(_model(), tmp_path / "a", int8_matmul=True)
    with pytest.raises(ValueError, match="int8_matmul needs an int8- or int4-quantized model.*bf16"):
        export_onnx(quantize(_model(), "bf16"), tmp_path / "b", int8_matmul=True)
    with pytest.raises(ValueError, match="float16.*export an fp32"):
        export_onnx(WiolaModel(WiolaConfig(**SMALL)).half(), tmp_path / "c")
    with pytest.raises(ValueError, match="on meta; move it to the CPU"):
        export_onnx(WiolaModel(WiolaConfig(**SMALL)).to("meta"), tmp_path / "m")
    with pytest.raises(TypeError, match="expected a WiolaModel"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "d")  # type: ignore[arg-type]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        export_onnx(_model(), tmp_path / "file")
    odd = quantize(FastModel(WiolaConfig(**{**SMALL, "d_model": 72, "n_heads": 4, "d_ff": 100})).eval().requires_grad_(False), "int8")  # fmt: skip
    with pytest.raises(ValueError, match="72 inputs.*multiple of 16"):
        export_onnx(odd, tmp_path / "e", int8_matmul=True)
    tok = train_tokenizer(["A cat."] * 20, 300, show_progress=False)
    model = _model()
    model.save_pretrained(tmp_path / "ckpt", tok)
    args = ["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "f"), "--quantize", "int8"]
    assert cli_main(args) == 2
    assert "--quantize and --int8-matmul are for --format onnx" in capsys.readouterr().err
    quantize(model, "bf16").save_pretrained(tmp_path / "q", tok)
    args = ["export", "--format", "onnx", "--checkpoint", str(tmp_path / "q"), "--out", str(tmp_path / "g")]
    assert cli_main([*args, "--quantize", "int8"]) == 2
    assert "already bf16-quantized" in capsys.readouterr().err
    assert cli_main([*args, "--int8-matmul"]) == 2  # named by its flag, not the Python argument
    assert "--int8-matmul needs int8 or int4 weights, and the checkpoint" in capsys.readouterr().err


def test_a_folder_that_is_not_an_export_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a Wiola ONNX export"):
        OnnxModel(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(b"")
    (tmp_path / META_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="does not describe a Wiola ONNX export"):
        read_meta(tmp_path)
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_meta(tmp_path)
    (tmp_path / META_FILE).write_text(json.dumps({"format": "wiola-onnx", "format_version": 99}))
    with pytest.raises(ValueError, match="format version 99"):
        read_meta(tmp_path)
    sizes = {"n_layers": 2, "n_heads": 4, "head_dim": 16, "vocab_size": 320, "max_seq_len": 64}
    for damage, match in (
        ({"n_layers": None}, "n_layers must be a positive int, got None"),
        ({"vocab_size": 0}, "vocab_size must be a positive int, got 0"),
        ({"head_dim": "16"}, "head_dim must be a positive int, got '16'"),
        ({"eos_token_id": 320}, r"eos_token_id 320 is outside \[0, vocab_size=320\)"),
        ({"pad_token_id": 1.5}, "pad_token_id must be a single int or None, got float 1.5"),
    ):
        meta = {"format": "wiola-onnx", "format_version": 1, **sizes, **damage}
        (tmp_path / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))
        with pytest.raises(ValueError, match=match):
            read_meta(tmp_path)


def test_runner_checks_eos_pad_and_threads(exports: dict[str, Path]) -> None:
    """eos and pad ids are checked as ``generate`` checks them (an id outside the vocabulary
    would be written into the output), and so is the thread count; a prompt id past int64 is
    named as given, not as the value a cast would wrap it to."""
    exported = OnnxModel(exports["fp32"])
    ids = np.array([[5, 6, 7]])
    with pytest.raises(ValueError, match=rf"token id {2**64 - 1} is outside \[0, vocab_size=320\)"):
        exported.generate(np.array([[1, 2**64 - 1]], dtype=np.uint64), 3)
    for kwargs, error, match in (
        ({"eos_token_id": 9, "pad_token_id": -7}, ValueError, r"pad_token_id -7 is outside \[0, vocab_size=320\)"),
        ({"eos_token_id": -5}, ValueError, "eos_token_id -5 is outside"),
        ({"eos_token_id": "x"}, TypeError, "eos_token_id must be a single int or None, got str 'x'"),
        ({"eos_token_id": True}, TypeError, "eos_token_id must be a single int or None, got bool"),
    ):
        with pytest.raises(error, match=match):
            exported.generate(ids, 4, **kwargs)
    np.testing.assert_array_equal(
        exported.generate(ids, 4, eos_token_id=np.int64(9), pad_token_id=np.int32(3)),
        exported.generate(ids, 4, eos_token_id=9, pad_token_id=3),
    )
    fill = SMALL["max_seq_len"] - ids.shape[1]  # a prompt and new tokens that fill the context exactly
    want = reference_on(_quantized("fp32")).generate(torch.from_numpy(ids), fill)
    np.testing.assert_array_equal(exported.generate(ids, fill), want.numpy())
    with pytest.raises(ValueError, match=rf"3 prompt \+ {fill + 1} new tokens = 65 is past max_seq_len=64"):
        exported.generate(ids, fill + 1)
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive int or None"):
            OnnxModel(exports["fp32"], threads=threads)


def _checkpoint(tmp_path: Path) -> tuple[Path, object]:
    tok = train_tokenizer(["The dog ran to the park and the sun was warm."] * 50, 300, show_progress=False)
    _model().save_pretrained(tmp_path / "ckpt", tok)
    return tmp_path / "ckpt", tok


def test_cli_refuses_a_run_folder_and_names_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An --out that holds a training run is refused in either format (a model at its top would be
    what --checkpoint reads from then on), nothing written; --int8-matmul on fp32 weights names
    --quantize; the wiola13m format refuses quantized weights naming the format."""
    ckpt, _ = _checkpoint(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    for fmt in ("wiola13m", "onnx"):
        capsys.readouterr()
        assert cli_main(["export", "--format", fmt, "--checkpoint", str(ckpt), "--out", str(run)]) == 2
        assert "holds a training run" in capsys.readouterr().err
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert cli_main(["export", "--format", "onnx", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x"), "--int8-matmul"]) == 2  # fmt: skip
    assert "add --quantize int8" in capsys.readouterr().err
    quantized = quantize(FastModel.from_pretrained(ckpt).eval().requires_grad_(False), "int8")
    quantized.save_pretrained(tmp_path / "q8", _checkpoint(tmp_path / "t")[1])
    assert cli_main(["export", "--checkpoint", str(tmp_path / "q8"), "--out", str(tmp_path / "hf")]) == 2
    assert "int8 weights, which the wiola13m format cannot hold" in capsys.readouterr().err
    for flags in (["--int8-matmul"], ["--quantize", "int8"]):  # ONNX-only flags in the default format
        assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf2"), *flags]) == 2, flags
        assert "are for --format onnx; the wiola13m format stores fp32 weights" in capsys.readouterr().err
        assert not (tmp_path / "hf2").exists()


def test_cli_refuses_an_out_that_holds_a_model_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An --out that already holds a checkpoint or an export is refused (nothing in it changed),
    in either format; --overwrite replaces the whole model, so no file of the old one stays
    beside the new one (an ONNX export over a wiola13m one, and back)."""
    ckpt, _ = _checkpoint(tmp_path)
    other = tmp_path / "other"
    torch.manual_seed(1)
    WiolaModel(WiolaConfig(**SMALL)).save_pretrained(other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    for fmt in ("wiola13m", "onnx"):
        capsys.readouterr()
        assert cli_main(["export", "--format", fmt, "--checkpoint", str(ckpt), "--out", str(other)]) == 2
        err = capsys.readouterr().err
        assert "already holds a model (config.json, model.safetensors): pass --overwrite" in err, err
        assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    out = tmp_path / "out"
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    args = ["export", "--format", "onnx", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]
    assert cli_main(args) == 0
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert (out / MODEL_FILE).is_file() and (out / "tokenizer.json").is_file()
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert not (out / MODEL_FILE).exists() and not (out / META_FILE).exists() and not (out / "run_onnx.py").exists()
    got, want = WiolaModel.from_pretrained(out).state_dict(), WiolaModel.from_pretrained(ckpt).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    (out / "notes.txt").write_text("mine")  # a file of the user's is not part of a model: kept
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    spaced = tmp_path / "with space"
    capsys.readouterr()
    assert cli_main(["export", "--format", "onnx", "--checkpoint", str(ckpt), "--out", str(spaced)]) == 0
    assert f"run it: python '{spaced / 'run_onnx.py'}' '{spaced}'" in capsys.readouterr().out


def test_cli_without_the_export_extra_exits_2(tmp_path: Path, capsys, monkeypatch) -> None:
    """Without onnx installed, ``wiola export --format onnx`` says what to install, exit 2 (no traceback)."""
    ckpt, _ = _checkpoint(tmp_path)
    monkeypatch.setitem(sys.modules, "onnx", None)
    assert cli_main(["export", "--format", "onnx", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wiola export: error:") and "pip install" in err, err


def test_runner_text_stops_before_eos_and_bad_folders_exit_2(tmp_path: Path) -> None:
    """``generate_text`` is what ``wiola generate`` prints: the prompt as given (not the ``<s>`` this
    tokenizer puts before it), then the new text, ending before the eos token; an empty prompt is
    refused as ``wiola generate`` refuses it; a damaged model.onnx and a missing onnxruntime are
    exit 2 with a message."""
    ckpt, tok = _checkpoint(tmp_path)
    export_onnx(FastModel.from_pretrained(ckpt).eval().requires_grad_(False), tmp_path / "x", tok)
    exported = OnnxModel(tmp_path / "x")
    prompt = "The dog"
    ids = tok.encode(prompt)
    exported.meta["eos_token_id"] = None
    free = exported.generate(np.array([ids]), 6)[0].tolist()
    exported.meta["eos_token_id"] = free[len(ids) + 3]  # the 4th new token ends the row
    got = exported.generate_text(prompt, 6)
    cut = free.index(free[len(ids) + 3], len(ids))
    assert ids[0] == 1 and got == prompt + exported.tokenizer.decode(free[len(ids) : cut]), (got, free)
    with pytest.raises(ValueError, match="the prompt is empty"):
        exported.generate_text("", 6)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / META_FILE).write_text((tmp_path / "x" / META_FILE).read_text())
    (bad / MODEL_FILE).write_text("garbage")
    runner = str(tmp_path / "x" / "run_onnx.py")
    done = subprocess.run([sys.executable, runner, str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "run_onnx: error: ONNX Runtime cannot load" in done.stderr, done.stderr
    script = f"import sys; sys.modules['onnxruntime'] = None; sys.argv = ['run_onnx', {str(tmp_path / 'x')!r}]; exec(open({runner!r}).read())"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install onnxruntime" in done.stderr, done.stderr


def test_ctrl_c_during_the_export_exits_130_and_leaves_no_files(tmp_path: Path, monkeypatch, capsys) -> None:
    """Ctrl-C inside torch.export can come out as torch's own export error: the command still
    says it was interrupted (exit 130) and removes the folder it made."""
    import os
    import signal

    import wiola.export.onnx as onnx_module

    def interrupted(model, out, tokenizer, **kwargs):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "model.onnx").write_bytes(b"half")
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt as e:
            raise RuntimeError("Failed to export the model with torch.export") from e

    tok = train_tokenizer(["The dog ran to the park and the sun was warm."] * 50, 300, show_progress=False)
    _model().save_pretrained(tmp_path / "ckpt", tok)
    monkeypatch.setattr(onnx_module, "export_onnx", interrupted)
    before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN where a shell started the tests in the background
    code = cli_main(
        ["export", "--format", "onnx", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x")]
    )
    assert code == 130 and "wiola export: interrupted" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert signal.getsignal(signal.SIGINT) is before, "the handler before the export is not back"


def test_recorded_ids_are_the_configs_then_the_tokenizers_and_pad_falls_back_to_eos() -> None:
    """The ids an export records (``special_ids``): the model config's win over the tokenizer's,
    the tokenizer's fill the rest, and without a pad id anywhere pad is eos (not bos)."""
    from types import SimpleNamespace

    from wiola.export.onnx import special_ids
    from wiola.tokenizer import load_tokenizer

    gpt2 = load_tokenizer("gpt2")  # eos 50256, no bos or pad
    config = SimpleNamespace(bos_token_id=None, eos_token_id=7, pad_token_id=None)
    assert special_ids(config, gpt2) == {"bos_token_id": None, "eos_token_id": 7, "pad_token_id": 7}
    config = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    assert special_ids(config, None) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert special_ids(config, gpt2) == {"bos_token_id": None, "eos_token_id": 50256, "pad_token_id": 50256}
