"""Config validation, presets, the exact parameter budget, and bad model input."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from wiola import PRESETS, WiolaConfig, WiolaModel, budget


def _number(cell: str) -> int:
    return int(cell.strip().strip("*").replace(",", ""))


def test_the_readmes_budget_table_is_the_budget_of_the_13m_preset():
    """Every number of README's "The budget of the 13m preset" (parameters, forward and training
    FLOPs per token at T = 512, the head's FLOPs, the GPT-2-vocabulary total) and SPEC's matched
    feed-forward widths (swiglu ``d_ff = 683``, gelu 1024, and their totals) as computed."""
    from pathlib import Path

    from wiola.budget import match_params

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme.split("## The budget of the 13m preset", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[1].strip("*")[-1:].isdigit():
            rows[cells[0].strip("*")] = (cells[1], cells[2])
    b = budget(WiolaConfig.preset("13m"), seq_len=512)
    names = {"embedding (tied head)": "embedding (tied head)", "attention q, k, v, o": "attention q,k,v,o"}
    names |= {"gate W1, W2, b2": "gate W1, W2, b2", "butterfly up, bypass, down": "butterfly up, bypass, down"}
    names |= {"norms": "norms"}
    for row, key in names.items():
        assert _number(rows[row][0]) == b.params[key], row
        assert rows[row][1] == f"{100 * b.params[key] / b.total_params:.1f}%", row
    assert _number(rows["total"][0]) == b.total_params
    assert _number(rows["forward FLOPs per token"][0]) == b.forward_flops
    assert rows["forward FLOPs per token"][1] == f"head {b.forward_flops_per_token['head (logits)']:,}"
    assert _number(rows["training FLOPs per token"][0]) == b.training_flops
    gpt2 = budget(WiolaConfig.preset("13m", vocab_size=50257)).total_params
    assert f"the same layers give {gpt2:,} parameters" in section
    spec = (root / "docs" / "SPEC.md").read_text()
    for ffn in ("swiglu", "gelu"):
        matched = match_params(WiolaConfig.preset("13m", ffn=ffn), WiolaConfig.preset("13m"))
        total = budget(matched).total_params
        assert (
            f"{ffn}\n`d_ff = {matched.d_ff}` ({total:,}" in spec or f"{ffn} `d_ff = {matched.d_ff}` ({total:,}" in spec
        ), ffn


def test_13m_preset_has_exactly_12915888_parameters():
    cfg = WiolaConfig.preset("13m")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (256, 6, 8, 512, 32000)
    assert WiolaModel(cfg).num_parameters() == 12_915_888
    assert budget(cfg).total_params == 12_915_888
    assert budget(WiolaConfig.preset("13m", vocab_size=50257)).total_params == 17_589_680


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("gate", [True, False])
def test_budget_equals_numel(name, gate):
    cfg = WiolaConfig.preset(name, gate=gate)
    with torch.device("meta"):  # shapes only: counting needs no memory and no init
        model = WiolaModel(cfg)
    b = budget(cfg)
    assert b.total_params == sum(p.numel() for p in model.parameters())
    per_component = {
        "embedding (tied head)": model.embed.weight.numel(),
        "norms": sum(p.numel() for n, p in model.named_parameters() if "norm" in n),
        "gate W1, W2, b2": sum(p.numel() for n, p in model.named_parameters() if "gate" in n),
    }
    for key, n in per_component.items():
        assert b.params[key] == n, key


def test_budget_refuses_a_length_the_model_cannot_run(capsys):
    """FLOPs at a sequence past ``max_seq_len`` describe no run: refused (exit 2 on the CLI)."""
    from wiola.cli import main

    cfg = WiolaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2, d_ff=6, max_seq_len=8)
    assert budget(cfg, seq_len=8).forward_flops > 0
    with pytest.raises(ValueError, match="seq_len 9 is past the model's max_seq_len=8"):
        budget(cfg, seq_len=9)
    assert main(["budget", "--preset", "tiny", "--seq-len", "100000"]) == 2
    assert "seq_len 100000 is past the model's max_seq_len=" in capsys.readouterr().err


def test_flops_by_hand_for_a_small_shape():
    cfg = WiolaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2, d_ff=6, max_seq_len=8)
    b = budget(cfg, seq_len=3)
    # projections 2·4·4² = 128; scores+values 2·2·4·(3+1)/2 = 32; gate 2·(2·2 + 2·2) = 16;
    # butterfly 2·4·4·6 = 192; head 2·4·10 = 80  -> 448 forward, 1344 training
    assert b.forward_flops_per_token == {
        "attention projections": 128,
        "attention scores + values": 32,
        "gate": 16,
        "butterfly": 192,
        "head (logits)": 80,
    }
    assert b.forward_flops == 448 and b.training_flops == 1344


@pytest.mark.parametrize("ffn", ["butterfly", "swiglu", "gelu"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
def test_one_token_flops_are_the_models_counted_matmul_flops(ffn, gate):
    """At one token (no attention over other positions) ``forward_flops`` is what torch's
    ``FlopCounterMode`` counts in the reference model's products, for every feed-forward block."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = WiolaConfig.preset("tiny", ffn=ffn, gate=gate, max_seq_len=8)
    model = WiolaModel(cfg).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))
    assert budget(cfg, seq_len=1).forward_flops == counter.get_total_flops(), f"ffn={ffn} gate={gate}"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=100, n_heads=8), "d_model"),
        (dict(d_model=24, n_heads=8), "even"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=-1), "n_layers"),
        (dict(d_ff=0), "d_ff"),
        (dict(max_seq_len=0), "max_seq_len"),
        (dict(n_heads=2.5), "n_heads"),
        (dict(helix_alpha=-0.1), "helix_alpha"),
        (dict(eos_token_id=32000), "eos_token_id"),
    ],
)
def test_invalid_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WiolaConfig.preset("tiny", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gate="False"), "gate must be true or false, got 'False'"),
        (dict(gate_pre_rope=1), "gate_pre_rope must be true or false, got 1"),
        (dict(n_layers=True), "n_layers must be an int, got True"),
        (dict(rope_base=math.inf), "rope_base must be a finite number, got inf"),
        (dict(helix_alpha=math.nan), "helix_alpha must be a finite number, got nan"),
        (dict(norm_eps=math.nan), "norm_eps must be a finite number, got nan"),
        (dict(init_std="0.02"), "init_std must be a finite number, got '0.02'"),
        (dict(rope_base=10**400), f"rope_base must be a finite number, got {10**400!r}"),
        (dict(rope_base=1.0), "rope_base must be > 1, got 1.0"),  # every frequency 1: no position schedule
        (dict(eos_token_id="2"), "eos_token_id must be an int or None, got '2'"),
        (dict(pad_token_id=1.0), "pad_token_id must be an int or None, got 1.0"),
        (dict(ffn=None), "ffn must be a string, got None"),
        (dict(width=3), "unknown WiolaConfig fields: ['width']"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_fields_of_the_wrong_kind_are_refused_by_name(kwargs, message):
    """A value of another kind (a config file's "False", a NaN) is refused with the field's name,
    not stored (the string "False" is truthy: a gated model) or left to fail inside the model."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        WiolaConfig.preset("tiny", **kwargs)
    if "width" not in kwargs:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            WiolaConfig.from_dict({**WiolaConfig().to_dict(), **kwargs})


def test_an_int_where_a_float_goes_is_stored_as_a_float():
    cfg = WiolaConfig.preset("tiny", rope_base=20000, helix_alpha=0)
    assert (cfg.rope_base, cfg.helix_alpha) == (20000.0, 0.0)
    assert type(cfg.rope_base) is float and type(cfg.helix_alpha) is float


def test_check_field_types_refuses_a_type_it_does_not_know():
    """A field of a type the check has no rule for fails loudly, rather than going unchecked."""
    import dataclasses

    from wiola.config import check_field_types

    @dataclasses.dataclass
    class Pair:
        sizes: tuple[int, int] = (1, 2)

    with pytest.raises(TypeError, match=r"Pair.sizes: check_field_types does not know the type tuple\[int, int\]"):
        check_field_types(Pair())


def test_presets_and_dict_round_trip():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        WiolaConfig.preset("huge")
    cfg = WiolaConfig.preset("micro")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff) == (384, 8, 12, 768)
    assert WiolaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown WiolaConfig fields"):
        WiolaConfig.from_dict({**cfg.to_dict(), "hidden_size": 3})


@pytest.fixture(scope="module")
def tiny():
    return WiolaModel(WiolaConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=12))


def test_bad_inputs_raise_clear_errors(tiny):
    ok = torch.randint(0, 50, (2, 5))
    with pytest.raises(ValueError, match="token id 50 is outside"):
        tiny(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        tiny(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="integer tensor"):
        tiny(ok.float())
    with pytest.raises(ValueError, match="past max_seq_len=12"):
        tiny(torch.randint(0, 50, (1, 13)))
    with pytest.raises(ValueError, match="attention_mask shape"):
        tiny(ok, attention_mask=torch.ones(2, 4))
    for cache in (None, tiny.new_cache(2, 12)):  # one row's mask for two rows: named, never broadcast
        with pytest.raises(ValueError, match=r"attention_mask shape \(1, 5\) does not match input_ids \(2, 5\)"):
            tiny(ok, attention_mask=torch.ones(1, 5, dtype=torch.long), cache=cache)
    for mask in (torch.full((2, 5), 0.5), torch.full((2, 5), 2), torch.full((2, 5), -1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
            tiny(ok, attention_mask=mask)
    for mask in (torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.uint8), torch.ones(2, 5)):
        tiny(ok, attention_mask=mask)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor or None, got list"):
        tiny(ok, attention_mask=[[1] * 5] * 2)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor or None, got ndarray"):
        tiny(ok, attention_mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match="attention_mask is on meta but input_ids is on cpu"):
        tiny(ok, attention_mask=torch.ones(2, 5, device="meta"))
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor or None, got list"):
        tiny.generate(ok, 2, attention_mask=[[1] * 5] * 2)
    with pytest.raises(ValueError, match="labels shape"):
        tiny(ok, labels=ok[:, :3])
    with pytest.raises(ValueError, match="label 77 is outside"):
        tiny(ok, labels=torch.full_like(ok, 77))
    with pytest.raises(ValueError, match="shape \\(B, T\\)"):
        tiny(ok[0])
    cache = tiny.new_cache(3, 8)
    with pytest.raises(ValueError, match="batch size 3"):
        tiny(ok, cache=cache)
    cache = tiny.new_cache(2, 8)
    tiny(ok, cache=cache)
    with pytest.raises(ValueError, match="past the cache's max_len=8"):
        tiny(ok, cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        tiny.new_cache(1, 13)


@pytest.mark.parametrize("cls", ["reference", "fast"])
def test_foreign_caches_odd_id_dtypes_and_negative_logits_to_keep_are_named(cls, tiny, plain_cpu):
    """Caught by the model's own checks before any work, on the fast model's one-token C++ step
    too (which once took uint8 ids and let a foreign cache fail deep inside the PyTorch path)."""
    import wiola.fast
    from wiola import Cache

    model = tiny if cls == "reference" else wiola.fast.WiolaModel(tiny.config).eval()
    config = model.config
    one = torch.tensor([[3]])
    for other in (
        WiolaConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=16, max_seq_len=12),  # head width
        WiolaConfig(vocab_size=50, d_model=16, n_layers=2, n_heads=2, d_ff=16, max_seq_len=12),  # layers
        WiolaConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=4, d_ff=16, max_seq_len=12),  # heads
    ):
        for ids in (one, torch.tensor([[3, 4]])):  # the one-token step and a prompt
            with torch.no_grad(), pytest.raises(ValueError, match=r"cache.k has shape .* this model needs \(1, 1, 2, 8, 8\)"):  # fmt: skip
                model(ids, cache=Cache(other, 1, 8))
    with torch.no_grad(), pytest.raises(ValueError, match="cache dtype torch.float64 is not the model's torch.float32"):
        model(one, cache=Cache(config, 1, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="cache must be a wiola.Cache"):
        model(one, cache={"k": None})
    for dtype in (torch.uint8, torch.int8, torch.int16):
        for cache in (None, model.new_cache(1, 8)):
            with torch.no_grad(), pytest.raises(TypeError, match=rf"integer tensor of dtype int64 or int32, got dtype {dtype}"):  # fmt: skip
                model(one.to(dtype), cache=cache)
    with torch.no_grad():
        assert torch.equal(model(one.int()).logits, model(one).logits), "int32 ids are taken as they are"
    for keep in (-1, True, 1.0):
        with pytest.raises(ValueError, match=rf"logits_to_keep must be a non-negative int .*got {keep!r}"):
            model(torch.tensor([[1, 2, 3]]), logits_to_keep=keep)
    with pytest.raises(ValueError, match=r"cache max_len must be an int in \[1, max_seq_len=12\], got 0"):
        model.new_cache(1, 0)
    assert model.new_cache(1).max_len == 12 and model.new_cache(1, None).max_len == 12
    cache = model.new_cache(np.int64(2), np.int32(5))  # numpy integers are the ints they hold
    assert (cache.batch_size, cache.max_len) == (2, 5) and type(cache.batch_size) is int
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match=rf"batch_size must be a positive int, got {bad!r}"):
            model.new_cache(bad, 5)
