"""A ``wiola`` model for EleutherAI's lm-evaluation-harness (``lm_eval``, the ``eval`` extra).

Importing this module registers the model under the name ``wiola``; ``wiola eval --tasks``
(``wiola.cli.evaluate``) runs it, and from Python::

    import lm_eval, wiola.train.harness
    lm_eval.simple_evaluate(model="wiola", model_args="pretrained=runs/wiola,quantize=int8", tasks=[...])

``pretrained`` is one of our checkpoint folders, a run folder (its latest checkpoint), a
``wiola13m`` folder or a Hugging Face Hub id; the model is ``wiola.fast.WiolaModel`` in fp32
(``quantize=int8|int4|bf16`` runs the C++ CPU step's weight-only forms; the prompt passes run on the
dequantized weights; a checkpoint saved quantized runs in its own form). The harness's ``TemplateLM``
does the text work (the context/continuation split at whitespace, an empty context scored after
``prefix_token_id``); here:

- ``tok_encode``: a text's ids with no framing (special-token text is read as its token), as
  lm-eval's HF model encodes with ``add_bos_token=False``; ``add_special_tokens=True`` adds what
  the tokenizer adds to a prompt (a ``<s>``). So a ``<s>`` is never scored as part of a text.
- ``prefix_token_id``: the token every training document begins with
  (``Tokenizer.document_prefix``): ``<s>`` where the tokenizer has one, else ``<|endoftext|>``.
- ``loglikelihood``: each (context, continuation) is scored by one forward over its last
  ``max_length`` tokens (default ``max_seq_len``); rows are batched left-padded
  (``attention_mask``), which the model computes exactly as each row alone; the answer is the sum
  of the continuation tokens' log softmax and whether each was the argmax. A continuation longer
  than ``max_length`` is refused (``ValueError``) before anything is scored: one forward cannot
  score it, and scoring only its end would report a larger log-likelihood than the whole has
  (lm-eval's HF model fails on it too, with a tensor shape error).
- ``loglikelihood_rolling``: the harness's disjoint rolling windows of ``max_length`` tokens
  (the first predicted from ``prefix_token_id``), summed.
- ``generate_until``: greedy ``model.generate`` (or sampling at the request's temperature),
  left-padded batches of the same settings, at most ``max_gen_toks`` new tokens (default 256, as
  lm-eval's HF model; one that leaves no room for the context in ``max_length`` is cut to half of
  it, with a note), stopped at the end-of-text token; the text is cut before the first of the
  ``until`` strings. Ids past the tokenizer's (a model with padded embedding rows may sample them)
  have no text: they are left out, with a warning (once a run).

Bars: ours and lm-eval's (building the requests, tokenising them) are drawn only where
``wiola.train.env.draws_bars`` (a terminal, progress on); ``lm_eval_bars`` silences lm-eval's own
around ``simple_evaluate``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

DEFAULT_MAX_GEN_TOKS = 256


def load_for_harness(pretrained: str, device: str | None = None, quantize: str | None = None) -> tuple[Any, Any]:
    """``(wiola.fast.WiolaModel in eval mode, its tokenizer)`` from a folder, run folder or Hub id,
    ``quantize``-d (a no-op for a checkpoint saved in that form). ``ValueError`` for a checkpoint
    quantized in another form, or a tokenizer with more ids than the model (``Tokenizer.check_fits``)."""
    from wiola.checkpoint import load_checkpoint_tokenizer, resolve_checkpoint
    from wiola.fast import WiolaModel
    from wiola.fast import quantize as quantize_module
    from wiola.train.env import resolve_device
    from wiola.train.run_folder import find_checkpoint

    path = resolve_checkpoint(pretrained)
    if not (path / "config.json").is_file():
        path = find_checkpoint(path)
    model = WiolaModel.from_pretrained(path, device=resolve_device(device)).eval().requires_grad_(False)
    current = getattr(model, "quantization", None)
    if quantize and current is None:
        model = quantize_module.quantize(model, quantize)
    elif quantize and current != quantize:
        raise ValueError(
            f"the checkpoint is {current}-quantized: it cannot be quantized again as {quantize} (--quantize)"
        )
    tokenizer = load_checkpoint_tokenizer(path)
    tokenizer.check_fits(model.config.vocab_size)
    return model, tokenizer


def left_pad(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` ``(B, max len)`` int64, each row right-aligned after ``pad`` tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


@register_model("wiola")
class WiolaLM(TemplateLM):
    """lm-eval's ``wiola`` model (see the module). Arguments (``model_args``): ``pretrained``
    (required), ``batch_size`` (default 8; ``auto`` is 8 too), ``device``, ``quantize``
    (``int8``/``int4``/``bf16``), ``max_length`` (default the model's ``max_seq_len``), ``progress``
    (default true: the scoring bar, drawn only where stderr is a terminal, as every wiola bar);
    ``max_batch_size`` (which lm-eval passes along) is not used. ``model``/``tokenizer``: already loaded ones,
    instead of ``pretrained``. Unknown arguments raise ``ValueError``."""

    def __init__(
        self,
        pretrained: str,
        batch_size: int | str = 8,
        device: str | None = None,
        quantize: str | None = None,
        max_length: int | None = None,
        max_batch_size: int | None = None,
        progress: bool = True,
        model: Any = None,
        tokenizer: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(f"wiola model: unknown model_args {sorted(unknown)}")
        if model is None:
            model, tokenizer = load_for_harness(pretrained, device, quantize)
        else:  # load_for_harness checks its own
            tokenizer.check_fits(model.config.vocab_size)
        self.model, self.tok = model, tokenizer
        self._noted: set[str] = set()  # notes said once each
        self.progress = bool(progress)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.max_length = int(max_length or model.config.max_seq_len)
        if not 2 <= self.max_length <= model.config.max_seq_len:
            raise ValueError(f"max_length must be in [2, max_seq_len={model.config.max_seq_len}], got {max_length}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no end-of-text token (lm-eval scores empty contexts after it)")
        self._eot = int(eos)
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eot

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "name", "wiola"))

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling text's first window are scored after: the token
        training documents begin with (``<s>``, or ``<|endoftext|>`` without one)."""
        bos = self.tok.bos_token_id
        return self._eot if bos is None else int(bos)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """``string``'s ids; the tokenizer's framing (a leading ``<s>``) only with
        ``add_special_tokens=True`` (lm-eval's ``TemplateLM`` asks for none)."""
        from wiola.chat import encode_rendered

        return list(self.tok.encode(string) if add_special_tokens else encode_rendered(self.tok, string))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(list(tokens))

    def _note(self, message: str) -> None:
        """``message`` on stderr, once per run."""
        if message not in self._noted:
            self._noted.add(message)
            print(message, file=sys.stderr)

    # ------------------------------------------------------------------------- log-likelihoods
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's ``TemplateLM.loglikelihood``, its "Tokenizing inputs" bar following ``draws_bars``."""
        from wiola.train.env import draws_bars

        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not draws_bars(self.progress))

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """For each ``(_, context ids, continuation ids)``: ``(Σ log p(continuation), all greedy)``."""
        from tqdm.auto import tqdm

        from wiola.train.env import draws_bars

        # lm-eval's disable_tqdm turns the bar off on other ranks; draws_bars keeps it off a pipe,
        # a log file and --no-progress, as every other wiola bar.
        disable = disable_tqdm or not draws_bars(self.progress)
        longest = max((len(k) for _, _, k in requests), default=0)
        if longest > self.max_length:  # before any forward: the whole task would fail at that row anyway
            raise ValueError(
                f"lm-eval asked to score a continuation of {longest} tokens, longer than max_length={self.max_length} "
                "(the tokens one forward sees): it cannot be scored whole, and scoring its end alone would overstate "
                "its log-likelihood; use a model with a longer max_seq_len (or a larger --seq-len, up to it)"
            )
        out: list[tuple[float, bool]] = []
        for start in tqdm(range(0, len(requests), self.batch_size), disable=disable, desc="wiola loglikelihood"):
            out += self._score_batch([(c, k) for _, c, k in requests[start : start + self.batch_size]])
        return out

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        rows, lengths = [], []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("lm-eval asked to score an empty continuation")
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append(whole[:-1])
            lengths.append(len(continuation))
        ids, mask = left_pad(rows, self._pad, self.device)
        logprobs = torch.log_softmax(self.model(ids, attention_mask=mask).logits.float(), dim=-1)
        out = []
        for i, ((_, continuation), n) in enumerate(zip(pairs, lengths)):
            target = torch.tensor(continuation, device=self.device)
            lp = logprobs[i, -n:]  # the last n positions predict the continuation
            picked = lp.gather(1, target[:, None])[:, 0]
            out.append((float(picked.double().sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in disjoint windows of ``max_length`` tokens."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
                )
            ]
            scores = self._loglikelihood_tokens([(("", ""), c, k) for c, k in windows], disable_tqdm=True)
            out.append(sum(score for score, _ in scores))
        return out

    # ------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations cut before the first ``until`` string, in request order."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in chunk], kwargs)
                for i, text in zip(chunk, texts):
                    results[i] = text
        return [r or "" for r in results]

    def _generate(self, contexts: list[str], kwargs: dict[str, Any]) -> list[str]:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        asked = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if asked < 1:
            raise ValueError(f"max_gen_toks must be >= 1, got {asked}")
        max_new = asked
        if asked >= self.max_length:  # no room left for the context: half the window for each
            max_new = self.max_length // 2
            self._note(
                f"note: max_gen_toks {asked} leaves no context within max_length={self.max_length}: generating at "
                f"most {max_new} tokens after the last {self.max_length - max_new} of the context"
            )
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
        rows = [self.tok_encode(c)[-(self.max_length - max_new) :] or [self.prefix_token_id] for c in contexts]
        ids, mask = left_pad(rows, self._pad, self.device)
        out = self.model.generate(
            ids, max_new, attention_mask=mask, temperature=temperature, eos_token_id=self._eot, pad_token_id=self._pad
        )
        texts = []
        for row in out[:, ids.shape[1] :].tolist():
            if self._eot in row:
                row = row[: row.index(self._eot)]
            if any(t >= self.tok.vocab_size for t in row):  # no text: decode leaves them out; said once
                self._note(
                    f"warning: the model generated token ids past the {self.tok.vocab_size:,} of tokenizer "
                    f"{self.tokenizer_name!r}: they have no text and are left out of it"
                )
            texts.append(cut_at_stop(self.tok_decode(row), until))
        return texts


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to (without) the earliest occurrence of any of the ``until`` strings."""
    cut = min((text.index(s) for s in until if s and s in text), default=len(text))
    return text[:cut]


@contextlib.contextmanager
def lm_eval_bars(progress: bool = True) -> Iterator[None]:
    """Inside: lm-eval's bar of building each task's requests drawn only where
    ``draws_bars(progress)``, as every wiola bar. lm-eval has no switch for that bar, so its task
    module's ``tqdm`` is swapped for one that is off, and put back on leaving. (Its "Tokenizing
    inputs" bar follows ``WiolaLM.progress`` through ``disable_tqdm``.)"""
    import lm_eval.api.task as task_module

    from wiola.train.env import draws_bars

    bar = getattr(task_module, "tqdm", None)
    if draws_bars(progress) or bar is None:
        yield
        return
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = bar


def task_manager(include_path: str | Path | None = None) -> Any:
    """lm-eval's ``TaskManager`` with ``include_path`` (a folder of task YAML files) added."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path) if include_path else None)
