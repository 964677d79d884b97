"""Does fine-tuning teach something measurable? Instruction following on the generated stories.

``wiola.train.corpus`` writes TinyStories-Instruct-style examples (a user turn naming words the
story must contain and its features, the story as the answer). ``follow_rate`` asks a model
for stories on held-out instructions and counts those that contain every required word;
``instruct_demo`` measures a checkpoint before and after ``wiola finetune`` on the examples,
with Wilson 95 % intervals and a one-sided two-proportion z-test (docs/SPEC.md "Chat and
fine-tuning"). ``wiola instruct-demo`` runs it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wiola.chat import apply_chat_template
from wiola.tokenizer import Tokenizer
from wiola.train.corpus import instruction_examples, story_words, write_instruction_corpus
from wiola.train.env import Progress
from wiola.train.run_folder import check_apart, check_no_model, check_output_folder

if TYPE_CHECKING:
    from wiola.train.finetune import FinetuneConfig

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson(hits: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``hits / n`` (95 % for the default ``z``)."""
    if n <= 0 or not 0 <= hits <= n:
        raise ValueError(f"need 0 <= hits <= n and n > 0, got hits={hits}, n={n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def two_proportion_z(hits_a: int, n_a: int, hits_b: int, n_b: int) -> tuple[float, float]:
    """``(z, p)`` of the pooled two-proportion test that b's rate exceeds a's (one-sided p)."""
    pooled = (hits_a + hits_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 0.0, 0.5 if hits_a * n_b == hits_b * n_a else 0.0
    z = (hits_b / n_b - hits_a / n_a) / se
    return z, 0.5 * math.erfc(z / math.sqrt(2))


@dataclass
class FollowRate:
    hits: int  # replies holding every required word
    n: int
    low: float  # Wilson 95 % interval
    high: float
    example: str  # the first reply, for the log

    @property
    def rate(self) -> float:
        return self.hits / self.n


@torch.no_grad()
def follow_rate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    examples: list[dict[str, Any]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    batch_size: int = 50,
    progress: Progress | None = None,
) -> FollowRate:
    """Share of ``examples`` (``instruction_examples`` dicts) whose reply, sampled once from the
    user turn alone under the chat template, contains every one of its ``words``. ``progress``
    counts the examples as their batches finish (the caller closes it)."""
    eos = tokenizer.eos_token_id
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    hits, first = 0, None
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [apply_chat_template(tokenizer, ex["messages"][:1]) for ex in chunk]
        width = max(map(len, prompts))
        ids = torch.full((len(chunk), width), eos, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
        device = model.embed.weight.device
        out = model.generate(
            ids.to(device),
            min(max_new_tokens, model.config.max_seq_len - width),
            attention_mask=mask.to(device),
            temperature=temperature,
            top_k=top_k,
            eos_token_id=eos,
            generator=generator,
        )
        for row, ex in enumerate(chunk):
            reply = out[row, width:].tolist()
            reply = reply[: reply.index(eos)] if eos in reply else reply
            text = tokenizer.decode(reply)
            first = text if first is None else first
            hits += set(ex["words"]) <= story_words(text)
        if progress is not None:
            progress.update(len(chunk))
    return FollowRate(hits, len(examples), *wilson(hits, len(examples)), first or "")


def held_out_examples(samples: int, seed: int, n_words: int = 3) -> list[dict[str, Any]]:
    """The examples ``instruct_demo`` scores before and after fine-tuning: drawn from a seed neither
    split of ``write_instruction_corpus(seed=seed)`` uses, so none is one the model was tuned on."""
    return instruction_examples(samples, seed + 3_000_017, n_words)


def instruct_demo(
    init: str | os.PathLike,
    out: str | os.PathLike,
    *,
    n_train: int = 2000,
    samples: int = 200,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 1e-3,
    lora_rank: int | None = None,
    n_words: int = 3,
    seed: int = 0,
    progress: bool = True,
    log: Any = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the instruction corpus into ``out/data``, measure ``init`` on ``samples`` held-out
    instructions, fine-tune it (``wiola.train.finetune``) into ``out/model``, measure again.
    Returns (and writes to ``out/results.json``) both rates, their intervals and the test.

    Every setting, ``init`` (a full model, not a LoRA folder) and ``out`` (a folder that can be
    written, apart from ``init``; one that holds a previous demo's files, or the user's there,
    only with ``overwrite``) is checked before anything is written or measured: a bad one
    raises ``ValueError``/``FileNotFoundError`` naming its ``wiola instruct-demo`` flag."""
    from wiola.train.finetune import FinetuneConfig, finetune, load_finetuned

    out = Path(out)
    cfg = FinetuneConfig(
        init=str(init),
        data=str(out / "data" / "train.jsonl"),
        out=str(out / "model"),
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        lora_rank=lora_rank,
        seed=seed,
        progress=progress,
        log_every=max(1, steps // 10),
    )
    init_dir = check_demo_settings(cfg, out, n_train=n_train, samples=samples, n_words=n_words, overwrite=overwrite)
    write_instruction_corpus(out / "data", n_train=n_train, n_val=1, seed=seed, n_words=n_words)
    held_out = held_out_examples(samples, seed, n_words)
    results: dict[str, Any] = {}

    def measured(when: str, folder: Path) -> FollowRate:  # a bar (or a line every 30 s) while sampling
        model, tokenizer = load_finetuned(folder)
        bar = Progress(len(held_out), f"scoring {when}", "sample", show=progress, log=log)
        rate = follow_rate(model, tokenizer, held_out, seed=seed, progress=bar)
        bar.close()
        return rate

    results["before"] = measured("before", init_dir)
    log(f"before: {_line(results['before'])}")
    finetune(cfg, log=log, overwrite=True)  # out/model: checked by check_demo_settings (--overwrite)
    results["after"] = measured("after", out / "model")
    log(f"after:  {_line(results['after'])}")
    before, after = results["before"], results["after"]
    z, p = two_proportion_z(before.hits, before.n, after.hits, after.n)
    summary = {
        "before": asdict(before),
        "after": asdict(after),
        "z": z,
        "p_one_sided": p,
        "finetune": {
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "lora_rank": lora_rank,
            "n_train": n_train,
            "n_words": n_words,
        },
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"rise: z = {z:.2f}, one-sided p = {p:.2g}")
    log(f"wrote {out / 'results.json'} (both rates and the test), the training examples in {out / 'data'}, "
        f"the fine-tuned model in {out / 'model'}")  # fmt: skip
    return summary


DEMO_FILES = ("data", "model", "results.json")  # what the demo writes into --out


def check_demo_settings(
    cfg: FinetuneConfig, out: Path, *, n_train: int, samples: int, n_words: int, overwrite: bool = False
) -> Path:
    """Check ``instruct_demo``'s settings without writing or loading anything: the fine-tune's
    own (``FinetuneConfig.check``), the counts, ``--init`` (a checkpoint or run folder holding a
    full model) and ``--out`` (writable, apart from ``--init``; not a model's folder or a
    training run's; one holding any of ``DEMO_FILES`` only with ``overwrite``, since the demo
    replaces a model in ``model/`` and the training file in ``data/``). Returns ``--init``'s
    checkpoint folder; raises ``ValueError``/``FileNotFoundError`` naming the flag, or
    ``RuntimeError`` for a missing package."""
    from wiola.checkpoint import read_config
    from wiola.train.env import require
    from wiola.train.finetune import checkpoint_dir, require_peft

    cfg.check()
    for flag, value in (("--examples", n_train), ("--samples", samples), ("n_words", n_words)):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    require("tqdm.auto", "fine-tuning")
    if cfg.lora_rank is not None:
        require_peft()
    try:
        init = checkpoint_dir(cfg.init)
        read_config(init)  # a folder without config.json, or one holding LoRA adapters, is refused here
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--init: {e}") from e
    for folder in (out, out / "data", out / "model"):  # a file at either subfolder would fail later
        check_output_folder(folder, "--out")
    given = [Path(cfg.init)] if Path(cfg.init).exists() else []  # a run folder, beside its latest checkpoint
    for source in (init, *given):
        check_apart(out, source, "--out", "--init checkpoint")
    check_no_model(out, ": the demo writes its data/ and model/ there")
    held = [name for name in DEMO_FILES if (out / name).exists() and not _empty_folder(out / name)]
    if held and not overwrite:
        raise ValueError(
            f"--out {str(out)!r} already holds {', '.join(held)} (a previous demo's, or files of yours), which "
            "the demo replaces: pass --overwrite to replace them, or use another folder"
        )
    return init


def _empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _line(r: FollowRate) -> str:
    return f"{r.hits}/{r.n} = {r.rate:.1%} contain every required word (95% CI {r.low:.1%}-{r.high:.1%})"
