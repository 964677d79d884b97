"""The Wiola model (docs/SPEC.md): pre-norm decoder with gated helical attention and butterfly FFN.

Every piece is a module with its own ``forward``: ``RMSNorm`` (with the fused residual add),
``Gate``, ``GatedHelicalAttention``, ``Butterfly`` and ``Block``. A block takes and returns the
pair ``(hidden, residual)`` (the layout of vLLM's decoder layers), so the residual add of one
block fuses with the next block's norm; blocks can be called, hooked, checkpointed
(``activation_checkpointing``), compiled or sharded one by one.

The modules compute through the op table ``Ops`` they are given at construction, the model
class's ``ops``: ``wiola.ops`` here (readable PyTorch). ``wiola.fast.WiolaModel`` runs the very
same modules on fused kernels by giving them another table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import wiola.ops as reference_ops
from wiola.cache import Cache
from wiola.checkpoint import load_pretrained, save_pretrained
from wiola.config import WiolaConfig
from wiola.generation import check_token_type_ids, generate
from wiola.ops.linear import DecodeLayout, autocast_dtype, decode_layout, linear, project, uses_decode_layout
from wiola.ops.rope import helix_frequencies, positions_from_mask, rope_tables, upcast

if TYPE_CHECKING:
    from wiola.tokenizer import Tokenizer


@dataclass
class ModelOutput:
    """A forward's result. Also read as ``transformers``' outputs are: ``out[0]``, ``out["logits"]``,
    ``to_tuple()`` and ``keys()`` over the fields that are set, in ``transformers``' order
    (``loss`` first when there is one, then ``logits``)."""

    logits: torch.Tensor | None  # (B, T, V) float32, None when the fused loss skipped them
    loss: torch.Tensor | None = None  # float32 scalar when labels were given
    cache: Cache | None = None

    def keys(self) -> list[str]:
        return [name for name in ("loss", "logits", "cache") if getattr(self, name) is not None]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.keys())

    def __getitem__(self, key: int | slice | str) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"{key!r}: this output holds {self.keys()}")
            return getattr(self, key)
        return self.to_tuple()[key]


@dataclass(frozen=True)
class Ops:
    """The op functions the modules call, each with the name and signature of its ``wiola.ops``
    reference (``wiola.fast.ops`` has tables of fused kernels and of its PyTorch path)."""

    rms_norm: Callable[..., Any]
    gate: Callable[..., Any]
    attention: Callable[..., Any]
    decode_attention: Callable[..., Any]
    butterfly: Callable[..., Any]
    linear_cross_entropy: Callable[..., Any]

    @classmethod
    def of(cls, namespace: Any) -> Ops:
        """The table of ``namespace``'s functions (a module such as ``wiola.ops``)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})

    def __deepcopy__(self, memo: dict) -> Ops:
        return self  # immutable: a copied model keeps the same table


REFERENCE_OPS = Ops.of(reference_ops)


