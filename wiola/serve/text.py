"""Token ids to streamed text: incremental decoding that never emits half a UTF-8 character or
text that may still turn out to start a stop string."""

from __future__ import annotations

from typing import Protocol

from wiola.generation import find_stop


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class TextStream:
    """One generated sequence's text, fed a token at a time.

    ``add(token)`` returns the text that became final (possibly empty) and whether a stop string
    was completed (then the text ends before it, and the sequence should end). ``rest()`` returns
    what was held back once the sequence has ended. ``text`` is everything emitted so far.
    """

    def __init__(self, tokenizer: Decoder, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) - 1 for s in stops), default=0)

    def add(self, token: int) -> str:
        """Append ``token``; the newly final text (empty while a character or a stop string may be incomplete)."""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        cut = find_stop(full, self.stops)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        if full.endswith("\ufffd"):
            return ""
        return self._emit(full[: max(0, len(full) - self._hold)])

    def rest(self) -> str:
        """The held-back text once the sequence has ended (up to a stop string if one was hit)."""
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta
