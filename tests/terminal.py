"""A real terminal for the tests of terminal programs (``wiola chat``, ``wiola bench``): a tmux
session of its own server, typed into and read as a person would."""

from __future__ import annotations

import subprocess
import time
import uuid


class Terminal:
    """A tmux session of its own server (``-L``), 120 x 40, running one command."""

    def __init__(self, command: str) -> None:
        self.server = f"wiola-test-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-x", "120", "-y", "40", "-s", "term", command)

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
