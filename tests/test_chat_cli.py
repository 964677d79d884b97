"""`wiola chat` as a person uses it: in a real terminal (tmux), typing, reading the screen,
Ctrl-C in the middle of a reply, /reset, /exit, the history kept within max_seq_len, and line
editing: arrow keys, long lines, a paste of several lines."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from terminal import Terminal

import wiola
from wiola.chat import apply_chat_template
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
def _chat(checkpoint: Path, *flags: str, record: Path | None = None) -> Iterator[Terminal]:
    """``wiola chat`` in a terminal of its own (what it writes recorded into ``record``), handed
    over once its first prompt shows; the terminal is closed afterwards, whatever happened."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in os.environ.items() if k in ("WIOLA_BPE_FILE", "PYTHONPATH"))
    cmd = [sys.executable, "-m", "wiola", "chat", "--checkpoint", str(checkpoint), *flags]
    # `; sleep` keeps the pane readable after the program exits (its exit code is printed)
    term = Terminal(f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.join(cmd)}; echo EXIT=$?; sleep 30", record)
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


def _paste(term: Terminal, text: str) -> None:
    """Paste ``text`` as a terminal does: in bracketed-paste markers when the program asked for
    them (``paste-buffer -p``), its newlines sent as Enter (carriage returns) otherwise."""
    term._tmux("set-buffer", "-b", "paste", text)
    term._tmux("paste-buffer", "-p", "-d", "-b", "paste", "-t", "term")


def test_chat_edits_lines_takes_long_lines_and_a_paste_as_one_message(tmp_path) -> None:
    """In a terminal the input goes through readline: a line past the 4095 bytes that the
    terminal's own line mode keeps arrives whole, a paste of several lines is one message, and
    arrow keys move the cursor instead of typing escape codes. The terminal's paste mode is on
    only while a line is read: off during a reply, after Ctrl-C at the prompt and at the end."""
    checkpoint = _checkpoint(tmp_path / "short", 64, 32)
    long = " ".join(f"word{i % 10}" for i in range(900))  # 6,299 characters
    need = len(apply_chat_template(load_tokenizer("gpt2-32k"), [{"role": "user", "content": long}]))
    record = tmp_path / "terminal.out"
    with _chat(checkpoint, "--max-new-tokens", "8", "--temperature", "1", record=record) as term:
        term.type(long)
        term.wait_for(lambda s: f"(cannot answer: the message takes {need} tokens" in s, "the long line, whole")
        # one message: a command is one line, and line by line "/exit" would end the session
        _paste(term, "/exit\ntell me\nabout the boat")
        term.key("Enter")
        term.type("/reset")
        screen = term.wait_for(lambda s: "(conversation cleared)" in s, "the session to go on after the paste")
        assert screen.count("model> ") == 1 and "EXIT=" not in screen, screen
        term._tmux("send-keys", "-t", "term", "-l", "never sent")
        # Ctrl-C once readline shows the text: it is then waiting for keys (a SIGINT that lands
        # before it waits, as a key sent at once can, is seen only at the next key)
        term.wait_for(lambda s: s.rstrip().endswith("you> never sent"), "readline to show the typed text")
        term.key("C-c")
        term.wait_for(lambda s: s.rstrip().endswith("you>") and "never sent" in s, "Ctrl-C at the prompt")
        term._tmux("send-keys", "-t", "term", "-l", "xit")
        term.key("Left")
        term.key("Left")
        term.key("Left")
        term.type("/e")  # "/exit" once the cursor is back at the start
        term.wait_for(lambda s: "EXIT=0" in s, "/exit, typed with the arrow keys, to end the program")
    modes = re.findall(rb"\x1b\[\?2004([hl])", record.read_bytes())
    assert len(modes) >= 8 and modes == [b"h", b"l"] * (len(modes) // 2), modes
