"""Checkpoints: ours (``config.json`` + ``model.safetensors``) and the published ``wiola13m``'s,
from a folder or a Hugging Face Hub id, each with the tokenizer it was trained with.

A ``wiola13m`` directory holds a Hugging Face style ``config.json`` (``model_type: "wiola"``)
and ``model.safetensors`` or ``pytorch_model.bin`` with ``model.layers.N...`` names; it is
converted on load, and the model then computes the same logits as that package on those
weights (for unpadded input; its gate also averages padding tokens, ours does not).
``export_wiola13m`` writes any of our models back in that format.

The tokenizer is ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``)
next to the weights, or a tiktoken name under ``"tokenizer"`` in our ``config.json``; the
config's bos/eos/pad ids win over the tokenizer's own. A model quantized by ``wiola.fast.quantize`` is saved with its
packed int8 or bf16 matrices and a ``quantization`` record in ``config.json``; only
``wiola.fast.WiolaModel`` loads such a checkpoint. Nothing here unpickles code:
``pytorch_model.bin`` is read with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from wiola.config import WiolaConfig

if TYPE_CHECKING:
    from wiola.tokenizer import Tokenizer

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
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
HUB_FILES = ["*.json", "*.safetensors", "pytorch_model.bin"]  # what a checkpoint needs from a Hub repo
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def save_pretrained(model: nn.Module, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` (a ``WiolaModel``: a module
    with a ``config``) into ``directory`` (created if needed), and ``tokenizer`` beside them."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    if getattr(model, "quantization", None) is not None:  # packed matrices (wiola.fast.quantize)
        codec = type(model).quantization_codec  # the model class knows its packing; this layer does not
        state, meta["quantization"] = codec.packed_state(model), codec.checkpoint_record(model)
    if tokenizer is not None:
        meta.update(tokenizer.save(directory))
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(state, p, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))


def resolve_checkpoint(name: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of a checkpoint: ``name`` itself when it exists, else the Hugging Face Hub
    repo ``name`` (``"org/model"``) at ``revision`` through ``huggingface_hub`` (its cache, and
    only the cache when ``HF_HUB_OFFLINE=1``).

    Raises ``FileNotFoundError`` naming the folder or the repo and what to do.
    """
    path = Path(name)
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids, but {str(path)!r} is a local path")
        return path
    repo = str(name)
    if not REPO_ID.match(repo) or repo.count("/") != 1:
        raise FileNotFoundError(f"checkpoint directory {repo!r} does not exist (nor is it a Hub id like org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise RuntimeError(f"{repo!r} is not a local folder; loading it from the Hub needs `huggingface_hub`") from e
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))
    except Exception as e:  # no network, not in the cache, no such repo, gated: one message says what to do
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        where = "the local Hub cache (HF_HUB_OFFLINE is set)" if offline else "the Hub or the local Hub cache"
        raise FileNotFoundError(
            f"checkpoint {repo!r}{'' if revision is None else f' (revision {revision!r})'} is not a local folder and "
            f"could not be had from {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            f"To fix: download it once with network (`hf download {repo}`, or any load without HF_HUB_OFFLINE), "
            "check the repo id and your access to it, or pass a local folder"
        ) from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return raw


def read_config(directory: str | Path) -> tuple[WiolaConfig, str]:
    """The config of a checkpoint directory and its flavour (``"wiola"`` or ``"wiola13m"``)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a checkpoint directory")
    raw = _read_json(path)
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
        fields = {ours: raw[theirs] for theirs, ours in HF_CONFIG_KEYS.items() if raw.get(theirs) is not None}
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
        state = safe_torch_load(pt, "a PyTorch state dict")
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


def safe_torch_load(path: str | Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, nothing executed.

    Raises ``ValueError`` naming ``path`` when it holds anything else (a pickled object or
    function, possibly planted to run code) or is not a ``torch.save`` file at all.
    """
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"refusing to load {path}: it holds Python objects beyond tensors and plain containers "
            f"(what a pickle that runs code would hold); nothing in it was run. Only {what} is read from it. "
            f"({str(e).splitlines()[0]})"
        ) from e
    except Exception as e:
        raise ValueError(f"{path} is corrupt or not {what}: {e}") from e


