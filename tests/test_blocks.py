"""The model as modules: blocks called one by one equal the model, forward hooks fire on every
block and gate without changing the logits, ``RMSNorm`` reads its ``eps``, activation
checkpointing gives the same loss and gradients and keeps fewer bytes, the per-model kernels
switch of ``wiola.fast`` and the per-model derived-weights store."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from numerics import DEVICE, TOL, assert_close
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import wiola.model
from wiola import WiolaConfig, WiolaModel
from wiola.fast import WiolaModel as Fast
from wiola.fast import ops as fast_ops
from wiola.fast import use_kernels
from wiola.model import RMSNorm
from wiola.ops.rope import positions_from_mask, rope_tables

CONFIG = WiolaConfig(vocab_size=300, d_model=64, n_layers=3, n_heads=4, d_ff=96, max_seq_len=64)
CLASSES = {"reference": WiolaModel, "fast": Fast}
FP32 = TOL[torch.float32]


def _model(cls: type[WiolaModel], seed: int = 0, config: WiolaConfig = CONFIG) -> WiolaModel:
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # gates and norms away from their init values
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.to(DEVICE)


def _batch(B: int = 3, T: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding in one row
    return ids.to(DEVICE), mask.to(DEVICE)


def _model_and_its_logits(kind: str) -> tuple[WiolaModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``kind`` model, the batch ``(ids, mask)`` of ``_batch`` and the model's own logits of it
    ``(B, T, V)``: what the module-level calls must reproduce."""
    model = _model(CLASSES[kind])
    ids, mask = _batch()
    return model, ids, mask, model(ids, attention_mask=mask).logits


@torch.no_grad()
@pytest.mark.parametrize("kind", list(CLASSES))
def test_blocks_called_one_by_one_equal_the_model(kind):
    model, ids, mask, want = _model_and_its_logits(kind)
    B, T = ids.shape
    cos, sin = rope_tables(positions_from_mask(mask, B, T), model.rope_freqs)
    hidden, residual = model.embed(ids), None
    for block in model.layers:
        hidden, residual = block(hidden, residual, cos, sin, mask.bool())
    x, _ = model.norm(hidden, residual)
    got = (x @ model.embed.weight.t()).float()
    assert_close(f"logits[{kind}, blocks by hand]", want, got, FP32)


@torch.no_grad()
@pytest.mark.parametrize("kind", list(CLASSES))
def test_forward_hooks_fire_on_every_block_and_gate(kind):
    model, ids, mask, want = _model_and_its_logits(kind)
    blocks, gates = [], []
    handles = [layer.register_forward_hook(lambda m, a, out: blocks.append(out)) for layer in model.layers]
    handles += [layer.attn.gate.register_forward_hook(lambda m, a, g: gates.append(g)) for layer in model.layers]
    got = model(ids, attention_mask=mask).logits
    for h in handles:
        h.remove()
    assert torch.equal(want, got), "logits changed with forward hooks registered"
    assert len(blocks) == len(gates) == CONFIG.n_layers, f"hooks fired {len(blocks)} / {len(gates)} times"
    hidden, residual = blocks[-1]  # the last block's (ffn_out, residual): the final norm gives the logits
    x, _ = model.norm(hidden, residual)
    assert_close("logits[from the last block's hook]", want, (x @ model.embed.weight.t()).float(), FP32)
    for i, g in enumerate(gates):
        assert g.shape == (3, 11, CONFIG.n_heads) and g.dtype == torch.float32, f"gate {i}: {g.dtype} {g.shape}"
        assert float(g.min()) > 0 and float(g.max()) < 1, f"gate {i} outside (0, 1)"
    model(ids, attention_mask=mask)
    assert len(blocks) == CONFIG.n_layers, "a removed hook still fired"


def test_rms_norm_reads_its_eps():
    torch.manual_seed(0)
    x, r = torch.randn(2, 5, 16, dtype=torch.float64) * 0.3, torch.randn(2, 5, 16, dtype=torch.float64) * 0.3
    norm = RMSNorm(16, eps=0.25).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h = x + r
    want = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 0.25) * norm.weight
    y, h_out = norm(x, r)
    assert (y - want).abs().max() < 1e-12, "RMSNorm(x, residual) with eps=0.25"
    assert torch.equal(h_out, h), "RMSNorm returned the wrong residual stream"
    assert (norm(h) - want).abs().max() < 1e-12, "RMSNorm(x) with eps=0.25"
    other = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight - want).abs().max()
    assert other > 1e-3, "eps=0.25 must matter at this input scale"


