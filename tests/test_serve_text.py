"""``wiola.serve.text.TextStream``: streamed chunks join to the text up to a stop string, never
emitting half a UTF-8 character or a tail that may still begin a stop string."""

from __future__ import annotations

import pytest

from wiola.serve.text import TextStream


class Bytes:
    """A byte-level tokenizer: id = one byte (decoding replaces incomplete UTF-8 as tokenizers do)."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stops: list[str]) -> tuple[list[str], TextStream]:
    s = TextStream(Bytes(), stops)
    chunks = []
    for b in text.encode():
        chunks.append(s.add(b))
        if s.stopped:
            break
    chunks.append(s.rest())
    return chunks, s


@pytest.mark.parametrize("stops", [[], ["cat"], ["zz", "\n\n"], ["é!"]])
def test_chunks_join_to_the_text_before_the_first_stop(stops):
    text = "Once a café cat met a dog.\n\nThe end é! more"
    chunks, s = _stream(text, stops)
    cut = min([i for i in (text.find(x) for x in stops) if i >= 0], default=len(text))
    assert "".join(chunks) == text[:cut] == s.text
    assert s.stopped == (cut < len(text))
    for chunk in chunks:
        assert "\ufffd" not in chunk, "half a character was emitted"
        assert not any(x in chunk for x in stops)


def test_a_tail_that_may_begin_a_stop_string_is_held_back():
    s = TextStream(Bytes(), ["cat"])
    assert [s.add(b) for b in b"a c"] == ["", "", "a"]  # the last len("cat") - 1 characters wait
    assert s.add(ord("o")) == " " and s.text == "a "
    assert s.rest() == "co" and s.text == "a co"


def test_a_long_stop_string_holds_everything_shorter():
    s = TextStream(Bytes(), ["the end"])
    assert [s.add(b) for b in b"abcd"] == ["", "", "", ""] and s.text == ""
    assert s.rest() == "abcd"
