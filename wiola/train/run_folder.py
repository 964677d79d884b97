"""The run folder of a training run: atomic checkpoints, the ``latest`` pointer, RNG states and
the metrics log (``wiola.train.loop`` writes it; ``wiola eval``/``gates``/``--resume`` read it).

Layout::

    run/metrics.jsonl                 one JSON object per log line and evaluation
    run/loss_curve.png, run/gates.png
    run/checkpoints/latest            the name of the newest checkpoint
    run/checkpoints/step_NNNNNNN/     config.json + model.safetensors (a model folder),
                                      trainer.json (settings, step, data position, metrics),
                                      optimizer.pt (optimizer, scheduler, RNG states),
                                      the tokenizer (tokenizer.json or its name in config.json)

``optimizer.pt`` holds only tensors and plain containers, and is read with ``weights_only=True``:
a planted pickle is refused, never run.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wiola.checkpoint import LATEST_FILE, RUN_CHECKPOINTS, latest_checkpoint, read_json_object

if TYPE_CHECKING:
    from wiola.config import WiolaConfig
    from wiola.tokenizer import Tokenizer
    from wiola.train.batches import BatchStream
    from wiola.train.config import TrainConfig
    from wiola.train.evaluate import EvalResult
    from wiola.train.token_cache import TokenData


def read_optimizer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """``optimizer.pt`` of a checkpoint folder: ``{"optimizer", "scheduler", "rng"}``, read with
    ``weights_only=True``. Raises ``ValueError`` for a file holding anything that could run code."""
    from wiola.checkpoint import safe_torch_load

    path = Path(checkpoint) / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint cannot be resumed")
    state = safe_torch_load(path, "optimizer, scheduler and RNG state")
    if not isinstance(state, dict) or {"optimizer", "scheduler", "rng"} - set(state):
        raise ValueError(f"{path} does not hold the optimizer, scheduler and RNG state")
    return state


TRAINER_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
METRICS_FILE = "metrics.jsonl"


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos}
    numpy_state |= {"has_gauss": has_gauss, "gauss": gauss}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from either itself or a run folder (its ``checkpoints/latest``).

    Raises ``FileNotFoundError`` naming what is missing; for a run folder with no complete
    checkpoint (a run stopped before its first), saying so and to start it again.
    """
    path = Path(path)
    if (path / TRAINER_FILE).is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is not None:
        if (ckpt / TRAINER_FILE).is_file():
            return ckpt
        raise FileNotFoundError(
            f"{path / 'checkpoints' / LATEST_FILE} names {ckpt.name}, which holds no {TRAINER_FILE}"
        )
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist")
    if held_run_files(path):
        raise FileNotFoundError(
            f"{path} holds a training run with no complete checkpoint (no checkpoints/{LATEST_FILE}: it stopped "
            f"before its first checkpoint was written): there is nothing to resume; start the run again with "
            f"wiola train --out {path} --overwrite"
        )
    raise FileNotFoundError(
        f"{path} is neither a training checkpoint (no {TRAINER_FILE}) nor a run folder (no checkpoints/latest)"
    )


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint folder of a training run (it holds ``trainer.json``)."""
    return (Path(path) / TRAINER_FILE).is_file()


def read_trainer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer.json`` of a checkpoint folder (or of a run folder's latest checkpoint): the
    settings, step, tokenizer, data position and latest metrics. The one reader of that file.

    Raises ``FileNotFoundError`` (see ``find_checkpoint``) or ``ValueError`` for a damaged file.
    """
    return read_json_object(find_checkpoint(checkpoint) / TRAINER_FILE)