# ------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("kind", list(CLASSES))
def test_activation_checkpointing_same_loss_and_gradients(kind, monkeypatch):
    calls = [0]
    original = wiola.model.checkpoint

    def counted(*args, **kwargs):
        calls[0] += 1
        assert kwargs.get("use_reentrant") is False, "checkpointing must be non-reentrant"
        return original(*args, **kwargs)

    monkeypatch.setattr(wiola.model, "checkpoint", counted)
    plain, ckpt = _model(CLASSES[kind]), _model(CLASSES[kind])
    assert plain.activation_checkpointing is False, "checkpointing must be off by default"
    ckpt.activation_checkpointing = True
    ids, mask = _batch(3, 17)
    want = plain(ids, attention_mask=mask, labels=ids)
    got = ckpt(ids, attention_mask=mask, labels=ids)
    assert calls[0] == CONFIG.n_layers, f"{calls[0]} checkpointed blocks for {CONFIG.n_layers} layers"
    want.loss.backward()
    got.loss.backward()
    assert_close(f"loss[{kind}]", want.loss.detach(), got.loss.detach(), FP32)
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert_close(f"grad[{kind}, {name}]", p.grad, grads[name].grad, FP32)
    with torch.no_grad():  # no gradients, or a cache: nothing to recompute, no checkpoint
        ckpt(ids, attention_mask=mask)
    ckpt(ids[:, :5], cache=ckpt.new_cache(3, 8))
    assert calls[0] == CONFIG.n_layers, "checkpoint ran without gradients or with a cache"


class _LiveBytes(TorchDispatchMode):
    """Records every storage an op allocates; ``live()`` sums those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    def live(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def kept_for_backward(model: WiolaModel, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors a training forward allocates and keeps alive (for backward, and
    the outputs), counted exactly on the CPU; and the loss."""
    mode = _LiveBytes()
    with mode:
        out = model(ids, labels=ids)
    return mode.live(), out.loss


@pytest.mark.skipif(DEVICE != "cpu", reason="counts CPU allocations")
def test_activation_checkpointing_keeps_fewer_bytes():
    """The 13m shape at T = 256: without checkpointing each layer keeps (among the rest) its
    ``(B, H, T, T)`` fp32 attention probabilities; with it, only each block's two inputs."""
    config = WiolaConfig.preset("13m")
    torch.manual_seed(0)
    model = WiolaModel(config)
    B, T = 1, 256
    ids = torch.randint(0, config.vocab_size, (B, T))
    without, loss = kept_for_backward(model, ids)
    model.activation_checkpointing = True
    with_ckpt, loss_ckpt = kept_for_backward(model, ids)
    assert torch.equal(loss, loss_ckpt), "checkpointing changed the loss"
    assert with_ckpt < without, f"checkpointing kept {with_ckpt} bytes, without {without}"
    L, H, d = config.n_layers, config.n_heads, config.d_model
    at_least = L * (B * H * T * T * 4 - 2 * B * T * d * 4)
    assert without - with_ckpt >= at_least, f"saved {without - with_ckpt} bytes, expected >= {at_least}"


# ------------------------------------------------------------------ wiola.fast per-model state
@pytest.fixture
def attention_calls(monkeypatch) -> list[int]:
    """The attention kernel, counting its calls in the returned one-element list."""
    if "attention" not in fast_ops.KERNELS or not fast_ops.kernels_usable(torch.zeros(1, device=DEVICE)):
        pytest.skip("the attention kernel does not run on this device")
    calls = [0]
    kernel = fast_ops.KERNELS["attention"]

    def counted(*args):
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setitem(fast_ops.KERNELS, "attention", counted)
    return calls


@torch.no_grad()
def test_kernels_switch_per_model_and_per_context(attention_calls: list[int]):
    """``model.use_kernels(False)`` takes one model off the kernels; the ``use_kernels`` context
    takes every model off inside it; both agree with the reference."""
    ref = _model(WiolaModel)
    on, off = _model(Fast), _model(Fast)
    assert off.use_kernels(False) is off and not off.kernels_enabled and on.kernels_enabled
    ids, mask = _batch()
    want = ref(ids, attention_mask=mask).logits
    assert_close("logits[kernels off]", want, off(ids, attention_mask=mask).logits, FP32)
    assert attention_calls[0] == 0, "a model switched off ran the attention kernel"
    assert_close("logits[kernels on]", want, on(ids, attention_mask=mask).logits, FP32)
    assert attention_calls[0] == CONFIG.n_layers, (
        f"attention kernel ran {attention_calls[0]} times for {CONFIG.n_layers} layers"
    )
    with use_kernels(False):
        assert not on.kernels_enabled
        on(ids, attention_mask=mask)
    assert attention_calls[0] == CONFIG.n_layers, "the use_kernels(False) context did not switch the kernels off"
    off.use_kernels(True)
    off(ids, attention_mask=mask)
    assert attention_calls[0] == 2 * CONFIG.n_layers, "use_kernels(True) did not switch the model back on"


@torch.no_grad()
def test_compiled_model_follows_the_switch_and_blocks_compile_alone(attention_calls: list[int]):
    """``torch.compile`` guards on each module's op table: switching recompiles. A block
    compiled on its own gives the model's logits."""
    config = WiolaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=32)
    model = _model(Fast, config=config)
    ids = torch.randint(0, 100, (2, 7), device=DEVICE)
    compiled = torch.compile(model, backend="eager")
    want = compiled(ids).logits
    assert attention_calls[0] == 1, "the compiled model did not run the kernel"
    model.use_kernels(False)
    assert_close("logits[compiled, kernels off]", want, compiled(ids).logits, FP32)
    assert attention_calls[0] == 1, "the compiled model kept the kernel after use_kernels(False)"
    model.use_kernels(True)
    for block in model.layers:
        block.compile(backend="eager")
    assert torch.equal(want, model(ids).logits), "a block compiled alone changed the logits"
    assert attention_calls[0] == 2
    torch._dynamo.reset()  # leave no compiled frames (nor their dynamic-shape marks) to later tests


