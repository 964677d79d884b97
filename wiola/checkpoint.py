"""Checkpoints: ours (``config.json`` + ``model.safetensors``) and the published ``wiola13m``'s,
from a folder or a Hugging Face Hub id, each with the tokenizer it was trained with.

A ``wiola13m`` directory holds a Hugging Face style ``config.json`` (``model_type: "wiola"``)
and ``model.safetensors`` or ``pytorch_model.bin`` (or their shards and index) with
``model.layers.N...`` names; it is converted on load, and the model then computes the same
logits as that package on those weights (for unpadded input; its gate also averages padding
tokens, ours does not). ``export_wiola13m`` writes any of our models back in that format.

The tokenizer is ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``)
next to the weights, or a tiktoken name under ``"tokenizer"`` in our ``config.json``; the
config's bos/eos/pad ids win over the tokenizer's own, and ``generation_config.json``'s over
both. A model quantized by ``wiola.fast.quantize`` is saved with its packed int8 or bf16
matrices and a ``quantization`` record in ``config.json``; only ``wiola.fast.WiolaModel`` loads
such a checkpoint. Nothing here unpickles code:
``pytorch_model.bin`` is read with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
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
BIN_WEIGHTS_FILE = "pytorch_model.bin"
# transformers' generation settings: its bos/eos/pad ids, where given, win over config.json's
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# A checkpoint saved in shards (transformers' save_pretrained(max_shard_size=...)): an index whose
# "weight_map" names the shard holding each tensor, for either kind of weights file.
SHARD_INDEXES = {WEIGHTS_FILE: WEIGHTS_FILE + ".index.json", BIN_WEIGHTS_FILE: BIN_WEIGHTS_FILE + ".index.json"}

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
# A training run folder (wiola.train.run_folder) keeps its checkpoints in checkpoints/step_NNNNNNN/ and
# names the newest in checkpoints/latest.
RUN_CHECKPOINTS = "checkpoints"
LATEST_FILE = "latest"
# What a checkpoint needs from a Hub repo: the configs and shard indexes, the weights in one file or shards
HUB_FILES = ["*.json", "*.safetensors", "pytorch_model*.bin"]
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


def _umask() -> int:
    """The process's umask, read from ``/proc/self/status`` where it is there (``os.umask`` can
    only be read by setting it, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write through a temporary file in the same folder (``write(temporary path)``), then rename
    over ``path``. The file gets mode 0o666 less the umask, as ``open()`` would create it: the
    temporary file (``tempfile.mkstemp``) and safetensors' own writes are 0o600 whatever the
    umask, and the rename keeps the mode.

    Raises ``OSError`` ``"cannot write {path}: ..."`` (with the cause's ``errno``, where it has
    one) when the write fails: safetensors' ``SafetensorError`` (a full disk among others) is no
    ``OSError``, and the temporary file an ``OSError`` would name is gone by then. ``path`` is
    left as it was."""
    from safetensors import SafetensorError

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if not isinstance(e, (OSError, SafetensorError)):
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        error = OSError(f"cannot write {path}: {reason}")
        error.errno = getattr(e, "errno", None) or _errno_in(reason)
        raise error from e


def _errno_in(message: str) -> int | None:
    """The errno a Rust I/O error's text gives (``"... (os error 28)"``, as safetensors reports
    one), None when it names none."""
    found = re.search(r"os error (\d+)", message)
    return int(found.group(1)) if found else None


def save_pretrained(model: nn.Module, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` (a ``WiolaModel``: a module
    with a ``config``) into ``directory`` (created if needed), and ``tokenizer`` beside them."""
    from safetensors.torch import save_file

    from wiola.tokenizer import Tokenizer

    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"save_pretrained: tokenizer must be a wiola.tokenizer.Tokenizer (load_tokenizer('gpt2-32k'), or a "
            f"tokenizer.json folder's), got {type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
        )
    directory = Path(directory)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    if getattr(model, "quantization", None) is not None:  # packed matrices (wiola.fast.quantize)
        codec = type(model).quantization_codec  # the model class knows its packing; this layer does not
        state, meta["quantization"] = codec.packed_state(model), codec.checkpoint_record(model)
    directory.mkdir(parents=True, exist_ok=True)  # after packed_state, which refuses a stale model
    if tokenizer is not None:
        meta.update(tokenizer.save(directory))
    # Not transformers' "pt": its loader (4.x, which wiola13m uses) then refuses this file, whose
    # tensor names are ours, rather than building a model of fresh random weights beside it.
    # transformers and wiola13m read what export_wiola13m writes.
    weights_meta = {"format": FORMAT, "note": "a wiola checkpoint; for transformers/wiola13m use `wiola export`"}
    _atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(state, p, metadata=weights_meta))
    _atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    """The newest checkpoint folder of a training run folder (the one ``checkpoints/latest`` names),
    or None when ``run`` has no ``checkpoints/latest``.

    Raises ``FileNotFoundError`` when the pointer names a folder that does not exist.
    """
    latest = Path(run) / RUN_CHECKPOINTS / LATEST_FILE
    if not latest.is_file():
        return None
    checkpoint = latest.parent / latest.read_text().strip()
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{latest} names {checkpoint.name}, which does not exist")
    return checkpoint