def check_output_folder(path: str | os.PathLike, name: str = "output folder") -> None:
    """Check, without creating anything, that ``path`` can become a folder to write: it is a
    folder already, or its nearest existing parent is a writable folder. ``ValueError`` naming
    ``name`` (a flag such as ``--out``) when ``path`` or a parent is a file, or the parent is
    not writable. Commands call it before their work, so a bad ``--out`` costs nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {str(path)!r} is a file, not a folder")
    existing = path
    while not existing.exists():  # the nearest existing parent (a relative path ends at ".")
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"{name} {str(path)!r} lies under {str(existing)!r}, which is a file, not a folder")
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {str(path)!r}: the folder {str(existing)!r} is not writable")


def check_apart(out: str | os.PathLike, source: str | os.PathLike, out_name: str, source_name: str) -> None:
    """``ValueError`` when the folder ``out`` is ``source``, lies inside it or holds it: writing
    there would overwrite or change the files read from ``source`` (a checkpoint folder, a run
    folder whose ``checkpoints/latest`` a new ``config.json`` above it would hide)."""
    a, b = Path(out).resolve(), Path(source).resolve()
    if a == b:
        raise ValueError(f"{out_name} {str(out)!r} is the {source_name} itself; write to another folder")
    if a.is_relative_to(b):
        raise ValueError(f"{out_name} {str(out)!r} lies inside the {source_name} {str(source)!r}; write elsewhere")
    if b.is_relative_to(a):
        raise ValueError(f"{out_name} {str(out)!r} holds the {source_name} {str(source)!r}; write elsewhere")


RUN_FILES = (METRICS_FILE, RUN_CHECKPOINTS, "loss_curve.png", "gates.png")  # what a run writes in its folder


def held_run_files(out_dir: str | os.PathLike) -> list[str]:
    """Which of a run's own files (``metrics.jsonl``, ``checkpoints/``) ``out_dir`` holds: a run's
    folder when any."""
    return [name for name in (METRICS_FILE, RUN_CHECKPOINTS) if (Path(out_dir) / name).exists()]


def check_new_run(out_dir: str | os.PathLike) -> None:
    """``ValueError`` when ``out_dir`` already holds a run (``metrics.jsonl`` or ``checkpoints/``):
    a new run there would rewrite its metrics, repoint ``checkpoints/latest`` and rotate its
    checkpoints away."""
    held = held_run_files(out_dir)
    if held and (Path(out_dir) / RUN_CHECKPOINTS / LATEST_FILE).is_file():
        raise ValueError(
            f"--out {str(out_dir)!r} already holds a run ({' and '.join(held)}); continue it with --resume {out_dir}, "
            "choose another --out, or pass --overwrite to delete it and start again"
        )
    if held:  # a run stopped before its first checkpoint: --resume has nothing to continue from
        raise ValueError(
            f"--out {str(out_dir)!r} already holds a run with no complete checkpoint ({' and '.join(held)}, no "
            f"checkpoints/{LATEST_FILE}); pass --overwrite to delete it and start again, or choose another --out"
        )


def check_not_a_run(out: str | os.PathLike, name: str = "--out") -> None:
    """``ValueError`` naming ``name`` when the folder ``out`` holds a training run (``metrics.jsonl``
    or ``checkpoints/``), is a run's ``checkpoints/`` folder (``latest``) or one of its checkpoints
    (``trainer.json``). A model written at a run's top would be what ``--checkpoint`` of that folder
    reads from then on, in place of the run's latest checkpoint; one written into a checkpoint
    would sit beside the optimizer state of other weights. For commands that write a model
    (``export``, ``finetune``, ``merge``)."""
    out = Path(out)
    held = held_run_files(out)
    if held:
        what = f"holds a training run ({' and '.join(held)})"
    elif (out / LATEST_FILE).is_file():
        what = f"is a training run's checkpoints folder (it holds {LATEST_FILE})"
    elif is_training_checkpoint(out):
        what = f"is a training run's checkpoint (it holds {TRAINER_FILE})"
    else:
        return
    raise ValueError(
        f"{name} {str(out)!r} {what}; a model written there would hide or mix with the run's checkpoints: "
        "write to another folder"
    )


def check_no_model(out: str | os.PathLike, why: str, name: str = "--out") -> None:
    """``ValueError`` naming ``name`` when the folder ``out`` holds a training run (``check_not_a_run``)
    or a model (``MODEL_FILES``), for commands that write beside a model's files but never replace
    them (``tokenizer train``, ``instruct-demo``); ``why`` says what writing there would do."""
    check_not_a_run(out, name)
    model = held_files(out, MODEL_FILES)
    if model:
        raise ValueError(f"{name} {str(out)!r} holds a model ({', '.join(model)}){why}: use another folder")


def clear_run(out_dir: str | os.PathLike) -> list[str]:
    """Delete what a run wrote in ``out_dir`` (``RUN_FILES``; anything else stays); returns the
    names deleted. For ``--overwrite``, once every check of the new run has passed."""
    out = Path(out_dir)
    return [name for name in RUN_FILES if remove_path(out / name)]


# The files of a model folder, as glob patterns. Any of MODEL_FILES means a model is there: a
# checkpoint of ours or of transformers' (one weights file, or shards and their index), an ONNX
# export (the graph, its external data and its record), LoRA adapters, a fine-tune's record.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "pytorch_model-*-of-*.bin",
    "model.onnx*",
    "wiola_onnx.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "finetune.json",
)
# What is written beside a model's files: its tokenizer (and chat template), transformers'
# generation settings, the ONNX runner, a fine-tune's loss curve.
MODEL_COMPANIONS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "run_onnx.py",
    "loss_curve.png",
)
# The commands that write a model (export, finetune, merge) refuse an --out holding any of these
# unless --overwrite is given, and then delete them all first (clear_model_folder): a new model
# never mixes with, or silently replaces, an old one's files, and no old file stays beside it.
MODEL_FOLDER_FILES = (*MODEL_FILES, *MODEL_COMPANIONS)
PEFT_MODEL_CARD = "README.md"  # peft writes it beside adapters: the old model's only there


def held_files(folder: str | os.PathLike, patterns: tuple[str, ...]) -> list[str]:
    """The names of the entries in ``folder`` that match ``patterns`` (``fnmatch`` globs; a plain
    name matches itself), in the patterns' order, sorted within one: the files of a model there."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = sorted(entry.name for entry in folder.iterdir())
    held: list[str] = []
    for pattern in patterns:
        held += [name for name in names if fnmatch.fnmatchcase(name, pattern) and name not in held]
    return held


