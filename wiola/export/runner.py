"""Run a Wiola model exported by ``wiola export --format onnx`` in ONNX Runtime: numpy,
``onnxruntime`` and (for text) ``tokenizers`` only, no torch and nothing else of wiola.

``wiola export`` copies this file into the export as ``run_onnx.py``, so the folder runs on its
own::

    pip install onnxruntime tokenizers numpy
    python run_onnx.py EXPORT_DIR --prompt "Once upon a time" --max-new-tokens 100

or from Python::

    from run_onnx import OnnxModel          # or: from wiola.export.runner import OnnxModel
    model = OnnxModel(EXPORT_DIR)
    print(model.generate_text("Once upon a time", max_new_tokens=100))

The graph (``model.onnx``) is one decoding step with the static cache passed in and the new
state passed out (``wiola.export.step``); ``StepDriver`` keeps the cache and feeds a prompt one
token a step, then decodes greedily. Greedy decoding here gives the tokens of the PyTorch model
it was exported from (``tests/test_export_onnx.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "wiola-onnx"
FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
META_FILE = "wiola_onnx.json"
INPUT_NAMES = ("input_ids", "position", "real", "key_mask", "k_cache", "v_cache", "gate_sum", "gate_count")

StepFn = Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]


class StepDriver:
    """Prefill and greedy decoding around a one-token step ``run(inputs) -> outputs`` with the
    signature of ``wiola.export.step.DecodeStep`` (an ONNX Runtime session, or the PyTorch step).

    The cache for a call holds ``prompt + max_new_tokens`` slots, up to ``max_seq_len``. A prompt
    is fed one token a step: the step computes at each position what the full pass computes.
    """

    def __init__(
        self, run: StepFn, *, n_layers: int, n_heads: int, head_dim: int, vocab_size: int, max_seq_len: int
    ) -> None:
        self.run = run
        self.shape = (n_layers, n_heads, head_dim)
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len

    def check(self, ids: np.ndarray, mask: np.ndarray | None, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompt as int64 and its mask as bool; ``ValueError`` naming what is wrong."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must hold integers, got dtype {ids.dtype}")
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"input_ids must be a non-empty (B, T) array, got shape {ids.shape}")
        lo, hi = int(ids.min()), int(ids.max())  # before the cast: a uint64 past int64 would wrap
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside [0, vocab_size={self.vocab_size})")
        ids = ids.astype(np.int64)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        B, T = ids.shape
        if T + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"{T} prompt + {max_new_tokens} new tokens = {T + max_new_tokens} is past max_seq_len={self.max_seq_len}"
            )
        if mask is None:
            return ids, np.ones((B, T), dtype=bool)
        mask = np.asarray(mask)
        if mask.shape != (B, T):
            raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids {ids.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = mask.astype(bool)
        if not mask[:, -1].all():
            raise ValueError("generate needs left padding: the last column of attention_mask must be all ones")
        return ids, mask

    def generate(
        self,
        input_ids: np.ndarray,
        max_new_tokens: int,
        *,
        attention_mask: np.ndarray | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        logits_out: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """``(B, T + max_new_tokens)`` int64: the (left-padded) prompt and its greedy continuation.
        A row that emits ``eos_token_id`` holds ``pad_token_id`` (default: eos) after it, and
        decoding ends once every row has. ``logits_out``: a list that receives every position's
        ``(B, V)`` float32 logits (prompt positions included)."""
        ids, mask = self.check(input_ids, attention_mask, max_new_tokens)
        eos_token_id = _token_id("eos_token_id", eos_token_id, self.vocab_size)
        pad_token_id = _token_id("pad_token_id", pad_token_id, self.vocab_size)
        B, T = ids.shape
        L, H, D = self.shape
        S = T + max_new_tokens
        k_cache = np.zeros((L, B, H, S, D), dtype=np.float32)
        v_cache = np.zeros_like(k_cache)
        key_mask = np.zeros((B, S), dtype=bool)
        gate_sum = np.zeros((L, B, D), dtype=np.float32)
        gate_count = np.zeros((L, B), dtype=np.float32)
        n_real = np.zeros(B, dtype=np.int64)
        pad = eos_token_id if pad_token_id is None else pad_token_id
        finished = np.zeros(B, dtype=bool)
        out = np.empty((B, S), dtype=np.int64)
        out[:, :T] = ids
        real = np.ones(B, dtype=bool)
        token = ids[:, :1]
        for slot in range(S - 1 if logits_out is None else S):
            if slot < T:
                token, real = ids[:, slot : slot + 1], mask[:, slot]
            inputs = {
                "input_ids": np.ascontiguousarray(token),
                "position": n_real.copy(),
                "real": real.astype(np.float32),
                "key_mask": key_mask,
                "k_cache": k_cache,
                "v_cache": v_cache,
                "gate_sum": gate_sum,
                "gate_count": gate_count,
            }
            logits, k_new, v_new, gate_sum, gate_count = self.run(inputs)
            if logits_out is not None:
                logits_out.append(logits)
            if slot == S - 1:
                break
            k_cache[:, :, :, slot] = k_new
            v_cache[:, :, :, slot] = v_new
            key_mask[:, slot] = real
            n_real += real
            if slot < T - 1:
                continue
            nxt = np.argmax(logits, axis=-1).astype(np.int64)
            if eos_token_id is not None:
                nxt = np.where(finished, pad, nxt)
                finished |= nxt == eos_token_id
            out[:, slot + 1] = nxt
            token = nxt[:, None]
            if eos_token_id is not None and finished.all() and logits_out is None:
                out[:, slot + 2 :] = pad
                break
        return out


def _token_id(name: str, value: Any, vocab_size: int) -> int | None:
    """``value`` (None, an int or a numpy integer) as an id in ``[0, vocab_size)``;
    ``TypeError``/``ValueError`` naming ``name`` otherwise (as ``wiola.generation`` checks it)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a single int or None, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < vocab_size:
        raise ValueError(f"{name} {int(value)} is outside [0, vocab_size={vocab_size})")
    return int(value)