def resolve_checkpoint(name: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of a checkpoint: ``name`` itself when it holds a checkpoint, the newest
    checkpoint of a training run folder ``name`` (``latest_checkpoint``), else the Hugging Face Hub
    repo ``name`` (``"org/model"``) at ``revision`` through ``huggingface_hub`` (its cache, and
    only the cache when ``HF_HUB_OFFLINE=1``).

    Raises ``FileNotFoundError`` naming the folder or the repo and what to do.
    """
    path = Path(name)
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids, but {str(path)!r} is a local path")
        if not (path / CONFIG_FILE).is_file():
            return latest_checkpoint(path) or path
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


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; ``ValueError`` naming the file when it does not parse
    or holds something else (``OSError`` where it cannot be read)."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return raw


def quantization_of(checkpoint: str | Path) -> str | None:
    """The scheme (``int8``, ``int4``, ``bf16``) of the ``quantization`` record in a checkpoint
    folder's ``config.json`` (``wiola.fast.quantize``); None for fp32 weights, a ``wiola13m``
    folder or a ``config.json`` that does not read (the loader then says what is wrong)."""
    try:
        record = json.loads((Path(checkpoint) / "config.json").read_text()).get("quantization")
    except (OSError, ValueError, AttributeError):
        return None
    if not record:
        return None
    return str(record.get("scheme", "quantized")) if isinstance(record, dict) else "quantized"


def read_config(directory: str | Path) -> tuple[WiolaConfig, str]:
    """The config of a checkpoint directory and its flavour (``"wiola"`` or ``"wiola13m"``), with
    the bos/eos/pad ids a ``generation_config.json`` beside it gives (``generation_ids``).

    Raises ``FileNotFoundError`` for a missing folder or ``config.json``, ``ValueError`` naming the
    file for one that does not describe a Wiola model."""
    config, flavour = _read_model_config(Path(directory))
    ids = generation_ids(directory)
    if ids:
        config = _config(Path(directory) / GENERATION_CONFIG_FILE, lambda: dataclasses.replace(config, **ids))
    return config, flavour


def generation_ids(directory: str | Path) -> dict[str, int | None]:
    """The bos/eos/pad ids the ``generation_config.json`` of a checkpoint folder sets, each one
    the file holds (``null`` too); none without the file. ``transformers`` generates with these
    rather than ``config.json``'s, and so do we: they become the config's, and the tokenizer's.

    Raises ``ValueError`` naming the file for a list of eos ids (Wiola ends a row at one)."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    raw = read_json_object(path)
    ids = {name: raw[name] for name in SPECIAL_IDS if name in raw}
    _check_one_eos(path, ids.get("eos_token_id"))
    return ids


def _check_one_eos(path: Path, eos: Any) -> None:
    if isinstance(eos, list):
        raise ValueError(
            f"{path}: eos_token_id {eos!r} is a list; Wiola takes one eos id (one id ends a row): keep the one its "
            "tokenizer ends a text with"
        )


def _read_model_config(directory: Path) -> tuple[WiolaConfig, str]:
    """``config.json`` alone: the config and the flavour (``read_config``)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileNotFoundError(f"{str(directory)!r} is a file, not a checkpoint directory")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file() and (directory / "adapter_config.json").is_file():  # wiola finetune --lora-rank's folder
        raise FileNotFoundError(
            f"{directory} holds LoRA adapters (adapter_config.json), not a model: fold them into their base with "
            f"`wiola merge --adapter {directory} --out MERGED_DIR` and use that folder (wiola chat reads it as it is)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a checkpoint directory")
    raw = read_json_object(path)
    if raw.get("format") == FORMAT:
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported format_version {raw.get('format_version')!r}")
        if "config" not in raw:
            raise ValueError(f"{path} lacks the key 'config', the model's settings (vocab_size, d_model, ...)")
        settings = raw["config"]
        if not isinstance(settings, dict):
            raise ValueError(
                f"{path}: 'config' must be a JSON object of the model's settings (vocab_size, d_model, ...), "
                f"not {json.dumps(settings)[:60]}"
            )
        return _config(path, lambda: WiolaConfig.from_dict(settings)), "wiola"
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
        _check_one_eos(path, fields.get("eos_token_id"))
        return _config(path, lambda: WiolaConfig(**fields)), "wiola13m"
    raise ValueError(f"{path} is neither a Wiola checkpoint config nor a wiola13m config")


def _config(path: Path, make: Callable[[], WiolaConfig]) -> WiolaConfig:
    """``make()``, its ``ValueError``/``TypeError`` (a bad field) naming the file it came from."""
    try:
        return make()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e


def _weight_files(directory: str | Path) -> tuple[list[Path], Path]:
    """The weights files of a checkpoint folder, in the order ``transformers`` looks for them:
    ``model.safetensors``, the shards ``model.safetensors.index.json`` names, ``pytorch_model.bin``,
    the shards ``pytorch_model.bin.index.json`` names. Returns ``(files, source)``: the file alone
    or the shards in their order, and the file errors name (the index for shards).

    Raises ``FileNotFoundError`` where there are none or a shard the index names is missing,
    ``ValueError`` for an index that is no ``{"weight_map": {tensor: shard}}``."""
    directory = Path(directory)
    for single, index in SHARD_INDEXES.items():
        if (directory / single).is_file():
            return [directory / single], directory / single
        if (directory / index).is_file():
            return _shards(directory / index), directory / index
    raise FileNotFoundError(
        f"no weights in {directory}: expected {WEIGHTS_FILE} or {BIN_WEIGHTS_FILE} (or their shards and "
        f"{SHARD_INDEXES[WEIGHTS_FILE]} / {SHARD_INDEXES[BIN_WEIGHTS_FILE]})"
    )


def _weight_map(index: Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` of a shard index; ``ValueError`` naming it when malformed
    or when a shard is not a plain file name (one beside the index)."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f'{index} holds no "weight_map" naming the shard of each tensor')
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
            raise ValueError(f"{index}: tensor {name!r} is mapped to {shard!r}, not a file beside the index")
    return weight_map


def _shards(index: Path) -> list[Path]:
    """The shard files an index names, in the order of their first tensor; ``FileNotFoundError``
    naming those missing."""
    shards = [index.parent / name for name in dict.fromkeys(_weight_map(index).values())]
    missing = [path.name for path in shards if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index} names shard(s) missing from {index.parent}: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; download or copy every shard of the checkpoint"
        )
    return shards


def _merge_shards(parts: list[tuple[Path, dict[str, Any]]], source: Path) -> dict[str, Any]:
    """One ``{tensor name: value}`` from each shard's, checked against ``source``, the index (when
    there is one): every tensor in the shard the index names for it, and in no other."""
    merged: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for shard, tensors in parts:
        for name, value in tensors.items():
            if name in where:
                raise ValueError(f"{source}: tensor {name!r} is in two shards, {where[name].name} and {shard.name}")
            merged[name], where[name] = value, shard
    if source.name in SHARD_INDEXES.values():
        for name, shard in _weight_map(source).items():
            if name not in where:
                raise ValueError(f"{source} puts tensor {name!r} in {shard}, which does not hold it")
            if where[name].name != shard:
                raise ValueError(f"{source} puts tensor {name!r} in {shard}, but {where[name].name} holds it")
    return merged


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of a checkpoint folder's weights (``_weight_files``: one file or its shards)
    and the file errors name."""
    files, source = _weight_files(directory)
    parts = []
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                state = load_file(str(path))
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{path} is corrupt or not a safetensors file: {e}") from e
        else:
            state = safe_torch_load(path, "a PyTorch state dict")
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ValueError(f"{path} does not hold a dict of tensors")
        parts.append((path, state))
    return _merge_shards(parts, source), source