def held_model_files(folder: str | os.PathLike) -> list[str]:
    """Which files of a model (``MODEL_FOLDER_FILES``) ``folder`` holds: none where it is new or
    holds only other files."""
    return held_files(folder, MODEL_FOLDER_FILES)


def describe_model_files(held: list[str], model: str = "a model") -> str:
    """``held`` (``held_model_files``) in words for an error: ``model`` (what the command calls
    one) and the names, or, where none of them is a model's own file, a tokenizer or settings."""
    own = any(fnmatch.fnmatchcase(name, pattern) for name in held for pattern in MODEL_FILES)
    return f"{model if own else 'the tokenizer or settings of a model'} ({', '.join(held)})"


def delete_files(folder: str | os.PathLike, patterns: tuple[str, ...]) -> list[str]:
    """Delete the files ``held_files`` finds (a file or a link, never a folder); anything else in
    ``folder`` stays. Returns the names deleted."""
    gone = []
    for name in held_files(folder, patterns):
        path = Path(folder) / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            gone.append(name)
    return gone


def clear_model_folder(folder: str | os.PathLike) -> list[str]:
    """Delete the files of the model in ``folder`` (``MODEL_FOLDER_FILES``, and peft's model card
    where it holds adapters), for ``--overwrite`` once the new model is ready to be written: no
    file of the old model stays beside it. Anything else stays. Returns the names deleted."""
    adapters = (Path(folder) / "adapter_config.json").is_file()
    return delete_files(folder, (*MODEL_FOLDER_FILES, PEFT_MODEL_CARD) if adapters else MODEL_FOLDER_FILES)