class DerivedWeights:
    """One model's tensors derived from its parameters for inference: the fused QKV matrix, the
    weights cast to the autocast dtype (or the gate's to fp32), the ``decode_layout`` copies
    that CPU decoding reads (and, in ``wiola.fast``, the C++ step bound to a cache). Not part of
    the state dict; copies and pickles of the model start empty.

    ``get(key, build, *sources)`` is plain ``build()`` with gradients on and while tracing; with
    gradients on (a training forward) it also forgets every value kept and moves ``epoch``, which
    a captured CUDA graph's stamp holds (``wiola.fast.generation``). In inference (CPU or GPU) it returns the value built
    earlier for ``key`` while every source keeps its storage and version counter; in-place updates
    (optimizer steps, ``load_state_dict``) bump the counter, and the sources are referenced so that
    a freed storage's address cannot come back as a false match. A write through ``p.data`` does
    not bump ``p``'s counter: a training step (a forward with gradients) between such writes and
    inference makes ``get`` build again; other ``.data`` writes (an EMA copy, ``p.data.mul_``) need
    ``clear()`` before the next inference forward. Sources without a version counter
    (made under ``torch.inference_mode``) are never cached. During CUDA-graph capture a value
    that is missing or stale is built (into the graph) but not kept: values are built outside
    capture (the capture's warm-up steps), so a captured graph reads a tensor that stays put.
    """

    def __init__(self) -> None:
        self.epoch = 0  # moves at each clear(): what was built from the weights before is forgotten
        self._tensors: dict[Hashable, tuple[tuple, tuple[torch.Tensor, ...], Any]] = {}
        self._bound: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()

    def get(self, key: Hashable, build: Callable[[], Any], *sources: torch.Tensor, extra: tuple = ()) -> Any:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            if not torch.compiler.is_compiling():  # a training step: the weights may change through .data
                self._tensors.clear()
                self.epoch += 1
            return build()
        if any(t.is_inference() for t in sources):
            return build()
        stamp = (*extra, *((t.data_ptr(), t._version, t.dtype) for t in sources))
        hit = self._tensors.get(key)
        if hit is None or hit[0] != stamp:
            if sources[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return build()
            hit = self._tensors[key] = (stamp, tuple(t.detach() for t in sources), build())
        return hit[2]

    def values(self) -> tuple[Any, ...]:
        """The tensors kept now (a captured CUDA graph holds them: they must outlive it)."""
        return tuple(hit[2] for hit in self._tensors.values())

    def bound(self, key: Hashable, owner: Any, build: Callable[[], Any], current: Callable[[Any], bool]) -> Any:
        """A value bound to ``owner`` (a decoding cache) and dropped with it: the one kept for
        ``(owner, key)`` while ``current(value)`` holds, else a fresh ``build()``."""
        store = self._bound.setdefault(owner, {})
        value = store.get(key)
        if value is None or not current(value):
            value = store[key] = build()
        return value

    def clear(self) -> None:
        self._tensors.clear()
        self._bound.clear()
        self.epoch += 1

    def __len__(self) -> int:
        return len(self._tensors) + sum(len(v) for v in self._bound.values())

    def __deepcopy__(self, memo: dict) -> DerivedWeights:
        return type(self)()

    def __reduce__(self) -> tuple:
        return (type(self), ())


_GATE = ("gate_w1", "gate_w2", "gate_b2")


def _cast_of(derived: DerivedWeights, key: Hashable, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``weight`` in ``dtype`` (as it is for None or its own dtype), the copy kept in ``derived``:
    what autocast (or an fp32 upcast) would copy on every call is copied once per weight version."""
    if dtype is None or weight.dtype == dtype:
        return weight
    return derived.get((key, dtype), lambda: weight.to(dtype), weight)


def _decode_layout_of(derived: DerivedWeights, key: Hashable, *weights: torch.Tensor) -> DecodeLayout:
    """The ``decode_layout`` of the rows of ``weights`` stacked, kept in ``derived``."""

    def build() -> DecodeLayout:
        return decode_layout(weights[0] if len(weights) == 1 else torch.cat(weights))

    return derived.get(key, build, *weights, extra=(torch.get_num_threads(),))


def adapted(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` is more than a plain ``nn.Linear`` (a ``peft`` LoRA layer wraps
    one). The blocks read plain projections' weights directly (fused, cast, in a decode layout);
    those they call as modules instead, so an adapter is never bypassed."""
    return any(type(m) is not nn.Linear for m in modules)


def has_adapters(model: nn.Module) -> bool:
    """Whether a projection of ``model`` (a ``WiolaModel``) is wrapped (``adapted``): paths that
    read the weights themselves (``wiola.fast``'s C++ step, CUDA graphs, quantization, export)
    must not run it. Asked on every decoding step, so it reads the blocks' module dicts, found
    once (a wrapper such as peft's replaces an entry of the same dict)."""
    slots = model.__dict__.get("_projection_slots")
    if slots is None:
        slots = [
            (parent._modules, tuple(name for name in ADAPTER_TARGETS if name in parent._modules))
            for block in model.layers
            for parent in (block.attn, block.ffn)
        ]
        model.__dict__["_projection_slots"] = slots
    for modules, names in slots:
        for name in names:
            if type(modules[name]) is not nn.Linear:
                return True
    return False


# The projections a LoRA adapter may wrap (their names in the state dict).
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "bypass_proj", "gate_proj")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) ⊙ γ``; with ``residual``, first ``h = x + residual`` (fused)."""

    def __init__(self, dim: int, eps: float, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(..., d)`` -> the normalised ``x``; with ``residual``, the pair ``(normalised h, h)``."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Gate(nn.Module):
    """The causal cumulative-mean gate of one layer (docs/SPEC.md eq. 8-10) as a parameter-free module.

    Its weights stay on the attention (and keep their state-dict names); they are passed in. A
    forward hook here sees each call's gate ``g`` ``(B, T, H)`` float32.
    """

    def __init__(self, pre_rope: bool, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.pre_rope = pre_rope
        self.ops = ops

    def forward(
        self,
        q: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``g`` ``(B, T, H)`` from the unrotated queries ``q`` ``(B, T, H, D)``; ``carry`` (one
        layer's running sum and count in a cache) is read and updated in place."""
        rope = {} if self.pre_rope else {"cos": cos, "sin": sin}
        g, _, _ = self.ops.gate(
            q, w1, w2, b2, attention_mask=attention_mask, carry=carry, update_carry=carry is not None, **rope
        )
        return g


