"""A real terminal for the tests of terminal programs (``wiola chat``, ``wiola bench``): a tmux
session of its own server, typed into and read as a person would."""

from __future__ import annotations

import shlex
import subprocess
import time
import uuid
from pathlib import Path


class Terminal:
    """A tmux session of its own server (``-L``), 120 x 40, running one command.

    With ``record``, every byte the command writes to the terminal is also appended to that file
    (``pipe-pane``), so a test can see what was on the screen only for a moment (a progress bar
    that a fast run draws and clears between two looks at the pane). The command waits on a tmux
    channel until the recording has started, so nothing it writes is missed."""

    def __init__(self, command: str, record: Path | None = None) -> None:
        self.server = f"wiola-test-{uuid.uuid4().hex[:8]}"
        if record is None:
            self._tmux("new-session", "-d", "-x", "120", "-y", "40", "-s", "term", command)
            return
        gate = f"tmux -L {self.server} wait-for recording; {command}"
        self._tmux("new-session", "-d", "-x", "120", "-y", "40", "-s", "term", gate)
        self._tmux("pipe-pane", "-t", "term", f"cat >> {shlex.quote(str(record))}")
        self._tmux("wait-for", "-S", "recording")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.server, *args], capture_output=True, text=True, timeout=20).stdout

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "term", "-l", text)
        self._tmux("send-keys", "-t", "term", "Enter")

    def key(self, key: str) -> None:
        self._tmux("send-keys", "-t", "term", key)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", "term")

    def wait_for(self, predicate, what: str, timeout: float = 90.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"waited {timeout:.0f} s for {what}; the screen:\n{self.screen()}")

    def alive(self) -> bool:
        return "term" in self._tmux("list-sessions", "-F", "#{session_name}")

    def close(self) -> None:
        self._tmux("kill-server")


def run_to_exit(command: str, record: Path, timeout: float = 240.0) -> str:
    """Run ``command`` (a shell line) in a new ``Terminal`` recorded into ``record`` until it
    exits; the screen then, which ends with ``EXIT=<status>``. The terminal is closed either way."""
    term = Terminal(f"{command}; echo EXIT=$?; sleep 30", record)
    try:
        return term.wait_for(lambda s: "EXIT=" in s, "the end of the run", timeout=timeout)
    finally:
        term.close()