def remove_path(path: Path) -> bool:
    """Delete ``path``: a folder with what it holds, a file or a link (not what it points to).
    Returns whether there was anything to delete."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return False
    return True


def ensure_writable(directory: Path) -> None:
    """Create ``directory`` and check a file can be written there; ``ValueError`` if not."""
    check_output_folder(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output folder {str(directory)!r} is not writable: {e}") from e


def read_metrics(path: Path, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, one JSON object per line (blank lines skipped).

    A last line that does not parse is dropped, with a warning naming the file (``warn``, else
    ``warnings.warn``): a run killed while appending a line leaves exactly that. Raises
    ``ValueError`` naming the file and the line for any other line that is not a JSON object.
    """
    lines = path.read_text().split("\n")
    last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for n, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n < last:
                raise ValueError(f"{path}, line {n + 1}: not valid JSON ({e}); the metrics log is damaged") from e
            message = f"{path}: dropped its last line ({n + 1}), cut short (a run stopped while writing it)"
            if warn is None:
                warnings.warn(message, stacklevel=2)
            else:
                warn(message)
            continue
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {n + 1}: not a JSON object; the metrics log is damaged")
        records.append(record)
    return records


class MetricsLog:
    """``metrics.jsonl`` (rank 0): one JSON object per line, flushed at once.

    A resumed run (``resume_step``) starts from the rows of ``history`` up to that step: the
    ``metrics.jsonl`` of the checkpoint's run folder, which is ``path`` itself when the run goes
    on in its own folder, and is copied when it goes on in another, so that every run folder
    holds its run's whole history (its run record, the loss curve from step 1). What a crashed
    run logged after the checkpoint is dropped. None (a checkpoint outside a run folder): the log
    starts at the resumed step. ``log`` gets the warnings (``read_metrics``'s, a missing history)."""

    def __init__(
        self,
        path: Path,
        enabled: bool,
        resume_step: int | None,
        history: Path | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.path, self.enabled = path, enabled
        self.records: list[dict[str, Any]] = []
        if not enabled:
            return
        if resume_step is not None and history is not None and history.is_file():
            old = read_metrics(history, log)
            self.records = [r for r in old if r.get("step", 0) <= resume_step]
        elif resume_step is not None and log is not None:
            where = "the checkpoint lies outside a run folder" if history is None else f"{history} is missing"
            log(f"{where}: {path} starts at step {resume_step:,}, without the rows of the steps before it")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, path)
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self.records.append(record)
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()