def _header_shapes(directory: Path) -> tuple[dict[str, tuple[int, ...]], Path] | None:
    """Name -> shape of every tensor in the safetensors weights (one file or every shard), from
    their headers alone (no tensor is read); None when the weights are ``pytorch_model.bin`` (no
    header to read). Raises ``ValueError`` for a damaged file, ``FileNotFoundError`` as
    ``_weight_files`` does."""
    files, source = _weight_files(directory)
    if files[0].suffix != ".safetensors":
        return None
    from safetensors import SafetensorError, safe_open

    parts = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                parts.append((path, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is corrupt or not a safetensors file: {e}") from e
    return _merge_shards(parts, source), source


def _check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: Any) -> None:
    """Every tensor the model has, none it lacks, each of the model's shape; ``ValueError`` naming
    the first tensors that differ (and, for a shape, the config fields it follows from)."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise ValueError(f"{source}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(shape)}, but config.json makes it "
                f"{tuple(expected[name])}: the config does not describe these weights"
            )


class _SkipRandomInit(torch.overrides.TorchFunctionMode):
    """Inside it, the random fills of weight initialisation return their tensor untouched: on the
    meta device they compute nothing anyway, and ``normal_`` there would import ``torch._dynamo``
    (seconds) through its decomposition. Per thread, like every torch function mode."""

    SKIPPED = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.nn.init.normal_,
            torch.nn.init.trunc_normal_,
            torch.nn.init.uniform_,
            torch.nn.init.kaiming_uniform_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:  # init functions pass the tensor by keyword, methods as self
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _expected_shapes(cls: Callable[[WiolaConfig], nn.Module], config: WiolaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of ``cls(config)``'s state dict, built on the meta device (nothing
    is allocated, whatever sizes the config asks for)."""
    with torch.device("meta"), _SkipRandomInit():
        skeleton = cls(config)
    return {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}


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

    Raises ``ValueError`` naming ``path``: when it is a readable pickle that names Python objects
    beyond those (a class or function, possibly planted to run code), saying so and which; when it
    is not a ``torch.save`` file at all (corrupt, truncated, another format), saying that. Neither
    message repeats torch's advice to retry with ``weights_only=False``, which would run the file.
    """
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol: the errors below say what matters
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = _pickle_globals(Path(path))
        blocked = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
        if blocked is None and not names:  # no readable pickle naming anything: damaged bytes
            raise ValueError(f"{path} is corrupt or not a PyTorch checkpoint (expected {what})") from None
        named = blocked.group(1) if blocked else ", ".join(names[:3])
        raise ValueError(
            f"refusing to load {path}: it holds Python objects beyond tensors and plain containers ({named}), "
            f"which is what a pickle that runs code holds; nothing in it was run. Only {what} is read from it"
        ) from None
    except Exception as e:
        why = f": {str(e).splitlines()[0]}" if str(e) else " (it ends too soon)"
        raise ValueError(f"{path} is corrupt or not a PyTorch checkpoint (expected {what}){why}") from e


def _pickle_globals(path: Path) -> list[str]:
    """The ``module.name`` globals the pickle of ``path`` (a ``torch.save`` zip's ``data.pkl``, or
    the file itself) names, read from its opcodes with ``pickletools`` (nothing is run); empty
    when it is not a whole, readable pickle."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if member is None:
                    return []
                data = archive.read(member)
        else:
            data = path.read_bytes()
        names, strings = [], []
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
        return names
    except Exception:  # not a pickle (bad opcode, truncated, no STOP), not a zip: nothing to name
        return []


def load_checkpoint_tokenizer(
    directory: str | Path, revision: str | None = None, *, tokenizer_flag: str | None = None
) -> Tokenizer:
    """The tokenizer a checkpoint (a folder or Hub id) was saved with, with the bos/eos/pad ids of
    its config (``read_config``: ``config.json``, then ``generation_config.json``; those win over
    the tokenizer's, as in ``transformers``' generation).

    A checkpoint of ours without a tokenizer record (written before there was one) gets the
    tiktoken encoding matching its vocabulary. Raises ``FileNotFoundError`` for a ``wiola13m``
    folder without ``tokenizer.json`` (its message names ``tokenizer_flag``, the caller's option
    that gives a tokenizer instead, where there is one), ``ValueError`` for a corrupt tokenizer.
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
        name = read_json_object(directory / CONFIG_FILE).get("tokenizer")
        tokenizer = (
            load_tokenizer(name) if name is not None else TiktokenTokenizer(encoding_for_vocab(config.vocab_size))
        )
    else:
        raise FileNotFoundError(
            f"{directory} holds no {TOKENIZER_FILE}: its tokenizer is unknown; copy the tokenizer files of the "
            "model's training run next to the weights"
            + (f", or name one with {tokenizer_flag}" if tokenizer_flag else "")
        )
    tokenizer = tokenizer.with_special_ids(config.bos_token_id, config.eos_token_id, config.pad_token_id)
    tokenizer.chat_template = tokenizer.chat_template or read_chat_template(directory)  # a tiktoken one's too
    return tokenizer


def export_wiola13m(model: nn.Module, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write ``model`` (a ``WiolaModel``) in the ``wiola13m`` / ``transformers`` format:
    ``config.json`` (``model_type: "wiola"``), ``model.safetensors`` under ``wiola13m``'s names,
    ``generation_config.json`` (its bos/eos/pad ids, as ``save_pretrained`` there writes it), and
    ``tokenizer`` as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``
    (a tiktoken tokenizer converted), the files ``wiola13m.WiolaForCausalLM.from_pretrained`` and
    ``transformers.PreTrainedTokenizerFast.from_pretrained`` read.
    """
    from safetensors.torch import save_file

    from wiola.tokenizer import TiktokenTokenizer

    cfg: WiolaConfig = model.config
    cfg.require_butterfly("the wiola13m format")
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
    # transformers' GenerationConfig.from_model_config: the ids config.json sets, none of them null
    generation = {"_from_model_config": True, **{k: theirs[k] for k in SPECIAL_IDS if theirs[k] is not None}}
    _atomic_write(
        directory / GENERATION_CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(generation, indent=2) + "\n")
    )
    if tokenizer is not None:
        (tokenizer.to_hf() if isinstance(tokenizer, TiktokenTokenizer) else tokenizer).save(directory)


DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float64": torch.float64,
}  # fmt: skip


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """``from_pretrained``'s ``dtype``: a floating ``torch.dtype``, its name (``"bfloat16"``,
    ``"bf16"``, ``"torch.float16"``, as ``transformers`` takes it), ``"auto"`` (the dtype the weights
    are stored in) or None (fp32, as built). ``ValueError`` naming ``dtype`` otherwise, before
    anything is read."""
    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype!r}: give a torch dtype, one of {', '.join(DTYPE_NAMES)}, or 'auto'")
        return DTYPE_NAMES[name]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, its name or 'auto', got {dtype!r}")
    return dtype


def load_pretrained(
    cls: Callable[[WiolaConfig], ModelT],
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
) -> ModelT:
    """Build ``cls(config)`` (a ``WiolaModel`` class) from a checkpoint directory (ours or
    ``wiola13m``'s), a training run folder (its latest checkpoint) or a Hub id (``resolve_checkpoint``).

    Every tensor is checked before the model is allocated: the shapes ``config.json`` implies (the
    model built on the meta device) against the safetensors header, so a config that does not
    describe the weights (say ``vocab_size`` 2,000,000,000 beside a 3,000-row embedding) raises
    ``ValueError`` naming the tensor instead of allocating. Raises ``FileNotFoundError`` for a missing
    folder or file, ``ValueError`` for a damaged or mismatched one.
    """
    dtype = resolve_dtype(dtype)
    directory = resolve_checkpoint(directory, revision)
    config, flavour = read_config(directory)
    record = read_json_object(directory / CONFIG_FILE).get("quantization") if flavour == "wiola" else None
    packed = None
    if record is not None:  # a quantized checkpoint (wiola.fast.quantize): only wiola.fast runs it
        quantize = getattr(cls, "quantization_codec", None)
        if quantize is None:
            raise ValueError(
                f"{directory} holds quantized weights ({record!r}), which only wiola.fast.WiolaModel runs; load it "
                f"with wiola.fast.WiolaModel.from_pretrained, not {getattr(cls, '__qualname__', cls)}"
            )
        scheme = quantize.read_record(record, directory / CONFIG_FILE)
        if dtype == "auto":
            dtype = torch.float32
        if dtype not in (None, torch.float32):
            raise ValueError(f"{directory} holds {scheme}-quantized weights: load them as fp32 (dtype={dtype})")
    # Before anything is allocated: the config's shapes (a meta-device model) against the file's header.
    expected = _expected_shapes(cls, config)
    header = _header_shapes(directory) if record is None else None  # packed tensors: checked after unpacking
    if header is not None:
        shapes, source = header
        if flavour == "wiola13m":
            names = wiola13m_names(config.n_layers)
            shapes = {names.get(name, name): shape for name, shape in shapes.items() if name != "lm_head.weight"}
        _check_shapes(expected, shapes, source)
    state, source = _read_tensors(directory)
    if flavour == "wiola13m":
        state = convert_wiola13m_state(state, config.n_layers, source)
    if record is not None:
        state, packed = quantize.unpack_state(state, scheme, config.n_layers, source, expected)
    _check_shapes(expected, {name: tuple(t.shape) for name, t in state.items()}, source)
    for name, tensor in state.items():
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")
    if dtype == "auto":  # as stored (transformers' torch_dtype="auto"): the embedding's dtype
        dtype = next(t.dtype for name, t in state.items() if name.endswith("embed.weight"))
    model = cls(config)
    model.load_state_dict(state)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    if packed is not None:
        quantize.attach(model.eval(), scheme, packed)
    return model