class GatedHelicalAttention(nn.Module):
    """Causal attention with helical RoPE, each query's scores scaled by its gate (docs/SPEC.md §2)."""

    def __init__(
        self,
        config: WiolaConfig,
        layer_index: int = 0,
        ops: Ops = REFERENCE_OPS,
        derived: DerivedWeights | None = None,
    ) -> None:
        super().__init__()
        d, H, D = config.d_model, config.n_heads, config.head_dim
        self.n_heads, self.head_dim = H, D
        self.layer_index = layer_index  # which of a cache's layers this one reads and writes
        self.ops = ops
        self.derived = derived if derived is not None else DerivedWeights()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate = Gate(config.gate_pre_rope, ops) if config.gate else None
        if config.gate:
            self.gate_w1 = nn.Linear(D, H, bias=False)  # W_1: c_t (d_h) -> H
            self.gate_w2 = nn.Linear(H, H, bias=True)  # W_2, b_2

    def qkv_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The three projections as one ``(3d, d)`` matrix: one GEMM, q/k/v as strided views.

        With ``dtype`` (the autocast dtype), the matrix cast to it, as autocast would cast it."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if dtype is None or weights[0].dtype == dtype:
            return self.derived.get(("qkv", self.layer_index), lambda: torch.cat(weights), *weights)
        return self.derived.get(("qkv", self.layer_index, dtype), lambda: torch.cat(weights).to(dtype), *weights)

    def gate_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``W_1, W_2, b_2``; for a half model, upcast to fp32 as the gate reads them (``upcast``),
        the copies kept."""
        weights = (self.gate_w1.weight, self.gate_w2.weight, self.gate_w2.bias)
        dtype = torch.float32 if weights[0].dtype in (torch.float16, torch.bfloat16) else None
        w1, w2, b2 = (_cast_of(self.derived, (n, self.layer_index), w, dtype) for n, w in zip(_GATE, weights))
        return w1, w2, b2

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cache_start: int | torch.Tensor = 0,
        keep: int = 0,
    ) -> torch.Tensor:
        """``(B, T, d)`` normalised input -> ``(B, T, d)`` attention output (after ``W_o``).

        ``cos, sin``: ``(B, T, D/2)`` rotation tables of the tokens' positions;
        ``attention_mask``: ``(B, T)`` bool, True for real tokens. With a ``cache``, the tokens
        go to slots ``cache_start ...`` of layer ``layer_index`` and attend to everything cached.
        ``keep`` (``0 < keep < T``): the output of the last ``keep`` positions only, ``(B, keep, d)``;
        every position's key, value and gate sum still goes to the cache.
        """
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        i = self.layer_index
        if adapted(self.q_proj, self.k_proj, self.v_proj):  # called, so their adapters run
            qkv = torch.cat([project(x, m) for m in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        elif uses_decode_layout(x):
            qkv = linear(x, self.q_proj.weight, self._layout("qkv", "q_proj", "k_proj", "v_proj"))
        else:
            qkv = linear(x, self.qkv_weight(autocast_dtype(x)))
        q, k, v = qkv.view(B, T, 3, H, D).unbind(2)  # (B, T, H, D) strided views, not rotated
        if self.gate is None:
            g = torch.ones(B, T, H, device=x.device, dtype=cos.dtype)
        else:
            carry = None if cache is None else (cache.gate_sum[i], cache.gate_count[i])
            g = self.gate(q, *self.gate_weights(), cos, sin, attention_mask, carry)
        if cache is None:
            o = self.ops.attention(q, k, v, g, cos, sin, attention_mask)
            o = o[:, T - keep :] if keep else o
        else:
            k_cache, v_cache = cache.k[i], cache.v[i]
            unpadded = attention_mask is None
            o = self.ops.decode_attention(
                q, k, v, g, cos, sin, k_cache, v_cache, cache.key_mask, cache_start, unpadded=unpadded,
                queries=keep or None,
            )  # fmt: skip
        o = o.reshape(B, o.shape[1], H * D)
        if adapted(self.o_proj):
            return project(o, self.o_proj)
        if uses_decode_layout(o):
            return linear(o, self.o_proj.weight, self._layout("o", "o_proj"))
        return linear(o, _cast_of(self.derived, ("o", i), self.o_proj.weight, autocast_dtype(o)))

    def _layout(self, key: str, *names: str) -> DecodeLayout:
        weights = [getattr(self, name).weight for name in names]
        return _decode_layout_of(self.derived, (key, self.layer_index), *weights)


class _FeedForward(nn.Module):
    """A feed-forward block of bias-free ``nn.Linear`` projections: the up-side ones (``up``: their
    state-dict names in call order, each ``d -> width · d_ff``) and ``down_proj`` (``d_ff -> d``).
    ``forward`` hands their weights to ``compute``: cast as autocast would cast them (the copies
    kept per weight version), or, for CPU decoding, with their ``decode_layout`` copies."""

    up: ClassVar[tuple[tuple[str, int], ...]]  # (name, width in units of d_ff) per up-side projection

    def __init__(
        self, config: WiolaConfig, layer_index: int = 0, ops: Ops = REFERENCE_OPS, derived: DerivedWeights | None = None
    ) -> None:
        super().__init__()
        d, f = config.d_model, config.d_ff
        self.layer_index = layer_index
        self.ops = ops
        self.derived = derived if derived is not None else DerivedWeights()
        for name, width in self.up:
            setattr(self, name, nn.Linear(d, width * f, bias=False))
        self.down_proj = nn.Linear(f, d, bias=False)
        self.names = (*(name for name, _ in self.up), "down_proj")  # the projections in call order

    def compute(self, x: torch.Tensor, *weights: torch.Tensor, layouts: tuple | None) -> torch.Tensor:
        """The block's function of ``x`` ``(..., d)`` and the projections' weights (``up`` order, then
        down); an adapted projection comes as its module, which ``wiola.ops.linear.linear`` calls."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` -> ``(..., d)``."""
        names = self.names
        modules = tuple(getattr(self, n) for n in names)
        if adapted(*modules):  # an adapted projection goes in as its module, called so its adapter runs
            return self.compute(x, *(m if adapted(m) else m.weight for m in modules), layouts=None)
        weights = tuple(m.weight for m in modules)
        if not uses_decode_layout(x):
            dtype = autocast_dtype(x)  # the casts autocast makes, once per weight version
            weights = tuple(_cast_of(self.derived, (n, self.layer_index), w, dtype) for n, w in zip(names, weights))
            return self.compute(x, *weights, layouts=None)
        layouts = tuple(_decode_layout_of(self.derived, (n, self.layer_index), w) for n, w in zip(names, weights))
        return self.compute(x, *weights, layouts=layouts)