def load_checkpoint_tokenizer(directory: str | Path, revision: str | None = None) -> Tokenizer:
    """The tokenizer a checkpoint (a folder or Hub id) was saved with, with the bos/eos/pad ids of
    its ``config.json`` (those win over the tokenizer's, as in ``transformers``' generation).

    A checkpoint of ours without a tokenizer record (written before there was one) gets the
    tiktoken encoding matching its vocabulary. Raises ``FileNotFoundError`` for a ``wiola13m``
    folder without ``tokenizer.json``, ``ValueError`` for a corrupt tokenizer.
    """
    from wiola.tokenizer import (
        TOKENIZER_FILE,
        TiktokenTokenizer,
        encoding_for_vocab,
        load_tokenizer,
        read_chat_template,
    )

    directory = resolve_checkpoint(directory, revision)
    config, flavour = read_config(directory)
    if (directory / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(directory)
    elif flavour == "wiola":
        name = _read_json(directory / CONFIG_FILE).get("tokenizer")
        tokenizer = (
            load_tokenizer(name) if name is not None else TiktokenTokenizer(encoding_for_vocab(config.vocab_size))
        )
    else:
        raise FileNotFoundError(
            f"{directory} holds no {TOKENIZER_FILE}: its tokenizer is unknown; copy the tokenizer files of the "
            "model's training run next to the weights, or name one with --tokenizer"
        )
    tokenizer = tokenizer.with_special_ids(config.bos_token_id, config.eos_token_id, config.pad_token_id)
    tokenizer.chat_template = tokenizer.chat_template or read_chat_template(directory)  # a tiktoken one's too
    return tokenizer


def export_wiola13m(model: nn.Module, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write ``model`` (a ``WiolaModel``) in the ``wiola13m`` / ``transformers`` format:
    ``config.json`` (``model_type: "wiola"``), ``model.safetensors`` under ``wiola13m``'s names, and
    ``tokenizer`` as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``
    (a tiktoken tokenizer converted), the files ``wiola13m.WiolaForCausalLM.from_pretrained`` and
    ``transformers.PreTrainedTokenizerFast.from_pretrained`` read.
    """
    from safetensors.torch import save_file

    from wiola.tokenizer import TiktokenTokenizer

    cfg: WiolaConfig = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    theirs = {hf: getattr(cfg, ours) for hf, ours in HF_CONFIG_KEYS.items()}
    if tokenizer is not None:
        for role in ("bos", "eos", "pad"):
            if theirs[f"{role}_token_id"] is None:
                theirs[f"{role}_token_id"] = getattr(tokenizer, f"{role}_token_id")
    weight = next(iter(model.state_dict().values()))
    config = {
        "architectures": ["WiolaForCausalLM"],
        "model_type": "wiola",
        **theirs,
        "tie_word_embeddings": True,
        "torch_dtype": str(weight.dtype).removeprefix("torch."),
    }
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    state = to_wiola13m_state(state, cfg.n_layers)
    del state["lm_head.weight"]  # tied: transformers stores the embedding once
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(state, p, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    if tokenizer is not None:
        (tokenizer.to_hf() if isinstance(tokenizer, TiktokenTokenizer) else tokenizer).save(directory)


def load_pretrained(
    cls: Callable[[WiolaConfig], ModelT],
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    revision: str | None = None,
) -> ModelT:
    """Build ``cls(config)`` (a ``WiolaModel`` class) from a checkpoint directory (ours or
    ``wiola13m``'s) or a Hub id (``resolve_checkpoint``); every tensor is checked."""
    directory = resolve_checkpoint(directory, revision)
    config, flavour = read_config(directory)
    record = _read_json(directory / CONFIG_FILE).get("quantization") if flavour == "wiola" else None
    packed = None
    if record is not None:  # a quantized checkpoint (wiola.fast.quantize): only wiola.fast runs it
        quantize = getattr(cls, "quantization_codec", None)
        if quantize is None:
            raise ValueError(
                f"{directory} holds quantized weights ({record!r}), which only wiola.fast.WiolaModel runs; load it "
                f"with wiola.fast.WiolaModel.from_pretrained, not {getattr(cls, '__qualname__', cls)}"
            )
        scheme = quantize.read_record(record, directory / CONFIG_FILE)
        if dtype not in (None, torch.float32):
            raise ValueError(f"{directory} holds {scheme}-quantized weights: load them as fp32 (dtype={dtype})")
    state, source = _read_tensors(directory)
    if flavour == "wiola13m":
        state = convert_wiola13m_state(state, config.n_layers, source)
    if record is not None:
        state, packed = quantize.unpack_state(state, scheme, config.n_layers, source)
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
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    if packed is not None:
        quantize.attach(model.eval(), scheme, packed)
    return model
