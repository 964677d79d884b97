"""Weight-only int8 and bf16 quantization (``wiola.fast.quantize``) and the C++ CPU step on it.

The oracle is the reference model (``wiola.WiolaModel``, PyTorch) on the dequantized weights: the
C++ step on the packed matrices equals it to fp32 rounding (logits and cache), at batch 1 and 8,
with left padding and deep cache positions, in every instruction-set variant this CPU runs. The
packing itself is checked against hand-computed values (int8) and bit arithmetic (bf16). Also:
bad input, quantized checkpoints (safetensors + the record in ``config.json``), the dispatch of
``wiola.fast.WiolaModel`` and ``wiola generate --quantize``, and the packed matrices kept the
parameters' (other weights refused by ``load_state_dict``; weights changed another way never
decoded or saved beside the old packed ones).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re

import numpy as np
import pytest
import torch
from numerics import assert_within, cache_bound, left_padded_prompt, reference_on, step_beside

import wiola
import wiola.fast
from wiola.fast import ops as fast_ops
from wiola.fast import quantize as quantize_module
from wiola.fast.quantize import GROUP, dequantize, matrix_names, quantize, quantize_tensor, unpack_int4
from wiola.fast.rows import RowRequest, Rows

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
SCHEMES = ("int8", "int4", "bf16")

ODD = wiola.WiolaConfig(vocab_size=301, d_model=40, n_layers=2, n_heads=4, d_ff=72, max_seq_len=320)
SHAPE_13M = dataclasses.replace(wiola.WiolaConfig.preset("13m"), vocab_size=2000, n_layers=2)
# Rows that end in a part of a lane-packed chunk (docs/SPEC.md, "Products by weight type"): bf16 K
# = 184 and 216 leave 24 past whole chunks of 32 (AVX-512: one vector and 8 scalars); int4, fitted
# to 192 and 224, leaves 64 and 96 past a chunk of 128.
TAILS = wiola.WiolaConfig(vocab_size=301, d_model=184, n_layers=1, n_heads=4, d_ff=216, max_seq_len=320)
VARIANTS = {"odd": ODD, "no-gate": dataclasses.replace(ODD, gate=False), "13m-shape": SHAPE_13M, "tails": TAILS}


def fit(config: wiola.WiolaConfig, scheme: str) -> wiola.WiolaConfig:
    """``config``, for int4 with ``d_model`` and ``d_ff`` raised to multiples of the group (the odd
    vocabulary and head counts kept)."""
    if scheme != "int4":
        return config
    up = lambda n: -(-n // GROUP) * GROUP
    return dataclasses.replace(config, d_model=up(config.d_model), d_ff=up(config.d_ff))


def _quantized(config: wiola.WiolaConfig, scheme: str, seed: int = 0) -> wiola.fast.WiolaModel:
    config = fit(config, scheme)
    torch.manual_seed(seed)
    model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    with torch.no_grad():  # larger than the init: attention and the gates far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return quantize(model, scheme)


# ----------------------------------------------------------------------------- packing
def test_int8_packing_matches_hand_computed_values():
    w = torch.tensor([[0.5, -1.27, 0.01, 0.004], [0.0, 0.0, 0.0, 0.0], [2.54, 1.27, -0.635, 0.0]])
    q, scale = quantize_tensor(w, "int8")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.tolist() == [[50, -127, 1, 0], [0, 0, 0, 0], [127, 64, -32, 0]]  # 63.5 -> 64 (half to even)
    assert torch.allclose(scale, torch.tensor([0.01, 0.0, 0.02]), rtol=1e-7, atol=0)
    assert torch.equal(dequantize(q, scale)[1], torch.zeros(4))


def test_int4_packing_matches_hand_computed_values():
    """Groups of ``GROUP`` weights, scale max|w|/7, q = round(w/scale) in [-7, 7] (half to even),
    stored as q + 8, weight 2j in the low nibble of byte j."""
    w = torch.zeros(2, 2 * GROUP)
    w[0, :4] = torch.tensor([0.7, -0.35, 0.05, 0.25])  # group 0 of row 0: scale 0.1
    w[0, GROUP : GROUP + 2] = torch.tensor([-1.4, 0.3])  # group 1: scale 0.2, 0.3 / 0.2 = 1.5 -> 2
    packed, scale = quantize_tensor(w, "int4")
    assert packed.dtype == torch.uint8 and packed.shape == (2, GROUP) and scale.shape == (2, 2)
    assert torch.allclose(scale, torch.tensor([[0.1, 0.2], [0.0, 0.0]]), rtol=1e-7, atol=0)
    q = unpack_int4(packed)
    assert q[0, :4].tolist() == [7, -4, 0, 2]  # -3.5 -> -4, 0.5 -> 0, 2.5 -> 2 (half to even)
    assert q[0, GROUP : GROUP + 2].tolist() == [-7, 2] and not q[1].any()
    assert packed[0, 0] == (7 + 8) | ((-4 + 8) << 4) and packed[0, 1] == 8 | ((2 + 8) << 4)
    assert torch.equal(dequantize(packed, scale)[0, :4], torch.tensor([7.0, -4.0, 0.0, 2.0]) * scale[0, 0])
    assert torch.equal(dequantize(packed, scale)[1], torch.zeros(2 * GROUP))
    with pytest.raises(ValueError, match=f"K = 40 is not a multiple of the group size {GROUP}"):
        quantize_tensor(torch.ones(3, 40), "int4")


def test_bf16_packing_rounds_to_nearest_even():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 3
    packed, scale = quantize_tensor(w, "bf16")
    assert scale is None and packed.dtype == torch.bfloat16
    u = w.numpy().view(np.uint32).astype(np.uint64)
    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16  # round half to even on the upper 16 bits
    got = dequantize(packed, None).numpy().view(np.uint32)
    assert np.array_equal(got.astype(np.uint64), want)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_overwrites_parameters_with_the_dequantized_weights(scheme):
    model = _quantized(ODD, scheme)
    params = dict(model.named_parameters())
    for name in matrix_names(ODD.n_layers):
        q, scale = model.quantized[name]
        if scheme == "int8":
            assert torch.equal(params[name], q.float() * scale[:, None]), name
            assert q.abs().max() == 127  # every row's largest weight maps to ±127
        else:
            N, K = params[name].shape
            w = unpack_int4(q).float().view(N, K // GROUP, GROUP) * scale[..., None]
            assert torch.equal(params[name], w.view(N, K)), name
            assert (unpack_int4(q).view(N, -1, GROUP).abs().amax(-1) == 7).all()  # each group's largest: ±7
    assert quantize_module.is_stamped(model) and quantize_module.stale_matrices(model) == []
    assert model.layers[0].attn_norm.weight.dtype == torch.float32  # γ stays fp32


# ----------------------------------------------------------------------------- the step
@torch.inference_mode()
@pytest.mark.parametrize("B,prompt,steps,pad", [(1, 1, 5, 0), (8, 17, 6, 6), (2, 290, 4, 30)], ids=lambda v: str(v))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_step_matches_dequantized_oracle(scheme, variant, B, prompt, steps, pad, isa):
    """Logits and cache after each one-token step equal the reference on the dequantized weights."""
    config = fit(VARIANTS[variant], scheme)
    model = _quantized(config, scheme)
    ref = reference_on(model)
    ids, mask = left_padded_prompt(config.vocab_size, B, prompt, pad)
    S = prompt + steps
    ref_cache, cache = ref.new_cache(B, S), model.new_cache(B, S)
    ref(ids, attention_mask=mask, cache=ref_cache)
    ref(ids, attention_mask=mask, cache=cache)  # prefill: the dequantized PyTorch path
    step = decode_step_cpu.DecodeStepCPU(model, cache, isa=isa)
    assert step.quantization == scheme
    proj = step_beside(ref, ref_cache, step, cache, steps, f"{scheme} logits")
    allowed = cache_bound(config, S, proj, steps)
    real = ref_cache.key_mask[None, :, None, :, None].expand_as(ref_cache.k)
    assert torch.equal(ref_cache.key_mask, cache.key_mask) and torch.equal(ref_cache.n_real, cache.n_real)
    for name in ("k", "v"):
        assert_within(f"cache.{name}", getattr(ref_cache, name)[real], getattr(cache, name)[real], allowed[name], isa)
    assert_within("cache.gate_sum", ref_cache.gate_sum, cache.gate_sum, allowed["gate_sum"], isa)


@torch.inference_mode()
@pytest.mark.parametrize("scheme", SCHEMES)
def test_step_reads_the_packed_matrices(scheme):
    """The step streams the packed matrices, not the fp32 parameters: zeroing the parameters under
    a bound step changes nothing it computes (whereas the fp32 step then sees zeros)."""
    model = _quantized(ODD, scheme)
    ids = torch.randint(0, ODD.vocab_size, (2, 1), generator=torch.Generator().manual_seed(1))
    steps = [decode_step_cpu.DecodeStepCPU(model, model.new_cache(2, 4)) for _ in range(2)]
    before = steps[0](ids.view(-1), 0)
    for name in matrix_names(ODD.n_layers):
        dict(model.named_parameters())[name].zero_()
    after = steps[1](ids.view(-1), 0)
    assert torch.equal(before, after)


@torch.inference_mode()
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fast_model_generates_the_oracles_greedy_tokens(scheme, plain_cpu):
    model = _quantized(SHAPE_13M, scheme)
    ref = reference_on(model)
    ids, mask = left_padded_prompt(SHAPE_13M.vocab_size, 8, 16, 5)
    assert fast_ops.cpu_decode_step(model, ids[:, :1], model.new_cache(8, 4)) is not None
    want = ref.generate(ids, 12, attention_mask=mask, temperature=0)
    got = model.generate(ids, 12, attention_mask=mask, temperature=0)
    assert torch.equal(want, got)


def _fp32(config: wiola.WiolaConfig, seed: int) -> wiola.fast.WiolaModel:
    """``_quantized``'s fp32 model before quantizing."""
    torch.manual_seed(seed)
    model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_state_dict_of_other_weights_is_refused(scheme, tmp_path, plain_cpu):
    """Other fp32 weights loaded into a quantized model (in place, or assigned) are refused before
    anything is copied: the model keeps decoding and saving its own weights. Equal matrices (its own
    state dict) and the fp32 norms load; other weights quantized are a fresh ``quantize``'s."""
    model, other = _quantized(ODD, scheme), _fp32(fit(ODD, scheme), seed=1)
    ids = torch.tensor([[3, 7, 11, 5]])
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.inference_mode():
        tokens = model.generate(ids, 8)
    for assign in (False, True):
        with pytest.raises(ValueError, match=rf"load_state_dict: this model is {scheme}-quantized, and the state dict's embed.weight \(and 14 more matrices\) differs"):  # fmt: skip
            model.load_state_dict(other.state_dict(), assign=assign)
        for name, t in model.state_dict().items():
            assert torch.equal(t, before[name]), f"{name} changed by a refused load (assign={assign})"
    nudged = model.state_dict()  # its own weights but one element, by far less than a rounding step
    q = "layers.0.attn.q_proj.weight"
    nudged[q] = nudged[q].clone()
    nudged[q][0, 0] += 1e-4 * float(nudged[q].abs().max())
    with pytest.raises(ValueError, match=rf"the state dict's {re.escape(q)} differs"):
        model.load_state_dict(nudged)
    assert torch.equal(model.state_dict()[q], before[q]), "a nearly equal matrix was loaded"
    with torch.inference_mode():
        assert fast_ops.cpu_decode_step(model, ids[:, :1], model.new_cache(1, 4)) is not None
        assert torch.equal(model.generate(ids, 8), tokens)
    model.save_pretrained(tmp_path)
    saved = wiola.fast.WiolaModel.from_pretrained(tmp_path)
    for name, t in saved.state_dict().items():
        assert torch.equal(t, before[name]), f"save_pretrained wrote another {name}"

    own = model.state_dict()
    gamma = "layers.0.attn_norm.weight"  # fp32 in every form: not packed
    own[gamma] = own[gamma].flip(0)
    model.load_state_dict(own)
    assert torch.equal(model.layers[0].attn_norm.weight, before[gamma].flip(0))
    with torch.inference_mode():
        assert fast_ops.cpu_decode_step(model, ids[:, :1], model.new_cache(1, 4)) is not None
        want = reference_on(model).generate(ids, 8)
        assert torch.equal(model.generate(ids, 8), want) and not torch.equal(want, tokens)

    fresh = quantize(other, scheme)  # the way to run other weights quantized
    with torch.inference_mode():
        assert torch.equal(fresh.generate(ids, 8), reference_on(fresh).generate(ids, 8))