@torch.no_grad()
def test_compiled_forward_with_a_new_length_and_a_mask():
    """A second length makes dynamo trace the lengths symbolically; the input checks must still
    trace without a graph break (``mask_len not in (T, past + T)`` raised there)."""
    torch._dynamo.reset()
    model = _model(WiolaModel)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    compiled(torch.randint(0, 100, (2, 7), device=DEVICE))
    ids, mask = _batch(3, 17)
    assert_close("logits[compiled, second length]", model(ids, attention_mask=mask).logits,
                 compiled(ids, attention_mask=mask).logits, FP32)  # fmt: skip
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [WiolaModel, Fast], ids=["reference", "fast"])
def test_compiled_training_with_traced_lengths(cls, plain_cpu):
    """``torch.compile(model, fullgraph=True, dynamic=True)`` trains at two lengths with no mask
    (on a plain CPU the fast model's causal path: a traced length must not reach SDPA's
    ``is_causal`` as a SymBool), with the eager model's loss and gradients."""
    torch._dynamo.reset()
    model = _model(cls)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)
    for T in (9, 5):
        ids, _ = _batch(2, T)
        model.zero_grad()
        want = model(ids, labels=ids).loss
        want.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = compiled(ids, labels=ids).loss
        got.backward()
        assert_close(f"{cls.__module__} loss[compiled, T={T}]", want, got, FP32)
        for (name, p), g in zip(model.named_parameters(), grads, strict=True):
            assert_close(f"{cls.__module__} grad {name}[compiled, T={T}]", g, p.grad, FP32)
    torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.skipif(DEVICE != "cpu", reason="the derived weights are kept for CPU inference")
def test_derived_weights_follow_updates_and_stay_off_parameters():
    model = _model(WiolaModel)
    ids, _ = _batch(2, 9)

    def decode(m: WiolaModel = model) -> torch.Tensor:
        cache = m.new_cache(2, 10)
        m(ids[:, :8], cache=cache)
        return m(ids[:, 8:], cache=cache).logits

    def full() -> torch.Tensor:
        with torch.enable_grad():  # gradients on: nothing is cached, plain products
            return model(ids).logits[:, -1:].detach()

    assert_close("decoded logits", full(), decode(), FP32)
    assert len(model.derived_weights) > 0, "CPU decoding kept no derived weights"
    for p in model.parameters():
        assert not vars(p), f"attributes stashed on a parameter: {sorted(vars(p))}"
    for module in model.modules():
        assert "_inference_cache" not in vars(module), "derived tensors stashed in a module's __dict__"
    for p in model.parameters():  # in place: the version counter moves, the copies are rebuilt
        p.mul_(1.1)
    assert_close("decoded logits after an in-place update", full(), decode(), FP32)
    with torch.enable_grad():  # a training step written through .data, which has no version counter
        model(ids, labels=ids).loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.5)
        p.grad = None
    decoded = decode()  # before full(), whose forward with gradients would rebuild the copies anyway
    assert_close("decoded logits after a step through .data", full(), decoded, FP32)
    for p in model.parameters():  # .data with no training step between: clear() is the documented way
        p.data.mul_(1.1)
    model.derived_weights.clear()
    decoded = decode()
    assert_close("decoded logits after .data and clear()", full(), decoded, FP32)
    clone = copy.deepcopy(model)
    assert len(clone.derived_weights) == 0, "a deep copy carried the derived weights"
    assert clone.layers[0].attn.derived is clone.derived_weights, "the copy's modules share another store"
    assert len(pickle.loads(pickle.dumps(model)).derived_weights) == 0, "a pickle carried the derived weights"
    assert "derived" not in str(sorted(model.state_dict())), "derived weights leaked into the state dict"
    assert torch.equal(decode(), decode(clone)), "the copy decodes differently"
    model.to(torch.float64)
    assert len(model.derived_weights) == 0, ".to() kept derived weights of the old dtype"


def test_fast_model_state_is_per_instance():
    a, b = _model(Fast), _model(Fast)
    assert a.cuda_graphs is not b.cuda_graphs and a.derived_weights is not b.derived_weights
    a.use_kernels(False)
    assert b.kernels and b.layers[0].attn.ops is fast_ops.KERNEL_OPS, "one model's switch moved another"
    assert a.layers[0].attn.ops is fast_ops.TORCH_OPS and a.norm.ops is fast_ops.TORCH_OPS
    assert set(a.state_dict()) == set(WiolaModel(CONFIG).state_dict()), "state-dict keys differ"
    c = copy.deepcopy(a)
    assert c.cuda_graphs is not a.cuda_graphs and not c.cuda_graphs.steps, "a copy shares the CUDA graphs"
    assert not c.kernels, "a copy lost the kernels switch"
