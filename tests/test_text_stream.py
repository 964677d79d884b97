"""``wiola.text_stream.TextStream``: streamed chunks join to the text up to a stop string, never
emitting half a UTF-8 character or a tail that may still begin a stop string."""

from __future__ import annotations

import pytest

from wiola.text_stream import TextStream


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


class Pieces:
    """A tokenizer whose id i decodes to ``PIECES[i]`` (one token may complete two stop strings)."""

    PIECES = ("ab", "XcdEND", "more")

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES[i] for i in ids)


def test_of_several_stop_strings_the_one_that_occurs_first_ends_the_text():
    """A token that completes two stop strings: the text ends before the one that occurs first
    ("X", before "END"), whatever their order in the list."""
    for stops in (["END", "X"], ["X", "END"]):
        s = TextStream(Pieces(), stops)
        chunks = [s.add(0), s.add(1)]
        assert s.stopped and "".join(chunks) == "ab" == s.text == s.final, (stops, chunks)
        assert s.rest() == "" and s.add(2) == "" and s.final == "ab", stops


def test_a_tail_that_may_begin_a_stop_string_is_held_back():
    s = TextStream(Bytes(), ["cat"])
    assert [s.add(b) for b in b"a c"] == ["", "", "a"]  # the last len("cat") - 1 characters wait
    assert s.add(ord("o")) == " " and s.text == "a "
    assert s.rest() == "co" and s.text == "a co"


def test_a_long_stop_string_holds_everything_shorter():
    s = TextStream(Bytes(), ["the end"])
    assert [s.add(b) for b in b"abcd"] == ["", "", "", ""] and s.text == ""
    assert s.rest() == "abcd"


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization, as ``wiola.tokenizer.HFTokenizer.decode`` applies it."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a in ("m", "s", "ve", "re"):
        text = text.replace(f" '{a}", f"'{a}")
    return text


class CleanBytes(Bytes):
    """A byte-level tokenizer whose decoding cleans up spaces before punctuation, which rewrites
    text already decoded when a later byte completes a pattern (" ." -> ".")."""

    def __init__(self, decode_reach: int) -> None:
        self.decode_reach = decode_reach

    def decode(self, ids: list[int]) -> str:
        return _clean_up(super().decode(ids))


CLEAN_UP_CHARS = " .?!,'ntmsveraé"  # the clean-up's patterns, and a character of two bytes


@pytest.mark.parametrize("stops", [[], ["ra"], ["'s", ". "]])
def test_chunks_join_to_the_decoding_when_it_rewrites_its_end(stops):
    import random

    rng = random.Random(0)
    tok = CleanBytes(decode_reach=3)
    streams = []
    for _ in range(2000):
        ids = list("".join(rng.choice(CLEAN_UP_CHARS) for _ in range(rng.randint(1, 16))).encode())
        s = TextStream(tok, stops)
        chunks = []
        for b in ids:
            chunks.append(s.add(b))
            if s.stopped:
                break
        chunks.append(s.rest())
        full = tok.decode(s.ids)
        want = full[: min([i for i in (full.find(x) for x in stops) if i >= 0], default=len(full))]
        assert "".join(chunks) == want, (bytes(ids), chunks)
        streams.append((s, want))
    assert [s.final for s, _ in streams] == [want for _, want in streams]


def test_a_rewrite_past_the_declared_reach_loses_nothing_after_it():
    """A tokenizer that understates how far its decoding rewrites: the text after the rewrite is
    still emitted (the rewritten space stays as it was sent); ``final`` is the exact decoding."""
    s = TextStream(CleanBytes(decode_reach=0), [])
    chunks = [s.add(b) for b in b"so . then n't more"] + [s.rest()]
    assert "".join(chunks) == s.text == "so . then n't more"
    assert s.final == "so. thenn't more"


def test_rewrites_past_the_reach_keep_every_character_of_the_decoding():
    """Whatever the rewrites, the exact decoding is a subsequence of the emitted text (in order,
    nothing skipped): only characters a rewrite removed or changed are extra."""
    import random

    rng = random.Random(1)
    tok = CleanBytes(decode_reach=0)
    streams = []
    for _ in range(2000):
        ids = list("".join(rng.choice(CLEAN_UP_CHARS) for _ in range(rng.randint(1, 16))).encode())
        s = TextStream(tok, [])
        text = "".join([s.add(b) for b in ids] + [s.rest()])
        full = tok.decode(ids)
        rest = iter(text)
        assert all(ch in rest for ch in full), (bytes(ids), text, full)
        assert len(text) - len(full) <= bytes(ids).count(b" "), (bytes(ids), text)  # only removed spaces
        streams.append((s, full))
    assert [s.final for s, _ in streams] == [full for _, full in streams]