class Butterfly(_FeedForward):
    """The butterfly feed-forward block (docs/SPEC.md eq. 14-16): ``W_down (SiLU(a) ⊙ b + W_bp x)``."""

    up = (("up_proj", 2), ("bypass_proj", 1))  # [a ‖ b], W_bp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d)`` -> ``(..., d)``."""
        if adapted(self.up_proj, self.bypass_proj, self.down_proj):  # ops.butterfly's formula on the modules
            a, b = project(x, self.up_proj).chunk(2, dim=-1)
            return project(F.silu(a) * b + project(x, self.bypass_proj), self.down_proj)
        return super().forward(x)

    def compute(self, x: torch.Tensor, *weights: torch.Tensor, layouts: tuple | None) -> torch.Tensor:
        return self.ops.butterfly(x, *weights, layouts=layouts)


class _Projections(_FeedForward):
    """A feed-forward block of the ablations (``wiola.ops.mlp``): projections named as in Llama
    (``gate_proj``, ``up_proj``, ``down_proj``, what peft targets), computed by ``function`` in both
    model classes (no fused kernel; ``wiola.fast`` says so)."""

    function: ClassVar[Callable[..., Any]]

    def compute(self, x: torch.Tensor, *weights: torch.Tensor, layouts: tuple | None) -> torch.Tensor:
        return type(self).function(x, *weights, layouts=layouts)


class SwiGLU(_Projections):
    """``W_down (SiLU(W_gate x) ⊙ W_up x)``: the Llama feed-forward block (``wiola.ops.swiglu``)."""

    function = staticmethod(reference_ops.swiglu)
    up = (("gate_proj", 1), ("up_proj", 1))


class GeluMLP(_Projections):
    """``W_down GELU(W_up x)``: the GPT-2 feed-forward block without biases (``wiola.ops.gelu_mlp``)."""

    function = staticmethod(reference_ops.gelu_mlp)
    up = (("up_proj", 1),)


FFN_BLOCKS: dict[str, type[nn.Module]] = {"butterfly": Butterfly, "swiglu": SwiGLU, "gelu": GeluMLP}


