"""`wiola chat` as a person uses it: in a real terminal (tmux), typing, reading the screen,
Ctrl-C in the middle of a reply, /reset, /exit, and the history kept within max_seq_len."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from terminal import Terminal

import wiola
from wiola.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]
ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(path: Path, max_seq_len: int, d_model: int) -> Path:
    torch.manual_seed(0)
    config = wiola.WiolaConfig(d_model=d_model, n_layers=2, n_heads=4, d_ff=2 * d_model, max_seq_len=max_seq_len)
    wiola.WiolaModel(config).save_pretrained(path, load_tokenizer("gpt2-32k"))
    return path


@contextlib.contextmanager
def _chat(checkpoint: Path, *flags: str) -> Iterator[Terminal]:
    """``wiola chat`` in a terminal of its own, handed over once its first prompt shows; the
    terminal is closed afterwards, whatever happened."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in os.environ.items() if k in ("WIOLA_BPE_FILE", "PYTHONPATH"))
    cmd = [sys.executable, "-m", "wiola", "chat", "--checkpoint", str(checkpoint), *flags]
    # `; sleep` keeps the pane readable after the program exits (its exit code is printed)
    term = Terminal(f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.join(cmd)}; echo EXIT=$?; sleep 30")
    try:
        term.wait_for(lambda s: "you> " in s, "the banner and the first prompt")
        yield term
    finally:
        term.close()


def test_chat_streams_stops_on_ctrl_c_resets_and_exits(tmp_path) -> None:
    checkpoint = _checkpoint(tmp_path / "long", 1024, 64)
    with _chat(checkpoint, "--max-new-tokens", "1000", "--temperature", "1") as term:
        assert "/reset" in term.screen()
        term.type("Tell me a long story.")
        # the reply streams: text appears after "model> " while it is still being written
        term.wait_for(lambda s: "model> " in s and len(s.split("model> ")[-1].strip()) > 10, "streamed text")
        term.key("C-c")
        screen = term.wait_for(lambda s: "[stopped]" in s and s.rstrip().endswith("you>"), "the reply to stop")
        assert "EXIT=" not in screen, "Ctrl-C ended the session"
        term.type("/reset")
        term.wait_for(lambda s: "(conversation cleared)" in s, "/reset")
        term.type("/exit now")  # a command's first word names it
        screen = term.wait_for(lambda s: "EXIT=0" in s, "/exit to end the program with 0")
        assert "unknown command" not in screen, screen


def test_chat_drops_old_turns_to_fit_and_says_so_once(tmp_path) -> None:
    # Sampled at temperature 1 from a random model, a reply is 8 tokens drawn nearly uniformly from
    # 32,000, so it is never whitespace only (greedy replies of a random model can be: such a turn is
    # not kept, and the history would never grow past the context).
    checkpoint = _checkpoint(tmp_path / "short", 64, 32)
    with _chat(checkpoint, "--max-new-tokens", "8", "--temperature", "1") as term:
        note = "older turns were dropped"
        for i in range(5):
            term.type(f"Turn {i}: tell me about the little red boat on the lake.")
            term.wait_for(lambda s, n=i + 2: s.count("you> ") >= n, f"the reply to turn {i}")
        screen = term.screen()
        assert screen.count(note) == 1, f"the dropped-turns note appears {screen.count(note)} times:\n{screen}"
        term.type("/bogus")
        term.wait_for(lambda s: "unknown command /bogus" in s, "the unknown-command line")
        term.key("C-d")
        term.wait_for(lambda s: "EXIT=0" in s, "Ctrl-D to end the program with 0")
