"""Checkpoints: ours (``config.json`` + ``model.safetensors``) and the published ``wiola13m``'s.

A ``wiola13m`` directory holds a Hugging Face style ``config.json`` (``model_type: "wiola"``)
and ``model.safetensors`` or ``pytorch_model.bin`` with ``model.layers.N...`` names; it is
converted on load, and the model then computes the same logits as that package on those
weights (for unpadded input; its gate also averages padding tokens, ours does not).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn as nn

from wiola.config import WiolaConfig

ModelT = TypeVar("ModelT", bound=nn.Module)

FORMAT = "wiola"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# wiola13m config key -> ours
HF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "d_ff",
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_base",
    "spiral_alpha": "helix_alpha",
    "use_attention_gate": "gate",
    "gate_pre_rope": "gate_pre_rope",
    "rms_norm_eps": "norm_eps",
    "initializer_range": "init_std",
}


def wiola13m_names(n_layers: int) -> dict[str, str]:
    """``{wiola13m tensor name: ours}`` for a model of ``n_layers`` (the tied ``lm_head`` aside)."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    for i in range(n_layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        names[theirs + "input_layernorm.weight"] = ours + "attn_norm.weight"
        names[theirs + "post_attention_layernorm.weight"] = ours + "ffn_norm.weight"
        for x in "qkvo":
            names[theirs + f"self_attn.{x}_proj.weight"] = ours + f"attn.{x}_proj.weight"
        names[theirs + "self_attn.gate_fc1.weight"] = ours + "attn.gate_w1.weight"
        names[theirs + "self_attn.gate_fc2.weight"] = ours + "attn.gate_w2.weight"
        names[theirs + "self_attn.gate_fc2.bias"] = ours + "attn.gate_w2.bias"
        for x in ("up", "bypass", "down"):
            names[theirs + f"mlp.{x}_proj.weight"] = ours + f"ffn.{x}_proj.weight"
    return names


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_pretrained(model: nn.Module, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` (a ``WiolaModel``: a module
    with a ``config``) into ``directory`` (created if needed)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(state, p, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))


def read_config(directory: str | Path) -> tuple[WiolaConfig, str]:
    """The config of a checkpoint directory and its flavour (``"wiola"`` or ``"wiola13m"``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    if raw.get("format") == FORMAT:
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported format_version {raw.get('format_version')!r}")
        return WiolaConfig.from_dict(raw["config"]), "wiola"
    if "model_type" in raw:
        if raw["model_type"] != "wiola":
            raise ValueError(f"{path} describes a {raw['model_type']!r} model, not a Wiola model")
        if raw.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{path}: the head is not tied to the embedding (tie_word_embeddings=false)")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"{path} lacks {missing}")
        fields = {ours: raw[theirs] for theirs, ours in HF_CONFIG_KEYS.items() if theirs in raw}
        if "d_ff" not in fields:
            fields["d_ff"] = 2 * fields["d_model"]  # wiola13m's default: d_inner = 2d
        return WiolaConfig(**fields), "wiola13m"
    raise ValueError(f"{path} is neither a Wiola checkpoint config nor a wiola13m config")


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    st, pt = directory / WEIGHTS_FILE, directory / "pytorch_model.bin"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st)), st
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{st} is corrupt or not a safetensors file: {e}") from e
    if pt.is_file():
        try:
            state = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{pt} is corrupt or not a PyTorch state dict: {e}") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{pt} does not hold a dict of tensors")
        return state, pt
    raise FileNotFoundError(f"no weights in {directory}: expected {WEIGHTS_FILE} (or pytorch_model.bin)")


def convert_wiola13m_state(state: dict[str, torch.Tensor], n_layers: int, source: Any = "") -> dict[str, torch.Tensor]:
    """Rename a ``wiola13m`` state dict to ours; checks that ``lm_head.weight`` is the tied embedding.

    Raises ``ValueError`` naming a tensor that has no counterpart (missing ones are named by
    the caller, against the model's own state dict).
    """
    names = wiola13m_names(n_layers)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        if name not in names:
            raise ValueError(f"{source}: unexpected tensor {name!r} in a wiola13m checkpoint")
        out[names[name]] = tensor
    head = state.get("lm_head.weight")
    if head is not None and "embed.weight" in out and not torch.equal(head, out["embed.weight"]):
        raise ValueError(f"{source}: lm_head.weight differs from model.embed_tokens.weight; Wiola's head is tied")
    return out


def to_wiola13m_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Our state dict under ``wiola13m``'s names, with its tied ``lm_head.weight``."""
    ours_to_theirs = {ours: theirs for theirs, ours in wiola13m_names(n_layers).items()}
    missing = sorted(set(state) - set(ours_to_theirs))
    if missing:
        raise ValueError(f"no wiola13m name for tensor(s) {missing}")
    out = {ours_to_theirs[name]: tensor for name, tensor in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def load_pretrained(
    cls: Callable[[WiolaConfig], ModelT],
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> ModelT:
    """Build ``cls(config)`` (a ``WiolaModel`` class) from a checkpoint directory (ours or
    ``wiola13m``'s); every tensor is checked."""
    directory = Path(directory)
    config, flavour = read_config(directory)
    state, source = _read_tensors(directory)
    if flavour == "wiola13m":
        state = convert_wiola13m_state(state, config.n_layers, source)
    model = cls(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise ValueError(f"{source}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