@pytest.mark.parametrize("how", ["in place", "sub-module load", "replaced"])
def test_changed_weights_are_never_decoded_or_saved(how, tmp_path, plain_cpu):
    """A matrix changed after ``quantize`` another way than the model's own ``load_state_dict``:
    every path that would compute or save with the old packed matrices beside it raises, the C++
    step's binding included (not a silent fall back to the PyTorch path); the values put back
    make the model current again."""
    model, other = _quantized(ODD, "int8"), _fp32(ODD, seed=1)
    rows = Rows(model, max_rows=2, max_len=40)
    rows.join(RowRequest([3, 7], 6))
    rows.step()
    ffn = model.layers[1].ffn
    kept = ffn.down_proj.weight.detach().clone()
    if how == "in place":
        with torch.no_grad():
            ffn.down_proj.weight.mul_(2)
    elif how == "sub-module load":  # the root's load_state_dict hook does not see it
        ffn.load_state_dict(other.layers[1].ffn.state_dict())
    else:
        ffn.down_proj.weight = torch.nn.Parameter(kept * 2, requires_grad=False)
    stale = r"layers\.1\.ffn\.\w+_proj\.weight( \(and 2 more matrices\))? changed after quantize\(\)"
    ids = torch.tensor([[3, 7, 11]])
    with torch.inference_mode():
        calls = {
            "generate": lambda: model.generate(ids, 4),
            "forward": lambda: model(ids),
            "one-token step": lambda: model(ids[:, :1], cache=model.new_cache(1, 4)),
            "cpu_decode_step": lambda: fast_ops.cpu_decode_step(model, ids[:, :1], model.new_cache(1, 4)),
            "DecodeStepCPU": lambda: decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4)),
            "Rows.step": rows.step,
        }
        for what, call in calls.items():
            with pytest.raises(ValueError, match=stale):
                call()
                pytest.fail(f"{what} ran on a stale model")
        with wiola.fast.use_kernels(False), pytest.raises(ValueError, match=stale):
            model.generate(ids, 4)
    with pytest.raises(ValueError, match="save_pretrained: .*" + stale):
        model.save_pretrained(tmp_path / "stale")
    assert not (tmp_path / "stale").exists(), "a refused save wrote something"

    with torch.no_grad():
        for name, p in ffn.named_parameters():
            p.copy_(dequantize(*model.quantized[f"layers.1.ffn.{name}"]))
    with torch.inference_mode():
        assert fast_ops.cpu_decode_step(model, ids[:, :1], model.new_cache(1, 4)) is not None
        assert torch.equal(model.generate(ids, 4), reference_on(model).generate(ids, 4))