# The sizes an export's wiola_onnx.json must give (positive ints).
META_SIZES = ("n_layers", "n_heads", "head_dim", "vocab_size", "max_seq_len")


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """An export's ``wiola_onnx.json``; ``FileNotFoundError``/``ValueError`` naming the problem."""
    directory = Path(directory)
    path = directory / META_FILE
    if not (directory / MODEL_FILE).is_file() or not path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a Wiola ONNX export: it needs {MODEL_FILE} and {META_FILE} (wiola export --format onnx)"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} does not describe a Wiola ONNX export (format {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {meta.get('format_version')!r}; this runner reads {FORMAT_VERSION}")
    for key in META_SIZES:
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive int, got {value!r} (a damaged export: export it again)")
    for key in ("eos_token_id", "pad_token_id"):
        try:
            _token_id(key, meta.get(key), meta["vocab_size"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e} (a damaged export: export it again)") from None
    return meta


# transformers' clean_up_tokenization, in order, applied to the decoded text where the export's
# tokenizer_config.json sets clean_up_tokenization_spaces (as wiola.tokenizer.CLEAN_UP_REPLACEMENTS:
# this file runs without wiola, so it holds its own copy).
CLEAN_UP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


class OnnxModel:
    """An export folder loaded into an ONNX Runtime CPU session: ``generate`` (ids) and
    ``generate_text`` (with the export's ``tokenizer.json``). ``threads``: intra-op threads
    (default: ONNX Runtime's, one per physical core)."""

    def __init__(self, directory: str | os.PathLike, *, threads: int | None = None) -> None:
        import onnxruntime as ort

        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int or None (ONNX Runtime's default), got {threads!r}")
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(self.directory / MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        m = self.meta
        self.driver = StepDriver(
            lambda inputs: self.session.run(None, inputs),
            n_layers=m["n_layers"],
            n_heads=m["n_heads"],
            head_dim=m["head_dim"],
            vocab_size=m["vocab_size"],
            max_seq_len=m["max_seq_len"],
        )
        self._tokenizer = None
        self._clean_up: bool | None = None

    @property
    def tokenizer(self) -> Any:
        """The export's ``tokenizers.Tokenizer``."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            path = self.directory / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: this export has no tokenizer (token ids only)")
            try:
                self._tokenizer = Tokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises a bare Exception on a damaged file
                raise ValueError(
                    f"{path} is not a valid tokenizers file (a damaged export: export it again): {e}"
                ) from None
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        """``ids`` as text, as ``wiola generate`` decodes them: special tokens' text kept, and
        transformers' clean-up of spaces where the export's ``tokenizer_config.json`` asks for it."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self._clean_up is None:
            path = self.directory / "tokenizer_config.json"
            try:
                config = json.loads(path.read_text()) if path.is_file() else {}
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is not valid JSON (a damaged export: export it again): {e}") from None
            self._clean_up = isinstance(config, dict) and bool(config.get("clean_up_tokenization_spaces", False))
        if self._clean_up:
            for a, b in CLEAN_UP_REPLACEMENTS:
                text = text.replace(a, b)
        return text

    def generate(
        self, input_ids: np.ndarray, max_new_tokens: int, *, attention_mask: np.ndarray | None = None, **kwargs: Any
    ) -> np.ndarray:
        """Greedy continuation of ``input_ids`` ``(B, T)`` (see ``StepDriver.generate``; greedy
        only: this runner has no sampler); eos and pad default to the export's."""
        kwargs.setdefault("eos_token_id", self.meta.get("eos_token_id"))
        kwargs.setdefault("pad_token_id", self.meta.get("pad_token_id"))
        return self.driver.generate(input_ids, max_new_tokens, attention_mask=attention_mask, **kwargs)

    def generate_text(self, prompt: str, max_new_tokens: int = 100) -> str:
        """The prompt's greedy continuation as text, as ``wiola generate`` prints it: the prompt as
        given, then the new tokens' text up to eos (the eos token and the padding after it are not
        part of it, nor a bos token the tokenizer put before the prompt)."""
        ids = self.tokenizer.encode(prompt).ids
        if not prompt or not ids:
            raise ValueError("the prompt is empty")
        new = self.generate(np.array([ids], dtype=np.int64), max_new_tokens)[0, len(ids) :].tolist()
        eos = self.meta.get("eos_token_id")
        if eos is not None and eos in new:
            new = new[: new.index(eos)]
        return prompt + self.decode(new)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Greedy text generation with a Wiola ONNX export (ONNX Runtime).")
    p.add_argument("export", help="the folder `wiola export --format onnx` wrote")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--threads", type=int, help="intra-op threads (default: ONNX Runtime's)")
    args = p.parse_args(argv)
    try:
        model = OnnxModel(args.export, threads=args.threads)
        t0 = time.perf_counter()
        text = model.generate_text(args.prompt, args.max_new_tokens)
        dt = time.perf_counter() - t0
    except ImportError as e:  # onnxruntime or tokenizers not installed
        print(f"run_onnx: error: {e}; this runner needs: pip install onnxruntime tokenizers numpy", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"run_onnx: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # ONNX Runtime's own errors: a damaged or truncated model.onnx
        if type(e).__module__.startswith("onnxruntime"):
            print(f"run_onnx: error: ONNX Runtime cannot load or run {args.export}: {e}", file=sys.stderr)
            return 2
        raise
    print(text)
    m = model.meta
    print(
        f"[{m['quantization'] or 'fp32'} weights, onnxruntime; {args.max_new_tokens} new tokens at most in {dt:.2f} s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