class Block(nn.Module):
    """One pre-norm decoder layer on the pair ``(hidden, residual)``.

    The residual stream is carried unsummed: a block gets the previous block's output
    ``hidden`` and the stream ``residual`` before it (None for the first block), adds them
    inside its first norm (fused), and returns its own output with the updated stream; the
    model's final norm makes the last add. ``h' = h + GSA(norm(h))``, ``h'' = h' + FFN(norm(h'))``.
    """

    def __init__(
        self, config: WiolaConfig, layer_index: int = 0, ops: Ops = REFERENCE_OPS, derived: DerivedWeights | None = None
    ) -> None:
        super().__init__()
        derived = derived if derived is not None else DerivedWeights()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, ops)
        self.attn = GatedHelicalAttention(config, layer_index, ops, derived)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, ops)
        self.ffn = FFN_BLOCKS[config.ffn](config, layer_index, ops, derived)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cache_start: int | torch.Tensor = 0,
        keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` ``(B, T, d)`` each -> ``(ffn_out, residual)``; the other
        arguments are those of ``GatedHelicalAttention.forward``: with ``keep``, both outputs are
        the last ``keep`` positions' ``(B, keep, d)``, the rest of the block computed for those alone."""
        if residual is None:
            x, residual = self.attn_norm(hidden), hidden
        else:
            x, residual = self.attn_norm(hidden, residual)
        attn_out = self.attn(x, cos, sin, attention_mask, cache, cache_start, keep)
        if keep:  # contiguous, as every other residual: a strided one takes another norm's path
            residual = residual[:, -keep:].contiguous()
        x, residual = self.ffn_norm(attn_out, residual)  # residual: h' = h + GSA
        return self.ffn(x), residual


class _NoBackwardThroughCache(torch.autograd.Function):
    """The identity, whose backward refuses by name: a forward with a cache writes each layer's
    keys and values into the cache's tensors in place, after earlier layers' attention saved
    views of them for their backward, so autograd would otherwise fail with a message about an
    in-place change (or, with one layer, differentiate the new tokens only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "backward through a forward with a cache is not supported: the cache is written in place "
            "layer by layer. Train without a cache (labels over the whole sequence), or run cached "
            "forwards under torch.no_grad()"
        )


class WiolaModel(nn.Module):
    """Wiola language model. ``forward``, ``generate``, ``save_pretrained``/``from_pretrained``.

    ``layers`` holds the ``Block`` modules; ``activation_checkpointing = True`` recomputes each
    block's activations in the backward pass instead of keeping them (training without a cache).
    """

    ops: ClassVar[Ops] = REFERENCE_OPS  # the op table the modules are built with
    # What packs and reads weight-only quantized matrices (``wiola.fast.quantize``): only a class
    # that can run them sets it; checkpoints ask the class, so this layer imports nothing above it.
    quantization_codec: ClassVar[Any] = None

    def __init__(self, config: WiolaConfig) -> None:
        super().__init__()
        self.config = config
        self.activation_checkpointing = False
        self.derived_weights = DerivedWeights()
        ops, derived = self.ops, self.derived_weights
        self.embed = nn.Embedding(config.vocab_size, config.d_model)  # also the tied head
        self.layers = nn.ModuleList(Block(config, i, ops, derived) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps, ops)
        # Not a buffer: `model.to(torch.bfloat16)` must not round the frequencies.
        self._freqs = {}  # (device, dtype) -> (D/2,) helical frequencies
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, 0.0, std, -2 * std, 2 * std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)  # b_2 = 0: every gate starts at 0.5
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _bind_ops(self, ops: Ops) -> None:
        """Make this model and every module of it compute with ``ops`` (``wiola.fast``'s switch)."""
        for module in self.modules():
            if isinstance(getattr(module, "ops", None), Ops):
                module.ops = ops

    def _apply(self, fn: Callable, recurse: bool = True) -> WiolaModel:
        self.derived_weights.clear()  # .to(), .half(), ...: the derived copies would go stale
        return super()._apply(fn, recurse)

    @property
    def device(self) -> torch.device:
        """Where the weights are (``transformers``' ``model.device``)."""
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (``transformers``' ``model.dtype``)."""
        return self.embed.weight.dtype

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (``transformers``' name for it)."""
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        """The head: the embedding itself, tied (its ``.weight`` is the head's)."""
        return self.embed

    @property
    def rope_freqs(self) -> torch.Tensor:
        """``(D/2,)`` helical frequencies θ̃ on the model's device, float32 (float64 for a float64 model)."""
        w = self.embed.weight
        key = (w.device, torch.float64 if w.dtype == torch.float64 else torch.float32)
        if key not in self._freqs:
            c = self.config
            self._freqs[key] = helix_frequencies(c.head_dim, c.rope_base, c.helix_alpha, torch.float64).to(*key)
        return self._freqs[key]

    # ------------------------------------------------------------------ inputs
    def check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None) -> None:
        """Raise ``TypeError``/``ValueError`` naming the problem with a ``forward`` call's inputs."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):  # the index dtypes F.embedding takes
            raise TypeError(f"input_ids must be an integer tensor of dtype int64 or int32, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0 or B == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if input_ids.device != self.embed.weight.device:
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {self.embed.weight.device}")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
            if attention_mask.device != input_ids.device:
                raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids is on {input_ids.device}")
            past = cache.length if cache is not None else 0
            S = attention_mask.shape[-1]
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or (S != T and S != past + T):
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
                )
        if self._sync_checks(input_ids):  # the values the checks need, read from the device in one sync
            lo, hi = torch.aminmax(input_ids)
            values = [lo.long(), hi.long()]
            if attention_mask is not None and attention_mask.dtype != torch.bool:
                values.append(((attention_mask != 0) & (attention_mask != 1)).any().to(lo.device, torch.long))
            lo, hi, *mask_off = torch.stack(values).tolist()
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside [0, vocab_size={self.config.vocab_size})")
            if any(mask_off):
                raise ValueError("attention_mask must hold only 0 and 1")
        if cache is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} is past max_seq_len={self.config.max_seq_len}")
        else:
            self._check_cache(cache)
            if cache.batch_size != B:
                raise ValueError(f"cache was made for batch size {cache.batch_size}, input has {B} rows")
            if cache.length + T > cache.max_len:
                raise ValueError(
                    f"{T} new tokens after {cache.length} cached ones is past the cache's max_len={cache.max_len}"
                )
            if cache.device != input_ids.device:
                raise ValueError(f"cache is on {cache.device} but input_ids is on {input_ids.device}")

    def _check_cache(self, cache: Cache) -> None:
        """Raise ``TypeError``/``ValueError`` when ``cache`` was not made for this model: another
        class, layer count, head count or head width, or a dtype other than the weights' (what
        ``new_cache`` makes)."""
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a wiola.Cache (model.new_cache), got {type(cache).__name__}")
        c, w = self.config, self.embed.weight
        want = (c.n_layers, cache.batch_size, c.n_heads, cache.max_len, c.head_dim)
        for name in ("k", "v"):
            got = tuple(getattr(cache, name).shape)
            if got != want:
                raise ValueError(
                    f"cache.{name} has shape {got} (layers, rows, heads, slots, head width); this model needs {want}: "
                    f"the cache was made for another model (make it with model.new_cache)"
                )
        if cache.dtype != w.dtype:
            raise ValueError(f"cache dtype {cache.dtype} is not the model's {w.dtype} (make it with model.new_cache)")

    def _sync_checks(self, t: torch.Tensor) -> bool:
        """Value checks read tensors on the host; skip them where that would break tracing."""
        if torch.compiler.is_compiling():
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        return_logits: bool | None = None,
        logits_to_keep: int = 0,
        token_type_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Logits, and the next-token loss when ``labels`` are given.

        Args:
            input_ids: ``(B, T)`` integer token ids in ``[0, vocab_size)``.
            attention_mask: ``(B, T)`` (or ``(B, cached + T)`` with a cache), 1 for real tokens
                and 0 for padding. Left padding (generation) and right padding (training)
                both work: every row computes what it would compute alone.
            labels: ``(B, T)`` aligned with ``input_ids`` and shifted inside (position ``t``
                predicts ``labels[t + 1]``); ``-100`` and padding positions are ignored.
            cache: a ``Cache``; the new tokens are appended and attend to everything cached.
                Inference only: a backward pass through a forward with a cache raises (each
                layer writes the cache in place, changing what earlier layers saved for it).
            return_logits: compute the ``(B, T, V)`` logits. Defaults to True here; the fast
                model defaults to False when labels are given (fused loss, no logits).
            logits_to_keep: if positive, logits only for the last ``logits_to_keep`` positions
                (``(B, min(logits_to_keep, T), V)``; what generation needs); 0, every position.
                Not with ``labels``.
            token_type_ids: None, or zeros of ``input_ids``' shape (what a ``transformers``
                tokenizer returns beside the ids, so ``model(**tokenizer(text, return_tensors="pt"))``
                works); ignored. Wiola has no token types: another value raises ``ValueError``.

        Returns a ``ModelOutput`` with ``logits`` (float32), ``loss`` and ``cache``.
        Raises ``TypeError``/``ValueError`` naming the problem for bad ids (out of the vocabulary,
        or not int64/int32), shapes, masks, lengths past ``max_seq_len`` or the cache, a cache of
        another batch size, model or dtype, and a negative ``logits_to_keep``.
        """
        self.check_inputs(input_ids, attention_mask, cache)
        if token_type_ids is not None:
            check_token_type_ids(token_type_ids, input_ids)
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be a non-negative int (0: every position), got {logits_to_keep!r}")
        if cache is not None and attention_mask is None and labels is None and return_logits is not False:
            out = self._decoding_step(input_ids, cache)
            if out is not None:
                return out
        context = self._forward_context(input_ids, cache)
        if type(self.embed) is not nn.Embedding:
            raise ValueError("an adapter on the embedding is not supported: the tied head reads its weight directly")
        if attention_mask is not None:
            attention_mask = attention_mask[:, -input_ids.shape[1] :].to(torch.bool)
        with context:
            x = self._hidden_states(input_ids, attention_mask, cache, logits_to_keep if labels is None else 0)
            logits, loss = self._head(x, input_ids, attention_mask, labels, return_logits, logits_to_keep)
        if cache is not None and torch.is_grad_enabled():
            logits, loss = (_NoBackwardThroughCache.apply(t) if t is not None and t.requires_grad else t
                            for t in (logits, loss))  # fmt: skip
        return ModelOutput(logits=logits, loss=loss, cache=cache)

    def _hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None, keep: int = 0
    ) -> torch.Tensor:
        """The final norm's output ``(B, T, d)``: the blocks over the embedded ids (the new tokens
        appended to ``cache``); ``attention_mask`` ``(B, T)`` bool or None, inputs checked.

        ``keep`` (``0 < keep < T``): that of the last ``keep`` positions, ``(B, keep, d)``. Only
        they reach the head, and in the last block nothing else depends on the other positions'
        outputs, so from its attention on (with a cache the attention's queries, ``W_o``, the
        feed-forward block and the norms; without one the attention runs every query and its output
        is cut to those) it computes those positions alone; every position's key, value and gate sum
        still goes to the cache. The kept positions' numbers are the same function as in the full
        pass (llama.cpp's graph keeps the outputs it returns likewise)."""
        B, T = input_ids.shape
        cos, sin = self._rope(attention_mask, B, T, cache, input_ids.device)  # (B, T, D/2) fp32
        start = 0 if cache is None else self._cache_start(cache, T, attention_mask)

        hidden, residual = self.embed(input_ids), None  # (B, T, d); the residual stream starts at hidden
        checkpointed = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        keep = keep if 0 < keep < T and not checkpointed else 0
        last = len(self.layers) - 1
        for i, block in enumerate(self.layers):
            if checkpointed:
                hidden, residual = checkpoint(block, hidden, residual, cos, sin, attention_mask, use_reentrant=False)
            else:
                hidden, residual = block(
                    hidden, residual, cos, sin, attention_mask, cache, start, keep if i == last else 0
                )
        x, _ = self.norm(hidden, residual)  # the last residual add, fused into the final norm

        if cache is not None:
            self._cache_advance(cache, T, attention_mask)
        return x

    def _decoding_step(self, input_ids: torch.Tensor, cache: Cache) -> ModelOutput | None:
        """A decoding step (new tokens on ``cache``, no mask, no labels) computed by another path than
        the modules, or None: ``wiola.fast`` runs a one-token CPU step in C++. None here."""
        return None

    def _forward_context(self, input_ids: torch.Tensor, cache: Cache | None) -> contextlib.AbstractContextManager:
        """The context the model's computation runs in (``wiola.fast``: CPU bf16 products for a
        prompt, or oneDNN's fp32 GEMM, where chosen). A no-op here."""
        return contextlib.nullcontext()

    def _head(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        return_logits: bool | None,
        logits_to_keep: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits (fp32, head tied to the embedding) and the loss from the final hidden states."""
        if labels is not None:
            if logits_to_keep:
                raise ValueError("logits_to_keep cannot be combined with labels (the loss needs every position)")
            labels = self._shifted_labels(labels, attention_mask, input_ids)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if return_logits is None:
            return_logits = self._default_return_logits(labels)
        E, V = self.embed.weight, self.config.vocab_size
        logits = loss = None
        if return_logits:
            if uses_decode_layout(x):
                logits = upcast(linear(x, E, _decode_layout_of(self.derived_weights, "head", E)))  # (B, T, V) fp32
            else:  # under autocast, E cast once per version (not an 8 MB copy per decoded token)
                logits = upcast(linear(x, _cast_of(self.derived_weights, "head", E, autocast_dtype(x))))
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels.reshape(-1), reduction="sum")
                loss = loss / (labels != -100).sum().clamp(min=1)
        elif labels is not None:
            loss = self.ops.linear_cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), E, labels.reshape(-1))
        return logits, loss

    def _default_return_logits(self, labels: torch.Tensor | None) -> bool:
        return True

    def _rope(
        self, attention_mask: torch.Tensor | None, B: int, T: int, cache: Cache | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``(B, T, D/2)`` at the new tokens' positions (after ``cache.n_real`` real
        tokens a row). ``wiola.fast`` reads a CUDA-graph step's from a table."""
        offset = 0 if cache is None else cache.n_real
        positions = positions_from_mask(attention_mask, B, T, offset=offset, device=device)
        return rope_tables(positions, self.rope_freqs)

    def _cache_advance(self, cache: Cache, T: int, attention_mask: torch.Tensor | None) -> None:
        """After the layers: ``T`` more slots used, and each row's count of real tokens."""
        cache.length += T
        cache.n_real += T if attention_mask is None else attention_mask.sum(dim=1)

    def _cache_start(self, cache: Cache, T: int, attention_mask: torch.Tensor | None) -> int | torch.Tensor:
        """Mark the ``T`` new slots in ``cache.key_mask``; return the first one (``decode_attention``'s
        ``start``). ``wiola.fast`` overrides this to keep the slot on the device for CUDA graphs."""
        start = cache.length
        cache.key_mask[:, start : start + T] = True if attention_mask is None else attention_mask
        return start

    def _shifted_labels(
        self, labels: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """``labels[:, 1:]`` with -100 where the target or the position predicting it is padding:
        ``(B, T - 1)`` int64. A left-padded row's first real token is predicted from padding, which
        the row alone never does, so its loss is the row's alone."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
        labels = labels.to(torch.int64)
        if attention_mask is not None:
            labels = labels.masked_fill(~attention_mask, -100)
        if self._sync_checks(labels):
            bad = (labels != -100) & ((labels < 0) | (labels >= self.config.vocab_size))
            if bool(bad.any()):
                raise ValueError(
                    f"label {int(labels[bad][0])} is outside [0, vocab_size={self.config.vocab_size}) and is not -100"
                )
        if attention_mask is not None:
            return labels[:, 1:].masked_fill(~attention_mask[:, :-1], -100)
        return labels[:, 1:]

    # ------------------------------------------------------------- decoding
    def new_cache(self, batch_size: int, max_len: int | None = None) -> Cache:
        """A static cache on the model's device and dtype, for ``max_len`` slots (None: max_seq_len).
        Raises ``ValueError`` as ``Cache`` does (``max_len`` outside ``[1, max_seq_len]``, ...)."""
        w = self.embed.weight
        max_len = self.config.max_seq_len if max_len is None else max_len
        return Cache(self.config, batch_size, max_len, device=w.device, dtype=w.dtype)

    def generate(
        self, input_ids: torch.Tensor | None = None, max_new_tokens: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Prompt followed by ``max_new_tokens`` new tokens, ``(B, T + N)``. See ``wiola.generation.generate``."""
        return generate(self, input_ids, max_new_tokens, **kwargs)

    # ---------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the tied head is not stored twice), and
        ``tokenizer`` beside them (``wiola.tokenizer.Tokenizer.save``)."""
        save_pretrained(self, directory, tokenizer)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        revision: str | None = None,
        torch_dtype: torch.dtype | str | None = None,
    ) -> WiolaModel:
        """Load a checkpoint written by ``save_pretrained`` or by the published ``wiola13m`` package,
        from a folder or a Hugging Face Hub id (``"org/name"``, at ``revision``). ``dtype``: a
        torch dtype or its name (``"bfloat16"``), ``"auto"`` for the stored one, None for fp32. Its
        tokenizer: ``wiola.checkpoint.load_checkpoint_tokenizer``. ``torch_dtype``: ``transformers``'
        older name for ``dtype``."""
        if torch_dtype is not None:
            if dtype is not None:
                raise ValueError("give dtype or torch_dtype (its older name), not both")
            dtype = torch_dtype
        return load_pretrained(cls, directory, device=device, dtype=dtype, revision=revision)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