@pytest.mark.parametrize(
    ("tokenizer", "text", "offsets"),
    [
        (Bytes(), "aé b".encode(), [0, 1, 1, 2, 3]),  # é is two tokens: both begin where it does
        (Bytes(), "x😀y".encode(), [0, 1, 1, 1, 1, 2]),
        (Bytes(), b"R\xc0\xf5~", [0, 1, 2, 3]),  # bytes that never form a character stay one U+FFFD each
        (Bytes(), b"a\xe2\x82b", [0, 1, 1, 2]),  # a character cut short by "b"
        (CleanBytes(decode_reach=3), b"so .x", [0, 1, 2, 2, 3]),  # "." makes " ." read ".": both begin at 2
    ],
)
def test_offset_is_where_each_token_begins_in_the_text(tokenizer, text, offsets):
    s = TextStream(tokenizer, [])
    got = []
    for b in text:
        s.add(b)
        got.append(s.offset)
    assert got == offsets


def _joined(tok, data: bytes) -> str:
    s = TextStream(tok, [])
    return "".join([s.add(b) for b in data] + [s.rest()])


def test_the_clean_up_rewrites_up_to_3_characters_back():
    """The clean-up rewrites ``" n't"`` when its "t" comes, 3 characters after its space: holding
    back 2 is too few. ``HFTokenizer`` says 3 with the clean-up, 0 without it."""
    from wiola.tokenizer import train_tokenizer

    assert _joined(CleanBytes(decode_reach=3), b"x n't") == "xn't"
    assert _joined(CleanBytes(decode_reach=2), b"x n't") != "xn't"
    tok = train_tokenizer(["it isn't so . we're here"] * 4, 270, show_progress=False)
    assert tok.decode_reach == 0
    tok.clean_up_spaces = True
    assert tok.decode_reach == 3 and tok.decode(tok.encode("x n't")[1:]) == "xn't"


class WholeDecode:
    """A tokenizer seen only through ``decode`` (no ``decoding``): the stream decodes its whole
    list at every token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decode_reach = tokenizer, getattr(tokenizer, "decode_reach", 0)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@pytest.mark.parametrize("tight_hold", [False, True])
def test_a_kept_decoding_streams_what_decoding_every_list_streams(tight_hold):
    """A byte-level tokenizer's stream keeps its decoding as it grows (``Tokenizer.decoding``)
    instead of decoding its whole list at every token: every chunk, offset, stop and final text
    is the same as the whole decoding's, for tiktoken and for a ``tokenizer.json`` BPE that cleans
    up spaces (text with characters cut between tokens, rewrites and stop strings)."""
    import random

    from wiola.tokenizer import ByteDecoding, load_tokenizer, train_tokenizer

    text = "Zoë 🦊 said: it isn't so . we're here , don't you ? 東京 ü\n\nUser: more"
    hf = train_tokenizer([text] * 4, 300, show_progress=False)
    hf.clean_up_spaces = True
    rng = random.Random(3)
    for tok in (load_tokenizer("gpt2-32k"), hf):
        assert isinstance(tok.decoding(), ByteDecoding), tok
        ids = tok.encode_batch([text])[0]
        by_byte = tok.encode_batch(["".join(rng.choice("é .'s東") for _ in range(60))])[0]
        for seq in (ids, by_byte, [rng.randrange(tok.vocab_size) for _ in range(120)]):
            for stops in ([], ["\n\nUser:"], ["'s", " ?"]):
                runs = []
                for t in (tok, WholeDecode(tok)):
                    s = TextStream(t, stops, tight_hold=tight_hold)
                    steps = []
                    for token in seq:
                        steps.append((s.add(token), s.offset, s.stopped))
                        if s.stopped:
                            break
                    runs.append((steps, s.rest(), s.text, s.final))
                assert runs[0] == runs[1], (tok, stops, seq)