@torch.inference_mode()
def test_a_copy_of_a_quantized_model_runs_its_packed_matrices(plain_cpu):
    """A deep copy's (or a pickle's) parameters sit elsewhere: their values are compared once, and
    the copy takes the C++ step on its packed matrices."""
    model = _quantized(ODD, "int8")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        ids = torch.tensor([[3, 7, 11]])
        assert fast_ops.cpu_decode_step(copied, ids[:, :1], copied.new_cache(1, 4)) is not None
        assert torch.equal(copied.generate(ids, 6), model.generate(ids, 6))


def _mapping_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``), or
    None where there is no such file."""
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in smaps:
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping of /proc/self/smaps holds {address:#x}")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_matrices_lie_in_one_mapping_advised_for_huge_pages(scheme, tmp_path, plain_cpu):
    """The packed matrices of a model whose matrices fill 2 MiB or more are copied, in order, into one
    private mapping that starts on a 2 MiB boundary and is advised MADV_HUGEPAGE (smaps flag ``hg``),
    each on a cache line; their values are quantize_tensor's; a copy, a pickle and a saved and
    loaded checkpoint (loaded into such a mapping again) decode the same tokens. Under 2 MiB they
    stay where they are."""
    config = dataclasses.replace(SHAPE_13M, vocab_size=12000)  # int4: 3.4 MB of matrices
    torch.manual_seed(0)
    model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    want = {name: quantize_tensor(params[name], scheme)[0] for name in matrix_names(config.n_layers)}
    quantize(model, scheme)
    names = list(model.quantized)
    matrices = [model.quantized[name][0] for name in names]
    sizes = [q.numel() * q.element_size() for q in matrices]
    assert sum(sizes) >= quantize_module.HUGE_PAGE, "the test's model is too small to be moved"
    assert matrices[0].data_ptr() % quantize_module.HUGE_PAGE == 0
    for i, q in enumerate(matrices):
        assert torch.equal(q, want[names[i]]), names[i]
        assert q.data_ptr() % 64 == 0, names[i]
        if i:
            gap = q.data_ptr() - matrices[i - 1].data_ptr() - sizes[i - 1]
            assert 0 <= gap < 64, f"{names[i]} lies {gap} bytes past the matrix before it"
    flags = _mapping_flags(matrices[0].data_ptr())
    if flags is not None:
        assert "hg" in flags, f"the packed matrices' mapping is not advised MADV_HUGEPAGE: {flags}"
    ids = torch.tensor([[3, 7, 11]])
    with torch.inference_mode():
        tokens = model.generate(ids, 6, temperature=0)
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(copied.generate(ids, 6, temperature=0), tokens)
        model.save_pretrained(tmp_path)  # safetensors refuses tensors that share memory
        loaded = wiola.fast.WiolaModel.from_pretrained(tmp_path)
        first = next(iter(loaded.quantized.values()))[0]
        assert first.data_ptr() % quantize_module.HUGE_PAGE == 0
        assert torch.equal(loaded.generate(ids, 6, temperature=0), tokens)
    small = torch.zeros(1000, dtype=torch.uint8)
    assert quantize_module.on_huge_pages([small])[0] is small


def test_packed_matrices_stay_where_no_mapping_can_be_made(monkeypatch):
    """A mapping that cannot be made leaves the matrices as they are (the step reads them there);
    one that can holds their values, each on a cache line, whatever their types."""
    big = [torch.arange(3 << 20, dtype=torch.int32).to(torch.int8), torch.ones(1000, dtype=torch.bfloat16)]

    def refused(*args, **kwargs):
        raise OSError("mmap refused")

    monkeypatch.setattr(quantize_module.mmap, "mmap", refused)
    assert all(a is b for a, b in zip(quantize_module.on_huge_pages(big), big))
    monkeypatch.undo()
    moved = quantize_module.on_huge_pages(big)
    assert [m.data_ptr() % 64 for m in moved] == [0, 0] and all(torch.equal(a, b) for a, b in zip(moved, big))


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_refused():
    torch.manual_seed(0)
    model = wiola.fast.WiolaModel(ODD)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        quantize(model.eval().requires_grad_(False), "int3")
    with pytest.raises(
        ValueError, match=r"int4 needs every matrix's K to be a multiple of the group size .* \(301, 40\)"
    ):
        quantize(model.eval().requires_grad_(False), "int4")  # d_model 40
    assert getattr(model, "quantization", None) is None  # refused before anything changed
    with pytest.raises(ValueError, match="training mode"):
        quantize(model.train(), "int8")
    with pytest.raises(ValueError, match="gradients are on"):
        quantize(model.eval().requires_grad_(True), "int8")
    with pytest.raises(TypeError, match="wiola.fast.WiolaModel"):
        quantize(wiola.WiolaModel(ODD).eval().requires_grad_(False), "int8")
    with pytest.raises(ValueError, match="fp32 model on the CPU"):
        quantize(wiola.fast.WiolaModel(ODD).double().eval().requires_grad_(False), "bf16")
    quantize(model.eval().requires_grad_(False), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "bf16")


@pytest.mark.parametrize("scheme", (None, *SCHEMES))
def test_matrix_bytes_counts_the_stored_matrices(scheme):
    """``matrix_bytes`` (the bytes the step's tuning is chosen for) is what the packed matrices and
    their scales hold, or the fp32 matrices' bytes."""
    model = _quantized(ODD, scheme) if scheme else wiola.fast.WiolaModel(ODD)
    config = model.config  # int4's fitted to whole groups
    if scheme:
        stored = [t for q, scale in model.quantized.values() for t in (q, scale) if t is not None]
    else:
        stored = [model.get_parameter(name) for name in matrix_names(config.n_layers)]
    assert quantize_module.matrix_bytes(config, scheme) == sum(t.numel() * t.element_size() for t in stored)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_checkpoint_round_trip(scheme, tmp_path, plain_cpu):
    from safetensors.torch import load_file

    model = _quantized(ODD, scheme)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["quantization"]
    assert record == {"scheme": scheme, "version": 1}
    stored = load_file(str(tmp_path / "model.safetensors"))
    q, scale = model.quantized["layers.1.ffn.down_proj.weight"]
    assert torch.equal(stored["layers.1.ffn.down_proj.weight"], q)
    assert ("layers.1.ffn.down_proj.weight.scale" in stored) == (scheme != "bf16")
    loaded = wiola.fast.WiolaModel.from_pretrained(tmp_path)
    assert loaded.quantization == scheme and not loaded.training
    for name, (q, scale) in model.quantized.items():
        lq, ls = loaded.quantized[name]
        assert torch.equal(lq, q) and (scale is None or torch.equal(ls, scale)), name
    for (name, p), lp in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, lp), name
    ids = torch.tensor([[3, 7, 11]])
    with torch.inference_mode():
        assert torch.equal(loaded.generate(ids, 6, temperature=0), model.generate(ids, 6, temperature=0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_checkpoint_with_a_stray_tensor_is_refused(scheme, tmp_path):
    """A tensor the scheme does not store is named, a scale beside a bf16 matrix included."""
    from safetensors.torch import load_file, save_file

    _quantized(ODD, scheme).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    stored = load_file(path)
    stray = "embed.weight.scale" if scheme == "bf16" else "embed.weight.bias"
    assert "embed.weight" in stored and stray not in stored
    save_file({**stored, stray: torch.full((ODD.vocab_size,), float("nan"))}, path)
    with pytest.raises(ValueError, match=re.escape(f"unexpected tensor(s) ['{stray}']")):
        wiola.fast.WiolaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_checkpoint_with_a_misshaped_matrix_names_it(scheme, tmp_path):
    """A packed matrix of another shape than the config's is named, not the scale read for it."""
    from safetensors.torch import load_file, save_file

    _quantized(ODD, scheme).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    stored = load_file(path)
    name = "layers.0.attn.q_proj.weight"
    stored[name] = stored[name][:-1].contiguous()  # one row short
    save_file(stored, path)
    with pytest.raises(ValueError, match=re.escape(f"'{name}' has shape")):
        wiola.fast.WiolaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("damage", ["fp16", "one short", "missing"])
def test_quantized_checkpoint_with_a_bad_scale_names_it(scheme, damage, tmp_path):
    """A matrix's scales stored in another dtype (fp16), of another shape or missing are refused
    when the checkpoint loads, naming the tensor: the C++ step reads fp32 scales of that shape."""
    from safetensors.torch import load_file, save_file

    _quantized(ODD, scheme).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    stored = load_file(path)
    name = "layers.1.ffn.down_proj.weight.scale"
    if damage == "fp16":
        stored[name] = stored[name].half()
    elif damage == "one short":
        stored[name] = stored[name][:-1].contiguous()
    else:
        del stored[name]
    save_file(stored, path)
    with pytest.raises(ValueError, match=re.escape(f"{name!r} must be an fp32 tensor of shape")):
        wiola.fast.WiolaModel.from_pretrained(tmp_path)


def test_quantized_checkpoint_refuses_what_cannot_run_it(tmp_path):
    _quantized(ODD, "int8").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only wiola.fast.WiolaModel runs"):
        wiola.WiolaModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load them as fp32"):
        wiola.fast.WiolaModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    for record, message in (({"scheme": "int3", "version": 1}, "unknown quantization"), ({"scheme": "int8", "version": 2}, "quantization version 2")):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization": record}))
        with pytest.raises(ValueError, match=message):
            wiola.fast.WiolaModel.from_pretrained(tmp_path)


def test_generate_cli_quantizes(tmp_path, capsys, plain_cpu):
    from wiola.cli import main
    from wiola.tokenizer import encoding_for_vocab

    torch.manual_seed(0)
    model = wiola.WiolaModel(wiola.WiolaConfig.preset("tiny", n_layers=1)).eval()
    model.save_pretrained(tmp_path)
    enc = encoding_for_vocab(model.config.vocab_size)
    prompt = torch.tensor([enc.encode("Once upon")])
    fast = wiola.fast.WiolaModel.from_pretrained(tmp_path).eval().requires_grad_(False)
    with torch.inference_mode():
        new = quantize(fast, "int8").generate(prompt, 5, temperature=0)[0, prompt.shape[1] :]
    want = "Once upon" + enc.decode(new.tolist()) + "\n"
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "Once upon", "--max-new-tokens", "5"]
    assert main([*args, "--temperature", "0", "--device", "cpu", "--quantize", "int8"]) == 0
    captured = capsys.readouterr()
    assert captured.out == want and "int8 weights" in captured.err
    assert main([*args, "--device", "cpu", "--quantize", "bf16", "--reference"]) == 2
    assert capsys.readouterr().err.strip().endswith("error: --quantize runs on wiola.fast (drop --reference)")
    fresh = wiola.fast.WiolaModel.from_pretrained(tmp_path).eval().requires_grad_(False)
    quantize(fresh, "int8").save_pretrained(tmp_path / "int8")  # --quantize of the scheme it has: nothing to redo
    again = ["generate", "--checkpoint", str(tmp_path / "int8"), "--prompt", "Once upon", "--max-new-tokens", "5"]
    assert main([*again, "--temperature", "0", "--device", "cpu", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out == want
    assert main([*again, "--temperature", "0", "--device", "cpu", "--quantize", "int4"]) == 2
    assert "cannot redo it" in capsys.readouterr().err