def save_checkpoint(
    out_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    stream: BatchStream,
    cfg: TrainConfig,
    model_config: WiolaConfig,
    data: TokenData,
    tokenizer: Tokenizer,
    step: int,
    last_eval: EvalResult | None,
    train_loss: float | None,
    log_interval: dict[str, Any] | None = None,
) -> Path:
    """Write ``checkpoints/step_NNNNNNN`` atomically, point ``latest`` at it, prune old ones.

    ``log_interval`` is the loss of the steps since the last log line (``loop._Meter.state_dict``),
    kept so that a resumed run logs the interval's full loss. What a killed writer left in
    ``checkpoints/`` goes first (``remove_stale_temporaries``).

    Raises ``OSError`` naming the file that could not be written, why (a full disk: with the space
    left) and the last complete checkpoint, which stays as it was, as does ``latest``; a
    ``checkpoints/`` folder left empty is removed, so the run folder reads as one stopped before
    its first checkpoint."""
    root = out_dir / RUN_CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    name = f"step_{step:07d}"
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    writing = tmp
    try:
        model.save_pretrained(tmp, tokenizer)
        writing = tmp / OPTIMIZER_FILE
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()},
            writing,
        )
        state = {
            "step": step,
            "train_config": cfg.to_dict(),
            "model_config": model_config.to_dict(),
            "tokenizer": data.tokenizer,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "data": {
                "fingerprint": data.manifest["fingerprint"],
                "source": data.manifest["source"],
                "position": stream.state_dict(),
            },
            "train_loss": train_loss,
            "log_interval": log_interval,
            "eval": last_eval.to_dict() if last_eval is not None else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        writing = tmp / TRAINER_FILE
        writing.write_text(json.dumps(state, indent=1) + "\n")
        writing = final
        if final.exists():
            old = root / f".{name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # the first checkpoint failed: the folder holds no run yet
            if not any(root.iterdir()):
                root.rmdir()
        if isinstance(e, (OSError, RuntimeError)):  # torch.save's short write is a RuntimeError
            raise _write_failure(e, writing, out_dir, tmp, final) from e
        raise
    latest_tmp = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    try:
        latest_tmp.write_text(name + "\n")
        os.replace(latest_tmp, root / LATEST_FILE)
    except OSError as e:
        latest_tmp.unlink(missing_ok=True)
        raise _write_failure(e, root / LATEST_FILE, out_dir, tmp, final) from e
    kept = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in kept[: max(0, len(kept) - cfg.keep_checkpoints)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write_failure(error: BaseException, writing: Path, out_dir: Path, tmp: Path, final: Path) -> OSError:
    """The ``OSError`` of a checkpoint of the run folder ``out_dir`` that could not be written: the
    file (under the name it was to have, ``final`` for ``tmp``), the reason, the space left where
    the disk is full, and the last complete checkpoint (``latest``'s), which the failure left as
    it was."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, OSError) and error.filename and error.strerror:
        writing, reason = Path(error.filename), error.strerror
    what = reason if reason.startswith("cannot write ") else f"cannot write {writing}: {reason}"
    what = what.replace(str(tmp), str(final))
    try:
        last = latest_checkpoint(out_dir)
    except OSError:  # latest names a folder that is gone
        last = None
    full = getattr(error, "errno", None) == errno.ENOSPC or re.search(r"No space left|os error 28", reason)
    short = re.search(r"unexpected pos|write failed", reason)  # how torch.save's zip writer says it
    if full or short:
        try:  # measured once the partial checkpoint is gone: what there is to write the next one into
            room = f"{shutil.disk_usage(out_dir).free / 2**20:,.1f} MiB free"
        except OSError:
            room = "free space unknown"
        if last is not None:
            size = sum(f.stat().st_size for f in last.iterdir() if f.is_file())
            room += f", a checkpoint takes {size / 2**20:,.1f} MiB"
        what += f" (the disk is full: {room})" if full else f" (a short write, as on a full disk: {room})"
    if last is not None:
        way_on = (
            f"the last complete checkpoint, {last}, is as it was (checkpoints/{LATEST_FILE} names it): "
            f"make room, then continue with wiola train --resume {out_dir}"
        )
    else:
        way_on = "the run has no complete checkpoint: make room, then start it again (--overwrite)"
    return OSError(f"{what}; {way_on}")


# A temporary entry of save_checkpoint: the checkpoint being written, the one it replaces (a
# checkpoint of the same step), the next ``latest``; each named after the writing process.
TEMPORARY = re.compile(r"\.(?P<name>step_\d+|latest)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def remove_stale_temporaries(root: Path) -> list[str]:
    """Delete the temporary entries (``TEMPORARY``) a killed writer left in a run's ``checkpoints/``
    folder ``root``: those of a process that no longer runs, or of this one (it writes one
    checkpoint at a time, so an entry of its process id is an earlier process's under a reused
    id, as in a container). A live process's are never touched. A ``.step_N.old-PID`` goes back
    to ``step_N`` where that is missing: it is the complete checkpoint a killed writer had moved
    aside. Returns the names dealt with."""
    done = []
    for entry in sorted(root.iterdir()):
        match = TEMPORARY.fullmatch(entry.name)
        if match is None:
            continue
        if _process_runs(int(match["pid"])):
            continue
        if match["kind"] == "old" and not (root / match["name"]).exists():
            os.replace(entry, root / match["name"])
        else:
            remove_path(entry)
        done.append(entry.name)
    return done


def _process_runs(pid: int) -> bool:
    """Whether another process ``pid`` runs on this machine (``kill(pid, 0)``, which sends nothing)."""
    if pid == os.getpid():
        return False
    if os.name == "nt":  # Windows' os.kill ends the process whatever the signal: take it to run
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): it runs
        return True
    return True
