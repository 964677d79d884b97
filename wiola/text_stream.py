"""Token ids to streamed text: incremental decoding that never emits half a UTF-8 character, text
that may still turn out to start a stop string, or text that the decoding of later tokens may
still rewrite. Used by ``wiola.chat.stream_reply``, the server and ``wiola generate``."""

from __future__ import annotations

from typing import Protocol

from wiola.generation import find_stop


class Decoder(Protocol):
    """What ``TextStream`` needs of a tokenizer. It may also have ``decode_reach`` (an int, 0 when
    absent): how many characters at the end of ``decode(ids)`` ``decode(ids + more)`` may rewrite
    (``wiola.tokenizer.HFTokenizer``'s clean-up of spaces before punctuation); and ``decoding()``
    (``wiola.tokenizer.Tokenizer.decoding``): an object whose ``add(token)`` returns ``decode`` of
    every id added so far, which a byte-level tokenizer keeps as it grows instead of decoding the
    whole list at every token (without it, the stream calls ``decode`` on the whole list)."""

    def decode(self, ids: list[int]) -> str: ...


class TextStream:
    """One generated sequence's text, fed a token at a time.

    ``add(token)`` returns the text that became final (possibly empty) and sets ``stopped`` when a
    stop string was completed (then the text ends before it, and the sequence should end).
    ``rest()`` returns what was held back once the sequence has ended. ``text`` is everything
    emitted so far; ``final`` the exact text of the sequence: the decoding of every token, cut
    before a stop string; ``offset`` where the last added token's text begins in it.

    The last ``max(len(longest stop) - 1, tokenizer.decode_reach)`` characters are held back, so
    the chunks join to ``final``. With ``tight_hold``, only the last ``decode_reach`` characters
    and, before them, the longest end that could still begin a stop string are held back: text
    shows as soon as it cannot be part of a stop string (what a person reading a chat sees).

    If a decoding still rewrites text already emitted (a tokenizer whose ``decode_reach`` is too
    small), the rest is emitted all the same, from the point of the new decoding up to which it
    matches the emitted text (in order, with the characters the rewrite removed or changed
    skipped); ``text`` then differs from ``final`` near that point.
    """

    def __init__(self, tokenizer: Decoder, stops: list[str], *, tight_hold: bool = False) -> None:
        self.tokenizer, self.stops, self.tight_hold = tokenizer, stops, tight_hold
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self.offset = 0
        self._reach = reach = getattr(tokenizer, "decode_reach", 0)
        self._hold = max(max((len(s) - 1 for s in stops), default=0), reach)
        self._full = ""  # decode(self.ids)
        self._decoding = tokenizer.decoding() if hasattr(tokenizer, "decoding") else None
        self._sent = ""  # the prefix of a decoding that the emitted chunks stand for

    def add(self, token: int) -> str:
        """Append ``token``; the newly final text (empty while a character, a stop string or a
        rewrite may be incomplete)."""
        before = self._full
        if self._decoding is not None:
            full = self._decoding.add(token)
        else:
            full = self.tokenizer.decode([*self.ids, token])
        self.ids.append(token)
        self._full = full
        self.offset = _token_start(before, full)
        cut = find_stop(full, self.stops)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        if full.endswith("\ufffd"):
            return ""
        return self._emit(full[: max(0, len(full) - self._held(full))])

    def _held(self, full: str) -> int:
        """How many characters at the end of ``full`` (no stop string in it) to hold back."""
        if not self.tight_hold:
            return self._hold
        # a stop string that later tokens complete begins in the end that they may rewrite, or
        # earlier with its start as the end of the text before that (which they leave as it is)
        stable = full[: max(0, len(full) - self._reach)]
        return len(full) - len(stable) + max((_stop_start(stable, s) for s in self.stops), default=0)

    def add_textless(self) -> None:
        """A token with no text (the eos that ends the sequence): its ``offset`` is the text's end."""
        self.offset = len(self.final)

    def rest(self) -> str:
        """The held-back text once the sequence has ended (up to a stop string if one was hit)."""
        if self.stopped:
            return ""
        return self._emit(self._full)

    @property
    def final(self) -> str:
        """The decoding of every token added, cut before the first stop string."""
        cut = find_stop(self._full, self.stops)
        return self._full if cut is None else self._full[:cut]

    def _emit(self, upto: str) -> str:
        if upto.startswith(self._sent):
            at = len(self._sent)
        elif self._sent.startswith(upto):  # the decoding got shorter: nothing new yet
            return ""
        else:  # it rewrote emitted text: go on after the part of it that matches what was sent
            at = _resume_at(self._sent, upto)
        delta = upto[at:]
        self._sent = upto
        self.text += delta
        return delta


def _stop_start(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that ``stop`` begins with (but is longer than)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    return p


def _token_start(before: str, after: str) -> int:
    """Where the text of a token begins, from the decoding without it and with it: where the two
    first differ (so a token that completes a character, or whose text makes the decoding rewrite
    its end, begins where that character or rewrite does), or, when it changes nothing (a byte
    inside a character still incomplete, decoded as one U+FFFD either way), where that character
    begins."""
    if before == after and before.endswith("\ufffd"):
        return len(before) - 1
    return _common_prefix(before, after)


def _resume_at(sent: str, new: str) -> int:
    """Where in ``new`` the text not yet sent begins, given that ``sent`` was sent and ``new`` does
    not start with it: past their common prefix, every further character of ``sent`` that ``new``
    holds next (in order) is taken as sent; the others were removed or changed by the rewrite.
    Nothing of ``new`` after the returned index was sent, and nothing before it is missing from
    ``sent``."""
    p = at = _common_prefix(sent, new)
    for ch in sent[p:]:
        if at < len(new) and new[at] == ch:
            at += 1
    return at
