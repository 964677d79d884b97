"""Model configuration and the named presets."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

_Settings = TypeVar("_Settings")

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's smallest model: exactly 12,915,888 parameters with the 32k vocabulary.
    "13m": dict(vocab_size=32000, d_model=256, n_layers=6, n_heads=8, d_ff=512, max_seq_len=1024),
    "micro": dict(vocab_size=32000, d_model=384, n_layers=8, n_heads=12, d_ff=768, max_seq_len=1024),
    "small": dict(vocab_size=32000, d_model=512, n_layers=12, n_heads=16, d_ff=1024, max_seq_len=1024),
    # For tests and the CPU demo: the 32k tokenizer, four layers of width 128.
    "tiny": dict(vocab_size=32000, d_model=128, n_layers=4, n_heads=4, d_ff=256, max_seq_len=512),
}

# The feed-forward blocks (docs/SPEC.md, Feed-forward variants); the first is the paper's.
FFN_KINDS = ("butterfly", "swiglu", "gelu")


def dataclass_from_dict(cls: type[_Settings], data: dict[str, Any], unknown_message: str) -> _Settings:
    """``cls(**data)`` for the dataclass ``cls``, refusing keys that are not its fields.

    Raises ``ValueError`` with ``unknown_message`` formatted with ``unknown`` and ``known`` (sorted
    lists of field names) when ``data`` holds a key ``cls`` lacks; ``cls``'s own checks raise as usual.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(unknown_message.format(unknown=unknown, known=sorted(known)))
    return cls(**data)


_WRONG = object()  # what ``_checked`` returns for a value of another kind
_KIND_NAMES: dict[Any, str] = {
    bool: "true or false",
    int: "an int",
    float: "a finite number",
    str: "a string",
    list[float]: "a list of finite numbers",
    dict: "a JSON object (a dict)",
}


def check_field_types(settings: Any) -> None:
    """Check every field of the dataclass instance ``settings`` against its declared type.

    ``bool`` takes only ``True``/``False`` (not ``"false"``, not 0); ``int`` an int that is not a
    bool; ``float`` a finite int or float (stored as a float: a comparison such as ``lr > 0`` lets
    NaN and infinity through); ``str`` a string; ``list[float]`` a list or tuple of those floats
    (stored as a list); ``dict[...]`` a dict; ``X | None`` also ``None``. Raises ``ValueError``
    naming the first field that does not fit, so a JSON file or a flag holding the wrong kind of
    value is refused with its name rather than a ``TypeError`` from deep inside."""
    for name in _field_kinds(type(settings)):
        setattr(settings, name, check_field(type(settings), name, getattr(settings, name)))


def check_field(cls: type, name: str, value: Any) -> Any:
    """``value`` checked against the declared type of field ``name`` of the dataclass ``cls``, by
    ``check_field_types``' rules, and returned as stored (an int as a float, a tuple as a list).
    Raises ``ValueError`` ``"{name} must be ..., got ..."``."""
    kind = _field_kinds(cls)[name]
    optional = type(None) in typing.get_args(kind)
    if optional and value is None:
        return None
    if optional:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    checked = _checked(value, kind)
    if checked is _WRONG:
        expected = _KIND_NAMES.get(kind) or _KIND_NAMES[dict]
        raise ValueError(f"{name} must be {expected}{' or None' if optional else ''}, got {value!r}")
    return checked


@functools.cache
def _field_kinds(cls: type) -> dict[str, Any]:
    """The declared type of each field of the dataclass ``cls`` (its string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    kinds = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    for name, kind in kinds.items():
        if isinstance(kind, types.UnionType):
            inner = [k for k in typing.get_args(kind) if k is not type(None)]
            kind = inner[0] if len(inner) == 1 else None
        if kind not in _KIND_NAMES and typing.get_origin(kind) is not dict:
            raise TypeError(f"{cls.__name__}.{name}: check_field_types does not know the type {hints[name]}")
    return kinds


def _checked(value: Any, kind: Any) -> Any:
    """``value`` as a ``kind`` (an int as a float, a tuple as a list), or ``_WRONG``."""
    if kind is bool:
        return value if isinstance(value, bool) else _WRONG
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _WRONG
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _WRONG
        try:
            value = float(value)
        except OverflowError:  # an int past the float range
            return _WRONG
        return value if math.isfinite(value) else _WRONG
    if kind is str:
        return value if isinstance(value, str) else _WRONG
    if typing.get_origin(kind) is dict:
        return value if isinstance(value, dict) else _WRONG
    (item,) = typing.get_args(kind)  # list[float]
    if not isinstance(value, (list, tuple)):
        return _WRONG
    items = [_checked(v, item) for v in value]
    return _WRONG if any(v is _WRONG for v in items) else items


@dataclass
class WiolaConfig:
    """Hyper-parameters of a Wiola model (docs/SPEC.md notation in brackets)."""

    vocab_size: int = 32000  # [V] gpt2-32k: GPT-2's first 31,999 ranks + <|endoftext|>
    d_model: int = 256  # [d] hidden width
    n_layers: int = 6  # [L]
    n_heads: int = 8  # [H]; head width d_h = d_model / n_heads must be even (rotation pairs)
    d_ff: int = 512  # [d_ff] inner width of the feed-forward block
    max_seq_len: int = 1024  # longest sequence (prompt + generation) the model accepts
    rope_base: float = 10000.0  # base of the rotary frequency schedule
    helix_alpha: float = 0.05  # helical perturbation; 0 gives standard RoPE
    gate: bool = True  # False: no gate parameters, every gate is 1 (plain causal attention)
    gate_pre_rope: bool = True  # gate from the queries before (True) or after rotation
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # std of the truncated-normal init of linear and embedding weights
    # The checkpoint's eos: generate stops there unless given another eos_token_id (None: none),
    # as transformers reads a generation config. None here: the tokenizer's, if any, for the CLI.
    eos_token_id: int | None = None
    bos_token_id: int | None = None  # None: the tokenizer's, if any
    pad_token_id: int | None = None  # fills left padding and finished rows; None: the tokenizer's (or eos)
    ffn: str = "butterfly"  # feed-forward block: "butterfly" (the paper's), "swiglu" or "gelu" (FFN_KINDS)

    def __post_init__(self) -> None:
        check_field_types(self)  # every field's kind; the ranges follow
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head width d_model/n_heads = {self.head_dim} must be even (n_heads={self.n_heads})")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {', '.join(FFN_KINDS)}, got {self.ffn!r}")
        if self.rope_base <= 1.0:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        if self.helix_alpha < 0:
            raise ValueError(f"helix_alpha must be >= 0, got {self.helix_alpha}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside [0, vocab_size={self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # The names transformers' configs (and wiola13m's) give these settings, read-only, so that code
    # written against them reads a WiolaConfig unchanged (wiola.checkpoint.HF_CONFIG_KEYS maps the files).
    hidden_size = property(lambda self: self.d_model)
    num_hidden_layers = property(lambda self: self.n_layers)
    num_attention_heads = property(lambda self: self.n_heads)
    intermediate_size = property(lambda self: self.d_ff)
    max_position_embeddings = property(lambda self: self.max_seq_len)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> WiolaConfig:
        """A named configuration (``13m``, ``micro``, ``small``, ``tiny``), optionally overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})  # an unknown field is named, not a TypeError

    def require_butterfly(self, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` (a path that implements only the paper's block)
        when this config's feed-forward block is not the butterfly."""
        if self.ffn != "butterfly":
            raise ValueError(f"{what} supports only the butterfly feed-forward block; this model has ffn={self.ffn!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WiolaConfig:
        return dataclass_from_dict(cls, data, "unknown WiolaConfig fields: {unknown}")
